"""A user's sampler resumes when its order can be drawn again: torch's random samplers given a
``generator`` (its state when the epoch began is saved and set back), sequential ones, ours;
one drawing from torch's global generator is named, once batches of it were taken."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import aioloader
from aioloader import DataLoader

N = 30


def samplers(g: torch.Generator) -> dict[str, dict[str, Any]]:
    """DataLoader arguments whose order ``g`` draws."""
    data = list(range(N))
    return {
        "random": {"sampler": tud.RandomSampler(data, generator=g), "batch_size": 4},
        "with replacement": {
            "sampler": tud.RandomSampler(data, replacement=True, num_samples=25, generator=g),
            "batch_size": 4,
        },
        "ours, with replacement": {  # seeded: its epoch's order, whatever g
            "sampler": aioloader.RandomSampler(data, True, 25, seed=5),
            "batch_size": 4,
        },
        "subset": {"sampler": tud.SubsetRandomSampler(range(5, 25), generator=g), "batch_size": 3},
        "weighted": {
            "sampler": tud.WeightedRandomSampler([1.0] * N, 22, generator=g),
            "batch_size": 4,
        },
        "batch sampler": {
            "batch_sampler": tud.BatchSampler(tud.RandomSampler(data, generator=g), 4, False)
        },
    }


def make(kind: str, seed: int, **kw: Any) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(list(range(N)), collate_fn=list, **samplers(g)[kind], **kw)


def epochs(loader: DataLoader[Any], count: int) -> list[list[list[int]]]:
    return [list(loader) for _ in range(count)]


@pytest.mark.parametrize("kind", list(samplers(torch.Generator())))
@pytest.mark.parametrize("stop", [0, 1, 3])
@pytest.mark.parametrize("kw", [{}, {"num_workers": 2}])
def test_a_sampler_given_a_generator_resumes_its_epoch(
    kind: str, stop: int, kw: dict[str, Any]
) -> None:
    """Epoch 1 stopped after ``stop`` batches goes on, in a loader whose generator was seeded
    otherwise, with the uninterrupted run's batches; and epoch 2 follows as it would have."""
    whole = epochs(make(kind, 1, **kw), 3)
    assert whole[0] != whole[1]  # the generator moves on: each epoch draws another order

    loader = make(kind, 1, **kw)
    assert list(loader) == whole[0]
    it = iter(loader)
    first = [next(it) for _ in range(stop)]
    text = json.dumps(loader.state_dict())
    it.close()

    resumed = make(kind, 999, **kw)
    resumed.load_state_dict(json.loads(text))
    assert first + list(resumed) == whole[1]
    assert list(resumed) == whole[2]


def test_a_state_between_epochs_holds_the_next_epochs_start() -> None:
    whole = epochs(make("random", 1), 2)
    loader = make("random", 1)
    list(loader)
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["epoch"] == 1 and state["sampler"] is not None
    resumed = make("random", 5)
    resumed.load_state_dict(state)
    assert list(resumed) == whole[1]


def without_generator(**kw: Any) -> DataLoader[Any]:
    data = list(range(N))
    return DataLoader(data, sampler=tud.RandomSampler(data), batch_size=4, collate_fn=list, **kw)


def test_a_sampler_on_the_global_generator_is_named_once_batches_were_taken() -> None:
    loader = without_generator()
    start = loader.state_dict()  # nothing taken: an epoch's start, any order will do
    assert start["taken"] == {"through": 0, "beyond": []} and start["sampler"] is None
    it = iter(loader)
    got = [next(it)]
    with pytest.raises(TypeError, match=r"RandomSampler may give another order.*generator="):
        loader.state_dict()
    got += list(it)  # the refusal lost nothing
    assert sorted(i for b in got for i in b) == list(range(N))


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda s: s | {"sampler": [1]}, "state\\['sampler'\\] must be dict or None"),
        (lambda s: s | {"sampler": {"generator": "x"}}, "not a generator's state"),
    ],
)
def test_a_malformed_sampler_state_is_named(
    change: Callable[[dict[str, Any]], dict[str, Any]], words: str
) -> None:
    loader = make("random", 1)
    it = iter(loader)
    next(it)
    state = change(json.loads(json.dumps(loader.state_dict())))
    it.close()
    resumed = make("random", 1)
    with pytest.raises((TypeError, ValueError), match=words):  # as it is loaded, not later
        resumed.load_state_dict(state)
    assert resumed.state_dict()["epoch"] == 0  # nothing of it was taken in


