"""A worker's result crosses as one shared-memory block: tensors packed, nothing else changed."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

import aioloader
from aioloader._workers.pack import pack_tensors
from tests.support import worker_fns
from tests.support.helpers import bare_pool, shared_memory_fds


class Pair(NamedTuple):
    image: torch.Tensor
    label: torch.Tensor


def storages(tensors: list[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_tensors_share_one_block_and_keep_values_dtypes_and_shapes() -> None:
    data: dict[str, Any] = {
        "images": [torch.arange(7, dtype=torch.uint8), torch.ones(3, 5, dtype=torch.float64)],
        "pair": Pair(torch.tensor([True, False, True]), torch.tensor(3)),
        "name": "batch",
    }
    packed = pack_tensors(data)
    flat = [*packed["images"], *packed["pair"]]
    assert len(storages(flat)) == 1 and flat[0].untyped_storage().is_shared()
    assert isinstance(packed["pair"], Pair) and packed["name"] == "batch"
    originals = [*data["images"], *data["pair"]]
    for got, want in zip(flat, originals, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
        assert got.data_ptr() % 64 == 0


def test_what_cannot_be_packed_is_left_as_it_is() -> None:
    base = torch.arange(12.0).reshape(3, 4)
    grad = torch.ones(2, requires_grad=True)
    data = [base, base[0], base.t(), grad, torch.empty(0), torch.ones(2), torch.zeros(2)]
    packed = pack_tensors(data)
    assert packed[0] is base and packed[1] is data[1]  # they alias: torch keeps the aliasing
    assert packed[2] is data[2] and packed[3] is grad and packed[4] is data[4]
    assert len(storages(packed[5:])) == 1 and torch.equal(packed[6], torch.zeros(2))
    single = [torch.ones(3), "x"]
    assert pack_tensors(single) is single  # one tensor: torch's own sharing is as good


def test_a_workers_batch_of_tensors_arrives_in_one_block() -> None:
    loader: aioloader.DataLoader[list[torch.Tensor]] = aioloader.DataLoader(
        list(range(16)), batch_size=8, num_workers=1, transform=worker_fns.image, collate_fn=list
    )
    batches = list(loader)
    assert len(batches) == 2
    for k, batch in enumerate(batches):
        assert len(storages(batch)) == 1
        for i, image in enumerate(batch):
            assert torch.equal(image, worker_fns.image(8 * k + i))


def test_strides_of_size_one_dimensions_and_large_tensors_are_kept() -> None:
    odd = torch.ones(3, 7)[:, :1]  # shape (3, 1), stride (7, 1): "contiguous" to torch
    column = torch.arange(3.0).reshape(3, 1).as_strided((3, 1), (1, 7))
    large = torch.zeros(300_000)  # 1.2 MB: shared on its own
    small = [torch.ones(2), torch.zeros(3)]
    packed = pack_tensors([odd, column, large, *small])
    assert packed[0] is odd
    assert packed[1].stride() == (1, 7) and packed[1] is column
    assert packed[2] is large
    assert len(storages(packed[3:])) == 1


def test_a_sparse_tensor_beside_others_is_left_to_torch() -> None:
    sparse = torch.eye(4).to_sparse()
    packed = pack_tensors([sparse, torch.ones(2), torch.zeros(3)])
    assert packed[0] is sparse and len(storages(packed[1:])) == 1


def test_a_job_s_tensors_are_packed_whatever_their_number_and_size() -> None:
    """As a job packs them (``ProcessWorkers._send``): one tensor, of any size, goes into a
    block of its own; the original is not moved to shared memory."""
    large = torch.ones(3 << 20, dtype=torch.uint8)  # 3 MiB: over a reply's limit
    packed = pack_tensors((large,), at_least=1, most=None)
    assert packed[0] is not large and packed[0].untyped_storage().is_shared()
    assert not large.untyped_storage().is_shared() and torch.equal(packed[0], large)


class Cached(aioloader.AsyncDataset[torch.Tensor]):
    """Samples the loader's process holds (an in-memory cache)."""

    def __init__(self, n: int) -> None:
        self.held = [torch.full((4,), float(i)) for i in range(n)]

    def __len__(self) -> int:
        return len(self.held)

    async def get(self, index: int) -> torch.Tensor:
        return self.held[index]


def test_samples_a_worker_transforms_stay_the_main_process_s_own() -> None:
    """A job's tensors cross in a block of the job's own. torch's sharing moved each cached
    sample to a shared-memory segment of its own where it was: the main process held a
    descriptor per sample for as long as the dataset lived (1,280 for 1,280 samples), and a
    transform that changed its sample in place changed the dataset's."""
    dataset = Cached(200)
    before = shared_memory_fds()
    loader = aioloader.DataLoader(
        dataset, batch_size=8, num_workers=2, transform=worker_fns.bumped, collate_fn=list
    )
    got = sorted(float(t[0]) for batch in loader for t in batch)
    assert got == [i + 1.0 for i in range(200)]  # bumped in the worker
    assert [float(t[0]) for t in dataset.held] == [float(i) for i in range(200)]
    assert not any(t.untyped_storage().is_shared() for t in dataset.held)
    assert shared_memory_fds() <= before + 4  # not one per sample


async def test_rows_of_one_tensor_and_a_permuted_view_in_a_job_are_copied_strides_kept() -> None:
    """Two rows of a dataset's tensor in one job share its storage: torch's sharing moved the
    whole tensor to shared memory, where it stayed; a permuted view (a cached CHW view of an
    HWC image) too. Each is copied into the job's block now, a dense view with its strides."""
    table = torch.zeros(100, 100)
    image = torch.zeros(8, 8, 3).permute(2, 0, 1)
    pool = bare_pool()
    await pool.start()
    try:
        back = await pool.run(worker_fns.add_one_in_place, [table[0], table[1], image])
    finally:
        await pool.aclose()
    assert [float(t.min()) for t in back] == [1.0, 1.0, 1.0]  # changed in the worker's copies
    assert back[2].stride() == image.stride()
    assert not table.untyped_storage().is_shared() and float(table.abs().sum()) == 0.0
    assert not image.untyped_storage().is_shared() and float(image.abs().sum()) == 0.0
