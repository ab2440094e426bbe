"""Drop-in compatibility with torch.utils.data.DataLoader.

A torch user switches by changing the import: on the same arguments, aioloader.DataLoader
yields exactly torch's batches (same values, dtypes and container types), reports the same
``len()``, and rejects the same argument combinations at construction.
"""

from __future__ import annotations

import math
import time
import warnings
from collections import OrderedDict, namedtuple
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import aioloader

N = 10


# -- datasets -----------------------------------------------------------------------------------


class Records(tud.Dataset[dict[str, Any]]):
    """A torch map-style dataset of dicts: a tensor, an int and a string per sample."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        return {"x": torch.tensor([index, index]), "y": index, "name": str(index)}


def tuples(n: int = N) -> list[tuple[int, float, str]]:
    """A plain list of tuples (torch collates a tuple into a list)."""
    return [(i, i / 2, f"s{i}") for i in range(n)]


MAP_DATASETS: dict[str, Callable[[], Any]] = {"records": Records, "list": tuples}


class Stream(tud.IterableDataset[dict[str, Any]]):
    """A torch iterable dataset: a generator of dicts, with no ``__len__``."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(self.n):
            yield {"a": i, "b": torch.full((2,), float(i)), "c": (i, str(i))}


class SizedStream(Stream):
    """A torch iterable dataset that defines ``__len__``."""

    def __len__(self) -> int:
        return self.n


