"""Failures: original type and traceback, notes naming the stage and sample, bounded skipping,
retries with backoff, timeouts; and after any of them, the next epoch is whole."""

from __future__ import annotations

import logging
import traceback
from typing import Any

import anyio
import pytest

import aioloader
from tests.support.helpers import Counting, Gated, Stream, TorchMap, flat


def notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


async def drain(loader: aioloader.DataLoader[Any]) -> list[Any]:
    return [b async for b in loader]


async def test_fetch_error_keeps_type_traceback_and_names_the_sample() -> None:
    ds = Counting(40, fail={17})
    async with aioloader.DataLoader(ds, batch_size=4) as dl:
        got = []
        with pytest.raises(KeyError, match="bad sample 17") as info:
            async for b in dl:
                got.append(b)
        # Batches already handed out before the failure came are good and in order.
        assert flat(got) == list(range(len(flat(got)))) and len(flat(got)) <= 16
        text = notes(info.value)
        assert "stage 'fetch'" in text and "sample 17" in text and "batch 4" in text
        frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
        assert "get" in frames  # the dataset's own frame is in the traceback
        ds.fail.clear()
        assert flat(await drain(dl)) == list(range(40))  # the next epoch is whole


async def test_torch_dataset_error_names_the_index() -> None:
    class Bad(TorchMap):
        def __getitem__(self, index: int) -> int:
            if index == 5:
                raise ValueError("corrupt record")
            return super().__getitem__(index)

    async with aioloader.DataLoader(Bad(10), batch_size=3) as dl:
        with pytest.raises(ValueError, match="corrupt record") as info:
            await drain(dl)
    assert "sample 5" in notes(info.value)


async def test_transform_error_names_stage_and_sample() -> None:
    def transform(x: int) -> int:
        if x == 7:
            raise ZeroDivisionError("cannot decode")
        return x

    async with aioloader.DataLoader(Counting(12), batch_size=4, transform=transform) as dl:
        with pytest.raises(ZeroDivisionError) as info:
            await drain(dl)
    text = notes(info.value)
    assert "stage 'transform'" in text and "sample 7" in text and "batch 1" in text


async def test_collate_error_names_the_batch() -> None:
    def collate(samples: list[int]) -> list[int]:
        if 9 in samples:
            raise RuntimeError("ragged")
        return samples

    async with aioloader.DataLoader(Counting(12), batch_size=4, collate_fn=collate) as dl:
        with pytest.raises(RuntimeError, match="ragged") as info:
            await drain(dl)
    assert "stage 'collate'" in notes(info.value) and "[8, 9, 10, 11]" in notes(info.value)


async def test_source_error_names_the_stream_position() -> None:
    async def broken() -> Any:
        for i in range(10):
            if i == 6:
                raise OSError("connection lost")
            yield i

    async with aioloader.DataLoader(broken, batch_size=4) as dl:
        with pytest.raises(OSError, match="connection lost") as info:
            await drain(dl)
    assert "stage 'source'" in notes(info.value) and "sample 6" in notes(info.value)


async def test_bounded_skipping_is_counted_and_reported(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="aioloader")
    ds = Counting(30, fail={3, 11, 12})

    def transform(x: int) -> int:
        if x == 20:
            raise ValueError("bad pixels")
        return x

    dl = aioloader.DataLoader(ds, batch_size=4, max_failures=4, transform=transform)
    async with dl:
        got = flat(await drain(dl))
    assert got == [i for i in range(30) if i not in {3, 11, 12, 20}]
    stats = dl.statistics()
    assert stats.stage("fetch").skipped == 3
    assert stats.stage("transform").skipped == 1
    assert sorted(stats.skipped_samples) == [3, 11, 12, 20]  # type: ignore[type-var]
    assert "skipped samples" in repr(stats)
    assert sum("skipped sample" in r.message for r in caplog.records) == 4
    assert stats.consumer.samples == 26


async def test_a_wholly_failed_batch_is_dropped_not_yielded_empty() -> None:
    dl = aioloader.DataLoader(Counting(8, fail={4, 5, 6, 7}), batch_size=4, max_failures=4)
    async with dl:
        assert flat(await drain(dl)) == [0, 1, 2, 3]


async def test_exhausted_failure_budget_raises_the_next_failure() -> None:
    dl = aioloader.DataLoader(Counting(30, fail={3, 11, 12}), batch_size=4, max_failures=2)
    async with dl:
        with pytest.raises(KeyError, match="bad sample 12") as info:
            await drain(dl)
    assert "max_failures=2 exhausted" in notes(info.value)


