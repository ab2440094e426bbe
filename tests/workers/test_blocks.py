"""Worker blocks (issue 25): a worker writes its result into a shared-memory block it reuses,
the main process maps each block once, the device stage registers it once and copies batches
straight out of it; a block goes back to its worker once nothing of its result is left."""

from __future__ import annotations

import gc
import os
import pickle
import signal
from collections.abc import Callable, Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest
import torch

import aioloader
from aioloader._workers import blocks as blocks_module
from aioloader._workers.blocks import LEDGER, MIN_BYTES, BlockView, OutputBlocks, find_block
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


def test_a_block_registers_once_a_refusal_is_not_retried_and_dropping_it_undoes_it() -> None:
    calls: list[tuple[str, int]] = []

    def register(address: int, nbytes: int) -> Callable[[], object]:
        calls.append(("register", nbytes))
        return lambda: calls.append(("unregister", address))

    got = crossed(OutputBlocks(), big(1))
    block = find_block(got["images"])
    assert block is not None
    assert block.registered(register) and block.registered(register)
    assert calls == [("register", block.nbytes)] and block.nbytes % (1 << 20) == 0
    other = blocks_module.Block((PID, 7), torch.empty(1 << 20, dtype=torch.uint8), LEDGER)
    refusals: list[int] = []
    assert not other.registered(lambda a, n: refusals.append(n))  # returns None: refused
    assert not other.registered(lambda a, n: refusals.append(n)) and refusals == [1 << 20]
    address = block.address
    LEDGER.forget(PID)  # the worker is gone; the views still map the block
    del block
    gc.collect()
    assert ("unregister", address) not in calls
    del got
    gc.collect()
    assert calls[-1] == ("unregister", address)


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
    """Batches dropped by a break (in flight, ready, staged) free their blocks: the epochs
    after it still find free blocks, so none of their batches goes the usual way."""
    loader = aioloader.DataLoader(Frames(), batch_size=16, num_workers=2, persistent_workers=True)
    fake = on_fake_device(loader, CopyingAccelerator())
    assert isinstance(fake, CopyingAccelerator)
    with loader:
        assert check_epoch(loader, stop_after=1) == list(range(16))
        for _ in range(4):
            assert check_epoch(loader) == list(range(96))
    assert host_copies(fake) == 0
    assert len(fake.registered) <= 2 * blocks_module.PER_WORKER


def test_without_a_pinning_device_stage_the_workers_use_no_blocks() -> None:
    """Pinned on the host only, or unpinned to a device: the usual sharing."""
    loader = aioloader.DataLoader(Frames(), batch_size=16, num_workers=2)
    fake = on_fake_device(loader, FakeAccelerator(), pin=False)
    assert check_epoch(loader) == list(range(96))
    assert fake.registered == [] and not [k for k in LEDGER._blocks if k[0] != PID]


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