class Failing(tud.Dataset[int]):
    """A map-style dataset whose sample 5 raises KeyError."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> int:
        if index == 5:
            raise KeyError("sample 5 is missing")
        return index


def collate_pairs(batch: list[Any]) -> tuple[str, list[Any]]:
    """A custom collate_fn: tags the batch and keeps the samples as they are."""
    return ("batch", list(batch))


def convert_one(sample: Any) -> Any:
    """A custom collate_fn for ``batch_size=None``: gets one sample."""
    return ("one", sample)


# -- comparison ---------------------------------------------------------------------------------


def assert_same(got: Any, want: Any, path: str = "batches") -> None:
    """Recursive exact equality: same container types, keys in the same order, tensors with the
    same dtype and shape and equal values, other leaves equal and of the same type."""
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.equal(got, want), f"{path}: {got} != {want}"
    elif isinstance(want, np.ndarray):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), f"{path}: {got!r} != {want!r}"
        assert np.array_equal(got, want), f"{path}: {got!r} != {want!r}"
    elif isinstance(want, Mapping):
        assert list(got.keys()) == list(want.keys()), f"{path}: keys differ"
        for key in want:
            assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}[{i}]")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def torch_batches(dataset: Any, **kwargs: Any) -> list[Any]:
    return list(tud.DataLoader(dataset, **kwargs))


def aio_batches(dataset: Any, **kwargs: Any) -> list[Any]:
    return list(aioloader.DataLoader(dataset, **kwargs))


async def aio_batches_async(dataset: Any, **kwargs: Any) -> list[Any]:
    loader: aioloader.DataLoader[Any] = aioloader.DataLoader(dataset, **kwargs)
    out = []
    async with loader:
        async for batch in loader:
            out.append(batch)
    return out


def test_assert_same_is_strict() -> None:
    assert_same([{"a": torch.tensor([1])}], [{"a": torch.tensor([1])}])
    with pytest.raises(AssertionError):
        assert_same(torch.tensor([1]), torch.tensor([1.0]))
    with pytest.raises(AssertionError):
        assert_same([1, 2], (1, 2))
    with pytest.raises(AssertionError):
        assert_same({"a": 1, "b": 2}, {"b": 2, "a": 1})
    with pytest.raises(AssertionError):
        assert_same(torch.tensor([[1, 2]]), torch.tensor([1, 2]))
    with pytest.raises(AssertionError):
        assert_same([torch.tensor([1])], [torch.tensor([1]), torch.tensor([2])])


# -- batches equal torch's ------------------------------------------------------------------------

_BATCHING = [
    pytest.param(bs, dl, id=f"bs={bs}-drop_last={dl}")
    for bs in (1, 3, 7, None)
    for dl in (False, True)
    if not (bs is None and dl)
]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(("batch_size", "drop_last"), _BATCHING)
@pytest.mark.parametrize("data", list(MAP_DATASETS))
def test_map_style_batches_equal_torch(
    data: str, batch_size: int | None, drop_last: bool, num_workers: int
) -> None:
    dataset = MAP_DATASETS[data]()
    want = torch_batches(dataset, batch_size=batch_size, shuffle=False, drop_last=drop_last)
    got = aio_batches(
        dataset, batch_size=batch_size, shuffle=False, drop_last=drop_last, num_workers=num_workers
    )
    assert_same(got, want)


def test_default_arguments_equal_torch() -> None:
    dataset = Records()
    assert_same(aio_batches(dataset), torch_batches(dataset))


@pytest.mark.parametrize("batch_size", [1, 3, None])
@pytest.mark.parametrize("data", list(MAP_DATASETS))
def test_custom_sampler_equals_torch(data: str, batch_size: int | None) -> None:
    dataset = MAP_DATASETS[data]()
    sampler = [9, 0, 8, 1, 7, 2, 6, 3]  # a subset, out of order
    want = torch_batches(dataset, batch_size=batch_size, sampler=sampler)
    got = aio_batches(dataset, batch_size=batch_size, sampler=sampler)
    assert_same(got, want)


@pytest.mark.parametrize("drop_last", [False, True])
def test_reversed_sampler_equals_torch(drop_last: bool) -> None:
    dataset = Records()
    sampler = list(reversed(range(N)))
    want = torch_batches(dataset, batch_size=3, sampler=sampler, drop_last=drop_last)
    got = aio_batches(dataset, batch_size=3, sampler=sampler, drop_last=drop_last)
    assert_same(got, want)


def test_torch_sampler_object_equals_torch() -> None:
    """A torch sampler instance (seeded RandomSampler) is iterated once per epoch, like torch."""
    dataset = Records()

    def sampler() -> tud.RandomSampler:
        return tud.RandomSampler(dataset, generator=torch.Generator().manual_seed(7))

    want = torch_batches(dataset, batch_size=4, sampler=sampler())
    got = aio_batches(dataset, batch_size=4, sampler=sampler())
    assert_same(got, want)


Point = namedtuple("Point", ["x", "y"])

_MORE_DATASETS: dict[str, Callable[[], Any]] = {
    "TensorDataset": lambda: tud.TensorDataset(torch.arange(N), torch.arange(N) * 0.5),
    "Subset": lambda: tud.Subset(Records(), [5, 3, 1, 7, 0]),
    "ConcatDataset": lambda: tud.ConcatDataset([Records(3), Records(4)]),
    "range": lambda: range(N),
    "tensor": lambda: torch.arange(2 * N).view(N, 2),
    "ndarray": lambda: np.arange(2 * N, dtype=np.float32).reshape(N, 2),
    "numpy-arrays": lambda: [np.full((2,), i, dtype=np.int16) for i in range(N)],
    "numpy-scalars": lambda: [np.float64(i) for i in range(N)],
    "bools": lambda: [i % 3 == 0 for i in range(N)],
    "floats": lambda: [i / 4 for i in range(N)],
    "strings": lambda: [f"s{i}" for i in range(N)],
    "namedtuples": lambda: [Point(i, torch.tensor([i, -i])) for i in range(N)],
    "OrderedDicts": lambda: [OrderedDict(b=i, a=float(i)) for i in range(N)],
    "nested": lambda: [{"a": [i, (i, str(i))], "b": {"c": torch.tensor(i)}} for i in range(N)],
    "empty": list,
}


@pytest.mark.parametrize("batch_size", [3, None])
@pytest.mark.parametrize("make", list(_MORE_DATASETS.values()), ids=list(_MORE_DATASETS))
def test_more_map_style_datasets_equal_torch(
    make: Callable[[], Any], batch_size: int | None
) -> None:
    want = torch_batches(make(), batch_size=batch_size)
    assert_same(aio_batches(make(), batch_size=batch_size), want)


class Batched(tud.Dataset[torch.Tensor]):
    """A map-style dataset with torch's batched ``__getitems__`` protocol."""

    def __init__(self) -> None:
        self.data = torch.arange(2 * N).view(N, 2)
        self.batched_calls = 0

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> torch.Tensor:
        raise AssertionError("__getitems__ should be used")

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        self.batched_calls += 1
        return list(self.data[indices])


