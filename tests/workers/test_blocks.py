"""Worker blocks (issue 25): a worker writes its result into a shared-memory block it reuses,
the main process maps each block once, the device stage registers it once and copies batches
straight out of it; a block goes back to its worker once nothing of its result is left."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest
import torch

import aioloader
from aioloader._device import stage as stage_module
from aioloader._device.hostcopy import HostCopy
from aioloader._device.plan import DevicePlan
from aioloader._device.stage import DeviceStage
from aioloader._workers import blocks as blocks_module
from aioloader._workers import fdpass
from aioloader._workers import ledger as ledger_module
from aioloader._workers.blocks import MIN_BYTES, BlockView, OutputBlocks
from aioloader._workers.ledger import LEDGER, Registrations, find_block
from aioloader._workers.result import JobResult
from tests.device.test_device import CopyingAccelerator, FakeAccelerator, on_fake_device

PID = os.getpid()


@pytest.fixture(autouse=True)
def _forget_this_process() -> Iterator[None]:
    """The tests below write blocks in this process: its keys leave the ledger after each."""
    yield
    gc.collect()
    LEDGER.forget(PID)


def crossed(blocks: OutputBlocks, data: Any) -> Any:
    """``data`` written into a block and sent as a worker sends it, unpickled here."""
    payload = ForkingPickler.dumps(blocks.write(data))
    blocks.sent()
    return pickle.loads(payload)


def big(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "images": torch.randint(0, 256, (16, 3, 64, 64), dtype=torch.uint8, generator=g),
        "features": torch.randn(256, 1024, generator=g),  # 1 MiB
        "half": torch.randn(301, generator=g).to(torch.bfloat16),
        "flags": torch.tensor([True, False, True]),
        "count": torch.tensor(seed),
        "complex": torch.randn(5, dtype=torch.complex64, generator=g),
        "name": f"batch {seed}",
    }


def tensors(data: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}


def test_a_result_crosses_in_one_block_with_its_values_dtypes_and_shapes() -> None:
    data = big(1)
    got = crossed(OutputBlocks(), data)
    assert got["name"] == "batch 1"
    places = set()
    for key, want in tensors(data).items():
        view = got[key]
        assert view.dtype == want.dtype and view.shape == want.shape, key
        assert torch.equal(view, want) and view.is_contiguous(), key
        assert view.data_ptr() % 64 == 0, key
        block = find_block(view)
        assert block is not None, key
        places.add(block.key)
    assert places == {(PID, 0)}  # every tensor of the result in the worker's first block


def test_small_or_ineligible_tensors_go_the_usual_way() -> None:
    small = {"x": torch.ones(1000), "y": torch.zeros(10)}  # 4 KiB: under MIN_BYTES
    assert OutputBlocks().write(small) is small
    base = torch.arange(float(MIN_BYTES // 4)).reshape(-1, 256)  # 1 MiB, contiguous
    grad = torch.ones(3, requires_grad=True)
    data = [torch.ones(MIN_BYTES // 4), base, base[0], base.t(), grad]
    written = OutputBlocks().write(data)
    assert isinstance(written[0], BlockView)  # the only eligible one
    assert written[1] is base and written[2] is data[2]  # they share a storage: left alone
    assert written[3] is data[3] and written[4] is grad  # not contiguous; needs grad


def test_a_block_goes_back_once_its_result_is_gone_and_travels_here_once() -> None:
    blocks = OutputBlocks(limit=2)
    first = blocks.write(big(1))
    assert first["images"].block is not None  # its first trip carries the block
    payload = ForkingPickler.dumps(first)
    blocks.sent()
    got = pickle.loads(payload)
    del first, payload
    assert LEDGER.freed(PID) == []  # its tensors are alive here
    second = crossed(blocks, big(2))  # block 0 is busy: a second block
    assert find_block(second["images"]).key == (PID, 1)  # type: ignore[union-attr]
    assert not isinstance(blocks.write(big(3))["images"], BlockView)  # both busy: limit 2
    keep = got["features"][3]  # a view of a view keeps the block too
    del got
    gc.collect()
    assert LEDGER.freed(PID) == []
    del keep
    gc.collect()
    freed = LEDGER.freed(PID)
    assert freed == [(PID, 0)] and LEDGER.freed(PID) == []  # told once
    blocks.free([(PID + 1, 0)])  # another process's key: not ours
    assert not isinstance(blocks.write(big(3))["images"], BlockView)
    blocks.free(freed)
    again = blocks.write(big(3))
    assert again["images"].block is None  # mapped here already: the key alone travels
    got = pickle.loads(ForkingPickler.dumps(again))
    blocks.sent()
    assert find_block(got["images"]).key == (PID, 0)  # type: ignore[union-attr]
    assert torch.equal(got["features"], big(3)["features"])


def test_a_reply_that_does_not_pickle_gives_its_block_back() -> None:
    blocks = OutputBlocks(limit=1)
    blocks.write(big(1))
    blocks.unsent()  # the worker could not pickle the reply
    assert isinstance(blocks.write(big(2))["images"], BlockView)  # the same block, free again


def test_a_block_registers_once_a_refusal_is_not_retried_and_a_gone_one_is_undone() -> None:
    calls: list[tuple[str, int]] = []

    def register(address: int, nbytes: int) -> Callable[[], object]:
        calls.append(("register", address))
        return lambda: calls.append(("unregister", address))

    registrations = Registrations(register)
    got = crossed(OutputBlocks(), big(1))
    block = find_block(got["images"])
    assert block is not None and block.nbytes % (1 << 20) == 0
    assert registrations.ready(block) and registrations.ready(block)
    address = block.address
    assert calls == [("register", address)]
    refusing = Registrations(lambda address, nbytes: calls.append(("refused", address)))
    assert not refusing.ready(block) and not refusing.ready(block)
    assert calls[1:] == [("refused", address)]  # not retried
    LEDGER.forget(PID)  # the worker is gone; the views still map the block
    del block
    gc.collect()
    registrations.let_go()
    assert ("unregister", address) not in calls  # its views are alive
    del got
    gc.collect()
    assert ("unregister", address) not in calls  # undone only on the stage's own call...
    registrations.let_go()
    assert calls[-1] == ("unregister", address) and registrations.undone == 1  # ...here
    registrations.close()
    assert registrations.undone == 1  # nothing left to undo


def test_closing_undoes_every_registration_even_of_blocks_still_mapped() -> None:
    undone: list[int] = []
    registrations = Registrations(lambda address, nbytes: lambda: undone.append(address))
    got = crossed(OutputBlocks(), big(1))
    block = find_block(got["images"])
    assert block is not None and registrations.ready(block)
    registrations.close()
    assert undone == [block.address]
    del block, got
    gc.collect()
    registrations.let_go()
    assert undone == [undone[0]]  # not twice


def test_a_tensor_twice_arrives_once_and_dense_layouts_keep_their_strides() -> None:
    image = torch.randn(16, 3, 64, 64).contiguous(memory_format=torch.channels_last)
    permuted = torch.randn(64, 32, 128).permute(2, 0, 1)
    data = {"a": image, "b": image, "p": permuted, "gapped": torch.randn(64, 64)[:, ::2]}
    got = crossed(OutputBlocks(), data)
    assert got["a"] is got["b"]
    for key in ("a", "p"):
        want = data[key]
        assert torch.equal(got[key], want) and got[key].stride() == want.stride(), key
        assert find_block(got[key]) is not None, key
    assert torch.equal(got["gapped"], data["gapped"])
    assert find_block(got["gapped"]) is None  # not dense: the usual way


def test_a_larger_batch_replaces_a_free_block_too_small_under_the_same_key() -> None:
    blocks = OutputBlocks(limit=1)
    small = crossed(blocks, {"x": torch.ones(MIN_BYTES, dtype=torch.uint8)})
    del small
    gc.collect()
    blocks.free(LEDGER.freed(PID))
    large = torch.arange(3 * MIN_BYTES, dtype=torch.int64) % 7
    written = blocks.write({"x": large})
    assert written["x"].block is not None  # the new block travels, under the old key
    got = pickle.loads(ForkingPickler.dumps(written))
    blocks.sent()
    block = find_block(got["x"])
    assert block is not None and block.key == (PID, 0) and block.nbytes >= large.nbytes
    assert torch.equal(got["x"], large)


def test_a_result_with_a_sparse_tensor_alone_goes_the_usual_way() -> None:
    sparse = torch.eye(2048).to_sparse()
    assert OutputBlocks().write([sparse])[0] is sparse


def test_a_view_of_a_block_never_mapped_here_is_an_error_naming_it() -> None:
    with pytest.raises(RuntimeError, match=f"worker {PID}'s block 99 came without its memory"):
        LEDGER.view((PID, 99), None, 0, torch.uint8, (4,))


# -- through worker processes to a (CPU) device stage --------------------------------------------


class Frames(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """Each sample a 3x224x224 uint8 frame filled with its index (mod 251): a batch of 16 is
    2.4 MB, over MIN_BYTES."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.full((3, 224, 224), index % 251, dtype=torch.uint8), index


