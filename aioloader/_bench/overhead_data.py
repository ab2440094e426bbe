"""The overhead workload's sizes, its datasets (module level: torch's workers and the forked
children use them by name), the checks of every epoch, and the epochs each configuration runs."""

from __future__ import annotations

import cProfile
import dataclasses
import gc
import importlib.util
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.data

import aioloader
from aioloader._bench.harness import delivery_error, describe, error_text

ROWS = 100_000
QUICK_ROWS = 20_000
WIDTH = 16  # floats in a row
BATCH_SIZES = (32, 256)
FILES = 20_000
QUICK_FILES = 2_000
FILE_BYTES = 16 * 1024
FILE_BATCH = 32
INDEX_BYTES = 8  # a file starts with its index, little-endian
REPEATS = 3
TIMEOUT_S = 300.0  # per configuration: its warm-up and timed epochs
PROFILE_TOP = 30
HAS_UVLOOP = importlib.util.find_spec("uvloop") is not None

WORKLOADS = ("rows", "files")
PLAIN = "plain-loop"
BASELINE = {"rows": "torch-nw0", "files": "plain-loop", "files-cold": "torch-nw8"}


# -- the datasets (module level: torch's workers and the forked children use them by name) ----


def make_rows(n: int) -> torch.Tensor:
    """(n, WIDTH) float32, row ``i`` all ``i`` (exact: n is far below 2**24)."""
    return torch.arange(n, dtype=torch.float32).unsqueeze(1).repeat(1, WIDTH)


class Rows(torch.utils.data.Dataset[torch.Tensor]):
    """A torch map-style dataset of in-memory rows: item ``i`` is ``self.data[i]``."""

    def __init__(self, n: int) -> None:
        self.data = make_rows(n)

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]


class AsyncRows(aioloader.AsyncDataset[torch.Tensor]):
    """The same rows as an ``AsyncDataset`` whose ``get`` never suspends."""

    def __init__(self, n: int) -> None:
        self.data = make_rows(n)

    def __len__(self) -> int:
        return self.data.shape[0]

    async def get(self, index: int) -> torch.Tensor:
        return self.data[index]


def file_path(directory: str, index: int) -> str:
    return os.path.join(directory, f"{index:06d}.bin")


class Files(torch.utils.data.Dataset[bytes]):
    """A torch map-style dataset of files: item ``i`` is the bytes of path ``i``."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = list(paths)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> bytes:
        with open(self.paths[index], "rb") as f:
            return f.read()


def write_files(directory: str, count: int, sync: bool) -> None:
    """``count`` files of ``FILE_BYTES``: the index, then the same random bytes; ``sync``:
    ``fdatasync`` each, so that the page cache can drop them (it keeps dirty pages)."""
    filler = os.urandom(FILE_BYTES - INDEX_BYTES)
    for i in range(count):
        with open(file_path(directory, i), "wb") as f:
            f.write(i.to_bytes(INDEX_BYTES, "little") + filler)
            if sync:
                f.flush()
                os.fdatasync(f.fileno())


def drop_cache(paths: Sequence[str]) -> None:
    """Ask the kernel to drop the files' pages from the page cache (clean pages are dropped)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- the checks ---------------------------------------------------------------------------------


class EpochError(Exception):
    """An epoch delivered something other than what it should have."""


def row_indices(batch: Any) -> list[int]:
    """The indices of a rows batch: a (b, WIDTH) float32 tensor, each row one value."""
    if (
        not isinstance(batch, torch.Tensor)
        or batch.dtype != torch.float32
        or batch.ndim != 2
        or batch.shape[1] != WIDTH
        or not bool((batch == batch[:, :1]).all())
    ):
        raise EpochError(f"a batch is {describe(batch)}, not (b, {WIDTH}) rows of one value each")
    return [int(v) for v in batch[:, 0].tolist()]


