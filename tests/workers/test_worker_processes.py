"""torch's private handles on a loader's workers, as code written for torch reads them: an
iterator's ``_workers`` (their pids, whether they live, their exit codes) and a loader's
``_iterator`` while persistent workers run (``_shutdown_workers()``, ``_iterator = None``:
Lightning's teardown). Real processes; every wait bounded."""

from __future__ import annotations

import gc
import os
import select
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.utils.data

import aioloader
from tests.support import worker_datasets as wd

JOIN_S = 10.0


@pytest.fixture
def collector_off() -> Iterator[None]:
    """Refcounting alone: what torch's loader relies on to stop its workers as it is dropped."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def pids_by_worker(batches: list[dict[str, Any]]) -> dict[int, set[int]]:
    seen: dict[int, set[int]] = {}
    for batch in batches:
        for worker, pid in zip(batch["our_id"].tolist(), batch["pid"].tolist(), strict=True):
            seen.setdefault(worker, set()).add(pid)
    return seen


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_are_the_processes_that_read_by_worker_id(persistent: bool) -> None:
    dl = aioloader.DataLoader(
        wd.WhoReads(32), batch_size=4, num_workers=2, persistent_workers=persistent
    )
    it = iter(dl)
    workers = it._workers
    assert [w.worker_id for w in workers] == [0, 1]
    assert all(w.is_alive() and w.exitcode is None for w in workers)
    seen = pids_by_worker(list(it))
    assert seen == {0: {workers[0].pid}, 1: {workers[1].pid}}
    assert it._workers is workers  # torch's list: the same after the epoch
    if persistent:
        assert all(w.is_alive() for w in workers)  # the loader keeps them for the next epoch
        dl.close()
    for w in workers:
        w.join(JOIN_S)
        assert not w.is_alive() and w.exitcode == 0, w


def test_without_worker_processes_there_is_no_workers_attribute() -> None:
    """As torch's single-process iterator: no ``_workers`` at all."""
    torch_loader = torch.utils.data.DataLoader(wd.WhoReads(4), batch_size=2)
    assert not hasattr(iter(torch_loader), "_workers")
    for options in ({}, {"num_workers": 2, "worker_mode": "thread"}):
        it = iter(aioloader.DataLoader(wd.WhoReads(4), batch_size=2, **options))
        with pytest.raises(AttributeError, match="no worker processes"):
            it._workers  # noqa: B018
        assert not hasattr(it, "_workers")
        assert len(list(it)) == 2


def test_a_worker_killed_through_its_handle_is_a_crash_with_its_exit_code(tmp_path: Any) -> None:
    """Killed mid-job: that job's batch fails naming the worker's pid and signal, the rest come.
    (A worker killed while idle is replaced with nothing lost: which one is idle is a race, so
    the victim is the worker that says it is hanging in sample 4, batch 1.)"""
    fifo = tmp_path / "hanging"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # before any writer: no EOF until one
    try:
        dl = aioloader.DataLoader(wd.HangsAt(64, 4, str(fifo)), batch_size=4, num_workers=2)
        it = iter(dl)
        next(it)
        assert select.select([reader], [], [], JOIN_S)[0], "no worker reached sample 4"
        worker_id = int(os.read(reader, 64).decode())
    finally:
        os.close(reader)
    victim = it._workers[worker_id]
    victim.kill()
    victim.join(JOIN_S)
    assert not victim.is_alive()
    errors: list[BaseException] = []
    batches = 1
    for _ in range(40):  # bounded: 16 batches, a few failed
        try:
            next(it)
            batches += 1
        except StopIteration:
            break
        except aioloader.WorkerCrashed as exc:
            errors.append(exc)
    assert [e.pid for e in errors] == [victim.pid], errors  # type: ignore[attr-defined]
    assert batches == 15
    victim.join(JOIN_S)  # the loader has found it dead and reaped it
    assert victim.exitcode == -signal.SIGKILL
    victim.terminate()  # ended: a signal to it is a no-op, never to a later process of its pid
    assert "exitcode=-9" in repr(victim)


