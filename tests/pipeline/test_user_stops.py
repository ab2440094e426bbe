"""A ``StopIteration`` or ``StopAsyncIteration`` that user code raises where the loader calls it
(an async ``get``, a transform, ``collate_fn``) is that sample's or batch's failure, never a
silent end of the epoch, and never PEP 479's bare ``RuntimeError`` naming nothing (found by
review). A plain ``for`` ends at a ``StopIteration``, as torch's loop does."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import aioloader
from aioloader._base.exceptions import StopInWorker


def notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


class SpentCursor(aioloader.AsyncDataset[int]):
    """Sample 5's read calls ``anext()`` on a spent async iterator, as a read from an async
    cursor that ran dry does."""

    def __len__(self) -> int:
        return 12

    async def get(self, index: int) -> int:
        if index == 5:

            async def spent() -> Any:
                return
                yield

            return await anext(spent())  # type: ignore[no-any-return]
        return index


async def test_an_async_read_that_raises_stop_async_iteration_fails_its_batch() -> None:
    # It ended `async for` there: the batches after it were lost, and nothing said so.
    got: list[list[int]] = []
    async with aioloader.DataLoader(SpentCursor(), batch_size=4) as loader:
        it = aiter(loader)
        got.append((await anext(it)).tolist())
        with pytest.raises(RuntimeError, match="raised StopAsyncIteration") as info:
            await anext(it)
        got += [batch.tolist() async for batch in it]  # the epoch goes on after a failure
    assert isinstance(info.value.__cause__, StopAsyncIteration)
    assert "stage 'fetch', sample 5, batch 1" in notes(info.value)
    assert got == [[0, 1, 2, 3], [8, 9, 10, 11]]


def test_a_plain_for_fails_at_an_async_read_s_stop_async_iteration() -> None:
    loader = aioloader.DataLoader(SpentCursor(), batch_size=4)
    got: list[list[int]] = []
    with pytest.raises(RuntimeError, match="raised StopAsyncIteration"):
        for batch in loader:
            got.append(batch.tolist())
    assert got == [[0, 1, 2, 3]]


def stops_at_5(x: int) -> int:
    if x == 5:
        return next(iter([]))  # type: ignore[no-any-return]
    return x


def collate_stops_at_5(samples: list[int]) -> torch.Tensor:
    if 5 in samples:
        raise StopIteration
    return torch.tensor(samples)


WHERE = [{}, {"num_workers": 1}, {"num_workers": 1, "worker_mode": "thread"}]
WHERE_IDS = ["in-process", "process", "thread"]


@pytest.mark.parametrize("where", WHERE, ids=WHERE_IDS)
async def test_a_transform_s_stop_iteration_names_the_transform_and_the_sample(
    where: dict[str, Any],
) -> None:
    # It came as "RuntimeError: coroutine raised StopIteration", labelled stage 'collate' with
    # the whole batch's ids, and without the worker's traceback.
    loader = aioloader.DataLoader(list(range(12)), batch_size=4, transform=stops_at_5, **where)
    got: list[list[int]] = []
    with pytest.raises(StopInWorker, match="the transform raised StopIteration") as info:
        async with loader:
            async for batch in loader:
                got.append(batch.tolist())
    assert got == [[0, 1, 2, 3]] and isinstance(info.value, RuntimeError)
    assert "stage 'transform', sample 5, batch 1" in notes(info.value)
    if where.get("worker_mode") is None and where:  # a process's traceback travels in a note
        assert "in stops_at_5" in notes(info.value)
        assert not notes(info.value).split("\naioloader: failed")[0].endswith("exception:")


@pytest.mark.parametrize("where", WHERE, ids=WHERE_IDS)
def test_a_collate_fn_s_stop_iteration_ends_a_plain_for_as_torchs(where: dict[str, Any]) -> None:
    # torch's loop ends there, its worker's StopIteration raised again by its iterator
    workers = {"num_workers": where.get("num_workers", 0)}
    theirs = torch.utils.data.DataLoader(
        list(range(12)), batch_size=4, collate_fn=collate_stops_at_5, **workers
    )
    ours = aioloader.DataLoader(
        list(range(12)), batch_size=4, collate_fn=collate_stops_at_5, **where
    )
    assert [b.tolist() for b in ours] == [b.tolist() for b in theirs] == [[0, 1, 2, 3]]


@pytest.mark.parametrize("where", WHERE, ids=WHERE_IDS)
async def test_async_for_names_a_collate_fn_s_stop_iteration(where: dict[str, Any]) -> None:
    loader = aioloader.DataLoader(
        list(range(12)), batch_size=4, collate_fn=collate_stops_at_5, **where
    )
    async with loader:
        it = aiter(loader)
        assert (await anext(it)).tolist() == [0, 1, 2, 3]
        with pytest.raises(StopInWorker, match="collate_fn raised StopIteration") as info:
            await anext(it)
        assert (await anext(it)).tolist() == [8, 9, 10, 11]  # the next batch, as after any
    assert "stage 'collate'" in notes(info.value) and "batch 1" in notes(info.value)


class StopsAt(torch.utils.data.Dataset[int]):
    def __init__(self, *stops: int) -> None:
        self.stops = stops

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> int:
        if index in self.stops:
            raise StopIteration
        return index


async def test_a_read_s_stop_iteration_past_the_failure_budget_names_its_sample() -> None:
    # With a budget the worker reports each failed read; the one past it was raised in a
    # coroutine, and came as the bare RuntimeError.
    loader = aioloader.DataLoader(StopsAt(2, 6), batch_size=4, num_workers=1, max_failures=1)
    got: list[list[int]] = []
    with pytest.raises(StopInWorker, match="the dataset raised StopIteration") as info:
        async with loader:
            async for batch in loader:
                got.append(batch.tolist())
    assert got == [[0, 1, 3]] and loader.statistics().skipped_samples == (2,)
    assert "sample 6" in notes(info.value) and "max_failures=1 exhausted" in notes(info.value)
