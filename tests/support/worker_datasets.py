"""torch datasets that the tests hand to the loader as a torch user would: their work is in
``__getitem__``/``__iter__``, and they ask torch (not aioloader) who they run in. Module-level,
so each worker process can be sent its own copy."""

from __future__ import annotations

import _thread
import contextlib
import os
import random
import threading
import time
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.utils.data

import aioloader


def strided_share(length: int) -> range:
    """This worker's share of ``range(length)``, strided, as torch's docs shard a stream (the
    whole of it outside workers)."""
    info = torch.utils.data.get_worker_info()
    worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
    return range(worker, length, workers)


class WhoReads(torch.utils.data.Dataset[dict[str, Any]]):
    """Sample ``i`` says where it was read: the pid, torch's and aioloader's worker info."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.offset = 0  # worker_init_fn may change a worker's copy
        self.reads = 0  # reads made by this copy

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        self.reads += 1
        torch_info = torch.utils.data.get_worker_info()
        ours = aioloader.get_worker_info()
        return {
            "index": index,
            "value": index + self.offset,
            "pid": os.getpid(),
            "torch_id": -1 if torch_info is None else torch_info.id,
            "torch_workers": -1 if torch_info is None else torch_info.num_workers,
            "our_id": -1 if ours is None else ours.id,
            "dataset_is_self": torch_info is not None and torch_info.dataset is self,
            "reads": self.reads,
        }


def offset_by_worker(worker_id: int) -> None:
    """A torch-style ``worker_init_fn``: configure this worker's copy of the dataset."""
    info = torch.utils.data.get_worker_info()
    assert info is not None and info.id == worker_id
    info.dataset.offset = 1000 * (worker_id + 1)


class Ranges(torch.utils.data.IterableDataset[int]):
    """torch's documented pattern: each worker iterates its own share of ``[start, end)``."""

    def __init__(self, start: int, end: int, *, split: str = "contiguous") -> None:
        self.start, self.end, self.split = start, end, split

    def __iter__(self) -> Iterator[int]:
        info = torch.utils.data.get_worker_info()
        if info is None:
            return iter(range(self.start, self.end))
        if self.split == "strided":  # worker k takes every num_workers-th item
            return iter(range(self.start + info.id, self.end, info.num_workers))
        if self.split == "skewed":  # worker 0 runs dry first; the last takes the rest
            edges = [self.start, self.start + 2, self.start + 9, self.end]
            edges = [*edges[: info.num_workers], self.end]
            return iter(range(edges[info.id], edges[info.id + 1]))
        per = -(-(self.end - self.start) // info.num_workers)
        lo = self.start + info.id * per
        return iter(range(lo, min(lo + per, self.end)))


class FailsAt(torch.utils.data.Dataset[int]):
    """``__getitem__`` raises for the indices in ``bad``; others read as themselves."""

    def __init__(self, n: int, bad: set[int]) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index in self.bad:
            raise KeyError(f"bad sample {index}")
        return index


class FlakyOnce(torch.utils.data.Dataset[int]):
    """Each index in ``flaky`` fails once per worker copy with a transient error, then reads."""

    def __init__(self, n: int, flaky: set[int]) -> None:
        self.n, self.flaky = n, flaky
        self.failed: set[int] = set()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index in self.flaky and index not in self.failed:
            self.failed.add(index)
            raise aioloader.TransientError(f"flaky read of {index}")
        return index


class Augmenting(torch.utils.data.Dataset[torch.Tensor]):
    """Random augmentation inside ``__getitem__``, from torch's and Python's generators."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, random.randint(0, 2**30), int(torch.randint(0, 2**30, ()))])


class HoldsALock(torch.utils.data.Dataset[int]):
    """Cannot be sent to a worker process: locks do not pickle."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return index


class BadItemStream(torch.utils.data.IterableDataset[Any]):
    """Yields ``0..n-1`` but ``"bad"`` at ``bad``, which default collation refuses."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        if info is not None and info.id != 0:
            return iter(())
        return iter("bad" if i == self.bad else i for i in range(self.n))


class InitialSeed(torch.utils.data.Dataset[int]):
    """Each sample is torch's initial seed where it was read."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return torch.initial_seed()


def seed_12345(worker_id: int) -> None:
    torch.manual_seed(12345)


class SharedHandle(torch.utils.data.Dataset[int]):
    """Not thread-safe, like most torch datasets: seek then read on one shared file handle."""

    def __init__(self, path: str, n: int) -> None:
        self.path, self.n = path, n
        self.handle: Any = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if self.handle is None:
            self.handle = open(self.path, "rb")  # noqa: SIM115 - lives as long as the dataset
        self.handle.seek(4 * index)
        time.sleep(0.0005)  # another thread, if any, seeks meanwhile
        return int.from_bytes(self.handle.read(4), "little")

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "handle": None}


