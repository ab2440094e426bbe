"""Tests for aioloader._data.sampler: seeds, samplers and sharding rules."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.utils.data as tud
from hypothesis import given, settings
from hypothesis import strategies as st

from aioloader._data.sampler import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
)
from aioloader._data.seeds import derive_seed
from aioloader._data.sharding import resolve_rank, shard, shard_length, shard_stream_position

FAST = settings(max_examples=100, deadline=None)

lengths = st.integers(min_value=0, max_value=200)
seeds = st.integers(min_value=-(2**70), max_value=2**70)
epochs = st.integers(min_value=0, max_value=1000)
world_sizes = st.integers(min_value=1, max_value=9)


class _Dataset(tud.Dataset[int]):
    """A dummy map-style dataset of a given length, for torch's samplers."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class _Unsized:
    """An iterable of indices with no length."""

    def __iter__(self) -> Iterator[int]:
        return iter(range(3))


# derive_seed


@FAST
@given(st.lists(seeds, max_size=4))
def test_derive_seed_deterministic_and_in_range(parts: list[int]) -> None:
    seed = derive_seed(*parts)
    assert seed == derive_seed(*parts)
    assert 0 <= seed < 2**63


@FAST
@given(st.lists(seeds, max_size=4), st.lists(seeds, max_size=4))
def test_derive_seed_differs_for_different_parts(a: list[int], b: list[int]) -> None:
    if a != b:
        assert derive_seed(*a) != derive_seed(*b)


def test_derive_seed_known_cases() -> None:
    # Order, arity and sign all matter; a 63-bit seed is accepted by torch.
    assert derive_seed(1, 2) != derive_seed(2, 1)
    assert derive_seed(0) != derive_seed(0, 0)
    assert derive_seed(1) != derive_seed(-1)
    assert derive_seed(2**64) != derive_seed(0)
    torch.Generator().manual_seed(derive_seed(123, 4))


def test_derive_seed_rejects_non_int() -> None:
    with pytest.raises(TypeError, match=r"parts\[1\]"):
        derive_seed(1, 2.5)  # type: ignore[arg-type]


# SequentialSampler


@FAST
@given(lengths)
def test_sequential(n: int) -> None:
    sampler = SequentialSampler(n)
    sampler.set_epoch(3)
    assert list(sampler) == list(range(n))
    assert len(sampler) == n


# RandomSampler


@FAST
@given(lengths, seeds, epochs)
def test_random_is_permutation_and_repeatable(n: int, seed: int, epoch: int) -> None:
    a = RandomSampler(n, seed=seed)
    b = RandomSampler(n, seed=seed)
    a.set_epoch(epoch)
    b.set_epoch(epoch)
    order = list(a)
    assert sorted(order) == list(range(n))
    assert len(a) == n
    assert list(b) == order
    assert list(a) == order  # iterating again gives the same epoch order
    assert a.seed == seed
    assert a.epoch == epoch


@FAST
@given(st.integers(min_value=10, max_value=200), seeds, epochs)
def test_random_epochs_differ(n: int, seed: int, epoch: int) -> None:
    sampler = RandomSampler(n, seed=seed)
    sampler.set_epoch(epoch)
    first = list(sampler)
    sampler.set_epoch(epoch + 1)
    assert list(sampler) != first


def test_random_default_epoch_is_zero() -> None:
    sampler = RandomSampler(50, seed=7)
    default = list(sampler)
    sampler.set_epoch(0)
    assert list(sampler) == default


@FAST
@given(st.integers(min_value=0, max_value=2**32))
def test_random_unseeded_follows_torch_manual_seed(torch_seed: int) -> None:
    """The seed is drawn as the first order is (torch draws at iteration): a
    ``torch.manual_seed`` after the sampler was built still makes the run repeatable (found by
    review: drawn at construction, it did not)."""
    a, b = RandomSampler(100), RandomSampler(100)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch_seed)
        first = list(a)
        torch.manual_seed(torch_seed)
        assert list(b) == first
    assert a.seed == b.seed


@FAST
@given(st.integers(min_value=0, max_value=2**32))
def test_random_generator_respected(gen_seed: int) -> None:
    a = RandomSampler(100, generator=torch.Generator().manual_seed(gen_seed))
    b = RandomSampler(100, generator=torch.Generator().manual_seed(gen_seed))
    assert a.seed == b.seed
    assert list(a) == list(b)
    # The generator, not torch's default one, supplies the seed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        c = RandomSampler(100, generator=torch.Generator().manual_seed(gen_seed))
    assert c.seed == a.seed