def test_a_generator_state_for_a_loader_without_one_is_refused() -> None:
    loader = make("random", 1)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="sampler was given no generator"):
        without_generator().load_state_dict(state)


def test_the_generator_is_saved_as_the_epoch_draws_its_order_not_as_iter_is_called() -> None:
    g = torch.Generator().manual_seed(3)
    data = list(range(N))
    loader = DataLoader(data, sampler=tud.RandomSampler(data, generator=g), batch_size=4)
    it = iter(loader)
    torch.rand(5, generator=g)  # the generator moves between iter() and the first batch
    first = next(it).tolist()
    state = json.loads(json.dumps(loader.state_dict()))
    rest = [b.tolist() for b in it]
    h = torch.Generator().manual_seed(0)
    again = DataLoader(data, sampler=tud.RandomSampler(data, generator=h), batch_size=4)
    again.load_state_dict(state)
    assert [b.tolist() for b in again] == rest and first not in rest
    t = torch.Generator().manual_seed(3)  # torch's loader draws from the generator as it is
    theirs = tud.DataLoader(data, sampler=tud.RandomSampler(data, generator=t), batch_size=4)
    torch_it = iter(theirs)
    torch.rand(5, generator=t)
    assert [b.tolist() for b in torch_it] == [first, *rest]


@pytest.mark.parametrize("kw", [{}, {"num_workers": 2}])
def test_a_generator_shared_with_the_loader_resumes_between_epochs(kw: dict[str, Any]) -> None:
    """The loader draws its workers' seed from its ``generator=`` as each plain ``for``
    begins, before the sampler draws its order from the same generator: a state kept between
    epochs sets the generator back as it is loaded, before that draw (found by review)."""

    def make(seed: int) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(seed)
        data = list(range(N))
        sampler = tud.RandomSampler(data, generator=g)
        return DataLoader(data, sampler=sampler, generator=g, batch_size=4, collate_fn=list, **kw)

    whole = epochs(make(1), 2)
    for before in (0, 1):  # before the first epoch, and between the two
        loader = make(1)
        epochs(loader, before)
        state = json.loads(json.dumps(loader.state_dict()))
        assert state["sampler"]["drawn"] is False
        resumed = make(7)
        resumed.load_state_dict(state)
        assert list(resumed) == whole[before]


class Rotated(tud.Sampler[int]):
    """Has a ``generator``, and draws from Python's ``random`` too: not torch's."""

    def __init__(self, n: int, generator: torch.Generator) -> None:
        self.n, self.generator = n, generator

    def __iter__(self) -> Any:
        order = torch.randperm(self.n, generator=self.generator).tolist()
        shift = random.randrange(self.n)
        return iter(order[shift:] + order[:shift])

    def __len__(self) -> int:
        return self.n


def test_only_torchs_samplers_are_trusted_to_draw_from_their_generator_alone() -> None:
    data = list(range(N))
    loader = DataLoader(data, sampler=Rotated(N, torch.Generator()), batch_size=4)
    it = iter(loader)
    next(it)
    with pytest.raises(TypeError, match=r"Rotated may give another order when iterated again; use"):
        loader.state_dict()
    it.close()


def _resumed_after(loader: Callable[[], DataLoader[Any]], taken: int) -> list[list[int]]:
    """Batches of one epoch: ``taken`` from a loader, then the rest from a new loader resumed
    from its state."""
    first = loader()
    iterator = iter(first)
    got = [next(iterator).tolist() for _ in range(taken)]
    state = first.state_dict()
    iterator.close()
    second = loader()
    second.load_state_dict(state)
    return got + [batch.tolist() for batch in second]


def test_a_torch_samplers_epoch_stays_its_owners_across_a_resume() -> None:
    """Found by review: a loaded state set the user's ``DistributedSampler`` to the loader's
    own epoch count, which its owner had never set: the resumed epoch read another order."""

    def loader() -> DataLoader[Any]:
        sampler = tud.DistributedSampler(list(range(N)), num_replicas=2, rank=0, seed=3)
        return DataLoader(list(range(N)), batch_size=4, sampler=sampler)

    whole = loader()
    for _ in range(2):  # two epochs first: the loader's count (2) is not the sampler's (0)
        list(whole)
    uninterrupted = [batch.tolist() for batch in whole]
    assert _resumed_after(loader, 2) == uninterrupted


