"""Fast calls inline, slow ones on the pool's thread (``_workers/offload.py``): the policy that
keeps a cheap read or collate from paying a thread hop, and a slow one off the event loop."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from aioloader._workers.offload import ThreadOffload


def where(pause: float = 0.0) -> int:
    if pause:
        time.sleep(pause)
    return threading.get_ident()


async def test_fast_calls_go_inline_and_a_slow_one_sends_the_next_back_to_the_thread() -> None:
    loop = threading.get_ident()
    pool = ThreadOffload(1, "io", inline_below=0.01)
    try:
        first = await pool.run(where)
        assert first != loop  # not timed yet: on the thread
        assert [await pool.run(where) for _ in range(3)] == [loop] * 3
        assert await pool.run(where, 0.05) == loop  # known fast, so inline; now known slow
        assert await pool.run(where) != loop
        after = [await pool.run(where) for _ in range(20)]  # fast again: back inline
        assert after[-1] == loop
    finally:
        pool.close()


async def test_calls_run_one_at_a_time_inline_or_not() -> None:
    running, most = 0, 0

    def counted(pause: float) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        time.sleep(pause)
        running -= 1

    pool = ThreadOffload(1, "io", inline_below=0.002)
    try:
        async with anyio.create_task_group() as tg:
            for k in range(40):  # slow and fast mixed: both paths, from 40 tasks at once
                tg.start_soon(pool.run, counted, 0.004 if k % 5 == 0 else 0.0)
    finally:
        pool.close()
    assert most == 1


async def test_inline_false_keeps_a_call_on_the_thread() -> None:
    loop = threading.get_ident()
    pool = ThreadOffload(1, "io", inline_below=1.0)
    try:
        await pool.run(where)
        assert await pool.run(where) == loop
        assert await pool.run(where, inline=False) != loop
    finally:
        pool.close()


async def test_an_error_inline_keeps_its_type() -> None:
    pool = ThreadOffload(1, "io", inline_below=1.0)

    def fails() -> None:
        raise KeyError("sample 7")

    try:
        await pool.run(where)
        with pytest.raises(KeyError, match="sample 7"):
            await pool.run(fails)
    finally:
        pool.close()


def test_inline_needs_a_single_thread() -> None:
    with pytest.raises(ValueError, match="inline_below needs threads=1"):
        ThreadOffload(2, "io", inline_below=0.001)
