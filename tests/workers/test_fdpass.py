"""Tensors' shared-memory descriptors cross a worker's pipe beside the message that refers to
them (``fdpass.py``), not through multiprocessing's resource sharer: a job's tensors, a
reply's, more of them than one ``sendmsg`` takes, and, when the worker dies before it takes a
job, nothing left open in the main process (the sharer kept each such descriptor, and its
shared memory, for as long as the process lived)."""

from __future__ import annotations

import errno
import gc
import multiprocessing
import os
import signal
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

import aioloader
from aioloader._base.recorders import WorkerRecorder
from aioloader._workers import fdpass
from aioloader._workers.processes import ProcessWorkers
from tests.support import worker_fns
from tests.support.helpers import bare_pool, derive_seed, run_json_script, shared_memory_fds


def shared(n: int, size: int = 16) -> list[torch.Tensor]:
    """``n`` tensors, each in a shared-memory segment of its own (its descriptor open here)."""
    made = [torch.full((size,), float(i)) for i in range(n)]
    for t in made:
        t.share_memory_()  # type: ignore[no-untyped-call]
    return made


async def test_a_job_s_tensors_are_the_worker_s_and_come_back_the_same_memory() -> None:
    """More than one ``sendmsg`` takes, both ways: the worker writes into each tensor in place
    (it has the memory, not a copy) and sends them back, shared already: the main process
    gets its own tensors' memory back, one descriptor each."""
    count = fdpass.PER_SENDMSG + 30
    tensors = shared(count)
    pool = bare_pool()
    await pool.start()
    try:
        back = await pool.run(worker_fns.add_one_in_place, tensors)
    finally:
        await pool.aclose()
    assert [t[0].item() for t in tensors] == [i + 1.0 for i in range(count)]
    assert [t.data_ptr() for t in back] == [t.data_ptr() for t in tensors]
    del tensors, back
    gc.collect()


async def test_a_job_refused_by_a_worker_dead_while_idle_leaves_no_descriptor_open() -> None:
    tensors = shared(4)
    pool = bare_pool()
    await pool.start()
    try:
        dead = pool._slots.now[0]
        os.kill(dead.pid, signal.SIGKILL)
        dead.process.join(10)
        before = shared_memory_fds()
        # Refused by the dead worker's pipe, then sent to the worker that replaces it
        back = await pool.run(worker_fns.add_one_in_place, tensors)
        assert pool._slots.now[0].pid != dead.pid
        assert [t[0].item() for t in back] == [1.0, 2.0, 3.0, 4.0]
        del back
        assert shared_memory_fds() == before
    finally:
        await pool.aclose()


