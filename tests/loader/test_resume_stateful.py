"""torchdata's ``Stateful`` protocol: a blocking stream's state may live on the dataset, on
the iterator its ``__iter__`` gives, or on both, and a resumed pass puts them back in
torchdata's order (the dataset's, ``iter()``, the iterator's), in the process and in workers."""

from __future__ import annotations

import collections
import itertools
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch.utils.data
from hypothesis import given, settings
from hypothesis import strategies as st

from aioloader import DataLoader
from aioloader._base.stateful import ITERATOR_STATE, TAG, StatefulPass, decode, encode
from tests.support.helpers import stop_and_resume
from tests.support.worker_datasets import (
    CountedCursorShards,
    Cursor,
    CursorShards,
    Draws,
    ResumableShards,
    SlowCursorShards,
    eight_and_ten_fail,
    fails_on_four,
    fails_on_zero,
    four_fails,
)


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
    full, first, rest, state = stop_and_resume(lambda: make(kind, **kw), stop)
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


def test_a_later_epoch_of_persistent_workers_resumes_from_where_its_passes_began() -> None:
    """The dataset keeps the state and ``__iter__`` is a generator function: before a pass's
    first item its ``state_dict()`` still says where the last pass ended, so a worker that gave
    nothing yet must not be saved at that place."""

    def make() -> DataLoader[Any]:
        kw: dict[str, Any] = {"num_workers": 2, "persistent_workers": True, "collate_fn": list}
        return DataLoader(ResumableShards(24), batch_size=2, **kw)

    with make() as whole:
        list(whole)
        uninterrupted = list(whole)
    with make() as loader:
        list(loader)
        it = iter(loader)
        first = [next(it)]
        state = json.loads(json.dumps(loader.state_dict()))
        it.close()
    with make() as resumed:
        resumed.load_state_dict(state)
        assert first + list(resumed) == uninterrupted


class Gated(ResumableShards):
    """``range(6)``, the dataset keeping the place in its generator ``__iter__``, whose first
    item waits for ``gate``; ``opened`` says the pass began."""

    def __init__(self) -> None:
        super().__init__(6)
        self.opened, self.gate = threading.Event(), threading.Event()

    def __iter__(self) -> Iterator[int]:
        self.opened.set()
        self.gate.wait(10)
        yield from super().__iter__()


def test_a_state_saved_as_a_pass_opens_is_the_epochs_start() -> None:
    """In the process, from another thread, while epoch 1's pass is open and its first item
    not read: the dataset's state still says epoch 0 ended; the saved state must not."""
    dataset = Gated()
    loader = DataLoader(dataset, batch_size=2, collate_fn=list)
    dataset.gate.set()
    assert list(loader) == [[0, 1], [2, 3], [4, 5]]
    dataset.gate.clear()
    dataset.opened.clear()
    it = iter(loader)
    reader = threading.Thread(target=lambda: next(it))
    reader.start()
    assert dataset.opened.wait(10)
    state = json.loads(json.dumps(loader.state_dict()))
    dataset.gate.set()
    reader.join(10)
    it.close()
    assert state["epoch"] == 1 and state["taken"]["through"] == 0
    resumed = DataLoader(Gated(), batch_size=2, collate_fn=list)
    resumed.dataset.gate.set()
    resumed.load_state_dict(state)
    assert list(resumed) == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.parametrize("in_order", [True, False])
def test_workers_whose_first_batch_failed_resume_without_losing_a_sample(in_order: bool) -> None:
    """Only the iterators keep the state; worker 1 opens late. The failed batch was taken (as
    its error, with worker 0's place after it): resumed, the epoch goes on past it, and never
    loses a sample of another batch."""

    def make() -> DataLoader[Any]:
        return DataLoader(
            SlowCursorShards(24, 0.3),
            batch_size=2,
            num_workers=2,
            collate_fn=fails_on_zero,
            in_order=in_order,
        )

    loader = make()
    it = iter(loader)
    first: list[list[int]] = []  # (out of order, worker 1's batches may come before)
    failed: list[str] = []
    while not failed and len(first) < 13:
        try:
            first.append(next(it))
        except ValueError as exc:
            failed.append(str(exc))
    assert failed == ["the batch holding sample 0"]
    state = json.loads(json.dumps(loader.state_dict()))
    it.close()
    resumed = make()
    resumed.load_state_dict(state)
    rest: list[list[int]] = []
    resumed_it = iter(resumed)
    while True:
        try:
            rest.append(next(resumed_it))
        except StopIteration:
            break
        except ValueError:
            assert not in_order  # taken before: re-delivered only out of order
    values = sorted(i for b in first + rest for i in b)
    lost = [1000, 1002]  # worker 0's first batch (a pass's samples are offset by 1000)
    assert values == sorted(set(range(1000, 1024)) - set(lost))