def check_epoch(loader: aioloader.DataLoader[Any], stop_after: int | None = None) -> list[int]:
    seen: list[int] = []
    for k, (frames, indices) in enumerate(loader):
        assert frames.shape == (16, 3, 224, 224)
        assert torch.equal(frames[:, 0, 0, 0].long(), indices % 251)
        assert torch.equal(frames.amin(dim=(1, 2, 3)), frames.amax(dim=(1, 2, 3)))
        seen += indices.tolist()
        if stop_after is not None and k + 1 == stop_after:
            break
    return seen


def host_copies(fake: CopyingAccelerator) -> int:
    return sum(1 for kind, *_ in fake.log if kind == "host")


def test_batches_come_straight_out_of_worker_blocks_registered_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loader = aioloader.DataLoader(
        Frames(), batch_size=16, shuffle=True, num_workers=2, persistent_workers=True
    )
    fake = on_fake_device(loader, CopyingAccelerator())
    assert isinstance(fake, CopyingAccelerator)
    with loader:
        for _ in range(3):
            assert sorted(check_epoch(loader)) == list(range(96))
        pids = [w.pid for w in loader._state.scope.work._slots.now]  # type: ignore[union-attr]
    assert host_copies(fake) == 0  # every batch went to the device out of its block
    assert 2 <= len(fake.registered) <= 2 * blocks_module.PER_WORKER
    assert len({address for address, _ in fake.registered}) == len(fake.registered)
    gc.collect()
    assert sorted(fake.unregistered) == sorted(a for a, _ in fake.registered)  # all undone
    assert all(key[0] not in pids for key in LEDGER._blocks)


