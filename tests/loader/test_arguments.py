"""Argument validation of aioloader.DataLoader and aioloader.RetryPolicy.

A bad argument fails when the loader is built, never later at iteration, with a ValueError (out
of range, or in conflict with another argument) or a TypeError (wrong kind of object) whose
message names the argument.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import aioloader

N = 10


class _MapData(tud.Dataset[int]):
    """A torch map-style dataset of the ints 0..n-1."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class _TorchStream(tud.IterableDataset[int]):
    """A torch iterable dataset of the ints 0..n-1."""

    def __iter__(self) -> Iterator[int]:
        return iter(range(N))


class _AsyncStream(aioloader.AsyncIterableDataset[int]):
    """An aioloader async iterable dataset of the ints 0..n-1."""

    async def __aiter__(self) -> AsyncIterator[int]:
        for i in range(N):
            yield i


async def _async_gen() -> AsyncIterator[int]:
    for i in range(N):
        yield i


# (id, keyword arguments, exception type, name the message must contain)
_BAD: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("batch_size=0", {"batch_size": 0}, ValueError, "batch_size"),
    ("batch_size=-1", {"batch_size": -1}, ValueError, "batch_size"),
    ("batch_size=1.5", {"batch_size": 1.5}, ValueError, "batch_size"),
    ("batch_size=True", {"batch_size": True}, ValueError, "batch_size"),
    ("num_workers=-1", {"num_workers": -1}, ValueError, "num_workers"),
    ("num_workers=1.5", {"num_workers": 1.5}, ValueError, "num_workers"),
    ("timeout=-1", {"timeout": -1}, ValueError, "timeout"),
    ("timeout='1'", {"timeout": "1"}, ValueError, "timeout"),
    ("max_inflight=0", {"max_inflight": 0}, ValueError, "max_inflight"),
    ("max_inflight=-3", {"max_inflight": -3}, ValueError, "max_inflight"),
    ("max_inflight=True", {"max_inflight": True}, TypeError, "max_inflight"),
    ("prefetch=-1", {"prefetch": -1}, ValueError, "prefetch"),
    ("max_failures=-1", {"max_failures": -1}, ValueError, "max_failures"),
    ("sample_timeout=0", {"sample_timeout": 0}, ValueError, "sample_timeout"),
    ("sample_timeout=-1", {"sample_timeout": -1}, ValueError, "sample_timeout"),
    ("sample_timeout=nan", {"sample_timeout": float("nan")}, ValueError, "sample_timeout"),
    ("max_inflight_bytes=0", {"max_inflight_bytes": 0}, ValueError, "max_inflight_bytes"),
    ("io_threads=0", {"io_threads": 0}, ValueError, "io_threads"),
    ("sampler+shuffle", {"sampler": [0, 1], "shuffle": True}, ValueError, "sampler"),
    (
        "batch_sampler+batch_size",
        {"batch_sampler": [[0]], "batch_size": 4},
        ValueError,
        "batch_size",
    ),
    ("batch_sampler+shuffle", {"batch_sampler": [[0]], "shuffle": True}, ValueError, "shuffle"),
    ("batch_sampler+sampler", {"batch_sampler": [[0]], "sampler": [0]}, ValueError, "sampler"),
    (
        "batch_sampler+drop_last",
        {"batch_sampler": [[0]], "drop_last": True},
        ValueError,
        "drop_last",
    ),
    ("batch_size=None+drop_last", {"batch_size": None, "drop_last": True}, ValueError, "drop_last"),
    ("prefetch_factor+num_workers=0", {"prefetch_factor": 2}, ValueError, "prefetch_factor"),
    ("prefetch_factor=0", {"prefetch_factor": 0, "num_workers": 2}, ValueError, "prefetch_factor"),
    ("prefetch_factor=2.0", {"prefetch_factor": 2.0, "num_workers": 2}, TypeError, "an int"),
    (
        "persistent_workers+num_workers=0",
        {"persistent_workers": True},
        ValueError,
        "persistent_workers",
    ),
    (
        "multiprocessing_context+num_workers=0",
        {"multiprocessing_context": "spawn"},
        ValueError,
        "multiprocessing_context",
    ),
    ("transform", {"transform": 42}, TypeError, "transform"),
    ("collate_fn", {"collate_fn": "stack"}, TypeError, "collate_fn"),
    ("worker_init_fn", {"worker_init_fn": 0}, TypeError, "worker_init_fn"),
    ("retry", {"retry": 3}, TypeError, "retry"),
    ("retry=dict", {"retry": {"attempts": 3}}, TypeError, "retry"),
    ("seed+generator", {"seed": 0, "generator": torch.Generator()}, ValueError, "seed"),
    ("seed='x'", {"seed": "x"}, TypeError, "seed"),
    ("seed=1.0", {"seed": 1.0}, TypeError, "seed"),
    ("generator='g'", {"generator": "g"}, TypeError, "generator"),
    ("shuffle='yes'", {"shuffle": "yes"}, TypeError, "shuffle"),
    ("drop_last=None", {"drop_last": None}, ValueError, "drop_last"),  # torch's type
    ("in_order='no'", {"in_order": "no"}, TypeError, "in_order"),
    ("sampler+distributed", {"sampler": [0], "distributed": True}, ValueError, "sampler"),
    ("rank>=world_size", {"distributed": True, "rank": 2, "world_size": 2}, ValueError, "rank"),
    ("world_size=0", {"distributed": True, "rank": 0, "world_size": 0}, ValueError, "world_size"),
]