def test_a_batch_size_set_on_the_loaders_batch_sampler_is_the_states() -> None:
    """The loader's batch sampler is torch's, whose ``batch_size`` a user may set (found by
    review: the state kept the argument's, and a resume went on in batches of another size)."""

    def loader() -> DataLoader[Any]:
        made = DataLoader(list(range(24)), batch_size=4, shuffle=True, seed=1)
        made.batch_sampler.batch_size = 8  # type: ignore[union-attr]
        return made

    assert _resumed_after(loader, 1) == [batch.tolist() for batch in loader()]
    saved = loader()
    iterator = iter(saved)
    next(iterator)
    state = saved.state_dict()
    iterator.close()
    assert state["batch_size"] == 8
    with pytest.raises(ValueError, match="saved with batch_size=8; this loader has 4"):
        DataLoader(list(range(24)), batch_size=4, shuffle=True, seed=1).load_state_dict(state)


def test_an_order_drawn_from_an_assigned_generator_is_not_resumed_elastically() -> None:
    """An elastic resume re-divides the seed's order; one drawn from a generator assigned to
    the sampler is another order, so it is refused."""
    from aioloader import merge_states

    saved = DataLoader(list(range(N)), batch_size=4, shuffle=True, seed=1)
    saved.sampler.generator = torch.Generator().manual_seed(5)  # type: ignore[union-attr]
    iterator = iter(saved)
    next(iterator)
    state = merge_states([saved.state_dict()])
    iterator.close()
    resumed = DataLoader(list(range(N)), batch_size=4, shuffle=True, seed=1)  # merged: elastic
    resumed.sampler.generator = torch.Generator().manual_seed(5)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="drawn from a generator"):
        resumed.load_state_dict(state)


def _ours(kind: str) -> tud.Sampler[int]:
    data = list(range(N))
    if kind == "distributed":
        return aioloader.DistributedSampler(data, num_replicas=2, rank=1, seed=4)
    return aioloader.RandomSampler(data, seed=4)


def _flat(loader: Any) -> list[int]:
    return [x for batch in loader for x in batch.tolist()]


@pytest.mark.parametrize("rebuilt", [False, True], ids=["one loader", "a loader per epoch"])
@pytest.mark.parametrize("kind", ["distributed", "random"])
def test_our_samplers_epoch_set_by_its_owner_is_the_epoch_the_loader_runs(
    kind: str, rebuilt: bool
) -> None:
    """torch's idiom, ``sampler.set_epoch(epoch)`` before each epoch, with our sampler gives
    what torch's loader gives over it: the owner's epochs, repeated when set again or not set
    (the epoch is the owner's from the first call on), from loaders rebuilt each epoch too.
    Before, the loader's own count overruled the owner (a loader per epoch read epoch 0's
    order every epoch; a restart at epoch 2 read epoch 0's)."""
    chosen = (2, 2, 5, None, 0, None)  # None: no call before that epoch
    results = []
    for cls in (tud.DataLoader, DataLoader):
        sampler = _ours(kind)
        loader = cls(list(range(N)), batch_size=4, sampler=sampler)
        orders = []
        for epoch in chosen:
            if epoch is not None:
                sampler.set_epoch(epoch)
            if rebuilt:
                loader = cls(list(range(N)), batch_size=4, sampler=sampler)
            orders.append(_flat(loader))
        results.append(orders)
    assert results[0] == results[1]
    assert results[1] == [_order(kind, e) for e in (2, 2, 5, 5, 0, 0)]
    assert results[1][0] != results[1][2] != results[1][4]


def test_without_its_owner_our_sampler_takes_the_loaders_count() -> None:
    sampler = _ours("random")
    loader = DataLoader(list(range(N)), batch_size=4, sampler=sampler)
    assert [_flat(loader) for _ in range(3)] == [_order("random", e) for e in range(3)]


def _order(kind: str, epoch: int) -> list[int]:
    sampler = _ours(kind)
    sampler.set_epoch(epoch)
    return list(sampler)


def test_an_epoch_set_after_iter_is_the_epochs_as_in_torch() -> None:
    """Lightning calls ``iter(loader)`` before it sets the sampler's epoch (found by review:
    a Lightning run resumed from a checkpoint read epoch 0's order in its first epoch). torch
    draws the order at the first batch; so do we."""
    results = []
    for cls in (tud.DataLoader, DataLoader):
        sampler = _ours("random")
        loader = cls(list(range(N)), batch_size=4, sampler=sampler)
        iterator = iter(loader)
        sampler.set_epoch(3)
        first = [x for batch in iterator for x in batch.tolist()]
        results.append((first, _flat(loader)))
    assert results[0] == results[1] == (_order("random", 3), _order("random", 3))
    assert "epoch 3" in loader.progress()


