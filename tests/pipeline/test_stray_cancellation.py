"""A ``CancelledError`` that user code raises of its own (it awaited a future that something
else cancelled; on a thread, ``concurrent.futures.CancelledError``) fails that sample, batch or
request alone, as :class:`aioloader.StrayCancellation`. Found by review: through the loader it
ended the epoch with a bare ``BrokenResourceError`` (the batches before it lost, nothing
naming the sample); through the batcher it closed the scope and cancelled the server's task.
A real cancellation still cancels."""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import torch

import aioloader

BAD = 3
CANCELLED = (asyncio.CancelledError, concurrent.futures.CancelledError)


def notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


async def cancelled_future() -> None:
    """Await a future another party cancelled (what a request's sub-task does when its
    client went away)."""
    future = asyncio.get_running_loop().create_future()
    future.cancel()
    await future


class Reads(aioloader.AsyncDataset[int]):
    def __len__(self) -> int:
        return 8

    async def get(self, index: int) -> int:
        if index == BAD:
            await cancelled_future()
        return index


class ReadsMany(Reads):
    async def get_many(self, indices: Any) -> list[int]:
        return [await self.get(i) for i in indices]


class Blocking(torch.utils.data.Dataset[int]):
    """A torch dataset whose read raises ``concurrent.futures.CancelledError`` (a
    ``Future.result()`` of a call its own pool withdrew)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        if index == BAD:
            raise concurrent.futures.CancelledError
        return index


async def stream() -> AsyncIterator[int]:
    for i in range(8):
        if i == BAD:
            await cancelled_future()
        yield i


def loader(dataset: Any, **kwargs: Any) -> aioloader.DataLoader[list[int]]:
    return aioloader.DataLoader(dataset, batch_size=2, collate_fn=list, **kwargs)


async def read_all(dl: aioloader.DataLoader[list[int]]) -> tuple[list[list[int]], Exception]:
    got: list[list[int]] = []
    with anyio.fail_after(20):
        async with dl:
            try:
                async for batch in dl:
                    got.append(batch)
            except Exception as exc:
                return got, exc
    raise AssertionError(f"no error: {got}")


@pytest.mark.parametrize(
    "dataset", [Reads(), ReadsMany(), Blocking()], ids=["get", "get_many", "torch"]
)
@pytest.mark.parametrize("way", ["async for", "for"])
async def test_a_read_that_raises_cancelled_fails_its_sample_and_the_batches_before_come(
    dataset: Any, way: str
) -> None:
    dl = loader(dataset)
    if way == "for":
        got, error = await anyio.to_thread.run_sync(lambda: read_all_plain(dl))
    else:
        got, error = await read_all(dl)
    assert got == [[0, 1]]
    assert isinstance(error, aioloader.StrayCancellation | concurrent.futures.CancelledError)
    if isinstance(error, aioloader.StrayCancellation):  # asyncio's, or the thread's converted
        assert isinstance(error.__cause__, CANCELLED)
    # get_many's failure names its slice, as any of its failures does
    assert re.search(r"stage 'fetch', sample (3|\[2, 3\]), batch 1", notes(error))


def read_all_plain(dl: aioloader.DataLoader[list[int]]) -> tuple[list[list[int]], Exception]:
    got: list[list[int]] = []
    try:
        for batch in dl:
            got.append(batch)
    except Exception as exc:
        return got, exc
    raise AssertionError(f"no error: {got}")


async def test_within_max_failures_the_sample_is_skipped_and_the_epoch_goes_on() -> None:
    dl = loader(Reads(), max_failures=1)
    with anyio.fail_after(20):
        async with dl:
            got = [x for batch in [b async for b in dl] for x in batch]
    assert got == [0, 1, 2, 4, 5, 6, 7]
    assert dl.statistics().skipped_samples == (BAD,)


async def test_a_retry_policy_that_names_it_reads_the_sample_again() -> None:
    tries = {BAD: 0}

    class OnceBad(Reads):
        async def get(self, index: int) -> int:
            if index == BAD and not tries[BAD]:
                tries[BAD] += 1
                await cancelled_future()
            return index

    retry = aioloader.RetryPolicy(retry_on=(aioloader.StrayCancellation,), initial_backoff=0)
    dl = loader(OnceBad(), retry=retry)
    with anyio.fail_after(20):
        async with dl:
            got = [x for batch in [b async for b in dl] for x in batch]
    assert got == list(range(8)) and tries[BAD] == 1


async def test_a_stream_that_raises_cancelled_ends_with_the_error_naming_its_place() -> None:
    got, error = await read_all(loader(stream))
    assert got == [[0, 1]]
    assert isinstance(error, aioloader.StrayCancellation)
    assert "the stream raised CancelledError" in str(error)
    assert "stage 'source', sample 3" in notes(error)


async def test_the_loaders_own_cancellation_still_cancels() -> None:
    """A read waiting when the consumer's scope is cancelled: cancelled, not a failure."""
    started = anyio.Event()

    class Waits(aioloader.AsyncDataset[int]):
        def __len__(self) -> int:
            return 4

        async def get(self, index: int) -> int:
            started.set()
            await anyio.sleep_forever()
            return index

    dl = loader(Waits())

    async def first() -> None:
        await anext(aiter(dl))

    with anyio.fail_after(20):
        async with dl:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(first)
                    await started.wait()
                    scope.cancel()
    assert scope.cancelled_caught


