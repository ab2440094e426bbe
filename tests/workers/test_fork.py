"""``multiprocessing_context="fork"`` with torch's meaning: each worker is a fork of this process
as the workers start, so a dataset that does not pickle (a lock, an open file) works and the
workers see it as it is then; what a forked worker must not keep of this process (the other
workers' pipes, the signal handlers, the event loop's wake-up descriptor) it drops."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import aioloader
from aioloader._workers.byvalue import ByValue
from tests.support import worker_fns
from tests.support.helpers import Counting, bare_pool, flat, run_json_script

# Python 3.12 and later warn as a multi-threaded process forks (the hazard the docs state):
# these tests fork on purpose, from a process with threads.
pytestmark = pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded, use of fork:DeprecationWarning"
)


class Unpicklable(torch.utils.data.Dataset[torch.Tensor]):
    """A torch dataset that pickle refuses (a lock, an open file), whose size may change after
    the loader is made: forked workers see it as it is when they start."""

    def __init__(self, n: int, path: Path) -> None:
        self.n = n
        self.lock = threading.Lock()
        self.file = path.open("rb")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        info = torch.utils.data.get_worker_info()
        assert info is not None and info.dataset is self  # its inherited copy, not pickled
        with self.lock:  # a positional read: forked workers share the file's offset
            byte = os.pread(self.file.fileno(), 1, index)[0]
        return torch.tensor([index, byte, info.id, os.getpid()])

    def close(self) -> None:
        self.file.close()


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "bytes.bin"
    path.write_bytes(bytes(range(64)))
    return path


def test_a_dataset_that_does_not_pickle_is_read_by_forked_workers(data_file: Path) -> None:
    dataset = Unpicklable(16, data_file)
    try:
        dl = aioloader.DataLoader(
            dataset, batch_size=4, num_workers=2, multiprocessing_context="fork"
        )
        for _ in range(2):  # each epoch forks its workers again (persistent_workers=False)
            rows = torch.cat(list(dl))
            assert sorted(rows[:, 0].tolist()) == list(range(16))
            assert rows[:, 1].tolist() == rows[:, 0].tolist()  # the byte at that offset
            assert set(rows[:, 2].tolist()) == {0, 1}
            assert os.getpid() not in set(rows[:, 3].tolist())
        dataset.n = 6  # changed after the loader was made: the next workers see it
        assert sorted(torch.cat(list(dl))[:, 0].tolist()) == list(range(6))
        assert multiprocessing.active_children() == []
    finally:
        dataset.close()


async def test_forked_workers_serve_async_for_and_leave_nothing(data_file: Path) -> None:
    fds = len(os.listdir("/proc/self/fd"))
    dataset = Unpicklable(8, data_file)
    try:
        dl = aioloader.DataLoader(
            dataset,
            batch_size=2,
            num_workers=2,
            multiprocessing_context=multiprocessing.get_context("fork"),
            persistent_workers=True,
        )
        async with dl:
            first = torch.cat([b async for b in dl])
            second = torch.cat([b async for b in dl])
        assert sorted(first[:, 0].tolist()) == list(range(8))
        assert set(first[:, 3].tolist()) == set(second[:, 3].tolist())  # the same two workers
        assert dl.statistics().workers.processes == 2
    finally:
        dataset.close()
    assert multiprocessing.active_children() == []
    assert len(os.listdir("/proc/self/fd")) == fds


def test_jobs_still_go_by_value_and_worker_init_fn_is_not_pickled() -> None:
    """A lambda transform goes by value as with the other start methods; ``worker_init_fn``
    (here a closure over a lock, which pickle refuses) is the one the worker inherits."""
    lock = threading.Lock()
    seen: list[int] = []

    def init(worker_id: int) -> None:
        with lock:
            seen.append(worker_id)  # in the worker's copy of ``seen``

    dl = aioloader.DataLoader(
        Counting(8),
        batch_size=4,
        num_workers=2,
        worker_init_fn=init,
        transform=lambda x: x * 10,
        multiprocessing_context="fork",
    )
    assert sorted(flat(dl)) == [x * 10 for x in range(8)]
    assert seen == []  # the main process's list: each worker appended to its own copy
    with pytest.raises(TypeError, match="worker_init_fn"):  # the default start pickles it
        aioloader.DataLoader(Counting(8), num_workers=1, worker_init_fn=init)


def test_the_default_start_names_fork_as_a_remedy_for_a_dataset_that_does_not_pickle(
    data_file: Path,
) -> None:
    dataset = Unpicklable(4, data_file)
    try:
        dl = aioloader.DataLoader(dataset, num_workers=1)
        with pytest.raises(TypeError, match=r"Unpicklable.*multiprocessing_context='fork'"):
            list(dl)
    finally:
        dataset.close()


async def test_each_forked_worker_exits_on_its_own_pipe_closing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker forked after another must not hold the other's pipe end: closing the pipe is
    the shutdown signal, and every worker exits on it, none terminated at the grace's end."""
    stopped: list[str] = []
    for name in ("terminate", "kill"):
        original = getattr(multiprocessing.process.BaseProcess, name)

        def recorded(process: Any, name: str = name, original: Any = original) -> None:
            stopped.append(f"{process.name}: {name}")
            original(process)

        monkeypatch.setattr(multiprocessing.process.BaseProcess, name, recorded)
    pool = bare_pool(3, "fork")
    await pool.start()
    try:
        assert await pool.run(len, [1, 2, 3]) == 3
    finally:
        await pool.aclose()
    assert stopped == []
    assert multiprocessing.active_children() == []


