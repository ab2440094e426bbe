"""Edge cases found in review: empty batches, a wrong-length ``__getitems__``, a dataset's own
exception group, blocking generators closed at the right time, counters after an early end."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import torch

import aioloader
from tests.support.helpers import Batched, Counting, Stream, flat


@pytest.mark.parametrize("in_order", [True, False])
async def test_empty_batches_from_a_batch_sampler_are_skipped_not_lost(in_order: bool) -> None:
    batches = [[0, 1], [2, 3], [], [4, 5], *[[]] * 50, [6, 7], [8, 9]]
    dl = aioloader.DataLoader(
        list(range(10)), batch_sampler=batches, collate_fn=list, in_order=in_order
    )
    async with dl:
        with anyio.fail_after(10):
            got = [b async for b in dl]
    if in_order:
        assert got == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert sorted(flat(got)) == list(range(10))


async def test_wrong_length_getitems_is_an_error_naming_the_dataset() -> None:
    class Short(torch.utils.data.Dataset[int]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, index: int) -> int:
            return index

        def __getitems__(self, indices: list[int]) -> list[int]:
            return [i for i in indices if i != 2]

    async with aioloader.DataLoader(Short(), batch_size=4) as dl:
        with pytest.raises(ValueError, match=r"Short.__getitems__ returned 3 items for 4"):
            [b async for b in dl]


async def test_a_datasets_own_exception_group_arrives_whole() -> None:
    class Parts(Counting):
        async def get(self, index: int) -> int:
            if index == 3:
                raise ExceptionGroup("parts failed", [OSError("a"), OSError("b")])
            return index

    async with aioloader.DataLoader(Parts(8), batch_size=2) as dl:
        with pytest.raises(ExceptionGroup) as info:
            [b async for b in dl]
    assert info.value.message == "parts failed"
    assert len(info.value.exceptions) == 2
    assert any("sample 3" in n for n in info.value.__notes__)


async def test_blocking_generator_is_closed_on_a_loader_thread_before_the_scope_exits() -> None:
    closed: list[str] = []

    class Gen(torch.utils.data.IterableDataset[int]):
        def __iter__(self) -> Iterator[int]:
            try:
                yield from range(10_000)
            finally:
                closed.append(threading.current_thread().name)

    async with aioloader.DataLoader(Gen(), batch_size=4) as dl:
        async for _ in dl:
            break
        assert flat([b async for b in dl]) == list(range(10_000))
        assert len(closed) == 2  # the abandoned epoch's generator was closed when it ended
    # Closed on an I/O thread (the second one ended in its last read, which, fast, may have
    # run inline on the loop's thread: see _workers/offload.py).
    assert closed[0].startswith("aioloader-io")


@pytest.mark.parametrize("make", [lambda: Counting(5000), lambda: Stream(5000)])
async def test_counters_return_to_zero_after_an_early_end(make: Any) -> None:
    dl = aioloader.DataLoader(make(), batch_size=8, max_inflight=16)
    async with dl:
        async for _ in dl:
            break
        async for _ in dl:
            break
    stats = dl.statistics()
    for stage in stats.stages:
        assert stage.in_flight == 0, stage
    assert stats.bytes_held == 0


async def test_batched_fallback_counts_only_the_bad_sample_as_failed() -> None:
    dl = aioloader.DataLoader(Batched(16, fail={3}), batch_size=8, max_failures=1)
    async with dl:
        assert len(flat([b async for b in dl])) == 15
    fetch = dl.statistics().stage("fetch")
    assert fetch.skipped == 1
    assert fetch.failed == 1
