"""The epoch's output stream (``_pipeline/handoff.py``): bounded as anyio's memory stream is,
and a consumer whose wait is cancelled loses nothing, where anyio's dropped the item it had
handed to the waiting receiver (found by review: a 4 ms ``asyncio.timeout`` around
``anext(it)`` lost 13 of 200 batches, and a cancelled first call of an epoch emptied it)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import anyio
import pytest
import torch

import aioloader
from aioloader._pipeline.handoff import handoff


@pytest.mark.parametrize("capacity", [0, 1, 3])
async def test_an_item_sent_to_a_receiver_cancelled_before_it_resumed_is_the_next_call_s(
    capacity: int,
) -> None:
    send, recv = handoff(capacity)
    waiting = asyncio.ensure_future(recv.receive())
    await asyncio.sleep(0)  # it waits
    send.send_nowait("a")  # to the waiting receiver (no buffer: only to one)
    waiting.cancel()  # before it resumes
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert recv.receive_nowait() == "a"


async def test_the_bounds_are_anyio_s() -> None:
    send, recv = handoff(2)
    send.send_nowait(1)
    send.send_nowait(2)
    with pytest.raises(anyio.WouldBlock):
        send.send_nowait(3)
    assert send.statistics().current_buffer_used == 2
    sending = asyncio.ensure_future(send.send(3))  # waits for room
    await asyncio.sleep(0)
    assert not sending.done()
    assert recv.receive_nowait() == 1
    await sending
    send.close()  # the rest is taken, then the end
    assert [recv.receive_nowait(), await recv.receive()] == [2, 3]
    with pytest.raises(anyio.EndOfStream):
        await recv.receive()


async def test_without_a_buffer_an_item_goes_only_to_a_waiting_receiver() -> None:
    send, recv = handoff(0)
    with pytest.raises(anyio.WouldBlock):
        send.send_nowait(1)
    sending = asyncio.ensure_future(send.send(1))
    await asyncio.sleep(0)
    assert not sending.done()  # nobody waits
    assert await recv.receive() == 1
    await sending


async def test_a_closed_receiving_end_breaks_the_sender_and_refuses_a_receive() -> None:
    send, recv = handoff(0)
    sending = asyncio.ensure_future(send.send(1))
    await asyncio.sleep(0)
    recv.close()
    with pytest.raises(anyio.BrokenResourceError):
        await sending
    with pytest.raises(anyio.ClosedResourceError):
        await recv.receive()
    with pytest.raises(anyio.ClosedResourceError):
        send.close() or send.send_nowait(2)


class Ids(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 400

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.0005)  # a batch of 8: about 4 ms
        return torch.tensor(index)


@pytest.mark.parametrize(
    "where",
    [{}, {"num_workers": 2, "worker_mode": "thread"}, {"num_workers": 2}],
    ids=["in-process", "thread", "process"],
)
async def test_a_consumer_that_polls_with_a_timeout_gets_every_batch_once(
    where: dict[str, Any],
) -> None:
    # A heartbeat while it waits for data: ask with a short timeout, and ask again.
    got: list[int] = []
    timeouts = 0
    async with aioloader.DataLoader(Ids(), batch_size=8, **where) as loader:
        for _ in range(2):  # the second epoch's first calls time out too
            it = aiter(loader)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    async with asyncio.timeout(0.001):
                        batch = await anext(it)
                except TimeoutError:
                    timeouts += 1
                    continue
                except StopAsyncIteration:
                    break
                got += batch.tolist()
    assert got == [*range(400), *range(400)], f"{len(got)} of 800 ({timeouts} timeouts)"
    assert timeouts > 0