def same(a: Any, b: Any) -> bool:
    """Equal values of the same types, containers compared item by item."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


TENSOR_DTYPES = [torch.uint8, torch.int64, torch.float32, torch.bfloat16, torch.bool]
leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=5)
    | st.binary(max_size=5)
    | st.builds(
        lambda shape, dtype: (torch.arange(int(np.prod(shape))) % 3).to(dtype).reshape(shape),
        st.lists(st.integers(0, 3), max_size=3),
        st.sampled_from(TENSOR_DTYPES),
    )
    | st.builds(
        lambda n, dtype: np.arange(n).astype(dtype),
        st.integers(0, 4),
        st.sampled_from(["<u4", ">i8", "<f2", "<M8[s]", "<U3", "?"]),
    )
    | st.builds(np.int64, st.integers(-5, 5))
    | st.builds(np.float32, st.floats(-1, 1, width=32))
)
states = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=3) | st.integers(-3, 3), inner, max_size=3)
        | st.dictionaries(st.just(TAG), inner, max_size=1)
    ),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(states)
def test_a_state_comes_back_through_json_as_it_was_given(state: Any) -> None:
    text = json.dumps(encode(state))
    assert same(decode(json.loads(text)), state)


def test_what_json_cannot_keep_exactly_is_named_or_made_plain() -> None:
    point = collections.namedtuple("point", "x y")
    back = decode(json.loads(json.dumps(encode([collections.Counter({3: 2}), point(1, 2)]))))
    assert back == [{3: 2}, (1, 2)] and type(back[0]) is dict  # plain, keys as they were
    conj = torch.tensor([1 + 2j]).conj()
    assert torch.equal(decode(json.loads(json.dumps(encode(conj)))), conj.resolve_conj())
    with pytest.raises(TypeError, match="not JSON serializable"):
        json.dumps(encode(np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")])))  # fields: not kept
    with pytest.raises(ValueError, match="'tensor' value is malformed"):
        decode({TAG: "tensor", "dtype": "nope", "shape": [1], "data": ""})


def _take_through_errors(loader: DataLoader[Any], count: int) -> tuple[list[Any], list[str]]:
    """The first ``count`` items of an epoch: batches, and the messages of the errors raised
    in their turns (the iterator goes on after one, as torch's does)."""
    it = iter(loader)
    items: list[Any] = []
    errors: list[str] = []
    while len(items) + len(errors) < count:
        try:
            items.append(next(it))
        except ValueError as exc:
            errors.append(str(exc))
    return items, errors


def test_a_worker_batch_that_failed_is_not_read_again_on_resuming() -> None:
    """Worker 0's second batch ([4, 6]) fails in collate; the state after the batch that
    follows it is past it: the resumed epoch neither raises it again nor shifts the turns."""

    def make() -> DataLoader[Any]:
        return DataLoader(
            ResumableShards(16), batch_size=2, num_workers=2, collate_fn=fails_on_four
        )

    with make() as loader:
        first, errors = _take_through_errors(loader, 4)
        state = json.loads(json.dumps(loader.state_dict()))
    assert first == [[0, 2], [1, 3], [5, 7]] and errors == ["the batch holding sample 4"]
    with make() as resumed:
        resumed.load_state_dict(state)
        assert list(resumed) == [[8, 10], [9, 11], [12, 14], [13, 15]]


def skipping(
    length: int, transform: Callable[[int], int], *, budget: int
) -> Callable[[], DataLoader[Any]]:
    """Loaders over :class:`ResumableShards` in 2 workers (batches of 2) whose ``transform``
    fails on some samples, skipped within ``budget``."""

    def make() -> DataLoader[Any]:
        return DataLoader(
            ResumableShards(length),
            batch_size=2,
            num_workers=2,
            transform=transform,
            max_failures=budget,
            collate_fn=list,
        )

    return make


@pytest.mark.parametrize("stop", [3, 4])
def test_a_worker_batch_with_a_skipped_sample_keeps_its_place(stop: int) -> None:
    """Sample 4 fails in the transform and is skipped (``max_failures``): worker 0's second
    batch is [6], and a state taken after it (or after the batch that follows) is past it:
    the resumed epoch gives every other sample once, and skips nothing again."""

    full, first, rest, _ = stop_and_resume(skipping(16, four_fails, budget=1), stop)
    assert full == [[0, 2], [1, 3], [6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert first + rest == full


def test_a_worker_batch_whose_samples_were_all_skipped_keeps_its_place() -> None:
    """Worker 0's third batch ([8, 10]) loses both samples under ``max_failures`` (found by
    review): a state taken after the batch that follows it is past it, so the resumed epoch
    neither reads nor skips them again."""

    make = skipping(12, eight_and_ten_fail, budget=2)
    with make() as loader:
        it = iter(loader)
        first = list(itertools.islice(it, 5))
        state = json.loads(json.dumps(loader.state_dict()))
        it.close()
    assert first == [[0, 2], [1, 3], [4, 6], [5, 7], [9, 11]]
    with make() as resumed:
        resumed.load_state_dict(state)
        assert list(resumed) == []
        assert resumed.statistics().stage("transform").skipped == 0