@pytest.mark.parametrize(
    ("kwargs", "exc", "name"),
    [pytest.param(kw, exc, name, id=case) for case, kw, exc, name in _BAD],
)
def test_bad_argument_raises_at_construction(
    kwargs: dict[str, Any], exc: type[Exception], name: str
) -> None:
    with pytest.raises(exc, match=re.escape(name)):
        aioloader.DataLoader(_MapData(), **kwargs)


def test_seed_and_generator_message_names_both() -> None:
    with pytest.raises(ValueError, match="generator"):
        aioloader.DataLoader(_MapData(), shuffle=True, seed=1, generator=torch.Generator())


def test_non_numeric_sample_timeout_is_named() -> None:
    with pytest.raises(TypeError, match="sample_timeout"):
        aioloader.DataLoader(_MapData(), sample_timeout="1")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "dataset", [object(), 42, "abc", b"abc", None, 1.5], ids=lambda d: type(d).__name__
)
def test_non_dataset_is_a_type_error(dataset: object) -> None:
    with pytest.raises(TypeError, match="dataset"):
        aioloader.DataLoader(dataset)


def test_dataset_error_comes_before_other_checks() -> None:
    with pytest.raises(TypeError, match="dataset"):
        aioloader.DataLoader(object(), batch_size=0)


_ITERABLES = [
    pytest.param(_TorchStream, id="torch-IterableDataset"),
    pytest.param(_AsyncStream, id="AsyncIterableDataset"),
    pytest.param(lambda: _async_gen, id="async-generator-function"),
    pytest.param(lambda: iter(range(N)), id="plain-iterator"),
]


@pytest.mark.parametrize("make", _ITERABLES)
@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        pytest.param({"shuffle": True}, "shuffle", id="shuffle"),
        pytest.param({"sampler": list(range(N))}, "sampler", id="sampler"),
        pytest.param({"batch_sampler": [[0, 1], [2]], "batch_size": 1}, "batch_sampler", id="bs"),
    ],
)
def test_map_only_options_reject_iterable_datasets(
    make: Any, kwargs: dict[str, Any], name: str
) -> None:
    with pytest.raises(ValueError, match=name):
        aioloader.DataLoader(make(), **kwargs)


