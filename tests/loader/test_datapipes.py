"""torch's DataPipes read as torch's ``DataLoader`` reads them, with torch's loader beside ours
in each test: each reader (a worker, or the main process) keeps its share of a
``sharding_filter`` (ours gave every worker the whole pipe: each sample ``num_workers`` times),
and ``shuffle`` switches the pipe's shufflers, seeded alike in every reader at each epoch from
``generator`` or torch's default generator."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.utils.data

import aioloader

datapipes = pytest.importorskip("torch.utils.data.datapipes")

Loader = Any


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DataPipes' deprecation, torch's CPU-count advice
        yield


def sharded(n: int) -> Any:
    return datapipes.iter.IterableWrapper(range(n)).sharding_filter()


def shuffled(n: int, buffer: int = 8) -> Any:
    return datapipes.iter.IterableWrapper(range(n)).shuffle(buffer_size=buffer).sharding_filter()


def values(loader: Loader) -> list[int]:
    return [int(x) for x in loader]


@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
def test_each_worker_keeps_its_share_of_a_sharding_filter(num_workers: int) -> None:
    options = {"num_workers": num_workers, "batch_size": None}
    theirs = values(torch.utils.data.DataLoader(sharded(23), **options))
    ours = values(aioloader.DataLoader(sharded(23), **options))
    assert sorted(ours) == list(range(23))
    assert ours == theirs  # in torch's order too: the workers' shares in turn


def test_without_a_sharding_filter_every_worker_reads_the_whole_pipe_as_torchs() -> None:
    pipe = datapipes.iter.IterableWrapper(range(5))
    options = {"num_workers": 2, "batch_size": 2}
    theirs = [b.tolist() for b in torch.utils.data.DataLoader(pipe, **options)]
    ours = [b.tolist() for b in aioloader.DataLoader(pipe, **options)]
    assert ours == theirs


@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_shuffle_seeds_each_epoch_from_torchs_generator(num_workers: int, persistent: bool) -> None:
    dl = aioloader.DataLoader(
        shuffled(40), shuffle=True, num_workers=num_workers, persistent_workers=persistent
    )
    try:
        torch.manual_seed(123)
        first = values(dl)
        torch.manual_seed(123)
        again = values(dl)
        torch.manual_seed(321)
        other = values(dl)
        unseeded = values(dl)
    finally:
        dl.close()
    assert first == again  # torch.manual_seed before an epoch repeats it, as with torch's
    assert sorted(first) == sorted(other) == sorted(unseeded) == list(range(40))
    assert first != other and first != list(range(40))


def test_a_generator_gives_the_same_epochs_in_two_loaders() -> None:
    def epochs() -> list[list[int]]:
        generator = torch.Generator().manual_seed(7)
        dl = aioloader.DataLoader(shuffled(30), shuffle=True, num_workers=2, generator=generator)
        return [values(dl) for _ in range(2)]

    one, two = epochs(), epochs()
    assert one == two and one[0] != one[1]


def test_shuffle_false_turns_the_pipes_shuffler_off_as_torchs() -> None:
    options = {"num_workers": 2, "batch_size": None, "shuffle": False}
    theirs = values(torch.utils.data.DataLoader(shuffled(20), **options))
    ours = values(aioloader.DataLoader(shuffled(20), **options))
    assert ours == theirs == sorted(ours)  # the shares in turn: 0, 1, 2, ...


def test_shuffle_unset_leaves_the_pipes_shuffler_as_it_is() -> None:
    ours = values(aioloader.DataLoader(shuffled(20), num_workers=2, batch_size=None))
    assert sorted(ours) == list(range(20)) and ours != list(range(20))


def test_a_sampler_is_still_refused_for_an_iterable_pipe() -> None:
    sampler = torch.utils.data.SequentialSampler(range(3))
    for loader in (torch.utils.data.DataLoader, aioloader.DataLoader):
        with pytest.raises(ValueError, match="expected unspecified sampler option"):
            loader(sharded(3), sampler=sampler)