def test_a_device_that_refuses_registration_gets_its_batches_through_the_pinned_pool() -> None:
    loader = aioloader.DataLoader(Frames(), batch_size=16, num_workers=2)
    refusing = CopyingAccelerator()
    refusing.refuse = True
    on_fake_device(loader, refusing)
    assert check_epoch(loader) == list(range(96))
    assert host_copies(refusing) == 12  # each batch's two tensors copied into a pinned buffer
    assert refusing.registered == []


def test_an_epoch_left_early_gives_its_blocks_back() -> None:
    """Batches dropped by a break (in flight, ready, staged) free their blocks: after the
    epoch that follows (whose first batches may find some not yet back, and go the usual
    way), no batch goes the usual way, epoch after epoch."""
    loader = aioloader.DataLoader(Frames(), batch_size=16, num_workers=2, persistent_workers=True)
    fake = on_fake_device(loader, CopyingAccelerator())
    assert isinstance(fake, CopyingAccelerator)
    with loader:
        assert check_epoch(loader, stop_after=1) == list(range(16))
        assert check_epoch(loader) == list(range(96))
        settled = host_copies(fake)
        # Blocks of the batches the break dropped come back as their views are collected, a
        # dropped one in a cycle only at the collector's next pass: in 12 runs the epoch after
        # sent 0 batches the usual way 11 times and 1 once, and 4 of its 6 in runs that failed
        # a bound of 2 (about 1 in 8, also at c338250). Not all of them, though: blocks came
        # back during it. The leak checks are the full epochs below.
        assert settled < 6 * 2  # fewer than the epoch's six batches of two tensors
        for _ in range(4):
            assert check_epoch(loader, stop_after=3) == list(range(48))  # left early too
            assert check_epoch(loader) == list(range(96))
        before = host_copies(fake)
        assert check_epoch(loader) == list(range(96))  # a full epoch after a full one
        last = host_copies(fake) - before
    # None leaked: a leaked block would send every batch after it the usual way (12 tensors a
    # full epoch, 48 over the rounds); the epochs' starts may send some (20 and 22 seen on a
    # busy machine, 30 on a very busy one), and a full epoch after a full one as few as the
    # first did.
    assert host_copies(fake) - last < settled + 4 * 12
    assert last <= 2 * 2
    assert len(fake.registered) <= 2 * blocks_module.PER_WORKER