@pytest.mark.parametrize("make", _ITERABLES)
def test_shuffle_false_is_fine_with_an_iterable_dataset(make: Any) -> None:
    loader: aioloader.DataLoader[Any] = aioloader.DataLoader(make(), batch_size=4, shuffle=False)
    assert loader.batch_size == 4


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        pytest.param({"attempts": 0}, "attempts", id="attempts=0"),
        pytest.param({"attempts": -1}, "attempts", id="attempts=-1"),
        pytest.param({"initial_backoff": -1}, "initial_backoff", id="initial_backoff=-1"),
        pytest.param({"max_backoff": -0.5}, "max_backoff", id="max_backoff=-0.5"),
        pytest.param({"multiplier": 0.5}, "multiplier", id="multiplier=0.5"),
        pytest.param(
            {"initial_backoff": float("nan")}, "initial_backoff", id="initial_backoff=nan"
        ),
    ],
)
def test_retry_policy_out_of_range(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        aioloader.RetryPolicy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        pytest.param({"retry_on": (int,)}, "retry_on", id="retry_on=(int,)"),
        pytest.param({"retry_on": [ValueError]}, "retry_on", id="retry_on=list"),
        pytest.param({"retry_on": ValueError}, "retry_on", id="retry_on=bare-type"),
        pytest.param({"attempts": 2.0}, "attempts", id="attempts=2.0"),
        pytest.param({"attempts": True}, "attempts", id="attempts=True"),
    ],
)
def test_retry_policy_wrong_type(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(TypeError, match=name):
        aioloader.RetryPolicy(**kwargs)


def test_retry_policy_accepts_valid_values() -> None:
    policy = aioloader.RetryPolicy(
        attempts=1, initial_backoff=0, max_backoff=0, multiplier=1, retry_on=(OSError,)
    )
    loader: aioloader.DataLoader[Any] = aioloader.DataLoader(_MapData(), retry=policy)
    assert len(loader) == N


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"batch_size": 1}, id="batch_size=1"),
        pytest.param({"batch_size": None}, id="batch_size=None"),
        pytest.param({"num_workers": 0, "timeout": 0, "prefetch": 0}, id="zeros"),
        pytest.param({"max_inflight": 1, "max_failures": 0, "io_threads": 1}, id="minimums"),
        pytest.param({"timeout": 0.5, "sample_timeout": 0.5}, id="float-timeouts"),
        pytest.param({"max_inflight_bytes": 1}, id="max_inflight_bytes=1"),
        pytest.param({"num_workers": 2, "prefetch_factor": 1}, id="prefetch_factor"),
        pytest.param(
            {"num_workers": 1, "persistent_workers": True, "multiprocessing_context": "spawn"},
            id="torch-worker-options",
        ),
        pytest.param({"shuffle": True, "seed": 3}, id="seed"),
        pytest.param({"shuffle": True, "generator": torch.Generator()}, id="generator"),
        pytest.param({"sampler": [3, 1, 2], "shuffle": False}, id="sampler+shuffle=False"),
        pytest.param({"batch_sampler": [[0, 1]], "batch_size": 1}, id="batch_sampler"),
        pytest.param({"retry": aioloader.RetryPolicy()}, id="retry"),
        pytest.param({"distributed": True, "rank": 1, "world_size": 2}, id="distributed"),
    ],
)
def test_boundary_values_are_accepted(kwargs: dict[str, Any]) -> None:
    aioloader.DataLoader(_MapData(), **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"batch_size": 3}, id="batch_size=3"),
        pytest.param({"batch_size": 1, "prefetch": 0, "max_inflight": 1}, id="tight-bounds"),
        pytest.param({"batch_size": 2, "max_inflight_bytes": 1, "io_threads": 1}, id="bytes=1"),
        pytest.param({"batch_size": None, "timeout": 30, "sample_timeout": 30}, id="timeouts"),
    ],
)
def test_boundary_values_iterate(kwargs: dict[str, Any]) -> None:
    batches: list[Any] = list(aioloader.DataLoader(list(range(N)), **kwargs))
    flat: list[int] = []
    for b in batches:
        flat += b.tolist() if isinstance(b, torch.Tensor) else [b]
    assert flat == list(range(N))


