"""A worker process's next job waits in its pipe while it runs the one before (queued.py), so it
never waits for the main process's event loop between jobs; replies are read in the order the
jobs were sent, a large job is not queued, and a job queued behind one its worker died in goes
to the replacement. Real processes; the event loop is held (``time.sleep`` in it) to show what
reached a worker without it."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import anyio
import pytest

import aioloader
import aioloader._workers.processes as processes
from aioloader import WorkerCrashed
from aioloader._base.recorders import WorkerRecorder
from aioloader._workers.queued import QUEUE_MOST
from tests.support import worker_datasets as wd
from tests.support.helpers import bare_pool

HOLD_S = 1.5  # the event loop held: long past the first job's 0.3 s


def stamped(sleep_s: float, payload: bytes = b"") -> tuple[int, float, float, int]:
    """In the worker: its pid, when the job began and ended (the system's monotonic clock),
    the bytes it was sent."""
    began = time.monotonic()
    time.sleep(sleep_s)
    return os.getpid(), began, time.monotonic(), len(payload)


def killed(delay_s: float) -> None:
    time.sleep(delay_s)
    os.kill(os.getpid(), signal.SIGKILL)


def big_reply(sleep_s: float, size: int) -> bytes:
    time.sleep(sleep_s)
    return b"r" * size


async def on_worker_0(
    pool: processes.ProcessWorkers,
    first: tuple[Any, ...],
    second: tuple[Any, ...],
    *,
    hold_s: float = 0.0,
    between: bool = False,
) -> tuple[Any, Any, float]:
    """``first`` then ``second`` (a function and its arguments) on worker 0 of ``pool``
    (started; closed here), the event loop held ``hold_s`` (it sends and reads nothing) once
    both are posted, or, ``between``, once the first is sent and before the second is posted;
    their results (or exceptions) and when the hold ended."""
    results: dict[int, Any] = {}
    try:
        with anyio.fail_after(30):
            async with pool.reserved() as run_on, anyio.create_task_group() as tg:

                async def job(k: int, fn: Any, *args: Any) -> None:
                    try:
                        results[k] = await run_on(0, fn, *args)
                    except Exception as exc:
                        results[k] = exc

                tg.start_soon(job, 0, *first)
                if not between:
                    tg.start_soon(job, 1, *second)
                await anyio.wait_all_tasks_blocked()  # sent, or waiting to be
                time.sleep(hold_s)  # noqa: ASYNC251  (held: the loop sends and reads nothing)
                held_until = time.monotonic()
                if between:
                    tg.start_soon(job, 1, *second)  # runs before the first's reader wakes
    finally:
        await pool.aclose()
    return results[0], results[1], held_until


async def two_jobs(first: tuple[Any, ...], second: tuple[Any, ...]) -> tuple[Any, Any, float]:
    """``first`` then ``second`` on worker 0 of a one-worker pool, both posted before the
    event loop is held for ``HOLD_S``; their results (or exceptions) and when the hold ended."""
    pool = bare_pool(1)
    await pool.start()
    return await on_worker_0(pool, first, second, hold_s=HOLD_S)


async def test_the_next_job_runs_while_the_event_loop_is_held() -> None:
    a, b, held_until = await two_jobs((stamped, 0.3), (stamped, 0.0, b"x" * 100))
    assert a[0] == b[0] and b[3] == 100
    assert a[2] <= b[1] < held_until  # after the first, in the worker, with no loop to send it


async def test_a_large_job_is_sent_once_the_worker_has_answered() -> None:
    """Queued, a job over QUEUE_MOST could fill the pipe and block the loop sending it."""
    size = 4 * QUEUE_MOST
    first, b, held_until = await two_jobs((stamped, 0.3), (stamped, 0.0, b"x" * size))
    assert b[3] == size and first[0] == b[0]
    assert b[1] > held_until  # sent once the loop read the first job's reply


@pytest.mark.timeout(30)
async def test_a_large_job_behind_a_large_reply_is_no_deadlock() -> None:
    """Were the second job sent while the worker is busy, the loop, blocked sending it, would
    never read the first reply, nor the worker, blocked sending that reply, the job."""
    reply, b, _ = await two_jobs((big_reply, 0.3, 8 << 20), (stamped, 0.0, b"x" * (8 << 20)))
    assert len(reply) == 8 << 20 and b[3] == 8 << 20


async def test_a_job_queued_behind_a_crash_goes_to_the_replacement() -> None:
    """The worker died in the first job, which fails naming it; the second never began there,
    so it runs in the one replacement, not as a second crash."""
    stats = WorkerRecorder()
    pool = bare_pool(1, stats=stats)
    await pool.start()
    [first] = pool.processes()
    results = await on_worker_0(pool, (killed, 0.2), (stamped, 0.0))
    crash, (pid, *_), _ = results
    assert isinstance(crash, WorkerCrashed) and crash.pid == first.pid  # type: ignore[attr-defined]
    assert pid != first.pid
    assert (stats.crashes, stats.restarts, stats.jobs) == (1, 1, 2)


async def test_a_job_posted_after_its_worker_died_leaves_the_crash_to_the_job_it_died_in() -> None:
    """The worker died in the first job; the second, posted before the first's reader woke,
    finds it dead. The first job's reader names the crash (the pipe is not closed under it by
    the replacement, which read a closed pipe's OSError), the second runs in the replacement."""
    stats = WorkerRecorder()
    pool = bare_pool(1, stats=stats)
    await pool.start()
    [first] = pool.processes()
    # the first sent (its reader waits on the pipe) and the loop held while the worker dies
    results = await on_worker_0(pool, (killed, 0.1), (stamped, 0.0), hold_s=0.6, between=True)
    crash, (pid, *_), _ = results
    assert isinstance(crash, WorkerCrashed) and crash.pid == first.pid, repr(crash)  # type: ignore[attr-defined]
    assert pid != first.pid
    assert (stats.crashes, stats.restarts) == (1, 1)


@pytest.fixture
def grace_1s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processes, "CANCEL_GRACE", 1.0)


