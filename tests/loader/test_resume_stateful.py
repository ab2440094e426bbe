"""torchdata's ``Stateful`` protocol: a blocking stream's state may live on the dataset, on
the iterator its ``__iter__`` gives, or on both, and a resumed pass puts them back in
torchdata's order (the dataset's, ``iter()``, the iterator's), in the process and in workers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch.utils.data

from aioloader import DataLoader
from aioloader._base.stateful import ITERATOR_STATE, StatefulPass
from tests.support.worker_datasets import CountedCursorShards, Cursor, CursorShards, Draws


class Calls(torch.utils.data.IterableDataset[int]):
    """Records the order the protocol's calls reach it and its iterator."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def state_dict(self) -> dict[str, int]:
        return {"d": 1}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.calls.append(f"dataset.load {state}")

    def __iter__(self) -> Cursor:
        self.calls.append("iter")
        calls = self.calls

        class Logged(Cursor):
            def load_state_dict(self, state: dict[str, int]) -> None:
                calls.append(f"iterator.load {state}")
                super().load_state_dict(state)

        return Logged([5, 6, 7])


def test_a_pass_puts_the_states_back_in_torchdatas_order() -> None:
    dataset = Calls()
    run = StatefulPass(dataset)
    assert run.resumable and next(run.items) == 5
    state = run.state()
    assert state == {ITERATOR_STATE: {"i": 1}, "dataset": {"d": 1}}
    again = StatefulPass(dataset, json.loads(json.dumps(state)))
    assert dataset.calls == ["iter", "dataset.load {'d': 1}", "iter", "iterator.load {'i': 1}"]
    assert list(again.items) == [6, 7]


class OwnIterator(torch.utils.data.IterableDataset[int]):
    """Its own iterator, whose ``__iter__`` starts over (so its state must be loaded after
    it, as torchdata does)."""

    def __init__(self) -> None:
        self.i = 0

    def __iter__(self) -> Iterator[int]:
        self.i = 0
        return self

    def __next__(self) -> int:
        self.i += 1
        if self.i > 3:
            raise StopIteration
        return self.i

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = state["i"]


def test_a_dataset_that_is_its_own_iterator_is_loaded_after_its_iter() -> None:
    run = StatefulPass(OwnIterator())
    next(run.items)
    state = run.state()
    assert state == {ITERATOR_STATE: {"i": 1}, "dataset": None}  # one state, not two
    assert list(StatefulPass(OwnIterator(), state).items) == [2, 3]


class Plain(torch.utils.data.IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(3))


def test_a_pass_without_state_says_so_and_a_state_of_another_kind_is_named() -> None:
    plain = StatefulPass(range(3))
    assert not plain.resumable and plain.state() is None
    with pytest.raises(TypeError, match=r"state of the iterator Plain\.__iter__\(\) gave"):
        StatefulPass(Plain(), {ITERATOR_STATE: {"i": 1}, "dataset": None})
    with pytest.raises(TypeError, match="range defines no state_dict"):
        StatefulPass(range(3), {"i": 1})


def make(kind: type, **kw: Any) -> DataLoader[Any]:
    return DataLoader(kind(40), batch_size=3, collate_fn=list, **kw)


@pytest.mark.parametrize("kind", [CursorShards, CountedCursorShards])
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"num_workers": 2},
        {"num_workers": 2, "in_order": False},
        {"num_workers": 2, "persistent_workers": True},
    ],
)
@pytest.mark.parametrize("stop", [0, 1, 4, 9])
def test_a_stream_whose_iterator_keeps_the_state_resumes(
    kind: type, kw: dict[str, Any], stop: int
) -> None:
    with make(kind, **kw) as loader:
        full = list(loader)
    with make(kind, **kw) as loader:
        it = iter(loader)
        first = [next(it) for _ in range(stop)]
        state = json.loads(json.dumps(loader.state_dict()))
        it.close()
    with make(kind, **kw) as resumed:
        resumed.load_state_dict(state)
        rest = list(resumed)
    if kw.get("in_order", True):
        assert first + rest == full
    else:
        assert sorted(i for b in first + rest for i in b) == sorted(i for b in full for i in b)
    if stop:
        saved = state["stream"]["dataset"]
        places = saved["workers"].values() if "workers" in saved else [saved]
        for place in places:
            assert ITERATOR_STATE in place
            assert place["dataset"] == ({"passes": 1} if kind is CountedCursorShards else None)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop", [1, 4])
def test_an_rng_state_in_the_state_resumes_the_same_draws(workers: int, stop: int) -> None:
    """The state holds a tensor, a tuple, an int-keyed dict and an array: it is JSON, and each
    comes back as it was. With 2 workers and ``stop=1``, one worker gave nothing yet: its pass
    resumes from where it began (its RNG then), not anew."""

    def make() -> DataLoader[Any]:
        return DataLoader(Draws(12), batch_size=2, num_workers=workers, collate_fn=list)

    loader = make()
    it = iter(loader)
    first = [next(it) for _ in range(stop)]
    text = json.dumps(loader.state_dict())
    rest_uninterrupted = list(it)
    resumed = make()
    resumed.load_state_dict(json.loads(text))
    assert list(resumed) == rest_uninterrupted
    assert len(first) + len(rest_uninterrupted) == 6 * max(workers, 1)


def test_a_pass_gives_items_that_cannot_be_compared() -> None:
    """Items are never compared with anything (a NumPy array's ``==`` is elementwise)."""
    arrays = [np.zeros(2), np.ones(2)]
    assert [a.tolist() for a in StatefulPass(arrays).items] == [[0.0, 0.0], [1.0, 1.0]]