def test_without_a_pinning_device_stage_the_workers_use_no_blocks() -> None:
    """Unpinned to a device: the usual sharing (no block mapped here while the epochs run)."""
    loader = aioloader.DataLoader(Frames(), batch_size=16, num_workers=2, persistent_workers=True)
    fake = on_fake_device(loader, FakeAccelerator(), pin=False)
    with loader:
        assert check_epoch(loader) == list(range(96))
        assert fake.registered == [] and not [k for k in LEDGER._blocks if k[0] != PID]


@pytest.fixture
def host_pinning(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Pinning on the host only, made to run without CUDA (the pinned allocation an ordinary
    one: torch pins only with a device); the list says, for each batch of frames the stage
    copied, whether it copied it out of a worker's block."""
    sources: list[bool] = []
    real_copy = HostCopy.copy

    def copy(self: HostCopy, dst: torch.Tensor, src: torch.Tensor) -> None:
        if src.dim() == 4:  # the frames; their indices are under MIN_BYTES with them anyway
            sources.append(find_block(src) is not None)
        real_copy(self, dst, src)

    monkeypatch.setattr(HostCopy, "copy", copy)
    monkeypatch.setattr(stage_module, "page_locked", lambda shape, strides, dtype: (
        torch.empty_strided(shape, strides, dtype=dtype)
    ))  # fmt: skip
    return sources


def pinning_on_the_host(loader: aioloader.DataLoader[Any]) -> aioloader.DataLoader[Any]:
    loader._plan = dataclasses.replace(loader._plan, device_plan=DevicePlan(None, True))
    return loader


@pytest.mark.parametrize("lasting", ["persistent_workers", "with"])
def test_pinning_on_the_host_only_reads_batches_out_of_blocks_where_workers_outlive_an_epoch(
    lasting: str, host_pinning: list[bool]
) -> None:
    """``pin_memory=True`` without ``device``, workers kept across epochs (persistent, or a
    ``with loader:`` scope): the stage copies each batch out of its worker's block (mapped
    once here) into pinned memory and hands out the copy, so batches the consumer keeps stay
    right while the workers reuse their blocks."""
    loader = pinning_on_the_host(aioloader.DataLoader(
        Frames(), batch_size=16, shuffle=True, num_workers=2,
        persistent_workers=lasting == "persistent_workers",
    ))  # fmt: skip
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    with loader if lasting == "with" else contextlib.nullcontext():
        for _ in range(3):
            epoch = []
            for frames, indices in loader:
                assert find_block(frames) is None  # the stage's copy, not the block
                epoch.append((frames, indices))
            assert sorted(torch.cat([i for _, i in epoch]).tolist()) == list(range(96))
            kept += epoch
        assert {k[0] for k in LEDGER._blocks if k[0] != PID} == {
            w.pid
            for w in loader._state.scope.work._slots.now  # type: ignore[union-attr]
        }  # each worker's blocks mapped here
        assert len([k for k in LEDGER._blocks if k[0] != PID]) <= 2 * blocks_module.PER_WORKER
    loader.close()
    assert len(host_pinning) == 18 and all(host_pinning[6:])  # the first epoch's may find none
    for frames, indices in kept:  # copies: the blocks' later batches did not overwrite them
        assert torch.equal(frames[:, 0, 0, 0].long(), indices % 251)
        assert torch.equal(frames.amin(dim=(1, 2, 3)), frames.amax(dim=(1, 2, 3)))


class LongFrames(Frames):
    """Frames, 4 times as many: 24 batches of 16, 12 for each of 2 workers."""

    def __len__(self) -> int:
        return 384


def test_pinning_on_the_host_only_in_a_plain_for_uses_blocks_where_each_worker_makes_many(
    host_pinning: list[bool],
) -> None:
    """A plain ``for`` without ``with`` or persistent workers (torch's default): workers that
    make fewer than ``REUSED_FROM`` batches each in their epoch would not live to reuse a
    block, so none is made; those that make more use them."""
    assert 96 // 16 < blocks_module.REUSED_FROM * 2 <= 384 // 16
    short = pinning_on_the_host(aioloader.DataLoader(Frames(), batch_size=16, num_workers=2))
    for _ in range(2):
        assert sorted(check_epoch(short)) == list(range(96))
    assert host_pinning == 12 * [False] and not [k for k in LEDGER._blocks if k[0] != PID]

    host_pinning.clear()
    long = pinning_on_the_host(aioloader.DataLoader(LongFrames(), batch_size=16, num_workers=2))
    assert sorted(i % 96 for i in check_epoch(long)) == sorted(4 * list(range(96)))
    assert len(host_pinning) == 24 and sum(host_pinning) >= 24 - 2 * blocks_module.PER_WORKER


class FrameBatch(Mapping[str, torch.Tensor]):
    """A read-only mapping batch type with its own ``pin_memory``, built from its two fields
    (not from a dict): torch's pinning calls the method and never rebuilds it."""

    def __init__(self, frames: torch.Tensor, indices: torch.Tensor) -> None:
        self.frames, self.indices, self.pinned = frames, indices, False

    def __getitem__(self, key: str) -> torch.Tensor:
        return {"frames": self.frames, "indices": self.indices}[key]

    def __iter__(self) -> Iterator[str]:
        return iter(("frames", "indices"))

    def __len__(self) -> int:
        return 2

    def pin_memory(self) -> FrameBatch:
        self.pinned = True
        return self


def frame_batch(samples: list[tuple[torch.Tensor, int]]) -> FrameBatch:
    frames, indices = torch.utils.data.default_collate(samples)
    return FrameBatch(frames, indices)


def test_a_batch_type_with_its_own_pin_memory_reaches_it_whole_from_the_workers(
    host_pinning: list[bool],
) -> None:
    """Blocks do not walk into an object that pinning hands to its own method: it arrives as
    the worker made it (found by review: a read-only mapping became a ``dict``)."""
    loader = pinning_on_the_host(aioloader.DataLoader(
        Frames(), batch_size=16, num_workers=2, persistent_workers=True, collate_fn=frame_batch
    ))  # fmt: skip
    for _ in range(2):
        batches = list(loader)
        assert {type(b) for b in batches} == {FrameBatch} and all(b.pinned for b in batches)
        assert torch.cat([b["indices"] for b in batches]).tolist() == list(range(96))
        assert all(torch.equal(b["frames"][:, 0, 0, 0].long(), b["indices"]) for b in batches)
    loader.close()
    assert host_pinning == []  # pinned by its method: the stage copied nothing


def test_blocks_leave_no_descriptor_behind() -> None:
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def epochs() -> None:
        loader = aioloader.DataLoader(
            Frames(), batch_size=16, num_workers=2, persistent_workers=True
        )
        on_fake_device(loader, FakeAccelerator())
        with loader:
            for _ in range(2):
                check_epoch(loader)
        gc.collect()

    epochs()  # torch's resource sharer starts once per process
    before = open_fds()
    epochs()
    assert open_fds() == before


def test_a_killed_worker_s_blocks_are_forgotten_and_its_replacement_gets_its_own() -> None:
    loader = aioloader.DataLoader(Frames(), batch_size=16, num_workers=2, persistent_workers=True)
    fake = on_fake_device(loader, FakeAccelerator())
    with loader:
        assert check_epoch(loader) == list(range(96))
        slots = loader._state.scope.work._slots  # type: ignore[union-attr]
        dead = slots.now[0].pid
        assert any(key[0] == dead for key in LEDGER._blocks)
        os.kill(dead, signal.SIGKILL)
        slots.now[0].process.join(10)  # dead while idle: noticed as its next job is sent
        for _ in range(2):
            assert check_epoch(loader) == list(range(96))
        fresh = slots.now[0].pid
        assert fresh != dead and any(key[0] == fresh for key in LEDGER._blocks)
        assert not any(key[0] == dead for key in LEDGER._blocks)
    gc.collect()
    assert sorted(fake.unregistered) == sorted(a for a, _ in fake.registered)


# -- a side stream that lags: no block goes back while a copy out of it may still run ----------


class LaggingAccelerator(CopyingAccelerator):
    """Each event completes ``lag`` seconds after the one before it (a side stream behind the
    host); remembers, for each block, until when copies out of it may still run, and records
    every block handed back to its worker before that (``early``) and each thread that
    registered or undid a registration."""

    def __init__(self, lag: float = 0.02) -> None:
        super().__init__()
        self.lag = lag
        self.last = 0.0
        self.pending: list[Any] = []  # blocks copied from since the last event
        self.busy_until: dict[int, float] = {}  # block token -> when its copies are done
        self.early: list[Any] = []
        self.threads: set[str] = set()

    def copied(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        super().copied(dst, src, non_blocking)
        if (block := find_block(src)) is not None:
            self.pending.append(block)

    def record(self) -> Any:
        super().record()
        self.last = max(self.last, time.monotonic()) + self.lag
        for block in self.pending:
            self.busy_until[block.token] = self.last
        self.pending.clear()
        return TimedEvent(self.last)

    def hand_over(self, event: Any, tensors: Any) -> None:
        event.synchronize()  # the consumer's stream waits for the copies

    def register(self, address: int, nbytes: int) -> Callable[[], None] | None:
        self.threads.add(threading.current_thread().name)
        undo = super().register(address, nbytes)
        assert undo is not None

        def unregister() -> None:
            self.threads.add(threading.current_thread().name)
            undo()

        return unregister

    def close(self) -> None:
        super().close()
        TimedEvent(self.last).synchronize()


class TimedEvent:
    def __init__(self, at: float) -> None:
        self.at = at

    def query(self) -> bool:
        return time.monotonic() >= self.at

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.at - time.monotonic()))


