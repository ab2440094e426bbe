"""torch's ``DataLoader`` and ours on the same generated arguments: every combination of
dataset kind, sample type, batching, shuffling, sampler, batch sampler, ``drop_last`` and
``collate_fn`` that hypothesis draws (valid or not) gives the same construction error, the same
``len()`` (or its error) and the same batches over two epochs.

The example-based tests (``test_torch_compat.py``) check each argument on its own; this one
checks them in combination, where a rule of one argument meets another's."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import aioloader
from tests.loader.test_torch_compat import assert_same


def make_sample(kind: str, i: int) -> Any:
    """Sample ``i`` of a dataset of ``kind``: each exercises another branch of collation (or,
    ``"failing"``, a dataset whose sample 5 raises)."""
    if kind == "int":
        return i
    if kind == "failing":
        if i == 5:
            raise KeyError(f"sample {i} is missing")
        return i
    if kind == "float":
        return i / 4
    if kind == "str":
        return f"s{i}"
    if kind == "tensor":
        return torch.arange(3) * i
    if kind == "numpy":
        return np.full((2,), i, dtype=np.int16)
    if kind == "tuple":
        return (torch.tensor(i, dtype=torch.float64), i, f"s{i}")
    return {"x": torch.full((2, 2), i), "meta": {"i": i, "tags": [i, i + 1]}}  # "nested"


KINDS = ["int", "float", "str", "tensor", "numpy", "tuple", "nested", "failing"]


class MapData(tud.Dataset[Any]):
    def __init__(self, n: int, kind: str) -> None:
        self.n, self.kind = n, kind

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < self.n:
            raise IndexError(index)
        return make_sample(self.kind, index)


class StreamData(tud.IterableDataset[Any]):
    def __init__(self, n: int, kind: str) -> None:
        self.n, self.kind = n, kind

    def __iter__(self) -> Iterator[Any]:
        return (make_sample(self.kind, i) for i in range(self.n))


class SplitStreamData(StreamData):
    """Each worker takes every ``num_workers``-th sample, from its id (torch's documented
    recipe): the workers' shares differ in length, so the order in which the loader takes
    batches from them shows (round robin, an exhausted worker skipped)."""

    def __iter__(self) -> Iterator[Any]:
        info = tud.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return (make_sample(self.kind, i) for i in range(start, self.n, step))


class SizedStreamData(StreamData):
    def __len__(self) -> int:
        return self.n


def tagged(batch: list[Any]) -> tuple[str, int, list[Any]]:
    return ("batch", len(batch), batch)


def identity(batch: list[Any]) -> list[Any]:
    return batch


COLLATES: dict[str, Callable[[Any], Any] | None] = {
    "default": None,
    "tagged": tagged,
    "identity": identity,
}


@st.composite
def arguments(
    draw: st.DrawFn,
) -> tuple[Callable[[], Any], dict[str, Any], Callable[[], dict[str, Any]]]:
    """``(dataset factory, plain kwargs, factory of the stateful kwargs)``: the stateful ones
    (generators, samplers) are made anew for each loader, from the same seeds."""
    n = draw(st.integers(0, 13))
    kind = draw(st.sampled_from(KINDS))
    style = draw(st.sampled_from(["map", "map", "stream", "sized-stream", "split-stream"]))
    dataset: Callable[[], Any] = {
        "map": lambda: MapData(n, kind),
        "stream": lambda: StreamData(n, kind),
        "sized-stream": lambda: SizedStreamData(n, kind),
        "split-stream": lambda: SplitStreamData(n, kind),
    }[style]
    kwargs: dict[str, Any] = {}
    if draw(st.booleans()):
        kwargs["batch_size"] = draw(st.one_of(st.none(), st.integers(-1, 5)))
    if draw(st.booleans()):
        kwargs["shuffle"] = draw(st.booleans())
    if draw(st.booleans()):
        kwargs["drop_last"] = draw(st.sampled_from([True, False] * 4 + [3]))
    kwargs["collate_fn"] = COLLATES[draw(st.sampled_from(sorted(COLLATES)))]
    if draw(st.booleans()):
        kwargs["pin_memory"] = draw(st.booleans())  # no accelerator here: a warning, as torch's
    if draw(st.booleans()):
        kwargs["in_order"] = draw(st.booleans())
    if draw(st.booleans()):  # torch's options of worker processes, mostly right
        kwargs["num_workers"] = draw(st.sampled_from([0, 1, 1, 2, 2, 2, -1]))
        kwargs["prefetch_factor"] = draw(st.sampled_from([None, None, None, 1, 3, -1]))
        kwargs["persistent_workers"] = draw(st.booleans())
        kwargs["multiprocessing_context"] = draw(st.sampled_from([None] * 4 + ["forkserver", "x"]))
        # A timeout with num_workers=0 is honoured here; torch's single-process iterator
        # fails an assert on it (a difference kept on purpose, docs/design.md).
        workers = kwargs["num_workers"] != 0
        kwargs["timeout"] = draw(st.sampled_from([0, 0, 0, 30, -1] if workers else [0, 0, -1]))
    seed = draw(st.integers(0, 2**16))
    sampler = draw(st.sampled_from([None, None, "list", "subset-random", "sequential"]))
    order = draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=12)) if n else []
    batch_sampler = draw(st.sampled_from([None, None, "lists", "torch"]))
    chunks = draw(st.integers(1, 4))
    with_generator = draw(st.booleans())

    def stateful() -> dict[str, Any]:
        made: dict[str, Any] = {}
        if with_generator:
            made["generator"] = torch.Generator().manual_seed(seed)
        if sampler == "list":
            made["sampler"] = list(order)
        elif sampler == "subset-random":
            made["sampler"] = tud.SubsetRandomSampler(
                order, generator=torch.Generator().manual_seed(seed + 1)
            )
        elif sampler == "sequential":
            made["sampler"] = tud.SequentialSampler(range(n))
        if batch_sampler == "lists":
            made["batch_sampler"] = [order[k : k + chunks] for k in range(0, len(order), chunks)]
        elif batch_sampler == "torch":
            made["batch_sampler"] = tud.BatchSampler(range(n), chunks, drop_last=n % 2 == 1)
        return made

    return dataset, kwargs, stateful


def drain(loader: Iterable[Any]) -> tuple[list[Any], Exception | None]:
    """An epoch's batches, up to the exception that ended it (if one did)."""
    batches: list[Any] = []
    iterator = iter(loader)
    try:
        for batch in iterator:
            batches.append(batch)
    except Exception as exc:  # compared with torch's
        if not getattr(loader, "persistent_workers", False):
            stop_torchs_workers(iterator)
        return batches, exc
    return batches, None