def test_two_loaders_over_one_sampler_both_run_its_owners_epoch() -> None:
    """Found by review: the first loader to begin an epoch took the owner's choice, and a
    second over the same sampler (``copy.copy``, an evaluation pass) ran its own count."""
    results = []
    for cls in (tud.DataLoader, DataLoader):
        sampler = _ours("distributed")
        a = cls(list(range(N)), batch_size=4, sampler=sampler)
        b = copy.copy(a)
        rows = []
        for epoch in (1, 2):
            sampler.set_epoch(epoch)
            rows.append((_flat(a), _flat(b)))
        results.append(rows)
    assert results[0] == results[1]
    assert results[1] == [(_order("distributed", e),) * 2 for e in (1, 2)]


def test_an_epoch_its_owner_chose_is_the_states_and_must_agree_with_a_loaded_one() -> None:
    """Between epochs, and after a ``break``, the state is the start of the epoch the
    sampler's owner chose. A loaded state of another epoch is not dropped silently: the
    iteration raises, naming both, and the state is kept for the next."""
    sampler = _ours("distributed")
    loader = DataLoader(list(range(N)), batch_size=4, sampler=sampler, seed=5)
    sampler.set_epoch(3)
    assert loader.state_dict()["epoch"] == 3
    iterator = iter(loader)
    first = [next(iterator).tolist() for _ in range(2)]
    state = loader.state_dict()
    rest = [batch.tolist() for batch in iterator]
    assert [x for b in first + rest for x in b] == _order("distributed", 3)
    assert loader.state_dict()["epoch"] == 4  # after epoch 3, before the owner's next call
    sampler.set_epoch(6)
    assert loader.state_dict()["epoch"] == 6
    for _batch in loader:
        break  # a break in epoch 6 (a state of its middle), then the owner goes on to 7
    assert loader.state_dict()["epoch"] == 6
    assert loader.state_dict() != DataLoader(
        list(range(N)), batch_size=4, sampler=_ours("distributed"), seed=5
    ).state_dict() | {"epoch": 6}
    sampler.set_epoch(7)
    assert loader.state_dict()["epoch"] == 7
    assert loader.state_dict() == DataLoader(
        list(range(N)), batch_size=4, sampler=_ours("distributed"), seed=5
    ).state_dict() | {"epoch": 7}

    resumed_sampler = _ours("distributed")
    resumed = DataLoader(list(range(N)), batch_size=4, sampler=resumed_sampler)
    resumed.load_state_dict(state)
    resumed_sampler.set_epoch(0)  # a training loop that restarts its count
    with pytest.raises(aioloader.LoaderStateError, match=r"epoch 3; sampler\.set_epoch\(0\)"):
        iter(resumed)
    resumed_sampler.set_epoch(3)  # the idiom, from the checkpoint's epoch
    assert [batch.tolist() for batch in resumed] == rest


class LoggingBatches(torch.utils.data.BatchSampler):
    """A batch sampler of the user's own, over ours: a subclass (logs, say)."""


def test_ours_inside_a_batch_sampler_subclass_resumes_every_sample_once() -> None:
    """Found by review: once our sampler took the next epoch at each iteration where no
    loader set it, inside a subclass of ``BatchSampler`` it was never set, and a resume read
    another order: samples twice, others never. Its epoch is now the loader's there too."""
    data = list(range(12))

    def loader() -> aioloader.DataLoader[torch.Tensor]:
        sampler = aioloader.RandomSampler(data, seed=1)
        return aioloader.DataLoader(data, batch_sampler=LoggingBatches(sampler, 3, False))

    first = loader()
    epochs = [[int(x) for batch in first for x in batch] for _ in range(2)]
    assert epochs[0] != epochs[1] and all(sorted(e) == data for e in epochs)
    iterator = iter(first)
    taken = [int(x) for _, batch in zip(range(2), iterator, strict=False) for x in batch]
    state = first.state_dict()
    iterator.close()
    again = loader()  # a new process's: loaded, it goes on with epoch 2
    again.load_state_dict(state)
    assert sorted(taken + [int(x) for batch in again for x in batch]) == data
