"""What one caller does never changes what another gets: a request's dtype, a caller cancelled
in the turn its batch is cut or its result comes, the grad mode of the thread a model call
runs on; and closing with ``on_exit="cancel"`` from a task already being cancelled. Each found
by a review that served the batcher as a server author would."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import aioloader
from aioloader._serving.alike import collate_alike


async def gather_outcomes(batcher: aioloader.DynamicBatcher, items: list[Any]) -> list[Any]:
    """Each item submitted at once; each caller's result or exception, in order."""
    return await asyncio.gather(*(batcher.submit(x) for x in items), return_exceptions=True)


def scaled(batch: torch.Tensor) -> torch.Tensor:
    return (batch * 0.1).sin()


async def test_a_request_of_another_dtype_leaves_the_others_as_they_would_be_alone() -> None:
    # Stacked with float32 requests, a float64 one made every result float64
    items: list[Any] = [torch.randn(4) for _ in range(7)] + [torch.randn(4, dtype=torch.float64)]
    batcher = aioloader.DynamicBatcher(scaled, max_batch_size=8, max_delay=60.0)
    async with batcher:
        got = await gather_outcomes(batcher, items)
    for item, out in zip(items, got, strict=True):
        alone = scaled(item[None])[0]
        assert out.dtype == item.dtype and torch.equal(out, alone)
    assert batcher.statistics().split >= 1


async def test_a_model_of_one_dtype_fails_only_the_request_of_another() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 2)

    def model(batch: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return linear(batch)

    items: list[Any] = [torch.randn(4) for _ in range(5)] + [torch.randn(4, dtype=torch.float64)]
    async with aioloader.DynamicBatcher(model, max_batch_size=6, max_delay=60.0) as batcher:
        got = await gather_outcomes(batcher, items)
    assert all(isinstance(out, torch.Tensor) for out in got[:5]), got
    assert isinstance(got[5], RuntimeError) and "dtype" in str(got[5])


async def test_plain_numbers_keep_their_own_type() -> None:
    # [1, 2.5] stacked as float32, [2.5, 1] as float64: the first request picked the dtype
    def model(batch: torch.Tensor) -> list[str]:
        return [str(batch.dtype)] * len(batch)

    async with aioloader.DynamicBatcher(model, max_batch_size=4, max_delay=60.0) as batcher:
        got = await gather_outcomes(batcher, [1, 2.5, 3, 4.5])
    assert got == ["torch.int64", "torch.float64", "torch.int64", "torch.float64"]


def test_collate_alike_names_where_requests_differ_and_collates_those_that_agree() -> None:
    same = [{"x": torch.ones(2), "ids": [np.int32(1), 2]} for _ in range(3)]
    assert collate_alike(same)["x"].shape == (3, 2)
    other = [*same, {"x": torch.ones(2), "ids": [np.int64(1), 2]}]
    with pytest.raises(TypeError, match=r"requests 0 and 3 .* at \['ids'\]\[0\] \(numpy int32"):
        collate_alike(other)
    with pytest.raises(TypeError, match=r"at the input \(torch.float32, torch.float16\)"):
        collate_alike([torch.ones(1), torch.ones(1, dtype=torch.float16)])
    assert collate_alike(["a", "b"]) == ["a", "b"]  # what is not a number passes as before


async def test_a_caller_cancelled_before_the_cut_in_the_same_turn_never_reaches_the_model() -> None:
    seen: list[float] = []

    def model(batch: torch.Tensor) -> torch.Tensor:
        seen.extend(batch[:, 0].tolist())
        return batch

    batcher = aioloader.DynamicBatcher(model, max_batch_size=2, max_delay=60.0)
    async with batcher:
        leaving = asyncio.create_task(batcher.submit(torch.tensor([1.0])))
        await asyncio.sleep(0)  # queued
        staying = asyncio.create_task(batcher.submit(torch.tensor([2.0])))
        await asyncio.sleep(0)  # queued: the batch is full, its runner woken
        leaving.cancel()  # before the runner cuts, in this same turn
        outcomes = await asyncio.gather(leaving, staying, return_exceptions=True)
    assert isinstance(outcomes[0], asyncio.CancelledError)
    assert seen == [2.0]
    stats = batcher.statistics()
    assert (stats.cancelled, stats.completed) == (1, 1)


async def test_a_caller_cancelled_as_its_result_comes_is_counted_cancelled() -> None:
    release = asyncio.Event()

    async def model(batch: torch.Tensor) -> torch.Tensor:
        await release.wait()
        return batch

    batcher = aioloader.DynamicBatcher(model, max_batch_size=1, max_delay=0.0)
    async with batcher:
        caller = asyncio.create_task(batcher.submit(torch.tensor([1.0])))
        for _ in range(100):  # bounded: until its batch runs
            if batcher.statistics().batches:
                break
            await asyncio.sleep(0.01)
        release.set()  # the result comes in the next turn ...
        caller.cancel()  # ... and the caller leaves in this one
        with pytest.raises(asyncio.CancelledError):
            await caller
    stats = batcher.statistics()
    assert (stats.completed, stats.cancelled) == (0, 1)


@pytest.mark.parametrize("mode", ["no_grad", "inference"])
async def test_a_model_on_the_batchers_thread_runs_in_the_loop_threads_grad_mode(mode: str) -> None:
    # torch's grad mode is per thread: calls on the batcher's thread required grad while those
    # inline did not
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 2)
    outputs: list[torch.Tensor] = []
    guard: Any = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with guard:
        async with aioloader.DynamicBatcher(linear, max_batch_size=4, max_delay=0.0) as batcher:
            for _ in range(8):  # the first call runs on the thread, later ones may run inline
                outputs.append(await batcher.submit(torch.randn(4)))
    assert not any(out.requires_grad for out in outputs)
    assert all(out.is_inference() == (mode == "inference") for out in outputs)
    assert torch.is_grad_enabled()  # the loop thread's own mode is as it was