class ExitsAt(torch.utils.data.Dataset[int]):
    """``__getitem__`` raises SystemExit at ``bad`` (user code calling sys.exit)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> int:
        if index == 5:
            raise SystemExit(3)
        return index


class MarksFinally(torch.utils.data.IterableDataset[int]):
    """Each worker's pass writes ``<folder>/done-<id>`` in its generator's ``finally``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __iter__(self) -> Iterator[int]:
        info = torch.utils.data.get_worker_info()
        worker = 0 if info is None else info.id
        try:
            yield from range(worker * 1000, worker * 1000 + 500)
        finally:
            with open(os.path.join(self.folder, f"done-{worker}"), "w") as f:
                f.write("ok")


class ResumableShards(torch.utils.data.IterableDataset[int]):
    """Each worker reads its own share (``get_worker_info()``): samples ``w, w + n, ...`` of
    ``range(length)``, worker ``w`` ending early when ``uneven`` (it stops at ``length - 7 *
    w``). ``state_dict()`` is where its pass stands, ``load_state_dict`` where the next starts."""

    def __init__(self, length: int, *, uneven: bool = False) -> None:
        self.length = length
        self.uneven = uneven
        self.at = 0  # samples of its share this copy has given
        self.start = 0

    def __iter__(self) -> Iterator[int]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        stop = self.length - 7 * worker if self.uneven else self.length
        share = range(worker, stop, workers)
        self.at, self.start = self.start, 0
        while self.at < len(share):
            self.at += 1
            yield share[self.at - 1]

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["at"]


class Cursor:
    """An iterator over ``items`` that keeps its own place (torchdata's ``Stateful`` on the
    iterator rather than the dataset)."""

    def __init__(self, items: list[int]) -> None:
        self.items = items
        self.i = 0

    def __iter__(self) -> Cursor:
        return self

    def __next__(self) -> int:
        if self.i >= len(self.items):
            raise StopIteration
        self.i += 1
        return self.items[self.i - 1]

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = state["i"]


class CursorShards(torch.utils.data.IterableDataset[int]):
    """Each worker's share of ``range(length)`` (strided), through a :class:`Cursor`: the
    place is the iterator's. Its samples are offset by ``1000 * passes`` (the passes this copy
    began)."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.passes = 0

    def __iter__(self) -> Cursor:
        self.passes += 1
        return Cursor([1000 * self.passes + i for i in strided_share(self.length)])


class CountedCursorShards(CursorShards):
    """:class:`CursorShards` whose dataset keeps a state too (the passes begun, the one a state
    was saved in included): a resumed pass has it loaded before ``iter()``, or its samples'
    offset is another."""

    def state_dict(self) -> dict[str, int]:
        return {"passes": self.passes}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.passes = state["passes"] - 1  # __iter__ counts the resumed pass again


class Restarting(torch.utils.data.IterableDataset[int]):
    """Its own iterator, which ``__iter__`` sets back to the start of this worker's share
    (strided) of ``range(length)``: a pass must call ``__iter__`` once, then only
    ``__next__``. It keeps its place (torchdata loads it after ``__iter__``)."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.share = range(0)
        self.i = 0

    def __iter__(self) -> Restarting:
        self.share, self.i = strided_share(self.length), 0
        return self

    def __next__(self) -> int:
        if self.i >= len(self.share):
            raise StopIteration
        self.i += 1
        return self.share[self.i - 1]

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = state["i"]