@pytest.mark.skipif(sys.platform != "linux", reason="signals as Linux delivers them")
async def test_a_forked_worker_stopped_by_sigterm_runs_none_of_this_process_s_handlers() -> None:
    """This process's SIGTERM handler (on the event loop, through its wake-up descriptor) is not
    run when a forked worker is sent SIGTERM: the worker dies of it, and the loader names the
    crash."""
    loop = asyncio.get_running_loop()
    handled: list[int] = []
    loop.add_signal_handler(signal.SIGTERM, handled.append, 1)
    try:
        dl = aioloader.DataLoader(
            Counting(64),
            batch_size=2,
            num_workers=1,
            transform=worker_fns.whoami,
            collate_fn=list,
            multiprocessing_context="fork",
        )
        with pytest.raises(aioloader.WorkerCrashed, match=r"killed by signal: .*SIGTERM"):
            async with dl:
                async for batch in dl:
                    os.kill(batch[0]["pid"], signal.SIGTERM)
        await asyncio.sleep(0.2)  # a stray wake-up would have run the handler by now
        assert handled == []
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def test_dynamic_batcher_refuses_fork_and_says_why() -> None:
    with pytest.raises(ValueError, match="client connections"):
        aioloader.DynamicBatcher(lambda b: b, num_workers=1, multiprocessing_context="fork")


def test_an_unknown_start_method_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"\['fork', 'spawn', 'forkserver'\].*'thread'"):
        aioloader.DataLoader(Counting(4), num_workers=1, multiprocessing_context="thread")


ORPHAN = """
import os, signal, sys
import torch, torch.utils.data
import aioloader

def mark(worker_id):
    with open(os.path.join(sys.argv[1], str(os.getpid())), "w"):
        pass

class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return i

if __name__ == "__main__":
    loader = aioloader.DataLoader(
        Rows(), batch_size=2, num_workers=2, worker_init_fn=mark, multiprocessing_context="fork"
    )
    for batch in loader:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-epoch: both workers started, busy
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # exited, unreaped
    except FileNotFoundError:
        return True


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_forked_workers_leave_when_the_main_process_is_killed(tmp_path: Path) -> None:
    """Each forked worker inherits this process's end of its own pipe too; it lets go of it,
    or a worker whose main process was killed would wait for EOF for ever."""
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN)
    with (tmp_path / "stderr").open("w+") as stderr:  # no pipe: a worker left would hold it
        done = subprocess.run(
            [sys.executable, str(script), str(tmp_path)],
            stdout=subprocess.DEVNULL, stderr=stderr, timeout=30, check=False,
        )  # fmt: skip
        stderr.seek(0)
        assert done.returncode == -signal.SIGKILL, stderr.read()
    pids = [int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()]
    assert len(pids) == 2
    deadline = time.monotonic() + 20
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in pids if not _gone(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == []


class Tagged(torch.utils.data.Dataset[int]):
    """A dataset that pickle refuses, whose ``collate`` (passed as ``collate_fn``, as fairseq's
    ``collater`` is) reads what ``worker_init_fn`` set on the worker's dataset."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.lock = threading.Lock()
        self.tag = "unset"

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index

    def set_tag(self, worker_id: int) -> None:
        self.tag = f"worker {worker_id}"

    def collate(self, batch: list[int]) -> tuple[str, list[int]]:
        info = torch.utils.data.get_worker_info()
        assert info is not None and info.dataset is self
        with self.lock:
            return self.tag, batch