def test_getitems_protocol_equals_torch() -> None:
    dataset = Batched()
    want = torch_batches(dataset, batch_size=3)
    calls = dataset.batched_calls
    assert_same(aio_batches(dataset, batch_size=3), want)
    assert dataset.batched_calls - calls == len(want)


class TwoReads(tud.Dataset[int]):
    """``__getitems__`` answers apart from ``__getitem__``: which one torch called shows."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> int:
        return index

    def __getitems__(self, indices: list[int]) -> list[int]:
        return [-1 - i for i in indices]


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("batch_size", [3, None])
def test_getitems_is_called_for_batches_only_as_in_torch(
    batch_size: int | None, workers: int
) -> None:
    """Without batching (``batch_size=None``) torch reads each sample with ``__getitem__``;
    ours called ``__getitems__`` with one index (found with a dataset whose two reads differ)."""
    kwargs: dict[str, Any] = {"batch_size": batch_size, "num_workers": workers}
    context = {"multiprocessing_context": "fork"} if workers else {}
    want = torch_batches(TwoReads(), **kwargs, **context)
    assert_same(aio_batches(TwoReads(), **kwargs), want)


def test_loader_attributes_like_torch() -> None:
    dataset = Records()
    kwargs: dict[str, Any] = {"batch_size": 3, "drop_last": True, "collate_fn": collate_pairs}
    want = tud.DataLoader(dataset, **kwargs, timeout=2)
    got: aioloader.DataLoader[Any] = aioloader.DataLoader(dataset, **kwargs, timeout=2)
    for name in ("dataset", "batch_size", "drop_last", "num_workers", "collate_fn", "timeout"):
        assert getattr(got, name) == getattr(want, name), name
    for name in ("pin_memory", "generator", "prefetch_factor", "persistent_workers"):
        assert getattr(got, name) == getattr(want, name), name
    with_batch_sampler: aioloader.DataLoader[Any] = aioloader.DataLoader(
        dataset, batch_sampler=[[0, 1]]
    )
    assert with_batch_sampler.batch_size is None  # torch's convention
    assert tud.DataLoader(dataset, batch_sampler=[[0, 1]]).batch_size is None


_BATCH_SAMPLERS: dict[str, Callable[[], Iterable[list[int]]]] = {
    "torch-BatchSampler": lambda: tud.BatchSampler(tud.SequentialSampler(range(N)), 3, False),
    "torch-BatchSampler-drop_last": lambda: tud.BatchSampler(
        tud.SequentialSampler(range(N)), 4, True
    ),
    "list-of-lists": lambda: [[9, 0], [1, 2, 3], [5], [4, 6, 7, 8]],
}


@pytest.mark.parametrize("make", list(_BATCH_SAMPLERS.values()), ids=list(_BATCH_SAMPLERS))
@pytest.mark.parametrize("data", list(MAP_DATASETS))
def test_batch_sampler_equals_torch(data: str, make: Callable[[], Iterable[list[int]]]) -> None:
    dataset = MAP_DATASETS[data]()
    want = torch_batches(dataset, batch_sampler=make())
    got = aio_batches(dataset, batch_sampler=make())
    assert_same(got, want)


@pytest.mark.parametrize(
    ("collate_fn", "batch_size"),
    [
        pytest.param(collate_pairs, 3, id="batched"),
        pytest.param(convert_one, None, id="unbatched"),
        pytest.param(tud.default_collate, 4, id="torch-default_collate"),
        pytest.param(aioloader.default_collate, 4, id="aioloader-default_collate"),
        pytest.param(tud.default_convert, None, id="torch-default_convert"),
    ],
)
@pytest.mark.parametrize("data", list(MAP_DATASETS))
def test_custom_collate_fn_equals_torch(
    data: str, collate_fn: Callable[[Any], Any], batch_size: int | None
) -> None:
    dataset = MAP_DATASETS[data]()
    want = torch_batches(dataset, batch_size=batch_size, collate_fn=collate_fn)
    got = aio_batches(dataset, batch_size=batch_size, collate_fn=collate_fn)
    assert_same(got, want)


def test_every_epoch_equals_torch() -> None:
    """A loader iterated twice yields the same (unshuffled) epoch twice, as torch does."""
    dataset = Records()
    torch_loader = tud.DataLoader(dataset, batch_size=3)
    aio_loader: aioloader.DataLoader[Any] = aioloader.DataLoader(dataset, batch_size=3)
    for _ in range(2):
        assert_same(list(aio_loader), list(torch_loader))


def test_with_scope_epochs_equal_torch() -> None:
    dataset = Records()
    torch_loader = tud.DataLoader(dataset, batch_size=4)
    aio_loader: aioloader.DataLoader[Any] = aioloader.DataLoader(dataset, batch_size=4)
    with aio_loader:
        for _ in range(2):
            assert_same(list(aio_loader), list(torch_loader))


# -- iterable datasets ------------------------------------------------------------------------


@pytest.mark.parametrize(("batch_size", "drop_last"), _BATCHING)
@pytest.mark.parametrize("cls", [Stream, SizedStream])
def test_iterable_dataset_batches_equal_torch(
    cls: type[Stream], batch_size: int | None, drop_last: bool
) -> None:
    dataset = cls()
    want = torch_batches(dataset, batch_size=batch_size, drop_last=drop_last, num_workers=0)
    got = aio_batches(dataset, batch_size=batch_size, drop_last=drop_last)
    assert_same(got, want)


def test_iterable_dataset_with_shuffle_false_equals_torch() -> None:
    dataset = Stream()
    assert_same(
        aio_batches(dataset, batch_size=4, shuffle=False),
        torch_batches(dataset, batch_size=4, shuffle=False),
    )


def test_iterable_dataset_longer_than_a_chunk_equals_torch() -> None:
    """More samples than the blocking stream reads per thread call (64)."""
    dataset = Stream(150)
    assert_same(aio_batches(dataset, batch_size=16), torch_batches(dataset, batch_size=16))


@pytest.mark.parametrize("collate_fn", [collate_pairs, tud.default_collate])
def test_iterable_dataset_custom_collate_equals_torch(collate_fn: Callable[[Any], Any]) -> None:
    dataset = Stream()
    assert_same(
        aio_batches(dataset, batch_size=3, collate_fn=collate_fn),
        torch_batches(dataset, batch_size=3, collate_fn=collate_fn),
    )


# -- len() ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 9, 10, 11])
@pytest.mark.parametrize(("batch_size", "drop_last"), _BATCHING)
def test_len_map_style_equals_torch(n: int, batch_size: int | None, drop_last: bool) -> None:
    dataset = Records(n)
    kwargs: dict[str, Any] = {"batch_size": batch_size, "drop_last": drop_last}
    want = len(tud.DataLoader(dataset, **kwargs))
    assert len(aioloader.DataLoader(dataset, **kwargs)) == want
    if n:  # torch's RandomSampler refuses an empty dataset (so does ours: test_torch_semantics)
        assert len(aioloader.DataLoader(dataset, shuffle=True, seed=0, **kwargs)) == want
    assert len(aioloader.DataLoader(list(range(n)), **kwargs)) == want


@pytest.mark.parametrize("batch_size", [1, 3, None])
def test_len_with_sampler_equals_torch(batch_size: int | None) -> None:
    dataset = Records()
    sampler = [1, 2, 3, 4, 5, 6, 7]
    want = len(tud.DataLoader(dataset, batch_size=batch_size, sampler=sampler))
    assert len(aioloader.DataLoader(dataset, batch_size=batch_size, sampler=sampler)) == want


@pytest.mark.parametrize("make", list(_BATCH_SAMPLERS.values()), ids=list(_BATCH_SAMPLERS))
def test_len_with_batch_sampler_equals_torch(make: Callable[[], Iterable[list[int]]]) -> None:
    dataset = Records()
    want = len(tud.DataLoader(dataset, batch_sampler=make()))
    assert len(aioloader.DataLoader(dataset, batch_sampler=make())) == want


@pytest.mark.parametrize("n", [0, 1, 9, 10, 11])
@pytest.mark.parametrize(("batch_size", "drop_last"), _BATCHING)
def test_len_sized_iterable_equals_torch(n: int, batch_size: int | None, drop_last: bool) -> None:
    dataset = SizedStream(n)
    kwargs: dict[str, Any] = {"batch_size": batch_size, "drop_last": drop_last}
    want = len(tud.DataLoader(dataset, **kwargs))
    if batch_size is not None:
        rounded = math.floor if drop_last else math.ceil
        assert want == rounded(n / batch_size)  # torch's rule, stated
    assert len(aioloader.DataLoader(dataset, **kwargs)) == want


@pytest.mark.parametrize("batch_size", [1, 3, None])
def test_len_unsized_iterable_raises_type_error_like_torch(batch_size: int | None) -> None:
    dataset = Stream()
    with pytest.raises(TypeError):
        len(tud.DataLoader(dataset, batch_size=batch_size))
    with pytest.raises(TypeError):
        len(aioloader.DataLoader(dataset, batch_size=batch_size))


def test_len_matches_batches_yielded() -> None:
    for kwargs in ({"batch_size": 3}, {"batch_size": 3, "drop_last": True}, {"batch_size": None}):
        loader: aioloader.DataLoader[Any] = aioloader.DataLoader(Records(), **kwargs)
        assert len(list(loader)) == len(loader)


# -- construction errors mirrored from torch -------------------------------------------------------

_TORCH_ERRORS: list[tuple[str, Callable[[], Any], dict[str, Any]]] = [
    ("sampler+shuffle", Records, {"sampler": [0, 1], "shuffle": True}),
    ("batch_sampler+batch_size", Records, {"batch_sampler": [[0]], "batch_size": 2}),
    ("batch_sampler+batch_size=None", Records, {"batch_sampler": [[0]], "batch_size": None}),
    ("batch_sampler+shuffle", Records, {"batch_sampler": [[0]], "shuffle": True}),
    ("batch_sampler+sampler", Records, {"batch_sampler": [[0]], "sampler": [0]}),
    ("batch_sampler+drop_last", Records, {"batch_sampler": [[0]], "drop_last": True}),
    ("batch_size=None+drop_last", Records, {"batch_size": None, "drop_last": True}),
    ("batch_size=0", Records, {"batch_size": 0}),
    ("batch_size=-1", Records, {"batch_size": -1}),
    ("num_workers=-1", Records, {"num_workers": -1}),
    ("timeout=-1", Records, {"timeout": -1}),
    ("prefetch_factor+num_workers=0", Records, {"prefetch_factor": 2}),
    ("persistent_workers+num_workers=0", Records, {"persistent_workers": True}),
    ("multiprocessing_context+num_workers=0", Records, {"multiprocessing_context": "spawn"}),
    ("iterable+shuffle", Stream, {"shuffle": True}),
    ("iterable+sampler", Stream, {"sampler": [0, 1]}),
    ("iterable+batch_sampler", Stream, {"batch_sampler": [[0, 1]]}),
]


@pytest.mark.parametrize(
    ("make", "kwargs"),
    [pytest.param(make, kwargs, id=case) for case, make, kwargs in _TORCH_ERRORS],
)
def test_construction_errors_mirror_torch(make: Callable[[], Any], kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        tud.DataLoader(make(), **kwargs)
    with pytest.raises(ValueError):
        aioloader.DataLoader(make(), **kwargs)


class _Boom(Exception):
    """Raised by a test's own loop body."""