class DrawsIterator:
    """Draws from the process's torch RNG (a worker's own, as the worker seeds it). Its state
    is kept as torchdata's examples keep one: the RNG's state (a tensor), a tuple, a dict keyed
    by int and a NumPy array; loading checks that each comes back as it was given."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.i = 0

    def __iter__(self) -> DrawsIterator:
        return self

    def __next__(self) -> float:
        if self.i >= self.count:
            raise StopIteration
        self.i += 1
        return float(torch.rand(()))

    def state_dict(self) -> dict[str, Any]:
        return {
            "rng": torch.get_rng_state(),
            "at": (self.i,),
            "by_int": {7: self.i},
            "np": np.arange(2),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert isinstance(state["rng"], torch.Tensor) and isinstance(state["at"], tuple)
        assert state["by_int"] == {7: state["at"][0]} and state["np"].tolist() == [0, 1]
        torch.set_rng_state(state["rng"])
        self.i = state["at"][0]


class Draws(torch.utils.data.IterableDataset[float]):
    """``count`` draws per pass (per worker), through a :class:`DrawsIterator`."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __iter__(self) -> DrawsIterator:
        return DrawsIterator(self.count)


class SlowCursorShards(CursorShards):
    """:class:`CursorShards` whose worker 1 takes ``delay`` s to start its pass."""

    def __init__(self, length: int, delay: float) -> None:
        super().__init__(length)
        self.delay = delay

    def __iter__(self) -> Cursor:
        info = torch.utils.data.get_worker_info()
        if info is not None and info.id == 1:
            time.sleep(self.delay)
        return super().__iter__()


def fails_on_zero(batch: list[int]) -> list[int]:
    """A ``collate_fn`` that fails on the batch holding sample 0 (of any pass, whose samples
    :class:`CursorShards` offsets by 1000)."""
    if any(i % 1000 == 0 for i in batch):
        raise ValueError("the batch holding sample 0")
    return batch