async def test_sample_timeout_is_still_a_timeout() -> None:
    class Slow(aioloader.AsyncDataset[int]):
        def __len__(self) -> int:
            return 2

        async def get(self, index: int) -> int:
            await anyio.sleep(10)
            return index

    _, error = await read_all(loader(Slow(), sample_timeout=0.05))
    assert isinstance(error, TimeoutError) and "sample_timeout=0.05s" in str(error)


# -- the batcher ---------------------------------------------------------------------------


async def test_a_model_that_raises_cancelled_fails_its_batch_and_the_batcher_serves_on() -> None:
    async def model(batch: list[int]) -> list[int]:
        if BAD in batch:
            await cancelled_future()
        return [x * 10 for x in batch]

    batcher = aioloader.DynamicBatcher(model, collate_fn=list, max_batch_size=1, max_delay=0)
    with anyio.fail_after(20):
        async with batcher:
            with pytest.raises(aioloader.StrayCancellation, match="model_fn raised") as caught:
                await batcher.submit(BAD)
            assert await batcher.submit(4) == 40
    assert "stage 'model', batch 0" in notes(caught.value)
    stats = batcher.statistics()
    assert (stats.failed, stats.completed, stats.cancelled) == (1, 1, 0)


def blocking_model(batch: list[int]) -> list[int]:
    if BAD in batch:
        raise concurrent.futures.CancelledError  # a .result() of a withdrawn call
    return [x * 10 for x in batch]


@pytest.mark.parametrize("concurrent_batches", [1, 2])
async def test_a_blocking_model_that_raises_cancelled_fails_only_its_batch(
    concurrent_batches: int,
) -> None:
    """On the batcher's thread asyncio turns the model's ``concurrent.futures.CancelledError``
    into its own; inline it stays what it was. Either way only its callers get it."""
    batcher = aioloader.DynamicBatcher(
        blocking_model, collate_fn=list, max_batch_size=1, max_delay=0,
        max_concurrent_batches=concurrent_batches,
    )  # fmt: skip
    with anyio.fail_after(20):
        async with batcher:
            for _ in range(2):  # the first call runs on the thread, later ones may run inline
                with pytest.raises(
                    (aioloader.StrayCancellation, concurrent.futures.CancelledError)
                ):
                    await batcher.submit(BAD)
                assert await batcher.submit(4) == 40


# -- plain (not async) calls ---------------------------------------------------------------


def collate_raising(batch: list[int]) -> list[int]:
    if BAD in batch:
        raise asyncio.CancelledError  # a .result() of a cancelled asyncio future
    return batch


def transform_raising(sample: int) -> int:
    if sample == BAD:
        raise asyncio.CancelledError
    return sample


class GetitemRaising(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        if index == BAD:
            raise asyncio.CancelledError
        return index


@pytest.mark.parametrize(
    "kwargs",
    [
        {"collate_fn": collate_raising},
        {"collate_fn": collate_raising, "prefetch": 2},  # made by the stages, inline
        {"transform": transform_raising},
        {"transform": transform_raising, "prefetch": 2},
        {"dataset": GetitemRaising()},
        {"dataset": GetitemRaising(), "prefetch": 2},
    ],
    ids=["collate", "collate-staged", "transform", "transform-staged", "getitem", "getitem-staged"],
)
@pytest.mark.parametrize("way", ["async for", "for"])
async def test_a_plain_call_that_raises_cancelled_fails_its_batch_and_the_epoch_goes_on(
    kwargs: dict[str, Any], way: str
) -> None:
    """Found by review: run inline, a ``collate_fn`` (or transform, or ``__getitem__``) that
    raised ``CancelledError`` cut the epoch short silently, or reached ``async for`` bare. A
    plain call never receives a cancellation: it is always its own."""
    args = {"dataset": list(range(8)), "batch_size": 2, **kwargs}
    args.setdefault("collate_fn", list)
    dl = aioloader.DataLoader(**args)
    got: list[Any] = []

    def plain() -> None:
        got.extend(outcomes_of(iter(dl)))

    if way == "for":
        await anyio.to_thread.run_sync(plain)
    else:
        with anyio.fail_after(20):
            async with dl:
                iterator = aiter(dl)
                while True:
                    try:
                        got.append(await anext(iterator))
                    except StopAsyncIteration:
                        break
                    except Exception as exc:
                        got.append(exc)
    assert [g for g in got if not isinstance(g, Exception)] == [[0, 1], [4, 5], [6, 7]]
    (error,) = [g for g in got if isinstance(g, Exception)]
    assert isinstance(error, aioloader.StrayCancellation), repr(error)
    assert "batch 1" in notes(error)


def outcomes_of(iterator: Any) -> list[Any]:
    """Each batch, or the exception raised in its place; the epoch goes on after one."""
    out: list[Any] = []
    while True:
        try:
            out.append(next(iterator))
        except StopIteration:
            return out
        except Exception as exc:
            out.append(exc)


async def test_a_split_fn_that_raises_cancelled_fails_its_batch() -> None:
    """Every stage's name is known to the message (found by reading: ``split`` was not)."""

    def split(output: list[int], n: int) -> list[int]:
        raise asyncio.CancelledError

    batcher = aioloader.DynamicBatcher(
        lambda b: b, collate_fn=list, split_fn=split, max_batch_size=1, max_delay=0
    )
    with anyio.fail_after(20):
        async with batcher:
            with pytest.raises(aioloader.StrayCancellation, match="split_fn raised"):
                await batcher.submit(1)