async def test_a_job_left_in_a_killed_worker_s_pipe_leaves_no_descriptor_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker is killed once its job (and the job's descriptors) are in its pipe, before
    it reads them: they go with the pipe, not with the main process."""
    tensors = shared(4)
    pool = bare_pool()
    send = fdpass.send

    def then_killed(conn: Any, message: memoryview, passing: fdpass.Passing) -> None:
        assert len(passing.fds) == 4
        worker = pool._slots.now[0]
        os.kill(worker.pid, signal.SIGSTOP)  # it cannot take the job before it is killed
        send(conn, message, passing)
        os.kill(worker.pid, signal.SIGKILL)
        worker.process.join(10)

    await pool.start()
    try:
        before = shared_memory_fds()
        monkeypatch.setattr(fdpass, "send", then_killed)
        with pytest.raises(aioloader.WorkerCrashed, match="killed by signal: Killed"):
            await pool.run(worker_fns.add_one_in_place, tensors)
        monkeypatch.undo()
        assert shared_memory_fds() == before
        assert [t[0].item() for t in tensors] == [0.0, 1.0, 2.0, 3.0]  # never run
    finally:
        await pool.aclose()


def test_descriptors_a_message_did_not_take_are_closed_as_it_is_unpickled() -> None:
    passing = fdpass.Passing()
    message = passing.dumps(torch.arange(3))
    fds = [*passing.handed(), os.open(os.devnull, os.O_RDONLY)]  # one it does not refer to
    assert fdpass.count(message) == 1
    assert fdpass.loads(message, fds).tolist() == [0, 1, 2]
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)  # closed: by torch's rebuild, and by loads


def test_a_storage_torch_would_not_share_by_descriptor_goes_torch_s_way() -> None:
    """An empty storage passes nothing (torch rebuilds it empty)."""
    passing = fdpass.Passing()
    message = passing.dumps(torch.empty(0))
    assert fdpass.count(message) == 0
    assert fdpass.loads(message, passing.handed()).shape == (0,)


@pytest.mark.parametrize("names", [0, 20_000], ids=["each-worker-s-start", "template-refused"])
def test_a_dataset_holding_more_tensors_than_a_start_hands_over_starts_its_workers(
    names: int,
) -> None:
    """A fork server's process start hands over at most 252 descriptors, one per tensor the
    dataset holds: a dataset of 300 preloaded tensors failed to start its workers
    (``ValueError: too many fds``). Each worker's start now sends them down its pipe; a
    template (for a start that pickles to 1 MiB or more) is refused, saying why."""
    held = worker_fns.HeldTensors(300, names, shared=True)
    loader = aioloader.DataLoader(held, batch_size=100, num_workers=2)
    batches = list(loader)
    assert torch.cat(batches)[:, 0].tolist() == [float(i) for i in range(300)]
    workers = loader.statistics().workers
    assert workers.template_pid == 0
    if names:
        assert "300 values handed over by descriptor" in workers.template_why
    del loader, batches
    gc.collect()  # the dataset's 300 segments: their descriptors (a select() elsewhere)


OUT_OF_FILES = """
import json, os, resource, sys
import torch
import aioloader
from aioloader._workers import startcopy
from tests.support.worker_fns import HeldTensors

if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), int(sys.argv[2])))
    if sys.argv[3] == "moved":  # every storage moved to shared memory, as torch's sharing does
        startcopy.MOVED_FROM = 0
    held = HeldTensors(int(sys.argv[1]))
    loader = aioloader.DataLoader(held, batch_size=50, num_workers=2)
    try:
        samples = sum(len(batch) for batch in loader)
        print(json.dumps({"samples": samples, "notes": [], "fds": len(os.listdir("/proc/self/fd")),
                          "moved": sum(item.is_shared() for item in held.items)}))
    except RuntimeError as exc:
        print(json.dumps({"samples": 0, "notes": getattr(exc, "__notes__", [])}))