_FAILING: dict[str, tuple[Callable[[], Any], type[Exception], str]] = {
    "dataset-KeyError": (Failing, KeyError, "sample 5"),
    "collate-None-first": (lambda: [None, 1, 2], TypeError, "NoneType"),
    "collate-None-second": (lambda: [0, None, 2], RuntimeError, "NoneType"),
}


@pytest.mark.parametrize(("make", "exc", "match"), list(_FAILING.values()), ids=list(_FAILING))
def test_iteration_error_keeps_its_type_like_torch(
    make: Callable[[], Any], exc: type[Exception], match: str
) -> None:
    with pytest.raises(exc, match=match):
        torch_batches(make(), batch_size=2)
    with pytest.raises(exc, match=match):
        aio_batches(make(), batch_size=2)


@pytest.mark.parametrize(("make", "exc", "match"), list(_FAILING.values()), ids=list(_FAILING))
async def test_iteration_error_keeps_its_type_async(
    make: Callable[[], Any], exc: type[Exception], match: str
) -> None:
    with pytest.raises(exc, match=match):
        await aio_batches_async(make(), batch_size=2)


class SlowThenFailing(tud.Dataset[int]):
    """Samples 0-3 are slow, sample 5 fails at once: the failing batch (the third, with
    batch_size=2) fails while the two good batches before it are still being fetched."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> int:
        if index == 5:
            raise KeyError("sample 5 is missing")
        if index < 4:
            time.sleep(0.05)
        return index


def _until_failure(loader: Iterable[Any]) -> list[Any]:
    seen = []
    with pytest.raises(KeyError, match="sample 5"):
        for batch in loader:
            seen.append(batch)
    return seen


def test_every_batch_before_a_failure_is_delivered_like_torch() -> None:
    want = _until_failure(tud.DataLoader(SlowThenFailing(), batch_size=2))
    assert [b.tolist() for b in want] == [[0, 1], [2, 3]]
    got = _until_failure(aioloader.DataLoader(SlowThenFailing(), batch_size=2))
    assert_same(got, want)


async def test_every_batch_before_a_failure_is_delivered_async() -> None:
    loader: aioloader.DataLoader[Any] = aioloader.DataLoader(SlowThenFailing(), batch_size=2)
    got = []
    with pytest.raises(KeyError, match="sample 5"):
        async with loader:
            async for batch in loader:
                got.append(batch.tolist())
    assert got == [[0, 1], [2, 3]]


def test_leaving_a_plain_for_early_is_clean_like_torch() -> None:
    want = next(iter(tud.DataLoader(Records(), batch_size=2)))
    aio_it: Iterator[Any] = iter(aioloader.DataLoader(Records(), batch_size=2))
    assert_same(next(aio_it), want)
    aio_it.close()  # type: ignore[attr-defined]  # a generator


def test_break_out_of_a_plain_for_like_torch() -> None:
    loader: aioloader.DataLoader[Any] = aioloader.DataLoader(Records(), batch_size=2)
    for torch_loader in (tud.DataLoader(Records(), batch_size=2), loader):
        seen = []
        for batch in torch_loader:
            seen.append(batch)
            if len(seen) == 2:
                break
        assert len(seen) == 2
    assert_same(list(loader), torch_batches(Records(), batch_size=2))  # usable afterwards


def test_error_in_a_plain_for_body_propagates_unchanged() -> None:
    with pytest.raises(_Boom):
        for _ in aioloader.DataLoader(Records(), batch_size=2):
            raise _Boom


async def test_error_in_an_async_for_body_propagates_unchanged() -> None:
    loader: aioloader.DataLoader[Any] = aioloader.DataLoader(Records(), batch_size=2)
    with pytest.raises(_Boom):
        async with loader:
            async for _ in loader:
                raise _Boom


# -- shuffle ------------------------------------------------------------------------------------


def _indices(loader: Iterable[Any]) -> list[int]:
    return [int(i) for batch in loader for i in batch]


@pytest.mark.parametrize("batch_size", [1, 4])
def test_shuffle_with_seeded_generator_is_a_repeatable_permutation(batch_size: int) -> None:
    n = 20
    dataset = list(range(n))

    def loader(seed: int) -> aioloader.DataLoader[Any]:
        gen = torch.Generator().manual_seed(seed)
        return aioloader.DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=gen)

    first, second, other = loader(0), loader(0), loader(1)
    order = _indices(first)
    assert sorted(order) == list(range(n))
    assert order != list(range(n))
    assert _indices(second) == order
    assert _indices(other) != order
    # Like torch, every epoch is reshuffled; equally seeded loaders stay in step.
    order_2 = _indices(first)
    assert sorted(order_2) == list(range(n))
    assert order_2 != order
    assert _indices(second) == order_2


def test_shuffle_torch_generator_permutation_like_torch() -> None:
    """Both libraries give a permutation of all indices (the orders themselves differ)."""
    n = 20
    dataset = list(range(n))
    gen = torch.Generator().manual_seed(0)
    torch_loader: tud.DataLoader[int] = tud.DataLoader(
        dataset,  # type: ignore[arg-type]  # a list is a map-style dataset
        batch_size=3,
        shuffle=True,
        generator=gen,
    )
    torch_order = _indices(torch_loader)
    gen = torch.Generator().manual_seed(0)
    aio_order = _indices(aioloader.DataLoader(dataset, batch_size=3, shuffle=True, generator=gen))
    assert sorted(torch_order) == sorted(aio_order) == list(range(n))


def test_shuffle_without_generator_follows_torch_manual_seed() -> None:
    dataset = list(range(20))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(123)
        first = _indices(aioloader.DataLoader(dataset, batch_size=5, shuffle=True))
        torch.manual_seed(123)
        second = _indices(aioloader.DataLoader(dataset, batch_size=5, shuffle=True))
    assert first == second
    assert sorted(first) == list(range(20))


# -- async variants -------------------------------------------------------------------------------


@pytest.mark.parametrize(("batch_size", "drop_last"), _BATCHING)
@pytest.mark.parametrize("data", list(MAP_DATASETS))
async def test_async_map_style_batches_equal_torch(
    data: str, batch_size: int | None, drop_last: bool
) -> None:
    dataset = MAP_DATASETS[data]()
    want = torch_batches(dataset, batch_size=batch_size, drop_last=drop_last)
    got = await aio_batches_async(dataset, batch_size=batch_size, drop_last=drop_last)
    assert_same(got, want)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
@pytest.mark.parametrize("num_workers", [0, 3])
async def test_async_sampler_and_collate_equal_torch(num_workers: int) -> None:
    dataset = Records()
    kwargs: dict[str, Any] = {"batch_size": 3, "sampler": list(reversed(range(N)))}
    want = torch_batches(dataset, **kwargs, collate_fn=collate_pairs)
    got = await aio_batches_async(
        dataset, **kwargs, collate_fn=collate_pairs, num_workers=num_workers
    )
    assert_same(got, want)


@pytest.mark.parametrize("make", list(_BATCH_SAMPLERS.values()), ids=list(_BATCH_SAMPLERS))
async def test_async_batch_sampler_equals_torch(make: Callable[[], Iterable[list[int]]]) -> None:
    dataset = Records()
    want = torch_batches(dataset, batch_sampler=make())
    got = await aio_batches_async(dataset, batch_sampler=make())
    assert_same(got, want)


@pytest.mark.parametrize(("batch_size", "drop_last"), _BATCHING)
async def test_async_iterable_dataset_equals_torch(batch_size: int | None, drop_last: bool) -> None:
    dataset = Stream()
    want = torch_batches(dataset, batch_size=batch_size, drop_last=drop_last)
    got = await aio_batches_async(dataset, batch_size=batch_size, drop_last=drop_last)
    assert_same(got, want)


async def test_async_epochs_in_one_scope_equal_torch() -> None:
    dataset = Records()
    torch_loader = tud.DataLoader(dataset, batch_size=4, drop_last=True)
    loader: aioloader.DataLoader[Any] = aioloader.DataLoader(dataset, batch_size=4, drop_last=True)
    async with loader:
        for _ in range(3):
            got = [batch async for batch in loader]
            assert_same(got, list(torch_loader))


class Squares(tud.Dataset[tuple[int, int]]):
    """A user's dataset, as a torch script defines it (the class itself is torch's)."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[int, int]:
        return i, i * i