async def drain_async(loader: aioloader.DataLoader[Any]) -> tuple[list[Any], Exception | None]:
    """:func:`drain` with ``async for``, in the loader's scope."""
    batches: list[Any] = []
    try:
        async with loader:
            async for batch in loader:
                batches.append(batch)
    except Exception as exc:  # compared with torch's
        return batches, exc
    return batches, None


def assert_same_epoch(
    got: tuple[list[Any], Exception | None],
    want: tuple[list[Any], Exception | None],
    kwargs: dict[str, Any],
    what: str,
) -> None:
    """The same batches before the same type of failure (if any); with ``in_order=False``,
    the same batches in any order (when no failure makes which ones came first a race)."""
    (batches, failed), (wanted, torch_failed) = got, want
    assert type(failed) is type(torch_failed), (what, failed, torch_failed)
    if kwargs.get("in_order", True):
        assert_same(batches, wanted, what)
    elif torch_failed is None:
        assert_same(sorted(batches, key=repr), sorted(wanted, key=repr), what)


def stop_torchs_workers(iterator: object) -> None:
    """Stop the workers of torch's iterator (a private call, in a test only): an iterator an
    exception ended is left to the garbage collector, and its ``__del__``, when that runs on
    another thread (our loop's, say), waits 5 s per worker for them to exit."""
    stop: Callable[[], None] | None = getattr(iterator, "_shutdown_workers", None)
    if stop is not None:
        stop()