async def test_batched_source_failure_falls_back_to_items_when_skipping() -> None:
    from tests.support.helpers import Batched

    ds = Batched(12, fail={5})
    dl = aioloader.DataLoader(ds, batch_size=4, max_failures=1)
    async with dl:
        assert flat(await drain(dl)) == [i for i in range(12) if i != 5]
    assert dl.statistics().skipped_samples == (5,)


class Flaky(aioloader.AsyncDataset[int]):
    """Fails each index a fixed number of times with a transient error, then succeeds."""

    def __init__(self, n: int, failures: dict[int, int], exc: type[Exception]) -> None:
        self.n, self.left, self.exc = n, dict(failures), exc
        self.attempts: dict[int, int] = {}

    def __len__(self) -> int:
        return self.n

    async def get(self, index: int) -> int:
        self.attempts[index] = self.attempts.get(index, 0) + 1
        if self.left.get(index, 0) > 0:
            self.left[index] -= 1
            raise self.exc(f"throttled {index}")
        return index


async def test_transient_errors_are_retried_and_counted() -> None:
    ds = Flaky(40, {i: 2 for i in range(0, 40, 4)}, aioloader.TransientError)
    retry = aioloader.RetryPolicy(attempts=3, initial_backoff=0.001, max_backoff=0.002)
    async with aioloader.DataLoader(ds, batch_size=8, retry=retry) as dl:
        assert flat(await drain(dl)) == list(range(40))
    assert dl.statistics().stage("fetch").retries == 20
    assert ds.attempts[0] == 3 and ds.attempts[1] == 1


async def test_retries_run_out_and_the_error_names_the_key() -> None:
    ds = Flaky(10, {6: 5}, ConnectionResetError)
    retry = aioloader.RetryPolicy(attempts=3, initial_backoff=0.0, max_backoff=0.0)
    async with aioloader.DataLoader(ds, batch_size=5, retry=retry) as dl:
        with pytest.raises(ConnectionResetError) as info:
            await drain(dl)
    assert "gave up after 3 attempts" in notes(info.value) and "sample 6" in notes(info.value)
    assert ds.attempts[6] == 3


async def test_errors_not_marked_transient_are_not_retried() -> None:
    ds = Flaky(10, {2: 1}, KeyError)
    async with aioloader.DataLoader(ds, batch_size=5, retry=aioloader.RetryPolicy()) as dl:
        with pytest.raises(KeyError):
            await drain(dl)
    assert ds.attempts[2] == 1


async def test_sample_timeout_cancels_a_stalled_fetch_and_retries_it() -> None:
    class StallOnce(aioloader.AsyncDataset[int]):
        def __init__(self) -> None:
            self.stalled = False

        def __len__(self) -> int:
            return 6

        async def get(self, index: int) -> int:
            if index == 4 and not self.stalled:
                self.stalled = True
                await anyio.sleep_forever()
            return index

    retry = aioloader.RetryPolicy(attempts=2, initial_backoff=0.0)
    dl = aioloader.DataLoader(StallOnce(), batch_size=3, sample_timeout=0.05, retry=retry)
    async with dl:
        assert flat(await drain(dl)) == list(range(6))
    assert dl.statistics().stage("fetch").retries == 1

    dl = aioloader.DataLoader(Gated(3), batch_size=3, sample_timeout=0.05)
    async with dl:
        with pytest.raises(TimeoutError) as info:
            await drain(dl)
    assert "sample_timeout=0.05s exceeded" in str(info.value)


async def test_loader_timeout_is_torchs_runtime_error() -> None:
    async with aioloader.DataLoader(Gated(2), timeout=0.05) as dl:
        with pytest.raises(RuntimeError, match=r"timed out after 0\.05 seconds") as info:
            await drain(dl)
    assert isinstance(info.value, aioloader.LoaderTimeout)
    assert isinstance(info.value, TimeoutError)


async def test_stream_failure_then_a_whole_epoch() -> None:
    class Once(Stream):
        def __init__(self) -> None:
            super().__init__(12)
            self.boom = True

        async def _gen(self) -> Any:
            async for i in super()._gen():
                if i == 5 and self.boom:
                    self.boom = False
                    raise aioloader.TransientError("hiccup")
                yield i

    async with aioloader.DataLoader(Once(), batch_size=4) as dl:
        with pytest.raises(aioloader.TransientError):
            await drain(dl)
        assert flat(await drain(dl)) == list(range(12))


async def test_body_exception_leaves_the_scope_unwrapped() -> None:
    dl = aioloader.DataLoader(Counting(100), batch_size=2)
    with pytest.raises(LookupError, match="mine"):
        async with dl:
            async for _ in dl:
                raise LookupError("mine")
