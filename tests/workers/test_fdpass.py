"""Tensors' shared-memory descriptors cross a worker's pipe beside the message that refers to
them (``fdpass.py``), not through multiprocessing's resource sharer: a job's tensors, a
reply's, more of them than one ``sendmsg`` takes, and, when the worker dies before it takes a
job, nothing left open in the main process (the sharer kept each such descriptor, and its
shared memory, for as long as the process lived)."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pytest
import torch

import aioloader
from aioloader._workers import fdpass
from tests.support import worker_fns
from tests.support.helpers import bare_pool, run_json_script


def shared_memory_fds() -> int:
    """This process's descriptors of torch's shared-memory segments."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed since
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/shm/torch_")
    return count


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
        send(conn, message, passing)
        worker = pool._slots.now[0]
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
    written = fdpass.buffer()
    pickler = ForkingPickler(written, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table.update(passing.reducers())
    pickler.dump(torch.arange(3))
    message = passing.finish(written)
    fds = [*passing.handed(), os.open(os.devnull, os.O_RDONLY)]  # one it does not refer to
    assert fdpass.count(message) == 1
    assert fdpass.loads(message, fds).tolist() == [0, 1, 2]
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)  # closed: by torch's rebuild, and by loads


def test_a_storage_torch_would_not_share_by_descriptor_goes_torch_s_way() -> None:
    """An empty storage passes nothing (torch rebuilds it empty)."""
    passing = fdpass.Passing()
    written = fdpass.buffer()
    pickler = ForkingPickler(written, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table.update(passing.reducers())
    pickler.dump(torch.empty(0))
    message = passing.finish(written)
    assert fdpass.count(message) == 0
    assert fdpass.loads(message, passing.handed()).shape == (0,)


@pytest.mark.parametrize("names", [0, 20_000], ids=["each-worker-s-start", "template-refused"])
def test_a_dataset_holding_more_tensors_than_a_start_hands_over_starts_its_workers(
    names: int,
) -> None:
    """A fork server's process start hands over at most 252 descriptors, one per tensor the
    dataset holds: a dataset of 1,000 preloaded tensors failed to start its workers
    (``ValueError: too many fds``). Each worker's start now sends them down its pipe; a
    template (for a start that pickles to 1 MiB or more) is refused, saying why."""
    loader = aioloader.DataLoader(
        worker_fns.HeldTensors(1000, names), batch_size=100, num_workers=2
    )
    batches = list(loader)
    assert torch.cat(batches)[:, 0].tolist() == [float(i) for i in range(1000)]
    workers = loader.statistics().workers
    assert workers.template_pid == 0
    if names:
        assert "1000 values handed over by descriptor" in workers.template_why


OUT_OF_FILES = """
import json, resource, sys
import torch
import aioloader
from tests.support.worker_fns import HeldTensors

if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), int(sys.argv[2])))
    loader = aioloader.DataLoader(HeldTensors(int(sys.argv[1])), batch_size=50, num_workers=2)
    try:
        print(json.dumps({"samples": sum(len(batch) for batch in loader), "notes": []}))
    except RuntimeError as exc:
        print(json.dumps({"samples": 0, "notes": getattr(exc, "__notes__", [])}))
"""


def test_a_dataset_of_more_tensors_than_open_files_says_what_to_do(tmp_path: Path) -> None:
    """Each tensor the dataset holds stays a shared-memory segment with its descriptor open in
    the main process (torch's ``file_descriptor`` strategy, as with its spawn workers); the
    pipe's descriptors are those, not copies (300 tensors start under a limit of 400)."""
    env = {"PYTHONPATH": str(Path(__file__).parents[2])}
    fits = run_json_script(tmp_path, OUT_OF_FILES, "300", "400", env=env)
    assert fits == {"samples": 300, "notes": []}
    over = run_json_script(tmp_path, OUT_OF_FILES, "600", "400", env=env)
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
