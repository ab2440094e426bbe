"""Samples and batches of the user's own container types, through worker processes: of their own
type as torch's loader gives them, and never written into the original (found by review: a
dataset's cached sample of a ``MutableMapping`` type changed under a worker's in-place
transform, epoch after epoch; ``Vec(*items)`` came back holding one list; a batch that holds
itself raised ``RecursionError``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import aioloader
from aioloader._base.tree import map_tensors


class Sample(MutableMapping[str, Any]):
    """Its items in a dict of its own, no ``__copy__``: a shallow copy shares that dict."""

    def __init__(self, **items: Any) -> None:
        self._d = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._d[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._d[key] = value

    def __delitem__(self, key: str) -> None:
        del self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


class Pair(Sequence[torch.Tensor]):
    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self._v = (a, b)

    def __getitem__(self, i: Any) -> Any:
        return self._v[i]

    def __len__(self) -> int:
        return 2


class Vec(Sequence[torch.Tensor]):
    def __init__(self, *items: torch.Tensor) -> None:
        self._v = items

    def __getitem__(self, i: Any) -> Any:
        return self._v[i]

    def __len__(self) -> int:
        return len(self._v)


class Record(Mapping[str, torch.Tensor]):
    def __init__(self, **items: torch.Tensor) -> None:
        self._d = items

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


class Tagged(tuple):  # type: ignore[type-arg]
    tag: str

    def __new__(cls, items: Any, tag: str) -> Tagged:
        made = super().__new__(cls, items)
        made.tag = tag
        return made

    def __reduce__(self) -> Any:
        return (Tagged, (tuple(self), self.tag))


class Cached(aioloader.AsyncDataset[Sample]):
    def __init__(self) -> None:
        self.cache = [Sample(image=torch.full((4,), float(i)), label=i) for i in range(8)]

    def __len__(self) -> int:
        return len(self.cache)

    async def get(self, index: int) -> Sample:
        return self.cache[index]


def brighten(sample: Sample) -> torch.Tensor:
    sample["image"].add_(100)  # in place, on the worker's copy
    assert type(sample) is Sample  # the sample's own type reached the transform
    return sample["image"]


def test_a_worker_s_in_place_transform_leaves_the_dataset_s_cached_sample_alone() -> None:
    ds = Cached()
    loader = aioloader.DataLoader(ds, batch_size=4, num_workers=1, transform=brighten)
    for _ in range(2):  # it added up, epoch after epoch
        batches = [b[:, 0].tolist() for b in loader]
        assert batches == [[100.0, 101.0, 102.0, 103.0], [104.0, 105.0, 106.0, 107.0]]
    assert [s["image"].tolist() for s in ds.cache] == [[float(i)] * 4 for i in range(8)]
    assert not ds.cache[0]["image"].is_shared()


class Rows(tud.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((3,), float(index))


def pair(samples: list[torch.Tensor]) -> Pair:
    x = torch.stack(samples)
    return Pair(x, x + 1)


def vec(samples: list[torch.Tensor]) -> Vec:
    x = torch.stack(samples)
    return Vec(x, x + 1)


def record(samples: list[torch.Tensor]) -> Record:
    x = torch.stack(samples)
    return Record(image=x, label=x.sum(1))


def tagged(samples: list[torch.Tensor]) -> Tagged:
    x = torch.stack(samples)
    return Tagged((x, x + 1), "train")


def described(batch: Any) -> tuple[Any, ...]:
    items = list(batch.values()) if isinstance(batch, Mapping) else list(batch)
    return (type(batch), getattr(batch, "tag", None), [t.tolist() for t in items])


@pytest.mark.parametrize("collate", [pair, vec, record, tagged])
@pytest.mark.parametrize("workers", [0, 1])
def test_a_batch_of_the_user_s_own_type_comes_as_torch_s(collate: Any, workers: int) -> None:
    # It came back as a plain list, dict or tuple, or a Vec holding one list
    theirs = list(tud.DataLoader(Rows(), batch_size=2, num_workers=workers, collate_fn=collate))
    ours = list(aioloader.DataLoader(Rows(), batch_size=2, num_workers=workers, collate_fn=collate))
    assert [described(b) for b in ours] == [described(b) for b in theirs]


def graph(samples: list[torch.Tensor]) -> dict[str, Any]:
    root: dict[str, Any] = {"feats": torch.stack(samples), "children": []}
    root["children"].append({"parent": root, "x": torch.ones(2)})
    return root


@pytest.mark.parametrize("workers", [0, 1])
def test_a_batch_that_holds_itself_is_delivered(workers: int) -> None:
    loader = aioloader.DataLoader(Rows(), batch_size=2, num_workers=workers, collate_fn=graph)
    batches = list(loader)  # RecursionError, as its bytes were counted and its tensors packed
    assert [b["feats"][:, 0].tolist() for b in batches] == [[0.0, 1.0], [2.0, 3.0]]
    assert all(b["children"][0]["x"].tolist() == [1.0, 1.0] for b in batches)


def test_the_walk_rebuilds_a_type_of_the_user_s_around_the_new_values_only() -> None:
    sample = Sample(image=torch.zeros(2), meta={"id": 7})
    moved = map_tensors(lambda t: t + 1, sample)
    assert type(moved) is Sample and moved["image"].tolist() == [1.0, 1.0]
    assert sample["image"].tolist() == [0.0, 0.0]  # the original's own dict untouched
    assert moved["meta"] is sample["meta"]  # what did not change is shared, not copied


def twice_linked(samples: list[torch.Tensor]) -> list[dict[str, Any]]:
    nodes: list[dict[str, Any]] = []
    nodes += [{"x": torch.stack(samples), "graph": nodes}, {"x": torch.ones(2), "graph": nodes}]
    return nodes


def test_a_batch_linked_to_itself_twice_is_counted_once_each() -> None:
    # A depth bound on the count made it grow as 3 ** (depth / 2): the loader hung.
    from aioloader._pipeline.flow import nbytes_of

    nodes = twice_linked([torch.zeros(4)])
    assert nbytes_of(nodes) == 4 * 4 + 2 * 4
    loader = aioloader.DataLoader(Rows(), batch_size=2, collate_fn=twice_linked)
    assert [b[0]["x"][:, 0].tolist() for b in loader] == [[0.0, 1.0], [2.0, 3.0]]


def counter(samples: list[torch.Tensor]) -> Any:
    from collections import Counter

    return Counter(a=torch.stack(samples), b=torch.ones(2))


@pytest.mark.parametrize("workers", [0, 1])
def test_a_counter_batch_is_not_added_to_itself(workers: int) -> None:
    # Rebuilt with update(), which a Counter adds with: every tensor doubled
    theirs = [
        dict(b)
        for b in tud.DataLoader(Rows(), batch_size=2, num_workers=workers, collate_fn=counter)
    ]
    ours = [
        dict(b)
        for b in aioloader.DataLoader(Rows(), batch_size=2, num_workers=workers, collate_fn=counter)
    ]
    assert [{k: v.tolist() for k, v in b.items()} for b in ours] == [
        {k: v.tolist() for k, v in b.items()} for b in theirs
    ]


class Vocabulary(Record):
    """Read-only, with a large attribute beside its items."""

    def __init__(self, vocab: dict[str, int], **items: torch.Tensor) -> None:
        super().__init__(**items)
        self.vocab = vocab


def test_a_rebuilt_container_shares_what_is_not_its_items_storage() -> None:
    # Its vocabulary was deep-copied at every rebuild (1 s for 200k entries)
    vocab = {str(i): i for i in range(1000)}
    moved = map_tensors(lambda t: t + 1, Vocabulary(vocab, x=torch.zeros(1)))
    assert type(moved) is Vocabulary and moved.vocab is vocab and moved["x"].tolist() == [1.0]