def test_a_worker_stream_whose_worker_dies_counts_one_crash() -> None:
    """An iterable dataset's worker killed: one error, one crash in the statistics (closing
    its stream found the same dead worker and counted it again)."""
    dl = aioloader.DataLoader(wd.Ranges(0, 400), batch_size=4, num_workers=2)
    it = iter(dl)
    next(it)
    victim = it._workers[1]
    victim.kill()
    victim.join(JOIN_S)
    errors: list[BaseException] = []
    for _ in range(200):  # bounded: 100 batches
        try:
            next(it)
        except StopIteration:
            break
        except aioloader.WorkerCrashed as exc:
            errors.append(exc)
    stats = dl.statistics().workers
    assert stats is not None
    assert [e.pid for e in errors] == [victim.pid], errors  # type: ignore[attr-defined]
    assert stats.crashes == 1, stats


def test_a_dropped_loader_stops_its_persistent_workers_at_once(collector_off: None) -> None:
    """torch's persistent workers stop as the loader is dropped, refcounting alone; ours kept
    running until the collector's next pass (the end of an epoch left a reference cycle
    through the iterator's frame)."""
    dl = aioloader.DataLoader(wd.WhoReads(16), batch_size=4, num_workers=2, persistent_workers=True)
    it = iter(dl)
    workers = it._workers
    assert len(list(it)) == 4
    del it, dl
    for w in workers:
        w.join(JOIN_S)
        assert not w.is_alive() and w.exitcode == 0, w


def test_iterator_is_none_until_persistent_workers_run_and_stops_them() -> None:
    """torch keeps its persistent iterator in ``loader._iterator``; Lightning's teardown calls
    its ``_shutdown_workers()`` and sets it to None. Both stop ours."""
    dl = aioloader.DataLoader(wd.WhoReads(16), batch_size=4, num_workers=2, persistent_workers=True)
    assert dl._iterator is None
    assert len(list(dl)) == 4
    first = dl._iterator._workers
    assert [w.is_alive() for w in first] == [True, True]
    dl._iterator = None
    assert dl._iterator is None
    for w in first:
        w.join(JOIN_S)
        assert not w.is_alive() and w.exitcode == 0
    assert len(list(dl)) == 4  # the next epoch starts new workers, as torch's does
    second = dl._iterator._workers
    assert {w.pid for w in second}.isdisjoint({w.pid for w in first})
    dl._iterator._shutdown_workers()
    assert dl._iterator is None and not any(w.is_alive() for w in second)
    with pytest.raises(TypeError, match="only None"):
        dl._iterator = iter(dl)


def test_iterator_stays_none_without_persistent_workers_and_leaves_with_alone() -> None:
    dl = aioloader.DataLoader(wd.WhoReads(8), batch_size=4, num_workers=1)
    assert len(list(dl)) == 2 and dl._iterator is None
    with dl:
        it = iter(dl)
        workers = it._workers
        dl._iterator = None  # torch's idiom for persistent workers: a `with` scope is not one
        assert len(list(it)) == 2 and workers[0].is_alive()
    workers[0].join(JOIN_S)
    assert not workers[0].is_alive()


def test_a_handle_first_asked_after_its_worker_died_unnoticed_is_ended() -> None:
    """A persistent worker killed between epochs, and reaped by the fork server: its pid is
    free for another process. Its handle, made after, is ended: no signal goes to the pid."""
    dl = aioloader.DataLoader(wd.WhoReads(8), batch_size=4, num_workers=1, persistent_workers=True)
    try:
        it = iter(dl)
        (pid,) = {int(p) for batch in it for p in batch["pid"]}
        watch = os.pidfd_open(pid)
        os.kill(pid, signal.SIGKILL)
        select.select([watch], [], [], JOIN_S)  # ended: now reaped by its fork server
        os.close(watch)
        for _ in range(100):  # bounded: the fork server reaps it at once
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.02)
        (handle,) = it._workers
        assert handle.pid == pid and not handle.is_alive() and handle.exitcode is None
        started = time.monotonic()
        handle.join()  # no wait: it ended (the loader has not reaped it: no exit code)
        handle.kill()  # a no-op, never a signal to whatever has the pid now
        assert time.monotonic() - started < 1.0
        assert sorted(int(i) for batch in dl for i in batch["index"]) == list(range(8))
    finally:
        dl.close()


@pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning")  # no accelerator: both warn
def test_no_pin_memory_thread_where_torchs_iterator_has_none() -> None:
    """torch's multiprocessing iterator has a pin thread only where it pins (an accelerator);
    without one, neither has the attribute (on a GPU: ``test_device_cuda.py``)."""
    if torch.cuda.is_available():
        pytest.skip("pins here: test_device_cuda.py checks the thread")
    for loader_class in (torch.utils.data.DataLoader, aioloader.DataLoader):
        loader = loader_class(wd.WhoReads(8), batch_size=4, num_workers=1, pin_memory=True)
        it = iter(loader)
        assert not hasattr(it, "_pin_memory_thread"), loader_class
        assert len(list(it)) == 2


def test_timeout_covers_a_worker_init_fn_that_hangs_as_torchs_does() -> None:
    # It held the first batch for as long as it hung; torch's raised after `timeout`.
    loader = aioloader.DataLoader(
        list(range(8)), batch_size=2, num_workers=2, worker_init_fn=wd.worker_1_hangs, timeout=1
    )
    began = time.monotonic()
    with pytest.raises(aioloader.LoaderTimeout, match=r"after 1 seconds: worker\(s\) \[1\]"):
        list(loader)
    assert time.monotonic() - began < 4  # the hanging worker is not given a grace to finish


class _CtrlCWhileWaiting:
    """Stands for a plain iterator's queue of replies: its ``get`` (the caller waiting for a
    batch) is interrupted after ``after`` seconds, as Ctrl-C interrupts that wait, whatever the
    machine's load (a real SIGINT's timing made the test flaky under CI's load)."""

    def __init__(self, replies: Any, after: float) -> None:
        self.replies, self.after = replies, after

    def put(self, item: Any) -> None:
        self.replies.put(item)

    def get(self) -> Any:
        time.sleep(self.after)
        raise KeyboardInterrupt


def test_ctrl_c_in_a_plain_for_stops_a_busy_worker_at_once() -> None:
    # Its job was given the 5 s grace a cancelled job gets where its worker may be reused;
    # torch's loop stops at once (and a second Ctrl-C was lost meanwhile).
    from tests.support.helpers import TorchMap

    loader = aioloader.DataLoader(TorchMap(4, delay=10.0), batch_size=1, num_workers=1)
    it = iter(loader)
    it._replies = _CtrlCWhileWaiting(it._replies, after=1.0)  # type: ignore[attr-defined]
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        next(it)
    assert time.monotonic() - began < 4  # 1 s of waiting, then no grace
    assert [
        b.tolist() for b in aioloader.DataLoader(list(range(4)), batch_size=2, num_workers=1)
    ] == [[0, 1], [2, 3]]


def test_timeout_gives_each_worker_s_start_its_own_wait_as_torch_each_batch() -> None:
    # One deadline for both starts failed where torch's loop (each batch within `timeout`
    # of the one before) goes through.
    loader = aioloader.DataLoader(
        list(range(4)), batch_size=2, num_workers=2, worker_init_fn=wd.staggered_start, timeout=3
    )
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]


def test_a_caught_ctrl_c_keeps_persistent_workers() -> None:
    # The hurried close killed them (their replies were waiting), and worker_init_fn ran again.
    from tests.support.helpers import TorchMap

    loader = aioloader.DataLoader(
        TorchMap(4, delay=0.5), batch_size=1, num_workers=1, persistent_workers=True
    )
    try:
        it = iter(loader)
        pids = [w.pid for w in it._workers]
        it._replies = _CtrlCWhileWaiting(it._replies, after=0.2)  # type: ignore[attr-defined]
        with pytest.raises(KeyboardInterrupt):
            next(it)
        again = iter(loader)
        assert [b.item() for b in again] == [0, 1, 2, 3]
        assert [w.pid for w in again._workers] == pids
    finally:
        loader.close()