@pytest.mark.usefixtures("grace_1s")
async def test_two_cancelled_jobs_stop_a_worker_busy_past_the_grace_once() -> None:
    """Each cancelled job's grace starts with its turn: the first's runs out, and it alone
    stops the worker (two stops at once raised anyio's BusyResourceError); the next job goes
    to a new worker."""
    stats = WorkerRecorder()
    pool = bare_pool(1, stats=stats)
    await pool.start()
    [first] = pool.processes()
    try:
        async with pool.reserved() as run_on:
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(run_on, 0, stamped, 4.0)
                    tg.start_soon(run_on, 0, stamped, 0.0)
                    await anyio.wait_all_tasks_blocked()
                    tg.cancel_scope.cancel()
            with anyio.fail_after(15):
                pid, *_ = await run_on(0, stamped, 0.0)
    finally:
        await pool.aclose()
    assert pid != first.pid and stats.restarts == 1


@pytest.mark.usefixtures("grace_1s")
async def test_a_job_cancelled_alone_leaves_the_job_before_it_its_reply() -> None:
    """The queued job's caller gives up while the job before it runs on past the grace: it
    waits its turn, reads its own reply and drops it; the first job's caller gets its own."""
    pool = bare_pool(1)
    await pool.start()
    [worker] = pool.processes()
    first: list[Any] = []
    try:
        async with pool.reserved() as run_on:
            with anyio.fail_after(15):
                async with anyio.create_task_group() as tg:

                    async def gives_up() -> None:
                        with anyio.move_on_after(0.2):
                            await run_on(0, stamped, 0.0)

                    async def waits() -> None:
                        first.append(await run_on(0, stamped, 2.0))

                    tg.start_soon(waits)
                    await anyio.wait_all_tasks_blocked()
                    tg.start_soon(gives_up)
                pid, *_ = await run_on(0, stamped, 0.0)
    finally:
        await pool.aclose()
    assert [r[0] for r in first] == [worker.pid] and pid == worker.pid


@pytest.mark.parametrize("first_s", [0.0, 0.5])
async def test_cancelled_jobs_are_drained_and_the_worker_kept(first_s: float) -> None:
    """Both jobs cancelled, sent: their replies are read (in turn) and dropped, and the worker
    goes on with the next job, the same process."""
    pool = bare_pool(1)
    await pool.start()
    [worker] = pool.processes()
    try:
        async with pool.reserved() as run_on:
            with anyio.move_on_after(5):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(run_on, 0, stamped, first_s)
                    tg.start_soon(run_on, 0, stamped, 0.0)
                    await anyio.wait_all_tasks_blocked()
                    tg.cancel_scope.cancel()
            with anyio.fail_after(10):
                pid, *_ = await run_on(0, stamped, 0.0)
    finally:
        await pool.aclose()
    assert pid == worker.pid


def test_a_value_sent_whole_twice_is_the_worker_s_one_copy() -> None:
    """The job queued behind the first carries a ``collate_fn`` object whole too (the worker
    has it only once it has run the first): the worker keeps the copy it has, with its state,
    as torch's worker keeps its one copy (a second copy restarted the count, and an object's
    own generator drew the same numbers for the first two batches)."""
    loader = aioloader.DataLoader(
        list(range(6)), batch_size=1, num_workers=1, collate_fn=wd.CountsItsCalls()
    )
    got = list(loader)
    assert [calls for _, _, calls in got] == [1, 2, 3, 4, 5, 6]
    assert len({(pid, obj) for pid, obj, _ in got}) == 1


def stopped_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` is in the stopped state (``T``) within ``seconds``."""
    for _ in range(int(seconds * 100)):  # bounded
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "T":
                return True
        time.sleep(0.01)
    return False


async def test_a_stop_cancelled_part_way_is_done_by_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker slow to exit (stopped by SIGSTOP here), its stop cancelled (as a replacement's
    is when the epoch ends): closing the pool still stops it and reaps it (the stop under way
    had made every later one return at once, leaving the process running)."""
    monkeypatch.setattr(processes, "_STOP_GRACE", 0.5)
    pool = bare_pool(1)
    await pool.start()
    [view] = pool.processes()
    worker = pool._slots.now[0]
    os.kill(view.pid, signal.SIGSTOP)
    # Stopped before its stop begins: a SIGTERM still pending beside the SIGSTOP is taken first
    # (the lower number), and the worker would exit at once
    assert stopped_within(view.pid, 5.0), "the worker did not stop on SIGSTOP"
    try:
        with anyio.move_on_after(0.2) as scope:
            await pool._stop(worker, grace=0.0)
        assert scope.cancelled_caught and not worker.stopped
    finally:
        with anyio.fail_after(20):
            await pool.aclose()
    assert worker.stopped and not view.is_alive() and view.exitcode == -signal.SIGKILL