def file_indices(batch: Any) -> list[int]:
    """The indices of a files batch: a list of ``FILE_BYTES`` bytes each."""
    if not isinstance(batch, list):
        raise EpochError(f"a batch is {describe(batch)}, not a list of bytes")
    indices = []
    for sample in batch:
        if not isinstance(sample, bytes) or len(sample) != FILE_BYTES:
            size = len(sample) if isinstance(sample, bytes) else "-"
            raise EpochError(f"a sample is {describe(sample)} ({size} bytes), not file bytes")
        indices.append(int.from_bytes(sample[:INDEX_BYTES], "little"))
    return indices


# -- the epochs ---------------------------------------------------------------------------------


class Epoch:
    """One epoch, as a context manager around the loop over the loader: a timed one runs the
    run's ``before_timed`` (untimed), collects garbage (untimed) and times the block (under the
    run's profiler, if any); ``add(batch)`` counts each batch (and, in the warm-up, records its
    indices for the check). Leaving the block checks the epoch (:class:`EpochError`)."""

    def __init__(self, run: Run, number: int) -> None:
        self.run = run
        self.number = number  # 0: the warm-up
        self.timed = number > 0
        self.batches = self.samples = 0
        self.indices: list[int] = []
        self.start = self.seconds = 0.0
        self.add: Callable[[Any], None] = self._count if self.timed else self._record

    def _count(self, batch: Any) -> None:
        self.batches += 1
        self.samples += len(batch)

    def _record(self, batch: Any) -> None:
        self.batches += 1
        self.samples += len(batch)
        self.indices.extend(self.run.indices_of(batch))

    def __enter__(self) -> Epoch:
        run = self.run
        if self.timed and run.before_timed is not None:
            run.before_timed()
        gc.collect()
        if self.timed and run.profiler is not None:
            run.profiler.enable()
        self.start = time.perf_counter()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start
        if self.timed and self.run.profiler is not None:
            self.run.profiler.disable()
        if exc_type is None:
            self.run.finish(self)


@dataclass
class Outcome:
    """What a child sends back (as a dict: its classes live in its ``__mp_main__``)."""

    epoch_s: list[float] = field(default_factory=list)
    warmup_s: float | None = None
    error: str | None = None


class Run:
    """A configuration's epochs: :meth:`epochs` yields the warm-up, then ``repeats`` timed
    ones; :meth:`finish` checks each and keeps its time."""

    def __init__(
        self,
        items: int,
        batch_size: int,
        repeats: int,
        indices_of: Callable[[Any], list[int]],
        before_timed: Callable[[], None] | None = None,
        profiler: cProfile.Profile | None = None,
    ) -> None:
        self.items = items
        self.batch_size = batch_size
        self.repeats = repeats
        self.indices_of = indices_of
        self.before_timed = before_timed
        self.profiler = profiler
        self.outcome = Outcome()

    def epochs(self) -> Iterator[Epoch]:
        for number in range(self.repeats + 1):
            yield Epoch(self, number)

    def finish(self, epoch: Epoch) -> None:
        expected = math.ceil(self.items / self.batch_size)
        if not epoch.timed:
            error = delivery_error(epoch.indices, self.items, epoch.batches, expected)
            if error is not None:
                raise EpochError(f"warm-up epoch: {error}")
            self.outcome.warmup_s = epoch.seconds
            return
        if epoch.samples != self.items or epoch.batches != expected:
            raise EpochError(
                f"epoch {epoch.number}: {epoch.samples} samples in {epoch.batches} batches, "
                f"expected {self.items} in {expected}"
            )
        self.outcome.epoch_s.append(epoch.seconds)

    def execute(self, body: Callable[[Run], None]) -> dict[str, Any]:
        """Run ``body`` (the configuration's epochs); its outcome as a dict, an exception it
        raised reported as its error."""
        try:
            body(self)
        except Exception as exc:
            self.outcome.error = error_text(exc)
        timed = len(self.outcome.epoch_s)
        if self.outcome.error is None and timed != self.repeats:
            self.outcome.error = f"{timed} timed epochs ran, expected {self.repeats}"
        return dataclasses.asdict(self.outcome)
