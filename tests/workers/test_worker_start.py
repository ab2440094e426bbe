"""A worker's start arguments, as torch's idioms use them: ``worker_init_fn`` a method of the
dataset sets up the worker's own copy (both arrive in one pickle), and a tensor both hold
crosses once (spawn refuses a descriptor given twice). Pickling the two apart breaks both.
And what a worker starts with besides: the main process's environment as it is then."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator

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


class ReadsEnviron(torch.utils.data.Dataset[tuple[str, str, str]]):
    """Reads the environment as it is unpickled in a worker and as it reads a sample."""

    def __init__(self) -> None:
        self.unpickled_with = "not unpickled"  # (an empty __dict__ is not passed to __setstate__)

    def __len__(self) -> int:
        return 2

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self.unpickled_with = os.environ.get("AIOLOADER_TEST_ROOT", "unset")

    def __getitem__(self, i: int) -> tuple[str, str, str]:
        return (
            self.unpickled_with,
            os.environ.get("AIOLOADER_TEST_ROOT", "unset"),
            os.environ.get("AIOLOADER_TEST_GONE", "unset"),
        )


@pytest.fixture
def restored_environ() -> Iterator[None]:
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


@pytest.mark.usefixtures("restored_environ")
def test_workers_have_the_environment_as_they_start_as_torch_s_do() -> None:
    """A fork server keeps the environment it started with: a variable the script sets (or
    removes) later, before its next loader, is the workers' too, as with torch's fork workers,
    and before the dataset is unpickled."""
    os.environ["AIOLOADER_TEST_GONE"] = "here"
    first = aioloader.DataLoader(ReadsEnviron(), batch_size=None, num_workers=1)
    assert [b[2] for b in first] == ["here", "here"]  # the fork server runs from here on
    os.environ["AIOLOADER_TEST_ROOT"] = "/data/b"
    del os.environ["AIOLOADER_TEST_GONE"]
    theirs = torch.utils.data.DataLoader(
        ReadsEnviron(), batch_size=None, num_workers=1, multiprocessing_context="fork"
    )
    ours = aioloader.DataLoader(ReadsEnviron(), batch_size=None, num_workers=1)
    assert [tuple(b)[1:] for b in theirs] == [("/data/b", "unset")] * 2
    assert [tuple(b) for b in ours] == [("/data/b", "/data/b", "unset")] * 2