class Countdown(tud.IterableDataset[int]):
    """A user's stream, split between workers by torch's ``get_worker_info``."""

    def __iter__(self) -> Iterator[int]:
        info = tud.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(30 - start, 0, -step))


def a_torch_script(data: Any, num_workers: int) -> list[Any]:
    """What a training script does with ``torch.utils.data`` (``data``): every name it uses is
    read from the module its import line names, so swapping the line swaps them all."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    train, val = data.random_split(Squares(), [0.75, 0.25], generator=g)
    both = data.ConcatDataset([train, data.Subset(Squares(), range(5))])
    pairs = data.TensorDataset(torch.arange(6), torch.arange(6) * 10)
    weights = [1.0 + (i % 3) for i in range(len(both))]
    sampler = data.WeightedRandomSampler(weights, 24, generator=torch.Generator().manual_seed(2))
    out = []
    for loader in (
        data.DataLoader(both, batch_size=5, sampler=sampler, num_workers=num_workers),
        data.DataLoader(val, batch_size=4, num_workers=num_workers),
        data.DataLoader(pairs, batch_size=4, num_workers=num_workers),
        data.DataLoader(data.StackDataset(val, val), batch_size=3, num_workers=num_workers),
        data.DataLoader(
            data.ChainDataset([Countdown(), Countdown()]), batch_size=7, num_workers=num_workers
        ),
        data.DataLoader(
            both,
            batch_sampler=data.BatchSampler(
                data.SubsetRandomSampler(range(10), generator=torch.Generator().manual_seed(3)),
                4,
                drop_last=False,
            ),
        ),
    ):
        out.append(list(loader))
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_torch_script_with_its_import_line_swapped_gives_torchs_batches(
    num_workers: int,
) -> None:
    """``from torch.utils.data import DataLoader, Dataset, random_split, ...`` swapped for
    ``from aioloader import ...``: the datasets, splits and samplers it names are torch's own,
    and the batches are torch's, with worker processes too (``IterableDataset`` streams split
    by ``torch.utils.data.get_worker_info`` in them). (``shuffle=True`` is left out: our
    shuffled order is seeded per epoch, so that it resumes; it is not torch's.)"""
    theirs = a_torch_script(tud, num_workers)
    ours = a_torch_script(aioloader, num_workers)
    assert len(ours) == len(theirs) == 6
    for k, (mine, torchs) in enumerate(zip(ours, theirs, strict=True)):
        assert_same(mine, torchs, f"loader {k}")
    assert sum(len(batch) for batch in theirs[4]) == 60  # each stream once, whatever the workers


class Range(tud.IterableDataset[int]):
    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end))