class RawBytes(torch.utils.data.Dataset[bytes]):
    """Sample ``i`` is ``size`` bytes that name ``i`` (its index, 4 bytes little-endian,
    repeated): a batch of them with ``collate_fn=list`` comes back from a worker as pickled
    bytes, not through shared memory."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> bytes:
        return index.to_bytes(4, "little") * (self.size // 4)


class WhereRead(torch.utils.data.Dataset[tuple[int, int, str]]):
    """Sample ``i`` is ``(i, pid, Ray node id)`` of where it was read, after ``delay`` seconds
    (for tests of Ray workers)."""

    def __init__(self, n: int, delay: float = 0.0) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[int, int, str]:
        import ray

        time.sleep(self.delay)
        return index, os.getpid(), ray.get_runtime_context().get_node_id()


def fails_on_four(batch: list[int]) -> list[int]:
    """A ``collate_fn`` that fails on the batch holding sample 4."""
    if 4 in batch:
        raise ValueError("the batch holding sample 4")
    return batch


def four_fails(sample: int) -> int:
    """A ``transform`` that fails on sample 4 alone."""
    if sample == 4:
        raise ValueError("sample 4")
    return sample


def eight_and_ten_fail(sample: int) -> int:
    """A ``transform`` that fails on samples 8 and 10 (a whole batch of worker 0's, in
    :class:`ResumableShards` with 2 workers and batches of 2)."""
    if sample in (8, 10):
        raise ValueError(f"sample {sample}")
    return sample


class CountsItsPickles(torch.utils.data.Dataset[dict[str, Any]]):
    """Counts, in the process that pickles it, how often it is pickled; sample ``i`` says
    which copy read it (a digest of ``payload``), in which process, and whether that process
    still holds a start file open (``startonce.py``'s are named ``aioloader-start``)."""

    pickled = 0

    def __init__(self, length: int, payload: bytes, held: object = None) -> None:
        self.length = length
        self.payload = payload
        self.held = held  # a tensor or a shared Value: what a pickle hands to one process

    def __getstate__(self) -> dict[str, Any]:
        type(self).pickled += 1
        return self.__dict__

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        held: Any = self.held
        if held is None:
            held = -1
        elif isinstance(held, torch.Tensor):
            held = int(held.sum())
        elif held is not None:
            held = held.value  # type: ignore[attr-defined]  # a multiprocessing Value
        return {
            "index": index,
            "digest": zlib.crc32(self.payload),
            "pid": os.getpid(),
            "start_files": start_files(),
            "held": held,
        }


def start_files() -> int:
    """The start files (``startonce.py``) this process holds open."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
    return sum("aioloader-start" in link for link in links)


def maps_a_start_file() -> bool:
    """Whether this process maps a start file (``startonce.py``: a buffers' file stays mapped
    while an array from it lives)."""
    with open("/proc/self/maps") as maps:
        return any("aioloader-start" in line for line in maps)


class HoldsArrays(torch.utils.data.Dataset[dict[str, Any]]):
    """Holds NumPy arrays, as a dataset of features or labels does; sample ``i`` says what its
    worker's copies are like: whether each is writable, their sums, whether the large one is
    mapped from a start file (``startonce.py``), and what the worker found in ``large[1]``
    before writing its own id there (a write shared with another worker would show)."""

    def __init__(self, length: int, large: np.ndarray[Any, Any]) -> None:
        self.length = length
        self.large = large
        self.frozen = np.arange(1000, dtype=np.int64)
        self.frozen.flags.writeable = False
        self.empty = np.empty((0, 3), dtype=np.float32)
        self.strided = np.arange(100, dtype=np.int16)[::2]  # not contiguous: goes in the pickle

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        info = torch.utils.data.get_worker_info()
        found = int(self.large[1])
        self.large[1] = 100 + (info.id if info is not None else -1)
        mapped = maps_a_start_file()
        return {
            "index": index,
            "worker": -1 if info is None else info.id,
            "found": found,
            "large_sum": int(self.large[2:].sum()),
            "frozen_writable": bool(self.frozen.flags.writeable),
            "frozen_sum": int(self.frozen.sum()),
            "empty_shape": "x".join(map(str, self.empty.shape)),
            "strided_sum": int(self.strided.sum()),
            "mapped": mapped,
            "boxes": len(getattr(self, "boxes", ())),
        }


class ListingKeys(torch.utils.data.Dataset[dict[str, Any]]):
    """Sample ``i`` is key ``i * 7`` of a ``FileReader`` listing (``sources.files``' workers'
    dataset), with whether this process maps a start file (``startonce.py``)."""

    def __init__(self, reader: Any, length: int) -> None:
        self.reader = reader
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        key = self.reader.key(index * 7)
        return {"key": key, "files": len(self.reader), "mapped": maps_a_start_file()}


class Unpickled(torch.utils.data.Dataset[dict[str, Any]]):
    """Holds ``names`` (Python objects, as ``ImageFolder``'s list of paths); notes in the file
    ``log`` each process that unpickled it (its pid), and as it is unpickled opens ``opens``
    and keeps it, starts a thread (``thread``; ``"raw"``: not through ``threading``), sleeps
    ``sleep`` seconds, prints ``says`` or raises (``raises``), as a ``__setstate__`` may.
    Sample ``i`` says which process read it, that process's parent, and the ``tag`` its
    worker's copy holds (:func:`tag_by_worker`)."""

    def __init__(
        self,
        length: int,
        names: list[str],
        log: str,
        *,
        opens: str | None = None,
        thread: bool | str = False,
        sleep: float = 0.0,
        raises: bool = False,
        says: str = "",
    ) -> None:
        self.length, self.names, self.log, self.says = length, names, log, says
        self.opens, self.thread, self.sleep, self.raises = opens, thread, sleep, raises
        self.tag = -1
        self.file: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "file": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        with open(self.log, "a") as log:
            log.write(f"{os.getpid()}\n")
        if self.says:
            print(self.says)
        if self.raises:
            raise ValueError("Unpickled refuses to be unpickled")
        if self.opens is not None:
            self.file = open(self.opens, "rb")  # noqa: SIM115  # kept open, as an HDF5 file is
        if self.thread == "raw":  # not threading's: its count does not see it
            _thread.start_new_thread(time.sleep, (3600,))
        elif self.thread:
            threading.Thread(target=threading.Event().wait, daemon=True).start()
        time.sleep(self.sleep)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {
            "index": index,
            "name": self.names[index * 7 % len(self.names)],
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "tag": self.tag,
        }


def tag_by_worker(worker_id: int) -> None:
    """``worker_init_fn``: the worker's copy of the dataset is tagged with its id."""
    info = torch.utils.data.get_worker_info()
    assert info is not None
    info.dataset.tag = 100 + worker_id  # type: ignore[attr-defined]


def unpicklers(log: str) -> list[int]:
    """The pids that unpickled an :class:`Unpickled` logging to ``log``, in order."""
    with open(log) as f:
        return [int(line) for line in f.read().split()]


class DrawsOnUnpickling(torch.utils.data.Dataset[dict[str, Any]]):
    """Holds ``names``; draws a random generator of its own as it is unpickled, as a dataset
    made for spawn workers may (each worker then draws its own). Sample ``i`` is a number it
    drew, and the process that drew it."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def __getstate__(self) -> dict[str, Any]:
        return {"names": self.names}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.rng = np.random.default_rng()

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"index": index, "pid": os.getpid(), "drawn": int(self.rng.integers(1 << 62))}


class HoldsGenerators(torch.utils.data.Dataset[dict[str, Any]]):
    """Holds ``names``, a NumPy generator and a ``random.Random``, pickled with their state."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.rng = np.random.default_rng(7)
        self.random = random.Random(7)

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"index": index, "drawn": int(self.rng.integers(100)) + self.random.randrange(9)}


class HangsAt(WhoReads):
    """As :class:`WhoReads`, but the worker that reads sample ``at`` writes its worker id to the
    FIFO ``signal`` and then hangs there (a minute): a test knows which worker is mid-job."""

    def __init__(self, n: int, at: int, signal: str) -> None:
        super().__init__(n)
        self.at = at
        self.signal = signal

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index == self.at:
            info = torch.utils.data.get_worker_info()
            with open(self.signal, "w") as fifo:
                fifo.write(f"{-1 if info is None else info.id}\n")
            time.sleep(60.0)
        return super().__getitem__(index)


class CountsItsCalls:
    """A ``collate_fn`` object that keeps state in its worker: its calls so far (as a cache or
    a generator of its own would), sent to the worker whole."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, batch: list[int]) -> tuple[int, int, int]:
        self.calls += 1
        return os.getpid(), id(self), self.calls


def worker_1_hangs(worker_id: int) -> None:
    """A ``worker_init_fn`` that hangs in worker 1 (a lock, a stuck mount)."""
    if worker_id == 1:
        time.sleep(60)


def staggered_start(worker_id: int) -> None:
    """Worker ``i``'s ``worker_init_fn`` takes ``1.8 * (i + 1)`` seconds: each within a 3 s
    ``timeout`` of the one before, both of them not."""
    time.sleep(1.8 * (worker_id + 1))