class Replay(tud.Sampler[int]):
    """Yields the given orders, one per epoch: torch's loader replays ours. An order is
    taken at the first index drawn, not at ``iter()``: torch's worker iterator calls
    ``iter(sampler)`` twice as it starts (in ``__init__`` and ``_reset``), and uses the
    second."""

    def __init__(self, orders: list[list[int]]) -> None:
        self.orders, self.n = iter(orders), len(orders[0])

    def __iter__(self) -> Iterator[int]:
        yield from next(self.orders)

    def __len__(self) -> int:
        return self.n


def outcome(call: Callable[[], Any], warned: list[str] | None = None) -> tuple[str, Any]:
    """``("ok", value)`` or ``("raised", exception)``; the warnings given on the way are added
    to ``warned`` (their category and first words: each library words its own detail)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return "ok", call()
        except Exception as exc:  # compared with torch's below
            return "raised", exc
        finally:
            if warned is not None:
                warned.extend(  # the loaders' own (not, say, Python's about fork and threads)
                    f"{w.category.__name__}: {str(w.message)[:24]}"
                    for w in caught
                    if issubclass(w.category, UserWarning)
                )


def assert_same_outcome(ours: tuple[str, Any], torchs: tuple[str, Any], what: str) -> None:
    """The same value, or the same exception type with torch's words first."""
    if torchs[0] == "raised":
        assert ours[0] == "raised", f"{what}: torch raised {torchs[1]!r}, ours gave {ours[1]!r}"
        assert type(ours[1]) is type(torchs[1]), f"{what}: {ours[1]!r} != torch's {torchs[1]!r}"
        # torch's words first (an object's address aside); our detail may follow them.
        mine, its = (re.sub(r" at 0x[0-9a-f]+", "", str(e)) for e in (ours[1], torchs[1]))
        assert mine.startswith(its.rstrip(".")), f"{what}: {mine!r} is not torch's {its!r}"
    else:
        assert ours[0] == "ok", f"{what}: ours raised {ours[1]!r}, torch gave {torchs[1]!r}"
        assert_same(ours[1], torchs[1], what)


def own_shuffle(loader: aioloader.DataLoader[Any]) -> bool:
    return isinstance(loader.sampler, aioloader.RandomSampler)