@pytest.fixture
def watched(monkeypatch: pytest.MonkeyPatch) -> LaggingAccelerator:
    """A lagging accelerator whose blocks, as each is handed back, must have no copy running."""
    fake = LaggingAccelerator()
    handed_back = ledger_module.BlockLedger.freed_now

    def freed_now(ledger: ledger_module.BlockLedger, block: ledger_module.Block) -> None:
        if block in fake.pending or fake.busy_until.get(block.token, 0.0) > time.monotonic():
            fake.early.append(block.key)
        handed_back(ledger, block)

    monkeypatch.setattr(ledger_module.BlockLedger, "freed_now", freed_now)
    return fake


def test_no_block_goes_back_while_a_copy_out_of_it_may_run(watched: LaggingAccelerator) -> None:
    loader = aioloader.DataLoader(
        Frames(), batch_size=16, shuffle=True, num_workers=2, persistent_workers=True
    )
    on_fake_device(loader, watched)
    with loader:
        assert len(check_epoch(loader, stop_after=2)) == 32  # left early: batches dropped
        for _ in range(3):
            assert sorted(check_epoch(loader)) == list(range(96))
    assert len(watched.busy_until) >= 2 and watched.early == []
    assert {name.rsplit("_", 1)[0] for name in watched.threads} == {"aioloader-device"}


