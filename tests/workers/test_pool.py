"""Both worker pools answer the pipeline's one protocol (``_pool.WorkerPool``)."""

from __future__ import annotations

import threading

from aioloader._workers.offload import ThreadOffload
from aioloader._workers.pool import WorkerPool


def whose_thread(x: int) -> tuple[int, str]:
    return x * 2, threading.current_thread().name


async def test_a_thread_pool_is_a_worker_pool() -> None:
    pool: WorkerPool = ThreadOffload(2, "worker")
    assert (pool.concurrency, pool.per_worker) == (2, False)
    await pool.start()
    try:
        assert (await pool.run(whose_thread, 3))[0] == 6
        async with pool.reserved() as run_on:
            doubled, name = await run_on(1, whose_thread, 5)
        assert doubled == 10 and name.startswith("aioloader-worker")
    finally:
        await pool.aclose()