def split_range(worker_id: int) -> None:
    """torch's documented ``worker_init_fn``: each worker takes its part of the range."""
    info = tud.get_worker_info()
    assert info is not None, "worker_init_fn called outside a worker"
    dataset = info.dataset
    per = math.ceil((dataset.end - dataset.start) / info.num_workers)
    dataset.start += worker_id * per
    dataset.end = min(dataset.start + per, dataset.end)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_worker_init_fn_runs_in_worker_processes_only(num_workers: int) -> None:
    """Found by review: with ``num_workers=0`` ours called it on its own thread, where torch's
    own example fails (``get_worker_info()`` is None), and a pool thread's failed initializer
    ended the epoch with ``BrokenThreadPool``."""
    batches = [
        sorted(int(x) for batch in cls(Range(3, 11), num_workers=num_workers,
                                       worker_init_fn=split_range) for x in batch)
        for cls in (tud.DataLoader, aioloader.DataLoader)
    ]  # fmt: skip
    assert batches[0] == batches[1] == list(range(3, 11))


class Buckets:
    """A batch sampler of the user's own over a sampler (bucketing, grouping): the loader
    cannot reach the sampler inside to give it its epoch."""

    def __init__(self, sampler: Iterable[int], size: int) -> None:
        self.sampler, self.size = sampler, size

    def __iter__(self) -> Iterator[list[int]]:
        order = list(self.sampler)
        return (order[i : i + self.size] for i in range(0, len(order), self.size))

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.size)  # type: ignore[arg-type]