async def test_with_grad_on_the_thread_keeps_it() -> None:
    linear = torch.nn.Linear(4, 2)
    async with aioloader.DynamicBatcher(linear, max_batch_size=1, max_delay=0.0) as batcher:
        out = await batcher.submit(torch.randn(4))
    assert out.requires_grad


@pytest.mark.parametrize("on_exit", ["drain", "cancel"])
async def test_closing_from_a_task_already_cancelled_returns(on_exit: str) -> None:
    """aiohttp's ``run_app`` runs its ``cleanup_ctx`` teardown in the ``finally`` of its
    cancelled main task; with ``on_exit="cancel"`` the batcher's exit raised the task group's
    cancellation there, and what followed ``async with batcher:`` did not run."""
    batcher = aioloader.DynamicBatcher(lambda x: x, on_exit=on_exit)
    log: list[str] = []

    async def context() -> AsyncIterator[None]:  # a cleanup_ctx, as the README wires it
        async with batcher:
            yield
        log.append("after the batcher")

    async def app() -> None:  # what aiohttp's _run_app does with it
        steps = context()
        await anext(steps)
        try:
            await asyncio.sleep(60)  # serving until cancelled
        finally:
            with pytest.raises(StopAsyncIteration):
                await anext(steps)
            log.append("torn down")

    task = asyncio.create_task(app())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert log == ["after the batcher", "torn down"]


LEAVES = st.sampled_from(
    [torch.ones(1), torch.ones(1, dtype=torch.float64), np.ones(1, np.int32), np.int64(1), 1, 1.5]
)
SAMPLES = st.recursive(
    LEAVES,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner, inner)
        | st.dictionaries(st.sampled_from("ab"), inner, max_size=2)
    ),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)
@given(SAMPLES, SAMPLES)
def test_the_quick_walk_sees_every_difference_the_named_one_finds(a: Any, b: Any) -> None:
    from aioloader._serving.alike import _differs, _kinds

    kinds_a: list[object] = []
    kinds_b: list[object] = []
    _kinds(a, kinds_a)
    _kinds(b, kinds_b)
    if _differs(a, b, "") is not None:
        assert kinds_a != kinds_b
    if kinds_a == kinds_b:
        assert _differs(a, b, "") is None


@pytest.mark.parametrize("workers", [0, 1])
async def test_interleaved_dtypes_run_as_one_part_each(workers: int) -> None:
    # split in halves, alternating float32 and float64 requests ran one model call each
    calls: list[torch.dtype] = []

    def model(batch: torch.Tensor) -> torch.Tensor:
        calls.append(batch.dtype)
        return scaled(batch)

    dtypes = [torch.float32, torch.float64] * 8
    items: list[Any] = [torch.randn(4, dtype=dtype) for dtype in dtypes]
    batcher = aioloader.DynamicBatcher(
        model, max_batch_size=16, max_delay=60.0, num_workers=workers
    )
    async with batcher:
        got = await gather_outcomes(batcher, items)
    assert sorted(calls, key=str) == [torch.float32, torch.float64]
    for item, out in zip(items, got, strict=True):
        assert out.dtype == item.dtype and torch.equal(out, scaled(item[None])[0])