"""


def test_a_dataset_of_more_tensors_than_open_files_starts_its_workers(tmp_path: Path) -> None:
    """A dataset of 3,000 preloaded tensors under an open-file limit of 400: their storages
    are copied into the start (``startcopy.py``), none moved to shared memory, no descriptor
    left open here (torch's sharing made a segment each, its descriptor open here: the start
    failed with 400 of them)."""
    env = {"PYTHONPATH": str(Path(__file__).parents[2])}
    got = run_json_script(tmp_path, OUT_OF_FILES, "3000", "400", "copied", env=env)
    assert got["samples"] == 3000 and got["moved"] == 0 and got["fds"] < 40, got


def test_a_dataset_of_more_moved_tensors_than_open_files_says_what_to_do(tmp_path: Path) -> None:
    """Each storage torch's sharing moves (one of ``startcopy.MOVED_FROM`` bytes or more;
    every one in this test) stays a shared-memory segment with its descriptor open in the main
    process (torch's ``file_descriptor`` strategy, as with its spawn workers); the pipe's
    descriptors are those, not copies (300 tensors start under a limit of 400)."""
    env = {"PYTHONPATH": str(Path(__file__).parents[2])}
    fits = run_json_script(tmp_path, OUT_OF_FILES, "300", "400", "moved", env=env)
    assert fits["samples"] == 300 and fits["moved"] == 300, fits
    over = run_json_script(tmp_path, OUT_OF_FILES, "600", "400", "moved", env=env)
    assert over["samples"] == 0
    assert any(
        "ran out of open files (400)" in note and "HeldTensors" in note and "ulimit -n" in note
        for note in over["notes"]
    ), over["notes"]


async def test_a_worker_killed_between_its_reply_and_its_descriptors_is_a_crash() -> None:
    """The message came, its descriptor never will: the worker's crash, named, not a reply
    misread; the next job goes to a new worker."""
    pool = bare_pool()
    await pool.start()
    try:
        with pytest.raises(aioloader.WorkerCrashed, match="killed by signal: Killed"):
            await pool.run(worker_fns.killed_between_reply_and_descriptors, 4)
        assert (await pool.run(torch.arange, 3)).tolist() == [0, 1, 2]
    finally:
        await pool.aclose()


async def test_a_worker_that_sets_a_default_socket_timeout_reads_its_pipe_on() -> None:
    """``socket.setdefaulttimeout`` (a dataset that reads over HTTP) made every socket object
    made over the pipe's descriptor non-blocking: the worker's next read failed, and it left."""
    loader = aioloader.DataLoader(
        worker_fns.HeldTensors(12),
        batch_size=4,
        num_workers=1,
        worker_init_fn=worker_fns.sets_a_socket_timeout,
    )
    assert torch.cat(list(loader))[:, 0].tolist() == [float(i) for i in range(12)]


async def test_a_worker_out_of_open_files_fails_the_job_it_cannot_take_and_serves_on() -> None:
    tensors = shared(40)  # already shared: each goes as a descriptor of its own
    pool = bare_pool()
    await pool.start()
    try:
        await pool.run(worker_fns.lower_the_open_file_limit, 30)
        with pytest.raises(RuntimeError, match="Too many open files: a worker could not take 40"):
            await pool.run(worker_fns.add_one_in_place, tensors)
        assert (await pool.run(torch.arange, 3)).tolist() == [0, 1, 2]  # the same worker
    finally:
        await pool.aclose()


async def test_a_job_whose_descriptors_the_kernel_refuses_stops_its_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The message went, its descriptors could not (``ETOOMANYREFS`` still, after the wait):
    the worker, waiting for them, cannot read on. It is stopped, a crash naming it, the
    refusal its cause; the next job gets a new one."""
    pool = bare_pool()

    def refused(conn: Any, passing: fdpass.Passing, **_: Any) -> None:
        raise OSError(errno.ETOOMANYREFS, "Too many references")

    await pool.start()
    try:
        first = pool._slots.now[0].pid
        monkeypatch.setattr(fdpass, "send_descriptors", refused)
        with pytest.raises(aioloader.WorkerCrashed, match=f"pid {first}") as caught:
            await pool.run(worker_fns.add_one_in_place, shared(2))
        monkeypatch.undo()
        assert isinstance(caught.value.__cause__, fdpass.Unsent)
        assert caught.value.__cause__.errno == errno.ETOOMANYREFS
        assert any("could not all be sent" in note for note in caught.value.__notes__)
        assert pool._stats.crashes == 1
        assert (await pool.run(torch.arange, 3)).tolist() == [0, 1, 2]
        assert pool._slots.now[0].pid != first
    finally:
        await pool.aclose()


async def test_a_job_s_descriptors_refused_for_a_moment_go_once_the_kernel_takes_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ETOOMANYREFS`` counts a user's descriptors in flight over all its processes: another
    loader's, another rank's, taken a moment later. The send waits; the worker goes on."""
    pool = bare_pool()
    real = socket.send_fds
    refusals: list[int] = []

    def busy_twice(sock: socket.socket, buffers: Any, fds: Any) -> int:
        if len(refusals) < 2:
            refusals.append(len(fds))
            raise OSError(errno.ETOOMANYREFS, "Too many references")
        return real(sock, buffers, fds)

    await pool.start()
    try:
        first = pool._slots.now[0].pid
        monkeypatch.setattr(fdpass.socket, "send_fds", busy_twice)
        back = await pool.run(worker_fns.add_one_in_place, shared(2))
        monkeypatch.undo()
        assert [t[0].item() for t in back] == [1.0, 2.0] and refusals == [2, 2]
        assert pool._slots.now[0].pid == first
    finally:
        await pool.aclose()


async def test_a_job_a_worker_could_not_take_gives_back_the_blocks_it_carried() -> None:
    """The blocks the main process let go of ride with the next job: when the worker could not
    take that job (out of open files), they ride with the one after, not lost (each would
    stay busy in the worker for good)."""
    pool = ProcessWorkers(
        1, context="forkserver", seed=0, derive=derive_seed, worker_init_fn=None,
        stats=WorkerRecorder(), blocks=True,
    )  # fmt: skip
    await pool.start()
    try:
        await pool.run(worker_fns.lower_the_open_file_limit, 30)
        result = await pool.run(worker_fns.big_result)
        del result
        gc.collect()  # its block is free: its key goes with the next job
        with pytest.raises(RuntimeError, match="Too many open files"):
            await pool.run(worker_fns.add_one_in_place, shared(40))
        assert await pool.run(worker_fns.blocks_busy) == [False]
    finally:
        await pool.aclose()


SPARSE = """
import json, warnings
warnings.filterwarnings("ignore", "Sparse invariant checks")  # as a worker rebuilds one
import torch
import aioloader
from tests.support.worker_fns import HeldSparse

if __name__ == "__main__":
    loader = aioloader.DataLoader(HeldSparse(130), batch_size=50, num_workers=1)
    print(json.dumps(torch.cat(list(loader))[:, 0].tolist()))
"""


def test_a_dataset_of_sparse_tensors_counts_their_descriptors(tmp_path: Path) -> None:
    """130 sparse tensors are 260 descriptors: more than a fork server's start takes. (A
    script of its own: torch warns as a worker rebuilds a sparse tensor, an error here, and
    workers take the main process's warning filters.)"""
    env = {"PYTHONPATH": str(Path(__file__).parents[2])}
    assert run_json_script(tmp_path, SPARSE, env=env) == [float(i) for i in range(130)]


def test_a_start_s_descriptors_refused_in_flight_go_once_earlier_workers_took_theirs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A user without ``CAP_SYS_RESOURCE`` may have no more descriptors in flight than its
    open-file limit (``ETOOMANYREFS``): the second worker's start waits for the first's."""
    send = fdpass.send_descriptors
    calls: list[int] = []

    def once_refused(conn: Any, passing: fdpass.Passing, **kwargs: Any) -> None:
        calls.append(len(passing.fds))
        if len(calls) == 2:
            raise OSError(errno.ETOOMANYREFS, "Too many references")
        send(conn, passing, **kwargs)

    monkeypatch.setattr(fdpass, "send_descriptors", once_refused)
    held = worker_fns.HeldTensors(300, shared=True)
    loader = aioloader.DataLoader(held, batch_size=100, num_workers=2)
    assert torch.cat(list(loader))[:, 0].tolist() == [float(i) for i in range(300)]
    assert calls[:3] == [300, 300, 300]  # the first worker's; the second's, refused, then sent
    del loader
    gc.collect()


def test_a_fork_made_while_a_start_is_pickled_does_not_take_it_along() -> None:
    with fdpass.starting(fdpass.Passing()):
        pid = os.fork()
        if pid == 0:  # the child: a loader it made would otherwise pipe into a dead Passing
            os._exit(0 if fdpass.for_the_pipe() is None else 1)
        assert fdpass.for_the_pipe() is not None
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_descriptors_received_are_closed_on_exec() -> None:
    ours, theirs = multiprocessing.Pipe(duplex=True)
    passing = fdpass.Passing()
    fdpass.send(ours, passing.dumps(torch.arange(3)), passing)
    message = theirs.recv_bytes()
    fds = fdpass.descriptors(theirs, fdpass.count(message))
    try:
        assert len(fds) == 1 and not os.get_inheritable(fds[0])
    finally:
        for fd in fds:
            os.close(fd)
        ours.close()
        theirs.close()
