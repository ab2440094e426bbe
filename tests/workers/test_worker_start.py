"""A worker's start arguments, as torch's idioms use them: ``worker_init_fn`` a method of the
dataset sets up the worker's own copy (both arrive in one pickle), and a tensor both hold
crosses once (spawn refuses a descriptor given twice). Pickling the two apart breaks both."""

from __future__ import annotations

import functools

import pytest
import torch

import aioloader


class Sharded(torch.utils.data.Dataset[int]):
    def __init__(self) -> None:
        self.offset = 0

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i + self.offset

    def init_worker(self, worker_id: int) -> None:
        self.offset = 1000 * (worker_id + 1)


@pytest.mark.parametrize("context", ["forkserver", "spawn"])
def test_worker_init_fn_a_method_of_the_dataset_sets_up_the_worker_s_copy(context: str) -> None:
    """torch's idiom: the bound method and the dataset arrive in one pickle, one object."""
    dataset = Sharded()
    loader = aioloader.DataLoader(
        dataset,
        batch_size=2,
        num_workers=1,
        worker_init_fn=dataset.init_worker,
        multiprocessing_context=context,
    )
    assert [b.tolist() for b in loader] == [[1000, 1001], [1002, 1003]]
    assert dataset.offset == 0  # this process's copy is its own


class Table(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self, table: torch.Tensor) -> None:
        self.table = table

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.table[i]


def check_table(table: torch.Tensor, worker_id: int) -> None:
    assert table.sum().item() == 6.0


def test_a_tensor_the_dataset_and_worker_init_fn_share_crosses_once_with_spawn() -> None:
    """One tensor in both arguments: its storage is reduced once (spawn refuses a descriptor
    given twice: "bad value(s) in fds_to_keep")."""
    table = torch.arange(4.0)
    loader = aioloader.DataLoader(
        Table(table),
        batch_size=2,
        num_workers=1,
        worker_init_fn=functools.partial(check_table, table),
        multiprocessing_context="spawn",
    )
    assert [b.tolist() for b in loader] == [[0.0, 1.0], [2.0, 3.0]]