@pytest.mark.parametrize("lib", [tud, aioloader], ids=["torch", "aioloader"])
def test_a_random_sampler_the_loader_cannot_reach_shuffles_each_epoch(lib: Any) -> None:
    """Found by review: inside a batch sampler of the user's own, ours gave the same order
    every epoch (its epoch only moved when a loader set it); torch's draws a new one at each
    iteration."""
    data = list(range(16))
    loader = lib.DataLoader(data, batch_sampler=Buckets(lib.RandomSampler(data), 4))
    epochs = [[int(x) for batch in loader for x in batch] for _ in range(3)]
    assert all(sorted(epoch) == data for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 3


@pytest.mark.parametrize("lib", [tud, aioloader], ids=["torch", "aioloader"])
def test_torch_manual_seed_after_the_loader_is_built_repeats_the_order(lib: Any) -> None:
    """Found by review: ours drew its order's seed as the loader was built, so a script that
    seeds after building its loaders shuffled differently at each run."""
    runs = []
    for _ in range(2):
        loader = lib.DataLoader(list(range(16)), batch_size=16, shuffle=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(5)
            runs.append([batch.tolist() for batch in loader])
    assert runs[0] == runs[1]


def test_pin_memory_device_is_warned_as_deprecated_in_torchs_words() -> None:
    """Found by review: torch warns that ``pin_memory_device`` is deprecated; ours was
    silent."""
    said = []
    for cls in (tud.DataLoader, aioloader.DataLoader):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            list(cls(list(range(4)), pin_memory=True, pin_memory_device="cpu"))
        said.append({str(w.message) for w in caught if "pin_memory_device" in str(w.message)})
    assert said[0] == said[1] and len(said[0]) == 1
    (ours,) = [w for w in caught if "pin_memory_device" in str(w.message)]
    assert ours.filename == __file__  # the line that built the loader
