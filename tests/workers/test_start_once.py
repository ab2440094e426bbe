"""The workers a pool starts together share one pickle of their start arguments (the dataset
and ``worker_init_fn``: ``_workers/startonce.py``), a large one through a file in memory, where
one pickle serves them all; where it holds what a pickle hands to one process (a tensor torch
shares, a multiprocessing ``Value``), each worker is pickled its own, as before."""

from __future__ import annotations

import errno
import multiprocessing
import os
import signal
import zlib
from typing import Any

import numpy as np
import psutil
import pytest
import torch

import aioloader
from aioloader._workers import startonce
from aioloader._workers.startonce import IN_FILE_FROM
from tests.support import worker_datasets as wd
from tests.support.helpers import views_kept

LARGE = IN_FILE_FROM + 12345

# More workers than this box's 2 CPUs: the pickle is shared by more than two
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create . worker processes")


@pytest.fixture(autouse=True)
def _count_afresh() -> None:
    wd.CountsItsPickles.pickled = 0


def rows(batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for batch in batches:
        for k in range(len(batch["index"])):
            row = {key: value[k] for key, value in batch.items()}
            out.append({k: v.item() if isinstance(v, torch.Tensor) else v for k, v in row.items()})
    return out


@pytest.mark.parametrize("size", [1000, LARGE], ids=["in the start", "in a file"])
def test_one_pickle_serves_every_worker_of_a_start(size: int) -> None:
    payload = os.urandom(size)
    dl = aioloader.DataLoader(wd.CountsItsPickles(48, payload), batch_size=4, num_workers=4)
    batches = []
    for batch in dl:
        batches.append(batch)
        assert wd.start_files() == 0  # let go of once the workers had it
    got = rows(batches)
    assert [r["index"] for r in got] == list(range(48))
    assert {r["digest"] for r in got} == {zlib.crc32(payload)}
    assert {r["start_files"] for r in got} == {0}  # each worker let go once it had its copy
    assert wd.CountsItsPickles.pickled == 1  # not once per worker
    assert size <= dl.statistics().workers.start_bytes < size + 1000  # type: ignore[union-attr]


def test_each_epoch_s_workers_get_the_dataset_as_it_is_then() -> None:
    dataset = wd.CountsItsPickles(16, b"a" * LARGE)
    dl = aioloader.DataLoader(dataset, batch_size=4, num_workers=2)
    first = rows(list(dl))
    dataset.payload = b"b" * LARGE  # as a script changes its dataset between epochs
    second = rows(list(dl))
    assert {r["digest"] for r in first} == {zlib.crc32(b"a" * LARGE)}
    assert {r["digest"] for r in second} == {zlib.crc32(b"b" * LARGE)}
    assert wd.CountsItsPickles.pickled == 2


def test_a_replaced_worker_gets_the_dataset_as_it_is_when_it_starts() -> None:
    dataset = wd.CountsItsPickles(16, b"a" * LARGE)
    dl = aioloader.DataLoader(dataset, batch_size=4, num_workers=2, persistent_workers=True)
    try:
        first = rows(list(dl))
        killed = first[-1]["pid"]
        os.kill(killed, signal.SIGKILL)  # between epochs, as an OOM kill would
        psutil.Process(killed).wait(timeout=30)  # gone, reaped by its parent
        dataset.payload = b"b" * 2 * LARGE
        second = rows(list(dl))
    finally:
        dl.close()
    assert [r["index"] for r in second] == list(range(16))
    digests = {r["pid"]: r["digest"] for r in second}
    kept = {r["pid"] for r in first} - {killed}
    assert all(digests[pid] == zlib.crc32(b"a" * LARGE) for pid in kept if pid in digests)
    fresh = set(digests) - {r["pid"] for r in first}
    assert fresh and all(digests[pid] == zlib.crc32(b"b" * 2 * LARGE) for pid in fresh)
    assert wd.CountsItsPickles.pickled == 2  # the start's, and the replacement's own
    assert dl.statistics().workers.start_bytes > 2 * LARGE  # type: ignore[union-attr]


@pytest.mark.parametrize("held", ["tensor", "shared Value"])
def test_what_a_pickle_hands_to_one_process_is_pickled_in_each_worker_s_start(held: str) -> None:
    """A tensor in shared memory (its descriptor is handed to one process's start) or a
    multiprocessing ``Value`` (the same) is pickled in each worker's start; the rest of the
    dataset once for them all."""
    value: Any = (
        torch.full((5,), 2).share_memory_()
        if held == "tensor"
        else multiprocessing.get_context("forkserver").Value("i", 10)
    )
    dataset = wd.CountsItsPickles(24, b"x" * LARGE, held=value)
    dl = aioloader.DataLoader(dataset, batch_size=4, num_workers=3, persistent_workers=True)
    try:
        first = rows(list(dl))
        if held == "tensor":  # shared with the workers, as torch's workers share it
            value += 1
        else:
            value.value = 15
        second = rows(list(dl))
    finally:
        dl.close()
    assert [r["index"] for r in first] == [r["index"] for r in second] == list(range(24))
    assert {r["held"] for r in first} == {10} and {r["held"] for r in second} == {15}
    assert {r["digest"] for r in first + second} == {zlib.crc32(b"x" * LARGE)}
    assert wd.CountsItsPickles.pickled == 1
    assert dl.statistics().workers.start_bytes > LARGE  # type: ignore[union-attr]


def test_spawned_workers_read_the_start_file_too() -> None:
    payload = os.urandom(LARGE)
    dl = aioloader.DataLoader(
        wd.CountsItsPickles(8, payload),
        batch_size=4,
        num_workers=2,
        multiprocessing_context="spawn",
    )
    got = rows(list(dl))
    assert {r["digest"] for r in got} == {zlib.crc32(payload)}
    assert {r["start_files"] for r in got} == {0}
    assert wd.CountsItsPickles.pickled == 1


def test_numpy_arrays_are_shared_copy_on_write_as_forked_workers_share_them() -> None:
    large = np.arange(LARGE // 8, dtype=np.int64)  # over IN_FILE_FROM: in its own file
    expected_sum = int(large[2:].sum())
    dl = aioloader.DataLoader(wd.HoldsArrays(40, large), batch_size=4, num_workers=2)
    got = rows(list(dl))
    assert [r["index"] for r in got] == list(range(40))
    # Mapped from the start file, not copied; writable, each worker's writes its own
    assert {r["mapped"] for r in got} == {True}
    for r in got:
        assert r["found"] in (1, 100 + r["worker"]), r  # another worker's write never shows
    assert int(large[1]) == 1  # nor this process's copy
    assert {r["large_sum"] for r in got} == {expected_sum}
    # A read-only array stays read-only; empty and strided arrays arrive whole
    assert {r["frozen_writable"] for r in got} == {False}
    assert {r["frozen_sum"] for r in got} == {sum(range(1000))}
    assert {r["empty_shape"] for r in got} == {"0x3"}
    assert {r["strided_sum"] for r in got} == {sum(range(0, 100, 2))}
    assert dl.statistics().workers.start_bytes >= large.nbytes  # type: ignore[union-attr]


def test_small_numpy_arrays_go_in_the_pickle_and_stay_writable() -> None:
    """Each array out of band costs a write here and a view in each worker: the boxes of a
    detection dataset (many arrays of a few numbers) go in the pickle, in its file here."""
    dataset = wd.HoldsArrays(8, np.arange(64, dtype=np.int64))
    dataset.boxes = [np.full(2, k) for k in range(100_000)]  # type: ignore[attr-defined]
    dl = aioloader.DataLoader(dataset, batch_size=4, num_workers=2)
    got = rows(list(dl))
    assert {r["mapped"] for r in got} == {False}  # no buffers' file kept mapped
    for r in got:
        assert r["found"] in (1, 100 + r["worker"]), r
    assert {r["frozen_writable"] for r in got} == {False}
    assert {r["large_sum"] for r in got} == {sum(range(2, 64))}
    assert {r["boxes"] for r in got} == {100_000}
    assert dl.statistics().workers.start_bytes > IN_FILE_FROM  # type: ignore[union-attr]


def test_a_start_file_that_cannot_be_written_leaves_no_view_of_the_pickle_in_the_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pickle is a view of a ``BytesIO``; an error's frames that keep one (in a reference
    cycle) crashed CPython 3.12.1's garbage collector (gh-111049). A write into the start's
    file in memory that fails (the memory cgroup full) raises with every view let go."""

    def full(fd: int, data: Any, offset: int) -> int:
        del data  # os.pwrite, in C, keeps no frame
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(startonce.os, "pwrite", full)
    with pytest.raises(OSError, match="No space left") as caught:
        startonce.OnceStart.of((None, bytes(IN_FILE_FROM)), lambda _: False)
    assert views_kept(caught.value) == []