def test_set_epoch_rejects_negative() -> None:
    loader: aioloader.DataLoader[Any] = aioloader.DataLoader(_MapData(), shuffle=True, seed=0)
    with pytest.raises(ValueError, match="epoch"):
        loader.set_epoch(-1)


def test_pin_memory_without_accelerator_warns_and_still_works() -> None:
    if torch.cuda.is_available():
        pytest.skip("an accelerator is present: pin_memory=True pins instead of warning")
    samples = [{"x": torch.tensor([i, -i]), "y": i} for i in range(5)]
    with pytest.warns(UserWarning, match="pin_memory"):
        loader: aioloader.DataLoader[Any] = aioloader.DataLoader(
            samples, batch_size=2, pin_memory=True
        )
    batches = list(loader)
    expected: list[Any] = list(aioloader.DataLoader(samples, batch_size=2))
    assert len(batches) == len(expected) == 3
    for got, want in zip(batches, expected, strict=True):
        assert got.keys() == want.keys()
        for key in got:
            assert got[key].dtype == want[key].dtype
            assert torch.equal(got[key], want[key])
            assert not got[key].is_pinned()


def test_a_dataset_may_refuse_loader_options_it_cannot_work_with() -> None:
    class NeedsPairs(aioloader.AsyncIterableDataset[int]):
        def check_loader_options(
            self, *, batch_size: int | None, in_order: bool, distributed: bool
        ) -> None:
            if batch_size != 2:
                raise ValueError(f"batch_size must be 2 for pairs, got {batch_size}")

        async def __aiter__(self) -> Any:  # type: ignore[override]
            yield 1

    with pytest.raises(ValueError, match="batch_size must be 2 for pairs, got 3"):
        aioloader.DataLoader(NeedsPairs(), batch_size=3)
    assert aioloader.DataLoader(NeedsPairs(), batch_size=2).batch_size == 2


@pytest.mark.parametrize(
    ("build", "wrong_type", "out_of_range"),
    [
        (lambda v: aioloader.sources.files(".", threads=v), "8", 0),
        (lambda v: aioloader.sources.tar_shards(["a.tar"], timeout=v), "1", -1.0),
        (lambda v: aioloader.sources.urls(["http://h/a"], timeout=v), None, float("inf")),
        (lambda v: aioloader.sources.tar_shards(["a.tar"], shards_in_flight=v), 2.0, 0),
        (lambda v: aioloader.interleave([aioloader.AsyncIterableDataset], in_flight=v), "4", 0),
        (lambda v: aioloader.sources.slot_streams([1, 2], print, slots=2).set_epoch(v), "1", -1),
    ],
)
def test_our_checks_follow_one_rule(build: Any, wrong_type: object, out_of_range: object) -> None:
    """Wrong type: TypeError; right type, out of range: ValueError (torch's own DataLoader
    arguments keep torch's types instead)."""
    with pytest.raises(TypeError):
        build(wrong_type)
    with pytest.raises(ValueError, match="must be"):
        build(out_of_range)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("max_inflight", 4),
        ("sample_timeout", 1.0),
        ("max_inflight_bytes", 2**20),
        ("io_threads", 2),
    ],
)
def test_an_option_without_effect_in_worker_processes_warns_naming_it(
    name: str, value: object
) -> None:
    with pytest.warns(UserWarning, match=f"{name}={value!r} has no effect here") as caught:
        aioloader.DataLoader(_MapData(), num_workers=1, **{name: value})  # type: ignore[arg-type]
    assert "read in the worker processes" in str(caught[0].message)
    assert caught[0].filename == __file__  # at the user's call
    # Where the option applies, and at its default, nothing is said.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        aioloader.DataLoader(_MapData(), num_workers=0, **{name: value})  # type: ignore[arg-type]
        threads = {"num_workers": 1, "worker_mode": "thread", name: value}
        aioloader.DataLoader(_MapData(), **threads)  # type: ignore[arg-type]
        aioloader.DataLoader(_MapData(), num_workers=1)


