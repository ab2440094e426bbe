"""The device stage on a real CUDA device: bit-exact batches, the consumer's stream waiting for
the side stream (pinned or not), ``record_stream`` while the consumer's stream lags behind,
``device_transform`` on the side stream, and the bound on batches ahead. Skipped as a whole
without CUDA; the tests that choose among devices need two."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import aioloader
from aioloader._base.tree import tensors_in
from aioloader._device import stage as stage_module
from tests.conftest import aioloader_threads
from tests.device.test_device import Records, collate_records, same
from tests.support.helpers import Counting, other_tasks

pytestmark = pytest.mark.cuda

SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time: long enough for a race to show


def cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


class Rows(aioloader.AsyncDataset[torch.Tensor]):
    """Sample ``i`` is ``width`` copies of ``i`` (int64): a batch's sum is known exactly."""

    def __init__(self, n: int, width: int) -> None:
        self.n, self.width = n, width

    def __len__(self) -> int:
        return self.n

    async def get(self, index: int) -> torch.Tensor:
        await anyio.lowlevel.checkpoint()
        return torch.full((self.width,), index, dtype=torch.int64)


def expected_sums(n: int, batch_size: int, width: int) -> list[int]:
    return [width * sum(range(s, min(n, s + batch_size))) for s in range(0, n, batch_size)]