@contextlib.asynccontextmanager
async def opened_stage(fake: FakeAccelerator) -> AsyncIterator[DeviceStage]:
    """A device stage on ``fake`` that pins, open; closed (its copies done) on the way out."""
    stage = DeviceStage(DevicePlan(lambda: fake, True), depth=1)
    await stage.open()
    try:
        yield stage
    finally:
        await stage.aclose()


class Boom(torch.Tensor):
    """A tensor whose move to the device fails, as a full device does."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.to:
            raise torch.OutOfMemoryError("pretend the device is full")
        return super().__torch_function__(func, types, args, kwargs or {})


async def test_a_batch_that_fails_on_its_way_holds_its_blocks_until_its_copies_are_done() -> None:
    """A later tensor of the batch fails after a copy out of a block was issued: the block is
    held until the copies issued are done (an event recorded after them), not handed back."""
    fake = FakeAccelerator(complete=False)  # the copies stay "in flight"
    async with opened_stage(fake) as stage:
        got = crossed(OutputBlocks(), {"x": torch.ones(MIN_BYTES, dtype=torch.uint8)})
        batch = {"x": got["x"], "y": torch.zeros(3).as_subclass(Boom)}
        del got
        with pytest.raises(torch.OutOfMemoryError) as raised:
            await stage.stage(batch)
        traceback.clear_frames(raised.tb)  # the failed call's frames held the batch too
        del batch, raised
        gc.collect()
        assert len(fake.events) == 1 and LEDGER.freed(PID) == []  # held: the copy may run
    gc.collect()  # closed: the side stream synchronized, the block goes back
    assert LEDGER.freed(PID) == [(PID, 0)]


class SomeUnpicklable(aioloader.AsyncDataset[tuple[Any, ...]]):
    """Frames read in this process; every other batch's first sample carries a lambda, so that
    batch's job cannot be pickled for the worker."""

    def __len__(self) -> int:
        return 16 * 12

    async def get(self, index: int) -> tuple[Any, ...]:
        frame = torch.full((3, 224, 224), index % 251, dtype=torch.uint8)
        return (frame, index, lambda: None) if index % 32 == 16 else (frame, index)