@pytest.mark.parametrize(
    ("dataset", "workers"),
    [(_AsyncStream(), 0), (_async_gen, 0), (_TorchStream(), 0), (_TorchStream(), 1)],
    ids=["async-iterable", "async-generator-function", "iterable", "iterable-in-workers"],
)
@pytest.mark.parametrize(
    ("name", "value"), [("sample_timeout", 0.5), ("retry", aioloader.RetryPolicy(attempts=3))]
)
def test_a_stream_given_sample_timeout_or_retry_warns_naming_it(
    dataset: object, workers: int, name: str, value: object
) -> None:
    """A stream is read one item at a time from its iterator, which cannot be asked again for
    an item it failed to give: both options were taken and silently did nothing (found by
    review). For an ``IterableDataset`` in worker processes, ``sample_timeout`` is named by the
    workers' warning."""
    if workers and name == "sample_timeout":
        match = "read in the worker processes"
    else:
        match = f"^{name} has no effect here: an .*iterable dataset is read one item"
    with pytest.warns(UserWarning, match=match) as caught:
        aioloader.DataLoader(dataset, num_workers=workers, **{name: value})  # type: ignore[call-overload]
    assert len(caught) == 1 and caught[0].filename == __file__
    with warnings.catch_warnings():  # where they apply, and at their defaults, nothing is said
        warnings.simplefilter("error")
        aioloader.DataLoader(_async_map(), **{name: value})  # type: ignore[arg-type]
        aioloader.DataLoader(dataset, num_workers=workers)  # type: ignore[call-overload]


def _async_map() -> aioloader.AsyncDataset[int]:
    class Map(aioloader.AsyncDataset[int]):
        def __len__(self) -> int:
            return N

        async def get(self, index: int) -> int:
            return index

    return Map()


async def _async_transform(x: int) -> int:
    return x


class _AsyncCall:
    async def __call__(self, x: Any) -> Any:
        return x


@pytest.mark.parametrize("name", ["transform", "collate_fn", "worker_init_fn", "device_transform"])
@pytest.mark.parametrize(
    "fn",
    [_async_transform, _AsyncCall(), functools.partial(_async_transform)],
    ids=["function", "instance", "partial"],
)
def test_an_async_function_where_a_plain_one_is_called_is_refused(name: str, fn: Any) -> None:
    """It was taken, and each batch held coroutine objects never awaited (or failed to
    collate one), with a RuntimeWarning each (found by review)."""
    with pytest.raises(TypeError, match=f"^{name} is an async function: .* give a plain"):
        aioloader.DataLoader(_MapData(), **{name: fn})


def test_each_argument_is_declared_once_and_the_rest_agrees() -> None:
    """The signature is the declaration (for users and their tools); the Arguments record, the
    attribute each argument is read back through and the docstring's Args follow it."""
    import dataclasses
    import inspect

    from aioloader._loader.arguments import Arguments
    from aioloader._loader.settings import Setting

    params = list(inspect.signature(aioloader.DataLoader.__init__).parameters.values())[1:]
    fields = dataclasses.fields(Arguments)
    assert [p.name for p in params] == [f.name for f in fields]
    assert {p.name: p.default for p in params if p.default is not p.empty} == {
        f.name: f.default for f in fields if f.default is not dataclasses.MISSING
    }
    names = [p.name for p in params]
    settings = [n for n, v in vars(aioloader.DataLoader).items() if isinstance(v, Setting)]
    # torch keeps no shuffle attribute; progress is the method that draws the line.
    assert settings == [n for n in names if n not in ("shuffle", "progress")]
    # (cleaned: 3.13's compiler strips the docstring's indentation, earlier ones keep it)
    doc = inspect.cleandoc(aioloader.DataLoader.__doc__ or "")
    args = doc.partition("Args:")[2].partition("Raises:")[0]
    assert re.findall(r"^    (\w+):", args, re.M) == names
