"""One owner for a stream's epoch (issue 26, part 3): a loader reading an ``OpensEpochs``
dataset passes its epoch as each one opens, and the dataset's own ``set_epoch`` is never
silently overwritten."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import aioloader
from aioloader import DataLoader, LoaderStateError
from aioloader.sources import tar_shards
from tests.sources.test_tar import collect, keys, make_shards


def shards(paths: list[Path]) -> Any:
    return tar_shards(paths, shuffle_shards=True, shuffle_buffer=5, seed=2)


async def direct_order(paths: list[Path], epoch: int) -> list[str]:
    ds = shards(paths)
    ds.set_epoch(epoch)
    return keys(await collect(ds))


def loader_order(loader: DataLoader[Any]) -> list[str]:
    return [s["__key__"] for b in loader for s in b]


async def test_set_epoch_on_a_dataset_a_loader_reads_raises_naming_the_loaders(
    tmp_path: Path,
) -> None:
    """Before, ``ds.set_epoch(3)`` was overwritten by the loader's epoch 0 without a word."""
    paths = make_shards(tmp_path)
    ds = shards(paths)
    loader = DataLoader(ds, batch_size=5, collate_fn=list)
    with pytest.raises(LoaderStateError, match=r"call loader\.set_epoch\(3\) instead"):
        ds.set_epoch(3)
    with pytest.raises(LoaderStateError, match=r"loader\.load_state_dict\(\)"):
        ds.load_state_dict(ds.state_dict())
    loader.set_epoch(3)  # the way that works
    assert loader_order(loader) == await direct_order(paths, 3)
    assert loader_order(loader) == await direct_order(paths, 4)


async def test_an_epoch_chosen_before_the_loader_is_built_is_its_first(tmp_path: Path) -> None:
    paths = make_shards(tmp_path)
    ds = shards(paths)
    ds.set_epoch(3)
    loader = DataLoader(ds, batch_size=5, collate_fn=list)
    assert loader.state_dict()["epoch"] == 3
    assert loader_order(loader) == await direct_order(paths, 3)
    # per_slot and interleave follow the same rule.
    slots = shards(paths).per_slot(2)
    slots.set_epoch(5)
    per_slot = DataLoader(slots, batch_size=2, collate_fn=list)
    got = [s.sample["__key__"] for b in per_slot for s in b]
    again = shards(paths).per_slot(2)
    again.set_epoch(5)
    assert got == [s.sample["__key__"] async for s in again]
    with pytest.raises(LoaderStateError, match=r"loader\.set_epoch"):
        slots.set_epoch(6)
    parts = aioloader.interleave([shards(paths)], in_flight=1)
    DataLoader(parts, batch_size=5, collate_fn=list)
    with pytest.raises(LoaderStateError, match=r"loader\.set_epoch"):
        parts.set_epoch(1)


async def test_a_state_loaded_into_the_dataset_is_not_lost_to_a_loader(tmp_path: Path) -> None:
    paths = make_shards(tmp_path)
    ds = shards(paths)
    ds.load_state_dict({"epoch": 2, "shards": len(paths), "cursor": None})
    with pytest.raises(LoaderStateError, match=r"loader\.load_state_dict"):
        DataLoader(ds, batch_size=5, collate_fn=list)


async def test_iterated_directly_the_dataset_counts_and_set_epoch_chooses(tmp_path: Path) -> None:
    paths = make_shards(tmp_path)
    ds = shards(paths)
    first, second = keys(await collect(ds)), keys(await collect(ds))
    assert first == await direct_order(paths, 0) and second == await direct_order(paths, 1)
    ds.set_epoch(0)
    assert keys(await collect(ds)) == first
    # A state loaded for the next epoch is not dropped by choosing another one.
    ds.load_state_dict({"epoch": 2, "shards": len(paths), "cursor": None})
    with pytest.raises(LoaderStateError, match="goes on with epoch 2"):
        ds.set_epoch(0)
    assert ds.state_dict()["epoch"] == 2
    ds.set_epoch(2)


async def test_open_epoch_checks_the_epoch_and_the_state_in_one_place(tmp_path: Path) -> None:
    paths = make_shards(tmp_path)
    ds = shards(paths)
    with pytest.raises(TypeError, match="epoch"):
        ds.open_epoch("1")
    with pytest.raises(ValueError, match="epoch"):
        ds.open_epoch(-1)
    with pytest.raises(TypeError, match=r"state must be a dict from TarShards\.state_dict\(\)"):
        ds.open_epoch(0, [1])
    with pytest.raises(ValueError, match="state is of epoch 2; it cannot go on with epoch 3"):
        ds.open_epoch(3, {"epoch": 2, "shards": len(paths), "cursor": None})
    with pytest.raises(TypeError, match="cannot resume"):
        shards(paths).per_slot(2).open_epoch(0, {"epoch": 0})