def random_batches(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out, start = [], 0
    while start < n:
        size = int(torch.randint(1, 9, (), generator=g))
        out.append(list(range(start, min(n, start + size))))
        start += size
    return out


@pytest.mark.parametrize("pin_memory", [True, False])
@pytest.mark.parametrize("workers", [{}, {"num_workers": 2}])
async def test_batches_equal_the_cpu_path_bit_for_bit(
    pin_memory: bool, workers: dict[str, Any]
) -> None:
    sampler = random_batches(97, seed=3)  # random batch sizes
    kwargs: dict[str, Any] = {"batch_sampler": sampler, "collate_fn": collate_records, **workers}
    async with aioloader.DataLoader(Records(97), **kwargs) as plain:
        want = [b async for b in plain]
    dl = aioloader.DataLoader(Records(97), pin_memory=pin_memory, device="cuda", **kwargs)
    assert dl.device == cuda()
    async with dl:
        got = [b async for b in dl]
        stage = dl._scope.device if dl._scope else None
        assert stage is not None and (stage.pool is not None) == pin_memory
        if stage.pool is not None:
            assert stage.pool.allocations <= stage.pool.capacity
    assert len(got) == len(want) == len(sampler)
    for g, w in zip(got, want, strict=True):
        same(g, w)
        assert all(t.device == cuda() for t in tensors_in(g))
        assert g["name"] == w["name"] and g["pair"].b == w["pair"].b  # non-tensors as they were


async def test_large_tensors_in_chunks_equal_the_host_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Small chunks: many chunk copies out of each pinned buffer. The transform keeps the side
    # stream busy, so the next batches' chunk copies are still queued when the host would
    # reuse their buffers: the pool must wait for the one event after all of a batch's chunks.
    monkeypatch.setattr(stage_module, "_CHUNK_BYTES", 1 << 12)
    g = torch.Generator().manual_seed(11)
    batches = [
        {
            "image": torch.randint(0, 256, (4, 3, 32, 32 + i), dtype=torch.uint8, generator=g),
            "feat": torch.randn(6000 + 7 * i, generator=g).to(torch.bfloat16),
            "mask": torch.rand(10_000 + i, generator=g) > 0.5,
            "t": torch.randn(40, 50, generator=g).t(),  # dense, permuted: copied whole
            "label": torch.tensor(i),
        }
        for i in range(24)
    ]

    def slow(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        torch.cuda._sleep(SLEEP_CYCLES // 4)
        return batch

    dl = aioloader.DataLoader(
        batches, batch_size=None, pin_memory=True, device="cuda", prefetch=3, device_transform=slow
    )
    async with dl:
        got = [{k: v.cpu() for k, v in b.items()} async for b in dl]
    assert len(got) == len(batches)
    for batch, want in zip(got, batches, strict=True):
        same(batch, want)


async def test_pin_memory_without_device_pins_on_the_host() -> None:
    async with aioloader.DataLoader(Records(10), batch_size=4, pin_memory=True) as dl:
        got = [b async for b in dl]
        assert dl.statistics().stage("device").completed == 3
    for batch in got:
        assert all(t.is_pinned() and t.device.type == "cpu" for t in tensors_in(batch))


def slow_double(batch: torch.Tensor) -> torch.Tensor:
    torch.cuda._sleep(SLEEP_CYCLES)  # keeps the side stream busy before the result is written
    return batch * 2


@pytest.mark.parametrize("pin_memory", [True, False])
async def test_async_for_batches_are_ready_on_the_current_stream(pin_memory: bool) -> None:
    dl = aioloader.DataLoader(
        Rows(64, 1024),
        batch_size=8,
        pin_memory=pin_memory,
        device="cuda",
        device_transform=slow_double,
    )
    async with dl:
        sums = [int(batch.sum()) async for batch in dl]  # int() syncs only this stream
    assert sums == [2 * s for s in expected_sums(64, 8, 1024)]


@pytest.mark.parametrize("pin_memory", [True, False])
def test_plain_for_waits_on_the_consumers_own_stream(pin_memory: bool) -> None:
    dl = aioloader.DataLoader(
        Rows(64, 1024),
        batch_size=8,
        pin_memory=pin_memory,
        device="cuda",
        device_transform=slow_double,
    )
    stream = torch.cuda.Stream()
    sums = []
    with torch.cuda.stream(stream):
        for batch in dl:
            assert torch.cuda.current_stream() == stream
            sums.append(int(batch.sum()))
    assert sums == [2 * s for s in expected_sums(64, 8, 1024)]
    assert aioloader_threads() == []


@pytest.mark.parametrize("pin_memory", [True, False])
async def test_freed_batches_are_not_reused_while_the_consumer_reads_them(
    pin_memory: bool,
) -> None:
    width = 1 << 16  # 512 KiB per sample row, 4 MiB per batch
    dl = aioloader.DataLoader(
        Rows(160, width), batch_size=8, prefetch=3, pin_memory=pin_memory, device="cuda"
    )
    sums: list[torch.Tensor] = []
    async with dl:
        async for batch in dl:
            # The consumer's stream falls further behind each batch (the host never waits).
            torch.cuda._sleep(SLEEP_CYCLES)
            sums.append(batch.sum())  # queued behind the sleeps
            # Dropped while the sum is pending. The batch's memory came from the side stream's
            # pool: without record_stream, the stage's next copies (same size, on that stream)
            # would reuse it and overwrite it before the sum ran. (Allocations here, on the
            # consumer's stream, could not take it: the allocator keeps free blocks per stream.)
            del batch
    torch.cuda.synchronize()
    assert [int(s) for s in sums] == expected_sums(160, 8, width)


async def test_device_transform_runs_on_the_side_stream() -> None:
    streams: list[torch.cuda.Stream] = []

    def normalise(batch: dict[str, Any]) -> dict[str, Any]:
        streams.append(torch.cuda.current_stream())
        assert not torch.is_grad_enabled()
        return {**batch, "image": (batch["image"].float() - 128) / 64}

    dl = aioloader.DataLoader(
        Records(20), batch_size=5, pin_memory=True, device="cuda", device_transform=normalise
    )
    async with dl:
        got = [b async for b in dl]
        accelerator = dl._scope.device.accelerator if dl._scope and dl._scope.device else None
        side = getattr(accelerator, "_stream", None)
    assert side is not None and streams == [side] * 4
    assert side != torch.cuda.default_stream()
    async with aioloader.DataLoader(Records(20), batch_size=5) as plain:
        want = [b async for b in plain]
    for g, w in zip(got, want, strict=True):
        assert g["image"].dtype == torch.float32 and g["image"].device == cuda()
        assert torch.equal(g["image"].cpu(), (w["image"].float() - 128) / 64)


@pytest.mark.parametrize("prefetch", [1, 3])
async def test_at_most_prefetch_batches_are_on_the_device_ahead(prefetch: int) -> None:
    width = 1 << 17  # 1 MiB per sample, 4 MiB per batch
    batch_bytes = 4 * width * 8
    dl = aioloader.DataLoader(Rows(400, width), batch_size=4, prefetch=prefetch, device="cuda")
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    async with dl:
        it = aiter(dl)
        first = await anext(it)

        def ahead() -> int:
            s = dl.statistics()
            return s.stage("device").completed - s.consumer.batches

        with anyio.fail_after(30):
            while ahead() < prefetch:
                await anyio.lowlevel.checkpoint()
        for _ in range(300):
            await anyio.lowlevel.checkpoint()
        assert ahead() == prefetch
        held = torch.cuda.memory_allocated() - baseline  # the consumer's batch, and those ahead
        assert held <= (prefetch + 1) * batch_bytes * 1.01, (held, batch_bytes)
        del first
        count = 1 + sum([1 async for _ in it])
    assert count == 100
    assert dl.statistics().stage("device").max_queued == prefetch


async def test_break_and_cancel_leave_nothing_behind() -> None:
    dl = aioloader.DataLoader(Rows(400, 4096), batch_size=4, prefetch=2, device="cuda")
    async with dl:
        async for _ in dl:
            break
    assert other_tasks() == set() and aioloader_threads() == []
    with anyio.CancelScope() as scope:
        async with dl:
            async for _ in dl:
                scope.cancel()
                await anyio.lowlevel.checkpoint()
    assert scope.cancelled_caught
    assert other_tasks() == set() and aioloader_threads() == []
    async with dl:
        sums = [int(b.sum()) async for b in dl]
    assert sums == expected_sums(400, 4, 4096)


two_devices = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA devices (device 0 proves nothing)"
)


@two_devices
def test_local_rank_names_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    last = torch.cuda.device_count() - 1
    monkeypatch.setenv("LOCAL_RANK", str(last))
    assert aioloader.DataLoader(Counting(4), device="cuda").device == torch.device("cuda", last)
    assert aioloader.DataLoader(Counting(4), device="cuda:0").device == torch.device("cuda", 0)


@two_devices
async def test_the_stage_thread_allocates_on_the_chosen_device() -> None:
    # Asked outside the side stream's context (which switches to the stream's device itself):
    # only set_device at open() makes the stage thread's own current device the chosen one.
    def where() -> tuple[str, int]:
        return threading.current_thread().name, torch.cuda.current_device()

    last = torch.cuda.device_count() - 1
    dl = aioloader.DataLoader(Counting(8), batch_size=4, device=f"cuda:{last}")
    async with dl:
        stage = dl._scope.device if dl._scope else None
        assert stage is not None
        assert await stage._thread.run(where) == ("aioloader-device_0", last)
        got = [b async for b in dl]
        assert await stage._thread.run(where) == ("aioloader-device_0", last)
    assert [b.device for b in got] == [torch.device("cuda", last)] * 2


def _slow_side_stream(batch: Any) -> Any:
    torch.cuda._sleep(SLEEP_CYCLES)  # the next batch's copy waits behind this on the side stream
    return batch


def test_batches_copied_out_of_worker_blocks_are_right_while_the_side_stream_lags() -> None:
    """Worker blocks (``_workers/blocks.py``): each registered once, the batches copied to the
    device straight out of them (no pinned buffer taken), and a block goes back to its worker
    only after the copy out of it is done: with the side stream held up by
    ``device_transform``, a block handed back early would be overwritten under its copy."""
    from aioloader._workers.ledger import LEDGER
    from tests.workers.test_blocks import Frames, check_epoch

    dl = aioloader.DataLoader(
        Frames(), batch_size=16, shuffle=True, num_workers=2, persistent_workers=True,
        pin_memory=True, device="cuda", device_transform=_slow_side_stream,
    )  # fmt: skip
    with dl:
        for _ in range(3):
            assert sorted(check_epoch(dl)) == list(range(96))
        stage = dl._scope.device if dl._scope else None
        assert stage is not None and stage.pool is not None and stage.registrations is not None
        assert stage.pool.allocations == 0  # every batch came out of a registered block
        blocks = list(LEDGER._blocks.values())
        assert blocks and all(stage.registrations.ready(b) for b in blocks)
    assert stage.registrations.undone >= len(blocks)  # all undone as the scope closed


def test_pin_memory_without_device_copies_out_of_worker_blocks_into_pinned_batches() -> None:
    """``pin_memory=True`` alone with worker processes: the workers' batches come in their
    blocks, and the consumer gets pinned copies, right even while it keeps them all and the
    workers reuse their blocks (torch's recipe then: ``.to("cuda", non_blocking=True)``)."""
    from aioloader._workers.ledger import LEDGER, find_block
    from tests.workers.test_blocks import Frames

    dl = aioloader.DataLoader(
        Frames(), batch_size=16, shuffle=True, num_workers=2, persistent_workers=True,
        pin_memory=True,
    )  # fmt: skip
    kept = []
    with dl:
        for _ in range(3):
            for frames, indices in dl:
                assert frames.is_pinned() and indices.is_pinned() and find_block(frames) is None
                on_gpu = frames.to(cuda(), non_blocking=True)
                kept.append((frames, indices, on_gpu))
        stage = dl._scope.device if dl._scope else None
        assert stage is not None and stage.accelerator is None and stage.registrations is None
        pids = {w.pid for w in dl._scope.work._slots.now}  # type: ignore[union-attr]
        assert pids and pids <= {key[0] for key in LEDGER._blocks}  # their blocks mapped here
    torch.cuda.synchronize()
    seen = sorted(i for _, indices, _ in kept for i in indices.tolist())
    assert seen == sorted(3 * list(range(96)))
    for frames, indices, on_gpu in kept:
        assert torch.equal(frames[:, 0, 0, 0].long(), indices % 251)
        assert torch.equal(on_gpu.cpu(), frames)


class PinnableBatch:
    """torch's ``SimpleCustomBatch`` (``TestCustomPinFn``): pinned by its own method."""

    def __init__(self, samples: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.inp = torch.stack([inp for inp, _ in samples])
        self.tgt = torch.stack([tgt for _, tgt in samples])

    def pin_memory(self) -> PinnableBatch:
        self.inp, self.tgt = self.inp.pin_memory(), self.tgt.pin_memory()
        return self

    def is_pinned(self) -> bool:
        return self.inp.is_pinned() and self.tgt.is_pinned()


def packed(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    data = torch.stack([inp for inp, _ in samples], 1)
    lengths = torch.randint(1, data.size(0), size=(data.size(1),), dtype=torch.int64)
    return torch.nn.utils.rnn.pack_padded_sequence(data, lengths, enforce_sorted=False)


@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize("collate", [PinnableBatch, packed])
def test_custom_batch_types_are_pinned_by_their_own_method(collate: Any, num_workers: int) -> None:
    values = torch.arange(50, dtype=torch.float32).view(10, 5)
    dataset = torch.utils.data.TensorDataset(values, values)
    dl = aioloader.DataLoader(
        dataset, batch_size=2, collate_fn=collate, pin_memory=True, num_workers=num_workers
    )
    got = list(dl)
    assert len(got) == 5 and all(b.is_pinned() for b in got)
    kind = torch.nn.utils.rnn.PackedSequence if collate is packed else PinnableBatch
    assert all(type(b) is kind for b in got)


def test_registering_in_place_copies_at_pinned_speed_and_a_refusal_leaves_no_error() -> None:
    """``CudaAccelerator.register`` (the driver's call) on the thread that opened it: shared
    memory registered copies right with ``non_blocking``; a refusal (address 0) returns None
    and leaves no error pending for torch's next kernel launch on that thread."""
    from aioloader._device.accelerator import CudaAccelerator

    found: list[Any] = []

    def on_a_thread() -> None:
        acc = CudaAccelerator(cuda())
        acc.open()
        shared = torch.arange(1 << 22, dtype=torch.int64).share_memory_()
        undo = acc.register(shared.data_ptr(), shared.numel() * shared.element_size())
        assert undo is not None
        with acc.side():
            out = shared.to(cuda(), non_blocking=True)
            acc.record().synchronize()
        found.append(torch.equal(out.cpu(), shared))
        undo()
        assert acc.register(0, 4096) is None
        found.append(int((torch.ones(4, device=cuda()) + 1).sum()))  # a kernel launch
        acc.close()

    thread = threading.Thread(target=on_a_thread)
    thread.start()
    thread.join(30)
    assert found == [True, 8]


@pytest.mark.parametrize("persistent", [False, True])
def test_the_pin_memory_thread_ends_once_the_iterator_is_dropped(persistent: bool) -> None:
    """torch's ``test_partial_workers`` on a GPU: it joins the iterator's ``_pin_memory_thread``
    and its ``_workers`` after dropping the iterator part-way."""
    from tests.support import worker_datasets as wd

    it = iter(
        aioloader.DataLoader(
            wd.WhoReads(64), batch_size=2, num_workers=4, pin_memory=True,
            persistent_workers=persistent,
        )
    )  # fmt: skip
    workers, pin_thread = it._workers, it._pin_memory_thread
    for i, _ in enumerate(it):
        if i == 10:
            break
    assert pin_thread.is_alive()
    del it
    pin_thread.join(10)
    assert not pin_thread.is_alive()
    for w in workers:
        w.join(10)
        assert not w.is_alive()