def test_a_bound_method_of_the_dataset_as_collate_fn_is_the_forked_worker_s_own() -> None:
    """As in torch's forked workers: ``collate_fn=dataset.collate`` is not pickled (its dataset
    holds a lock) and runs on the worker's dataset, which ``worker_init_fn`` configured."""
    dataset = Tagged(8)
    dl = aioloader.DataLoader(
        dataset,
        batch_size=2,
        num_workers=2,
        collate_fn=dataset.collate,
        worker_init_fn=dataset.set_tag,
        multiprocessing_context="fork",
    )
    got = list(dl)
    assert sorted(i for _, batch in got for i in batch) == list(range(8))
    assert {tag for tag, _ in got} == {"worker 0", "worker 1"}
    assert dataset.tag == "unset"  # the main process's dataset: untouched
    # The default start method sends the dataset, which does not pickle: named, with fork
    with pytest.raises(TypeError, match=r"Tagged.*multiprocessing_context='fork'"):
        list(aioloader.DataLoader(dataset, num_workers=1, collate_fn=dataset.collate))


IGNORES_SIGCHLD = """
import json, os, signal, sys
import aioloader

signals = []
real_kill = os.kill

def kill(pid, signum):
    signals.append(signum)
    real_kill(pid, signum)

if __name__ == "__main__":
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reaped by the kernel, never waited
    os.kill = kill
    got = {}
    for method in sys.argv[1:]:
        loader = aioloader.DataLoader(
            list(range(8)), batch_size=4, num_workers=2, multiprocessing_context=method
        )
        got[method] = [[int(x) for x in batch] for _ in range(2) for batch in loader]
    os.kill = real_kill
    print(json.dumps({"got": got, "signals": signals}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="SIGCHLD as Linux handles it")
def test_workers_stop_cleanly_where_the_application_ignores_sigchld(tmp_path: Path) -> None:
    """With SIGCHLD ignored a stopped worker can never be reaped (its exit status is gone):
    the epoch still ends with its batches, not with the error of closing a running process,
    and no worker that left is signalled (its pid is free, or another process's)."""
    got = run_json_script(tmp_path, IGNORES_SIGCHLD, "fork", "spawn", env={})
    assert got["got"] == {m: [[0, 1, 2, 3], [4, 5, 6, 7]] * 2 for m in ("fork", "spawn")}
    assert got["signals"] == []


def test_a_local_class_from_a_forked_worker_fails_loudly_not_as_a_copy() -> None:
    """A forked worker inherits its classes; one pickle cannot find by name would come back a
    copy by value (``isinstance`` false), so it fails, named, as in torch's forked workers: even
    where this process was itself sent values by value (a worker of another pool, this test's
    process), whose state the forked worker inherits and must drop."""
    pickle.loads(pickle.dumps(ByValue(len)))  # this process has now received a value by value

    class Batch:
        def __init__(self, items: list[int]) -> None:
            self.items = items

    dl = aioloader.DataLoader(
        Counting(4), batch_size=2, num_workers=1, collate_fn=Batch, multiprocessing_context="fork"
    )
    with pytest.raises(AttributeError, match="local object") as info:
        list(dl)
    assert "Batch" in str(info.value)