def stack(samples: list[tuple[Any, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([s[0] for s in samples]), torch.tensor([s[1] for s in samples])


async def test_blocks_freed_for_a_job_that_could_not_be_sent_go_with_the_next_one() -> None:
    loader = aioloader.DataLoader(SomeUnpicklable(), batch_size=16, num_workers=1, collate_fn=stack)
    fake = on_fake_device(loader, CopyingAccelerator())
    assert isinstance(fake, CopyingAccelerator)
    good, failed = 0, 0
    async with loader:
        batches = loader.__aiter__()
        for _ in range(24):  # bounded: 12 batches, each given or failed in its turn
            try:
                frames, indices = await batches.__anext__()
            except StopAsyncIteration:
                break
            except AttributeError as exc:  # the lambda does not pickle: the batch fails
                failed += any("as the job was pickled" in note for note in exc.__notes__)
                continue
            assert torch.equal(frames[:, 0, 0, 0].long(), indices % 251)
            good += 1
    assert (good, failed) == (6, 6)
    assert host_copies(fake) == 0  # no block was lost: none of the good ones fell back


def test_a_reply_whose_packing_fails_gives_its_block_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from aioloader._workers import worker as worker_module
    from aioloader._workers.result import JobResult

    blocks = OutputBlocks(limit=1)
    monkeypatch.setattr(worker_module, "_blocks", blocks)

    def full(data: Any) -> Any:
        raise RuntimeError("no room in /dev/shm")

    monkeypatch.setattr(worker_module, "pack_tensors", full)
    result = JobResult(batch={"x": torch.ones(MIN_BYTES, dtype=torch.uint8)}, size=1)
    with pytest.raises(RuntimeError, match="no room"):
        worker_module._into_blocks(result)
    assert isinstance(blocks.write({"x": torch.ones(MIN_BYTES, dtype=torch.uint8)})["x"], BlockView)


def test_a_forgotten_worker_s_result_never_frees_the_block_of_a_new_worker_with_its_pid() -> None:
    got = crossed(OutputBlocks(), big(1))
    LEDGER.forget(PID)  # the worker died; a new worker got its pid
    fresh = crossed(OutputBlocks(), big(2))  # the new worker's block 0: the same key
    del got
    gc.collect()
    assert LEDGER.freed(PID) == []  # else the new worker would write over `fresh`
    assert torch.equal(fresh["features"], big(2)["features"])


def _unpicklable_reply() -> JobResult:
    return JobResult(batch={"x": torch.ones(MIN_BYTES, dtype=torch.uint8)}, state=lambda: None)


def test_a_job_whose_reply_does_not_pickle_gives_its_block_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aioloader._workers import worker as worker_module

    blocks = OutputBlocks(limit=1)
    monkeypatch.setattr(worker_module, "_blocks", blocks)
    job = bytes(fdpass.HEADER) + pickle.dumps((_unpicklable_reply, (), None, []))  # no fds
    message, passing = worker_module._run_job(job, [])
    ok, _ = fdpass.loads(message, passing.handed())
    assert not ok  # the reply says why it could not be sent
    assert isinstance(blocks.write({"x": torch.ones(MIN_BYTES, dtype=torch.uint8)})["x"], BlockView)


async def test_a_gone_block_is_unregistered_at_the_stage_s_next_batch() -> None:
    fake = CopyingAccelerator()
    async with opened_stage(fake) as stage:
        got = crossed(OutputBlocks(), {"x": torch.ones(MIN_BYTES, dtype=torch.uint8)})
        await stage.stage({"x": got["x"]})
        assert len(fake.registered) == 1
        LEDGER.forget(PID)  # its worker is gone
        del got
        await stage.stage({"y": torch.zeros(4)})  # the copy is done: its tensor let go
        gc.collect()
        await stage.stage({"y": torch.zeros(4)})  # the block gone: its registration undone
        assert fake.unregistered == [fake.registered[0][0]]  # before the stage closes


def mapped(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            low, high = (int(x, 16) for x in line.split()[0].split("-"))
            if low <= address < high:
                return True
    return False


def test_a_registered_block_stays_mapped_until_its_registration_is_undone() -> None:
    undone: list[bool] = []
    registrations = Registrations(lambda address, nbytes: lambda: undone.append(mapped(address)))
    got = crossed(OutputBlocks(), big(1))
    block = find_block(got["images"])
    assert block is not None and registrations.ready(block)
    address = block.address
    LEDGER.forget(PID)
    del block, got
    gc.collect()
    assert mapped(address)  # gone, not yet undone: still mapped
    registrations.let_go()
    assert undone == [True]  # mapped while it was undone
    gc.collect()
    assert not mapped(address)  # unmapped after


def test_an_eligible_tensor_viewed_by_an_ineligible_one_keeps_its_aliasing() -> None:
    x = torch.arange(MIN_BYTES // 4, dtype=torch.float32).reshape(512, -1)
    data = {"x": x, "gapped": x[:, ::2], "s": torch.eye(4).to_sparse()}
    written = OutputBlocks().write(data)
    assert written["x"] is x and written["gapped"] is data["gapped"]  # torch's sharing keeps it


def test_a_block_whose_write_fails_is_free_again(monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = OutputBlocks(limit=1)
    real = blocks_module.np.copyto

    def failing(*args: Any, **kwargs: Any) -> None:
        raise MemoryError("pretend the copy failed")

    monkeypatch.setattr(blocks_module.np, "copyto", failing)
    with pytest.raises(MemoryError):
        blocks.write(big(1))
    monkeypatch.setattr(blocks_module.np, "copyto", real)
    assert isinstance(blocks.write(big(2))["images"], BlockView)  # the one block, free again


class NoEvents(FakeAccelerator):
    """Recording an event fails (a broken device): nothing is known to be done."""

    def record(self) -> Any:
        raise RuntimeError("pretend the device broke")


async def test_without_an_event_a_block_is_held_until_the_stage_closes() -> None:
    fake = NoEvents()
    async with opened_stage(fake) as stage:
        got = crossed(OutputBlocks(), {"x": torch.ones(MIN_BYTES, dtype=torch.uint8)})
        with pytest.raises(RuntimeError, match="device broke") as raised:
            await stage.stage({"x": got["x"]})
        traceback.clear_frames(raised.tb)
        del got, raised
        gc.collect()
        assert LEDGER.freed(PID) == []  # its copy may still run: held
    gc.collect()
    assert LEDGER.freed(PID) == [(PID, 0)]
