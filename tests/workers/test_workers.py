"""The process pool: workers that know who they are, seeded batches, shared-memory results,
failures with the worker's traceback, crashes named within the epoch, and nothing left behind."""

from __future__ import annotations

import functools
import gc
import multiprocessing
import os
import re
import signal
import socket
import threading
import time
import warnings
from collections.abc import Collection
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import aioloader
from aioloader._workers import fdpass
from aioloader._workers.children import remove_left_segments
from aioloader._workers.serverstart import prepare_forkserver
from tests.support import worker_fns
from tests.support.helpers import Counting, bare_pool, flat, open_fds, views_kept

# Names in /dev/shm that carry the pid of the process that made them: a Ray pool's blocks (its
# driver's pid) and torch's file_system segments.
_MADE_BY = re.compile(r"^(?:aioloader-ray-|torch_)(\d+)[-_]")


def shm(ours: Collection[int] = ()) -> set[str]:
    """The names in ``/dev/shm``, less those that another process made: the suite may run in
    several processes (``pytest -n``), and theirs come and go while this one looks. A name
    counts if it carries no pid, or this process's, or one of ``ours``; multiprocessing's
    named semaphores (``sem.mp-*``, which carry none) do not: aioloader makes none, and
    another process's test does."""
    mine = {os.getpid(), *ours}
    return {
        name
        for name in os.listdir("/dev/shm")
        if ((made := _MADE_BY.match(name)) is None or int(made[1]) in mine)
        and not name.startswith("sem.mp-")
    }


def children() -> list[multiprocessing.process.BaseProcess]:
    return multiprocessing.active_children()


async def run_epochs(dl: aioloader.DataLoader[Any], epochs: int = 1) -> list[list[Any]]:
    out = []
    async with dl:
        for _ in range(epochs):
            out.append([b async for b in dl])
    return out


def notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


