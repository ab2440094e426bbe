"""torch's ``DataLoader`` and ours on what a review found different, running torch's and our
loader on the same scripts: sparse samples, integral counts of other types than int, and the
sampler and batch sampler torch shows where ours had none."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data

import aioloader
from tests.support.torchrun import ROOT, torchrun

LOADERS = [torch.utils.data.DataLoader, aioloader.DataLoader]


class Sparse(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 3

    def __getitem__(self, index: int) -> torch.Tensor:
        return (torch.eye(3) * (index + 1)).to_sparse()


def stacked(batch: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(batch)


@pytest.mark.parametrize(
    "kwargs",
    [{"batch_size": None}, {"batch_size": 2, "collate_fn": stacked}],
    ids=["unbatched", "collate_fn"],
)
def test_sparse_samples_come_as_torchs(kwargs: dict[str, Any]) -> None:
    # counting a sparse sample's bytes raised: torch defines no nbytes for it
    got = [[b.to_dense() for b in cls(Sparse(), **kwargs)] for cls in LOADERS]
    assert len(got[0]) == len(got[1]) and all(map(torch.equal, *got))
    assert next(iter(aioloader.DataLoader(Sparse(), **kwargs))).layout == torch.sparse_coo


def test_a_coo_sample_is_counted_by_its_indices_and_values() -> None:
    from aioloader._pipeline.flow import nbytes_of

    coo = torch.eye(4).to_sparse()  # 2x4 int64 indices, 4 float32 values
    assert nbytes_of(coo) == nbytes_of([coo]) == 2 * 4 * 8 + 4 * 4


@pytest.mark.parametrize(
    "counts",
    [
        {"num_workers": np.int64(2)},
        {"num_workers": np.int64(0)},
        {"num_workers": True},
        {"num_workers": torch.tensor(1)},
        {"num_workers": 1, "prefetch_factor": np.int32(4)},
    ],
    ids=["np-int64", "np-zero", "bool", "tensor", "prefetch-np"],
)
def test_integral_counts_of_other_types_are_taken_as_torchs(counts: dict[str, Any]) -> None:
    # a NumPy integer from a config array was refused: "num_workers option should be
    # non-negative", even for np.int64(0)
    got = [[b.tolist() for b in cls(list(range(6)), batch_size=2, **counts)] for cls in LOADERS]
    assert got[0] == got[1] == [[0, 1], [2, 3], [4, 5]]
    assert type(aioloader.DataLoader([1], **counts).num_workers) is int


def test_counts_that_are_not_integral_are_still_refused() -> None:
    for bad in (2.0, np.float64(2), torch.tensor(2.0), "2"):
        with pytest.raises(ValueError, match="num_workers option should be non-negative"):
            aioloader.DataLoader([1], num_workers=bad)


class Stream(torch.utils.data.IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(5))


@pytest.mark.parametrize(
    ("make", "kwargs"),
    [
        (lambda: list(range(5)), {"batch_sampler": [[0, 1], [2, 3, 4]]}),
        (Stream, {"batch_size": 2}),
        (Stream, {"batch_size": None}),
        (lambda: list(range(5)), {"batch_size": 2, "shuffle": True}),
    ],
    ids=["batch_sampler", "stream", "stream-unbatched", "shuffled"],
)
def test_the_sampler_and_batch_sampler_are_torchs(make: Any, kwargs: dict[str, Any]) -> None:
    # ours had None where torch has a SequentialSampler (a batch_sampler given) or its endless
    # sampler (a stream): `len(loader.sampler)` failed
    theirs, ours = (cls(make(), **kwargs) for cls in LOADERS)
    for name in ("sampler", "batch_sampler"):
        assert type(getattr(ours, name)).__name__ == type(getattr(theirs, name)).__name__, name
        assert getattr(ours, name) is getattr(ours, name)  # the same object each time
    if isinstance(ours.sampler, torch.utils.data.SequentialSampler):
        assert len(ours.sampler) == len(theirs.sampler) == 5
    if kwargs.get("batch_size") == 2 and isinstance(make(), Stream):
        assert ours.batch_sampler.sampler is ours.sampler
        with pytest.raises(TypeError):
            len(ours)  # a stream without a length, as torch's
        assert [b.tolist() for b in ours] == [[0, 1], [2, 3], [4]]


class Box:
    def __init__(self, value: int) -> None:
        self.value = value


def collate_boxes(batch: list[Box], *, collate_fn_map: Any = None) -> list[int]:
    return [box.value for box in batch]


def strings_as_tuple(batch: list[str], *, collate_fn_map: Any = None) -> tuple[str, ...]:
    return tuple(batch)


@pytest.fixture
def registered() -> Any:
    """A type registered in torch's ``default_collate_fn_map`` and its ``str`` rule replaced,
    as torch documents extending ``default_collate``; the map restored after."""
    from torch.utils.data._utils.collate import default_collate_fn_map

    saved = dict(default_collate_fn_map)
    default_collate_fn_map[Box] = collate_boxes
    default_collate_fn_map[str] = strings_as_tuple
    try:
        yield
    finally:
        default_collate_fn_map.clear()
        default_collate_fn_map.update(saved)


def test_types_registered_in_torchs_collate_map_are_collated_as_torchs(registered: Any) -> None:
    # a registered type raised "cannot collate"; a replaced str rule was not used
    samples = [{"box": Box(i), "name": f"n{i}", "x": torch.tensor([i])} for i in range(4)]
    theirs, ours = ([b for b in cls(samples, batch_size=2)] for cls in LOADERS)
    assert [b["box"] for b in ours] == [b["box"] for b in theirs] == [[0, 1], [2, 3]]
    assert [b["name"] for b in ours] == [b["name"] for b in theirs] == [("n0", "n1"), ("n2", "n3")]
    assert all(torch.equal(a["x"], b["x"]) for a, b in zip(ours, theirs, strict=True))


def test_without_registrations_the_default_collate_is_ours() -> None:
    from aioloader._data import collatemap

    collatemap.refresh()
    assert collatemap.registered == {}
    with pytest.raises(TypeError, match=r"sample\['box'\]: cannot collate"):
        aioloader.default_collate([{"box": Box(0)}, {"box": Box(1)}])


@dataclasses.dataclass
class Point:
    x: torch.Tensor
    box: Box


def test_a_registration_keeps_our_dataclass_collation(registered: Any) -> None:
    # the first fix handed every batch to torch's collate once anything was registered, and
    # torch refuses dataclasses (our documented extension)
    batch = aioloader.default_collate([Point(torch.tensor([i]), Box(i)) for i in range(3)])
    assert isinstance(batch, Point) and batch.box == [0, 1, 2]
    assert torch.equal(batch.x, torch.tensor([[0], [1], [2]]))


class ByKey(torch.utils.data.Dataset[float]):
    """A map-style dataset without ``__len__``: its keys come from a sampler."""

    def __getitem__(self, key: Any) -> float:
        return {"a": 1.0, "b": 2.0, "c": 3.0}[key] if isinstance(key, str) else float(key)


def outcome(call: Any) -> Any:
    try:
        return call()
    except Exception as exc:
        return type(exc), str(exc)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"sampler": ["a", "c"], "batch_size": 2},
        {"sampler": range(5), "batch_size": 2, "num_workers": 2},
        {"batch_sampler": [[0, 1], [2]]},
        {},
    ],
    ids=["keys", "workers", "batch_sampler", "no-sampler"],
)
def test_a_dataset_without_len_is_read_as_torchs(kwargs: dict[str, Any]) -> None:
    # it was refused as the loader was built; without a sampler, torch's error comes as its
    # length is asked for
    theirs, ours = (cls(ByKey(), **kwargs) for cls in LOADERS)
    assert outcome(lambda: len(ours)) == outcome(lambda: len(theirs))
    read = [outcome(lambda dl=dl: [b.tolist() for b in dl]) for dl in (theirs, ours)]  # type: ignore[misc]
    assert read[0] == read[1]


class StopsAt2(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        if index == 2:
            raise StopIteration  # a way some datasets end an epoch early
        return index


@pytest.mark.parametrize(
    "ours",
    [{}, {"num_workers": 1}, {"num_workers": 2, "worker_mode": "thread"}, {"prefetch": 2}],
    ids=["in-process", "process", "thread", "prefetch"],
)
def test_stop_iteration_in_getitem_ends_the_loop_as_torchs(ours: dict[str, Any]) -> None:
    # with workers (processes, threads, reads ahead) it came as PEP 479's "coroutine raised
    # StopIteration" RuntimeError
    theirs = [b.tolist() for b in torch.utils.data.DataLoader(StopsAt2())]
    assert [b.tolist() for b in aioloader.DataLoader(StopsAt2(), **ours)] == theirs == [[0], [1]]


async def test_async_for_names_a_stop_iteration_in_a_worker() -> None:
    from aioloader._base.exceptions import StopInWorker

    loader = aioloader.DataLoader(StopsAt2(), num_workers=1)
    seen: list[int] = []
    with pytest.raises(StopInWorker) as info:
        async with loader:
            async for batch in loader:
                seen.append(int(batch))
    assert seen == [0, 1] and "raised StopIteration" in str(info.value)
    assert isinstance(info.value, RuntimeError) and "sample 2" in "\n".join(info.value.__notes__)


def test_workers_know_the_rank_of_the_training_processs_group(tmp_path: Any) -> None:
    """Under torchrun, an ``IterableDataset`` that shards by ``dist.get_rank()`` in a worker
    (webdataset's ``split_by_node``) read everything on every rank, and a ``worker_init_fn``
    that seeds by rank failed: our workers are forks of a server made before the group was
    (``_workers/rankinfo.py``). ``RANK`` is taken out of the job's environment, as Lightning's
    launcher sets none."""
    output = torchrun(2, ROOT / "tests/support/ddp_rank_job.py", cwd=tmp_path, timeout=120)
    rows = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert sorted(row["rank"] for row in rows) == [0, 1], output
    for row in rows:
        mine = list(range(row["rank"], 8, 2))
        assert row["ours"] == row["torch"] == [mine[:2], mine[2:]], row


@pytest.mark.parametrize("workers", [0, 1])
def test_a_generator_given_draws_the_order_as_torchs_and_reads_back(workers: int) -> None:
    # the sampler's generator read None, so accelerate gave it one of its own, seeded from
    # the global generator, and the user's `generator=` no longer decided the order
    theirs, ours = (
        cls(
            list(range(20)),
            batch_size=4,
            shuffle=True,
            num_workers=workers,
            generator=torch.Generator().manual_seed(3),
        )
        for cls in LOADERS
    )
    assert ours.sampler.generator is ours.generator
    for _ in range(2):  # each epoch drawn from it, as torch's: the same batches
        assert [b.tolist() for b in ours] == [b.tolist() for b in theirs]
    assert aioloader.DataLoader([0, 1], shuffle=True, seed=5).sampler.generator is None