def test_a_generator_given_draws_each_order_as_torchs() -> None:
    # (it used to draw a base seed only; accelerate then replaced the generator, which read
    # None, with its own)
    ours = RandomSampler(10, generator=torch.Generator().manual_seed(1))
    theirs = torch.utils.data.RandomSampler(range(10), generator=torch.Generator().manual_seed(1))
    assert [list(ours) for _ in range(3)] == [list(theirs) for _ in range(3)]
    assert ours.generator is not None and ours.seed == 0  # no seed drawn: it decides nothing


def test_random_seed_wins_over_generator() -> None:
    generator = torch.Generator().manual_seed(1)
    assert RandomSampler(10, seed=5, generator=generator).seed == 5


def test_random_validation() -> None:
    with pytest.raises(ValueError, match="length"):
        RandomSampler(-1)
    with pytest.raises(TypeError, match="length"):
        RandomSampler(True)
    with pytest.raises(TypeError, match="seed"):
        RandomSampler(3, seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="generator"):
        RandomSampler(3, generator=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="epoch"):
        RandomSampler(3, seed=0).set_epoch(-1)


# DistributedSampler and sharding


def _per_rank(
    n: int, world_size: int, *, shuffle: bool, drop_last: bool, seed: int = 0, epoch: int = 0
) -> list[list[int]]:
    out = []
    for rank in range(world_size):
        sampler = DistributedSampler(
            n, rank=rank, world_size=world_size, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        sampler.set_epoch(epoch)
        indices = list(sampler)
        assert len(indices) == len(sampler)
        out.append(indices)
    return out


@FAST
@given(lengths, world_sizes, st.booleans(), st.booleans(), seeds, epochs)
def test_distributed_partition(
    n: int, world_size: int, shuffle: bool, drop_last: bool, seed: int, epoch: int
) -> None:
    ranks = _per_rank(n, world_size, shuffle=shuffle, drop_last=drop_last, seed=seed, epoch=epoch)
    per_rank = len(ranks[0])
    assert all(len(r) == per_rank for r in ranks)
    counts = Counter(i for r in ranks for i in r)
    assert set(counts) <= set(range(n))
    if drop_last:
        assert per_rank == n // world_size
        assert all(c == 1 for c in counts.values())
    else:
        assert per_rank * world_size >= n > (per_rank - 1) * world_size
        assert set(counts) == set(range(n))
        # Disjoint except for the padding: total extra copies equal the padding size.
        assert sum(c - 1 for c in counts.values()) == per_rank * world_size - n


@FAST
@given(lengths, world_sizes, st.booleans(), seeds, epochs)
def test_distributed_shuffled_uses_random_sampler_order(
    n: int, world_size: int, drop_last: bool, seed: int, epoch: int
) -> None:
    random = RandomSampler(n, seed=seed)
    random.set_epoch(epoch)
    order = list(random)
    if drop_last:
        order = order[: n - n % world_size]
    else:  # Pad cyclically from the start up to a multiple of world_size.
        total = -(-n // world_size) * world_size
        order = [order[p % n] for p in range(total)]
    ranks = _per_rank(n, world_size, shuffle=True, drop_last=drop_last, seed=seed, epoch=epoch)
    assert ranks == [order[r::world_size] for r in range(world_size)]


@FAST
@given(lengths, world_sizes, st.booleans())
def test_distributed_unshuffled_matches_torch(n: int, world_size: int, drop_last: bool) -> None:
    ours = _per_rank(n, world_size, shuffle=False, drop_last=drop_last)
    for rank in range(world_size):
        theirs: tud.DistributedSampler[int] = tud.DistributedSampler(
            _Dataset(n), num_replicas=world_size, rank=rank, shuffle=False, drop_last=drop_last
        )
        assert ours[rank] == list(theirs)
        assert len(ours[rank]) == len(theirs)


def test_distributed_epochs_differ_when_shuffled() -> None:
    a = _per_rank(100, 2, shuffle=True, drop_last=False, epoch=0)
    b = _per_rank(100, 2, shuffle=True, drop_last=False, epoch=1)
    assert a != b


def test_distributed_validation() -> None:
    with pytest.raises(ValueError, match="world_size"):
        DistributedSampler(4, rank=0, world_size=0)
    with pytest.raises(ValueError, match="rank"):
        DistributedSampler(4, rank=2, world_size=2)
    with pytest.raises(ValueError, match="rank"):
        DistributedSampler(4, rank=-1, world_size=2)
    with pytest.raises(ValueError, match="length"):
        DistributedSampler(-1, rank=0, world_size=1)
    with pytest.raises(TypeError, match="shuffle"):
        DistributedSampler(4, rank=0, world_size=1, shuffle=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="drop_last"):
        DistributedSampler(4, rank=0, world_size=1, drop_last=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seed"):
        DistributedSampler(4, rank=0, world_size=1, seed="0")  # type: ignore[arg-type]


def test_resolve_rank_defaults_without_distributed() -> None:
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())
    assert resolve_rank(None, None) == (0, 1)
    assert resolve_rank(2, 4) == (2, 4)
    assert resolve_rank(None, 4) == (0, 4)
    sampler = DistributedSampler(10)
    assert (sampler.rank, sampler.world_size) == (0, 1)
    assert list(sampler) == list(RandomSampler(10, seed=0))


@FAST
@given(lengths, world_sizes, st.booleans())
def test_shard_positions(n: int, world_size: int, drop_last: bool) -> None:
    for rank in range(world_size):
        positions = shard(n, rank, world_size, drop_last)
        assert len(positions) == shard_length(n, world_size, drop_last)
        assert all(0 <= p < n for p in positions)


@FAST
@given(st.integers(min_value=0, max_value=10_000), world_sizes)
def test_shard_stream_position_round_robin(position: int, world_size: int) -> None:
    owners = [r for r in range(world_size) if shard_stream_position(position, r, world_size)]
    assert owners == [position % world_size]


def test_shard_stream_position_rejects_negative() -> None:
    with pytest.raises(ValueError, match="position"):
        shard_stream_position(-1, 0, 1)


# BatchSampler


@FAST
@given(st.lists(st.integers(0, 50), max_size=100), st.integers(1, 20), st.booleans())
def test_batch_sampler(indices: list[int], batch_size: int, drop_last: bool) -> None:
    ours = list(BatchSampler(indices, batch_size, drop_last))
    theirs = list(tud.BatchSampler(indices, batch_size, drop_last))
    assert ours == theirs
    assert all(len(b) == batch_size for b in ours[:-1])
    if ours:
        assert 0 < len(ours[-1]) <= batch_size
        if drop_last:
            assert len(ours[-1]) == batch_size
    flat = [i for b in ours for i in b]
    if drop_last:
        assert flat == indices[: len(indices) - len(indices) % batch_size]
    else:
        assert Counter(flat) == Counter(indices)
        assert flat == indices


@FAST
@given(lengths, st.integers(1, 50), st.booleans())
def test_batch_sampler_len(n: int, batch_size: int, drop_last: bool) -> None:
    ours = BatchSampler(SequentialSampler(n), batch_size, drop_last)
    theirs = tud.BatchSampler(tud.SequentialSampler(range(n)), batch_size, drop_last)
    assert len(ours) == len(list(ours)) == len(theirs)


def test_batch_sampler_forwards_set_epoch() -> None:
    inner = RandomSampler(20, seed=3)
    batches = BatchSampler(inner, 4, False)
    batches.set_epoch(5)
    assert inner.epoch == 5
    BatchSampler([1, 2, 3], 2, False).set_epoch(5)  # no set_epoch: ignored


@pytest.mark.parametrize(
    ("batch_size", "drop_last"), [(0, False), (True, False), (2.0, False), (1, 0), (1, "yes")]
)
def test_batch_sampler_refuses_what_torch_refuses_with_its_type_and_words(
    batch_size: Any, drop_last: Any
) -> None:
    """Found by review: ours raised TypeError where torch's raises ValueError."""
    said = []
    for cls in (torch.utils.data.BatchSampler, BatchSampler):
        with pytest.raises(ValueError) as caught:
            cls([1], batch_size, drop_last)
        said.append(str(caught.value))
    assert said[0] == said[1]


def test_batch_sampler_validation() -> None:
    with pytest.raises(TypeError, match="sampler"):
        BatchSampler(5, 1, False)  # type: ignore[arg-type]
    unsized = BatchSampler(_Unsized(), 2, False)
    assert list(unsized) == [[0, 1], [2]]
    with pytest.raises(TypeError, match="sampler"):
        len(unsized)


def test_the_samplers_take_torch_s_arguments_in_torch_s_order() -> None:
    """A script's ``from torch.utils.data import DistributedSampler, RandomSampler`` swapped
    for aioloader's: torch's calls work, with torch's lengths (the unshuffled orders torch's
    exactly). ``DistributedSampler(ds, num_replicas=2)`` and ``RandomSampler(ds,
    replacement=True, num_samples=5)`` used to raise TypeError."""
    ds = _Dataset(10)
    for drop_last in (False, True):
        for rank in (0, 1, 2):
            ours = DistributedSampler(ds, 3, rank, False, 0, drop_last)
            theirs = tud.DistributedSampler(ds, 3, rank, False, 0, drop_last)
            assert (list(ours), len(ours)) == (list(theirs), len(theirs))
            assert ours.dataset is ds and ours.num_replicas == 3
    keyword = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=5)
    assert (len(keyword), keyword.num_samples, keyword.total_size) == (5, 5, 10)
    for args, kwargs in [
        ((True, 5), {}),
        ((), {"replacement": True}),
        ((), {"num_samples": 25}),
        ((False, 3, torch.Generator()), {}),
    ]:
        ours_random = RandomSampler(ds, *args, **kwargs)
        theirs_random = tud.RandomSampler(ds, *args, **kwargs)
        assert len(ours_random) == len(theirs_random) == len(list(ours_random))
        assert ours_random.num_samples == theirs_random.num_samples
        assert ours_random.replacement == theirs_random.replacement
    with pytest.raises(TypeError, match=r"num_replicas \(torch's name\) or world_size, not both"):
        DistributedSampler(ds, 2, 0, world_size=2)


@pytest.mark.parametrize(
    "kwargs",
    [{"replacement": 1}, {"num_samples": 0}, {"num_samples": -2}, {"num_samples": 2.0}],
)
def test_random_sampler_refuses_what_torch_s_refuses_in_its_words(
    kwargs: dict[str, object],
) -> None:
    with pytest.raises((TypeError, ValueError)) as theirs:
        tud.RandomSampler(_Dataset(4), **kwargs)  # type: ignore[arg-type]
    with pytest.raises(type(theirs.value)) as ours:
        RandomSampler(_Dataset(4), **kwargs)  # type: ignore[arg-type]
    assert str(ours.value) == str(theirs.value)


@FAST
@given(
    st.integers(min_value=1, max_value=40), st.integers(min_value=1, max_value=100), st.booleans()
)
def test_num_samples_and_replacement_draw_as_torch_does(
    n: int, num_samples: int, replacement: bool
) -> None:
    """From the epoch's generator (seed and epoch: repeatable, each epoch its own), drawn as
    torch draws from its generator: with a generator assigned, torch's very indices, and the
    generator left in the same state."""
    ours = RandomSampler(n, replacement, num_samples, seed=3)
    ours.set_epoch(0)  # its owner's: the same epoch at each iteration
    first = list(ours)
    assert len(first) == num_samples == len(ours)
    assert all(0 <= i < n for i in first)
    if not replacement:  # whole permutations, then part of one: each index as often
        counts = Counter(first)
        assert {counts[i] for i in range(n)} <= {num_samples // n, -(-num_samples // n)}
    assert list(ours) == first  # the same epoch again
    mine, theirs_gen = torch.Generator(), torch.Generator()
    mine.manual_seed(11)
    theirs_gen.manual_seed(11)
    ours.generator = mine
    theirs = tud.RandomSampler(range(n), replacement, num_samples, generator=theirs_gen)
    assert list(ours) == list(theirs)
    assert torch.equal(mine.get_state(), theirs_gen.get_state())


def test_epochs_with_replacement_differ_and_repeat() -> None:
    sampler = RandomSampler(50, replacement=True, num_samples=64, seed=1)
    zero = list(sampler)
    sampler.set_epoch(1)
    one = list(sampler)
    sampler.set_epoch(0)
    assert list(sampler) == zero != one
    assert len(set(zero)) < 50  # drawn with replacement: some twice, some not at all