async def test_workers_know_who_they_are_and_are_reused_across_epochs() -> None:
    assert aioloader.get_worker_info() is None
    dl = aioloader.DataLoader(
        Counting(24),
        batch_size=4,
        num_workers=2,
        transform=worker_fns.whoami,
        worker_init_fn=worker_fns.init,
        collate_fn=list,
    )
    e0, e1 = await run_epochs(dl, epochs=2)
    rows = [r for batch in e0 + e1 for r in batch]
    assert sorted(r["x"] for r in rows) == sorted(list(range(24)) * 2)
    by_id = {r["id"]: r for r in rows}
    assert set(by_id) <= {0, 1} and all(r["num_workers"] == 2 for r in rows)
    for worker_id, row in by_id.items():
        assert row["init_calls"] == [worker_id]  # worker_init_fn ran once, with its own id
    assert len({r["pid"] for r in rows}) <= 2  # the same processes served both epochs
    assert len({r["seed"] for r in by_id.values()}) == len(by_id)
    stats = dl.statistics().workers
    assert stats is not None and stats.processes == 2 and stats.startup_s > 0
    assert stats.jobs == 12 and stats.crashes == 0
    assert "2 processes started in" in repr(dl.statistics())


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
async def test_seeded_augmentations_are_identical_whatever_num_workers() -> None:
    results = []
    for workers in (1, 3):
        dl = aioloader.DataLoader(
            Counting(40, jitter=0.002),
            batch_size=4,
            num_workers=workers,
            seed=11,
            shuffle=True,
            transform=worker_fns.augment,
        )
        results.append(await run_epochs(dl, epochs=2))
    (a0, a1), (b0, b1) = results
    assert all(torch.equal(x, y) for x, y in zip(a0, b0, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(a1, b1, strict=True))
    assert not torch.equal(torch.cat(a0)[:, 1:], torch.cat(a1)[:, 1:])  # a new epoch draws anew
    draws = torch.cat(a0)[:, 1:]
    assert len({tuple(r.tolist()) for r in draws}) == len(draws)  # no two samples drew alike


async def test_unseeded_batches_never_share_a_random_stream() -> None:
    dl = aioloader.DataLoader(
        Counting(32), batch_size=4, num_workers=2, transform=worker_fns.augment
    )
    (batches,) = await run_epochs(dl)
    firsts = [tuple(b[0, 1:].tolist()) for b in batches]  # each batch's first draws
    assert len(set(firsts)) == len(firsts)


async def test_batches_come_back_through_shared_memory() -> None:
    dl = aioloader.DataLoader(
        Counting(128), batch_size=64, num_workers=2, transform=worker_fns.image
    )
    (batches,) = await run_epochs(dl)
    assert [b.shape for b in batches] == [torch.Size([64, 3, 224, 224])] * 2
    assert torch.equal(batches[1][5], torch.full((3, 224, 224), 69, dtype=torch.uint8))
    stats = dl.statistics().workers
    assert stats is not None
    data = 64 * 3 * 224 * 224
    per_batch = stats.bytes_received / stats.jobs
    assert per_batch < 4096 < data  # a handle, not 9.6 MB of pixels


async def test_worker_exception_keeps_type_and_names_batch_sample_worker() -> None:
    dl = aioloader.DataLoader(
        Counting(12), batch_size=4, num_workers=2, transform=worker_fns.bad_value
    )
    with pytest.raises(ValueError, match="cannot decode sample 5") as info:
        await run_epochs(dl)
    text = notes(info.value)
    assert "stage 'transform'" in text and "sample 5" in text and "batch 1" in text
    assert "raised in worker" in text and "pid" in text
    assert "in bad_value" in text  # the worker's own traceback travelled with it


async def test_unpicklable_worker_exception_arrives_as_a_clear_stand_in() -> None:
    dl = aioloader.DataLoader(
        Counting(8), batch_size=4, num_workers=1, transform=worker_fns.raise_unpicklable
    )
    with pytest.raises(aioloader.RemoteError, match="Unpicklable: holds a lock") as info:
        await run_epochs(dl)
    assert "raise_unpicklable" in notes(info.value)


async def test_a_killed_worker_is_named_and_the_loader_recovers() -> None:
    dl = aioloader.DataLoader(
        Counting(16), batch_size=4, num_workers=2, transform=worker_fns.kill_on_7
    )
    async with dl:
        with pytest.raises(aioloader.WorkerCrashed) as info:
            [b async for b in dl]
        crash = info.value
        assert crash.signal == "SIGKILL" and crash.pid > 0 and crash.worker_id in (0, 1)
        assert f"DataLoader worker (pid {crash.pid}) is killed by signal: Killed" in str(crash)
        assert f"aioloader worker {crash.worker_id}, SIGKILL" in str(crash)
        assert "stage 'transform'" in notes(crash) and "batch 1" in notes(crash)
    assert children() == []
    stats = dl.statistics().workers
    assert stats is not None and stats.crashes == 1


async def test_a_crashed_worker_is_replaced_for_the_next_epoch() -> None:
    dl = aioloader.DataLoader(
        Counting(16),
        batch_size=4,
        num_workers=1,
        transform=worker_fns.kill_on_7,
        max_failures=0,
    )
    async with dl:
        with pytest.raises(aioloader.WorkerCrashed):
            [b async for b in dl]
        # The next epoch skips the poisonous batch with a sampler that leaves it out.
    assert children() == []
    batches = [[0, 1], [7], [2, 3]]
    dl2 = aioloader.DataLoader(
        Counting(16), batch_sampler=batches, num_workers=1, transform=worker_fns.kill_on_7
    )
    async with dl2:
        with pytest.raises(aioloader.WorkerCrashed):
            [b async for b in dl2]
        batches.remove([7])  # the sampler's next epoch (the attribute itself is frozen)
        assert flat([b async for b in dl2]) == [0, 1, 2, 3]
        stats = dl2.statistics().workers
        assert stats is not None and stats.restarts == 1


def test_unpicklable_functions_fail_at_construction() -> None:
    """A lambda goes by value (test_by_value.py); one holding what cannot be pickled at all
    fails at construction, named."""
    lock = threading.Lock()
    with pytest.raises(TypeError, match=r"transform=.*cannot be sent to worker processes"):
        aioloader.DataLoader(Counting(4), num_workers=2, transform=lambda x: (lock, x))
    with pytest.raises(TypeError, match=r"collate_fn=.*cannot pickle '_thread.lock'"):
        aioloader.DataLoader(Counting(4), num_workers=1, collate_fn=lambda b: (lock, b))
    # Threads need no pickling.
    aioloader.DataLoader(
        Counting(4), num_workers=2, transform=lambda x: (lock, x), worker_mode="thread"
    )


def test_an_unknown_worker_mode_is_named() -> None:
    with pytest.raises(ValueError, match="worker_mode"):
        aioloader.DataLoader(Counting(4), num_workers=1, worker_mode="greenlet")  # type: ignore[arg-type]


async def test_worker_init_failure_surfaces_from_the_scope() -> None:
    dl = aioloader.DataLoader(Counting(4), num_workers=1, worker_init_fn=worker_fns.failing_init)
    with pytest.raises(LookupError, match="no config for worker 0") as info:
        async with dl:
            pass
    assert "raised in worker 0" in notes(info.value)
    assert children() == []


@pytest.mark.parametrize("how", ["break", "exception", "cancel"])
async def test_leaving_the_scope_leaves_no_process_fd_or_shared_memory(how: str) -> None:
    resource_tracker.ensure_running()  # multiprocessing's helper: started once, it lives on
    # The default start method's server: likewise, once a process (and the standby forked as
    # aioloader was imported, with its pipes, is gone once it is started).
    prepare_forkserver("forkserver")
    gc.collect()
    fds, segments = open_fds(), shm()
    workers: set[int] = set()
    dl = aioloader.DataLoader(Counting(400), batch_size=4, num_workers=2, transform=worker_fns.slow)
    with anyio.CancelScope() as scope:
        try:
            async with dl:
                async for batch in dl:
                    del batch
                    workers |= {child.pid for child in children() if child.pid is not None}
                    if how == "break":
                        break
                    if how == "exception":
                        raise RuntimeError("the training step failed")
                    scope.cancel()
                    await anyio.lowlevel.checkpoint()
        except RuntimeError:
            assert how == "exception"
    gc.collect()
    assert children() == []
    assert open_fds() == fds
    assert len(workers) == 2  # the workers were seen: a name one of them made counts
    assert shm(workers) == segments


def test_a_reaped_workers_left_segment_names_are_removed_under_file_descriptor() -> None:
    """A CI run under load once found a ``torch_<worker pid>_...`` name in ``/dev/shm`` after
    the scope closed: the ``file_descriptor`` strategy unlinks each segment as it makes it,
    so a name left is a stopped worker's half-made one, which nothing refers to."""
    child = multiprocessing.get_context("fork").Process(target=os.getpid)
    child.start()
    child.join()  # a pid that has exited, as a reaped worker's
    left = Path("/dev/shm", f"torch_{child.pid}_1234_1")
    left.write_bytes(b"x")
    try:
        strategy = torch.multiprocessing.get_sharing_strategy()
        torch.multiprocessing.set_sharing_strategy("file_system")
        try:  # the names of that strategy stay while another process maps them
            assert remove_left_segments(child.pid) == 0 and left.exists()
        finally:
            torch.multiprocessing.set_sharing_strategy(strategy)
        assert strategy == "file_descriptor"
        assert remove_left_segments(child.pid) == 1 and not left.exists()
    finally:
        left.unlink(missing_ok=True)


def test_plain_for_with_worker_processes() -> None:
    dl = aioloader.DataLoader(Counting(24), batch_size=6, num_workers=1, transform=worker_fns.slow)
    with dl:
        assert flat(dl) == list(range(24))
        for _ in dl:
            break
        assert flat(dl) == list(range(24))
    assert children() == []


def test_spawn_gives_the_batches_the_default_forkserver_gives() -> None:
    dl = aioloader.DataLoader(
        Counting(12), batch_size=4, num_workers=1, transform=worker_fns.augment, seed=5
    )
    spawn = aioloader.DataLoader(
        Counting(12),
        batch_size=4,
        num_workers=1,
        transform=worker_fns.augment,
        seed=5,
        multiprocessing_context="spawn",
    )
    assert dl.start_method == "forkserver"
    got, want = list(dl), list(spawn)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert children() == []


def _check_raw(batches: list[list[bytes]], n: int, size: int) -> None:
    samples = [sample for batch in batches for sample in batch]
    assert [int.from_bytes(s[:4], "little") for s in samples] == list(range(n))
    assert all(s == i.to_bytes(4, "little") * (size // 4) for i, s in enumerate(samples))


def test_a_batch_larger_than_the_pipe_s_buffer_comes_back_whole_in_a_plain_for() -> None:
    """32 samples of 64 KiB as raw bytes (2 MiB a batch, pickled through the worker's pipe):
    the plain ``for`` runs on uvloop, which makes the pipe non-blocking when it polls it; a
    batch once read as the worker's crash (``BlockingIOError`` part-way through the message)."""
    from tests.support.worker_datasets import RawBytes

    n, size = 96, 64 * 1024
    loader = aioloader.DataLoader(RawBytes(n, size), batch_size=32, num_workers=2, collate_fn=list)
    _check_raw(list(loader), n, size)


async def test_a_batch_larger_than_the_pipe_s_buffer_comes_back_whole_in_async_for() -> None:
    from tests.support.worker_datasets import RawBytes

    n, size = 96, 64 * 1024
    loader = aioloader.DataLoader(RawBytes(n, size), batch_size=32, num_workers=2, collate_fn=list)
    async with loader:
        _check_raw([batch async for batch in loader], n, size)


def test_a_process_forked_since_keeps_no_worker_from_its_eof(tmp_path: Path) -> None:
    """A process forked after the workers started (torch's fork workers, a user's fork) holds
    a copy of each worker's pipe: closing ours alone left the worker waiting, terminated 5 s
    later. The worker leaves of itself (its finalizers ran: the file is there)."""
    init = functools.partial(worker_fns.mark_a_clean_exit, str(tmp_path))
    loader = aioloader.DataLoader(
        list(range(8)), batch_size=4, num_workers=2, persistent_workers=True, worker_init_fn=init
    )
    with loader:
        assert flat(loader) == list(range(8))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads
            pid = os.fork()
        if pid == 0:  # the child holds every descriptor, the workers' pipes too
            time.sleep(60)
            os._exit(0)
    try:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["w0", "w1"]
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


async def test_a_dead_worker_s_refused_job_leaves_no_view_of_its_pickle_in_the_error() -> None:
    """A job's pickle is a view of a ``BytesIO``. A traceback that keeps one, left in a reference
    cycle, crashed CPython 3.12.1's garbage collector (gh-111049): a job sent to a worker that
    died while idle raised ``WorkerCrashed`` whose context's frames (``send_bytes``) still
    viewed it, and the next ``gc.collect()`` segfaulted."""
    pool = bare_pool()
    await pool.start()
    try:
        async with pool.reserved() as run_on:
            assert await run_on(0, len, [1, 2]) == 2
            worker = pool._slots.now[0]
            os.kill(worker.pid, signal.SIGKILL)
            await anyio.to_thread.run_sync(worker.process.join, 10)  # dead while idle
            with pytest.raises(aioloader.WorkerCrashed) as caught:
                await run_on(0, len, [1, 2, 3], replace=False)
        assert views_kept(caught.value) == []
    finally:
        await pool.aclose()


async def test_a_worker_killed_once_its_reply_is_sent_loses_nothing_of_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reply's tensor crosses as a descriptor that follows the message on the worker's pipe
    (``fdpass.py``). A worker killed once it sent both is gone before the main process takes
    them: the reply arrives whole (the descriptor was the main process's once sent; it was
    taken from the worker's resource sharer before, which refused it), and the next job goes
    to a new worker."""
    pool = bare_pool()
    descriptors = fdpass.descriptors

    def killed_first(conn: Any, expected: int) -> list[int]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0, conn.fileno())
        try:  # the worker has sent its descriptors too (their byte is there to read)
            assert sock.recv(1, socket.MSG_PEEK) == b"\0"
        finally:
            sock.detach()
        worker = pool._slots.now[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.process.join(10)
        assert expected == 1  # the reply's tensor, sent
        return descriptors(conn, expected)

    await pool.start()
    try:
        first = pool._slots.now[0].pid
        monkeypatch.setattr(fdpass, "descriptors", killed_first)
        assert (await pool.run(torch.arange, 4)).tolist() == [0, 1, 2, 3]
        monkeypatch.undo()
        assert (await pool.run(torch.ones, 4)).tolist() == [1.0] * 4
        assert pool._slots.now[0].pid != first  # a new worker
    finally:
        await pool.aclose()