def made_with_seed_7(make: Callable[[], Any], warned: list[str]) -> tuple[str, Any]:
    """``outcome(make)`` with torch's default generator seeded 7 as it is built and as its
    shuffled order's seed is drawn (at its first use, as torch draws at an epoch's start)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        made = outcome(make, warned)
        if made[0] == "ok" and own_shuffle(made[1]) and made[1].sampler.generator is None:
            assert isinstance(made[1].sampler.seed, int)  # (given a generator, none drawn)
    return made


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(arguments())
def test_every_combination_of_arguments_behaves_as_torchs(
    args: tuple[Callable[[], Any], dict[str, Any], Callable[[], dict[str, Any]]],
) -> None:
    dataset, kwargs, stateful = args
    warned_torch: list[str] = []
    warned_ours: list[str] = []
    made_torch = outcome(lambda: tud.DataLoader(dataset(), **kwargs, **stateful()), warned_torch)
    made_ours = made_with_seed_7(
        lambda: aioloader.DataLoader(dataset(), **kwargs, **stateful()), warned_ours
    )
    drawn = made_ours[0] == "ok" and own_shuffle(made_ours[1]) and made_ours[1].sampler.generator
    if made_ours[0] == "ok" and made_torch[0] == "ok" and own_shuffle(made_ours[1]) and not drawn:
        # Our shuffled order is ours (a seed per epoch, so that it resumes), not torch's:
        # torch's loader replays it, as our sampler gives it for each epoch. (Given a
        # generator, ours draws as torch's, from it.)
        orders = []
        for epoch in range(2):
            sampler = aioloader.RandomSampler(
                len(made_ours[1].dataset), seed=made_ours[1].sampler.seed
            )
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        plain = {k: v for k, v in kwargs.items() if k != "shuffle"}
        made_torch = outcome(lambda: tud.DataLoader(dataset(), sampler=Replay(orders), **plain))
    if made_torch[0] == "raised" or made_ours[0] == "raised":
        event(f"refused: {str(made_torch[1])[:40]}")
        assert_same_outcome(made_ours, made_torch, "construction")
        return
    event(f"iterated, num_workers={kwargs.get('num_workers', 0)}")
    theirs, ours = made_torch[1], made_ours[1]
    # One scope for both epochs (ours: torch has none), but where the order is drawn from the
    # generator: torch draws its workers' seed from it at each iterator, ours at each scope
    with contextlib.nullcontext() if drawn else ours:
        assert_same_outcome(
            outcome(lambda: len(ours), warned_ours),
            outcome(lambda: len(theirs), warned_torch),
            "len()",
        )
        epochs = []
        for epoch in range(2):
            got = outcome(functools.partial(drain, ours), warned_ours)[1]
            epochs.append(want := outcome(functools.partial(drain, theirs), warned_torch)[1])
            assert_same_epoch(got, want, kwargs, f"epoch {epoch}")
    stop_torchs_workers(getattr(theirs, "_iterator", None))  # persistent workers'
    # ``async for`` (its own path: a batch made in ``__anext__``, or by the stages) gives the
    # first epoch again, from a loader made as ours was.
    again = made_with_seed_7(
        lambda: aioloader.DataLoader(dataset(), **kwargs, **stateful()), warned_ours
    )
    got = outcome(lambda: asyncio.run(drain_async(again[1])), warned_ours)[1]
    assert_same_epoch(got, epochs[0], kwargs, "async for, epoch 0")
    # The same warnings, once each (torch gives some at each epoch, ours once a loader).
    assert set(warned_ours) == set(warned_torch)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")  # 2 CPUs
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("num_workers", [2, 3])
def test_a_stream_split_by_worker_comes_in_torchs_order(num_workers: int, drop_last: bool) -> None:
    """Workers with shares of 4, 3 (and 3) samples in batches of 2: each worker's last batch
    is short (or dropped), and the exhausted ones are skipped in the round robin."""
    kwargs: dict[str, Any] = {"batch_size": 2, "num_workers": num_workers, "drop_last": drop_last}
    theirs = list(tud.DataLoader(SplitStreamData(7 + num_workers - 2, "int"), **kwargs))
    with aioloader.DataLoader(SplitStreamData(7 + num_workers - 2, "int"), **kwargs) as ours:
        assert_same(list(ours), theirs)


@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize("batch_size", [None, 1, 2])
def test_every_batch_before_a_streams_failure_is_delivered_as_torchs(
    batch_size: int | None, num_workers: int
) -> None:
    """Found by the test above: a blocking stream read in this process is pulled in chunks
    on a thread, and a failure mid-chunk lost the chunk's samples before it."""
    kwargs: dict[str, Any] = {"batch_size": batch_size, "num_workers": num_workers}
    want, torch_failed = drain(tud.DataLoader(StreamData(9, "failing"), **kwargs))
    with aioloader.DataLoader(StreamData(9, "failing"), **kwargs) as loader:
        got, failed = drain(loader)
    assert len(want) == (2 if batch_size == 2 else 5)  # a batch cut short is not delivered
    assert_same(got, want)
    assert type(failed) is type(torch_failed) is KeyError
