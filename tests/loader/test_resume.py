"""Resuming a map-style epoch: ``state_dict()`` between batches, ``load_state_dict()`` in a new
loader (the same world size, or another through ``merge_states``), the epoch's samples exactly
once across the stop; and every bad state named."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import aioloader
from aioloader import DataLoader, LoaderStateError, merge_states
from aioloader._data.resume import Layer, Taken, rank_batches, remainder, share_positions
from aioloader._data.seeds import epoch_permutation
from tests.support import worker_fns


def alone(sample: Any) -> Any:
    return sample


def make(n: int, rank: int, world: int, **kw: Any) -> DataLoader[Any]:
    unbatched = kw.get("batch_size", 1) is None
    if unbatched:
        kw["drop_last"] = False  # torch refuses it without batches
    return DataLoader(
        list(range(n)),
        collate_fn=alone if unbatched else list,
        distributed=world > 1,
        rank=rank if world > 1 else None,
        world_size=world if world > 1 else None,
        **kw,
    )


async def batches_of(loader: DataLoader[Any], stop: int | None = None) -> tuple[list[Any], Any]:
    """The batches of one epoch (the first ``stop``, then the state at that point)."""
    got: list[Any] = []
    async with loader:
        batches = aiter(loader)
        while stop is None or len(got) < stop:  # a batch received is a batch taken
            try:
                got.append(await anext(batches))
            except StopAsyncIteration:
                break
        state = json.loads(json.dumps(loader.state_dict()))  # as a checkpoint file holds it
    return got, state


def flat(batches: list[Any]) -> list[int]:
    return [i for b in batches for i in (b if isinstance(b, list) else [b])]


SETTINGS = st.fixed_dictionaries(
    {
        "batch_size": st.sampled_from([1, 3, 4, None]),
        "shuffle": st.booleans(),
        "drop_last": st.booleans(),
        "in_order": st.booleans(),
        "seed": st.integers(0, 2**31),
    }
)


async def stop_and_resume(
    n: int, before: int, after: int, stops: list[int], kw: dict[str, Any], merge: bool
) -> tuple[list[list[Any]], list[list[Any]], list[list[Any]]]:
    """Each of ``before`` ranks takes ``stops[r]`` batches and saves its state; ``after`` ranks
    resume (from their own states, or the merged one). Returns every rank's batches: the
    uninterrupted run's, those before the stop, and those after."""
    full = [(await batches_of(make(n, r, before, **kw)))[0] for r in range(before)]
    first, states = [], []
    for r in range(before):
        got, state = await batches_of(make(n, r, before, **kw), stops[r] % (len(full[r]) + 1))
        first.append(got)
        states.append(state)
    rest = []
    for r in range(after):
        loader = make(n, r, after, **kw)
        loader.load_state_dict(merge_states(states) if merge else states[r])
        rest.append((await batches_of(loader))[0])
    return full, first, rest


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(0, 40),
    worlds=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    stops=st.lists(st.integers(0, 50), min_size=3, max_size=3),
    kw=SETTINGS,
)
def test_the_epoch_is_yielded_exactly_once_across_a_stop(
    n: int, worlds: tuple[int, int], stops: list[int], kw: dict[str, Any]
) -> None:
    assume(n or not kw["shuffle"])  # torch's RandomSampler refuses an empty dataset; so do we
    before, after = worlds
    merge = before != after or stops[0] % 2 == 1  # the same world resumes either way
    full, first, rest = asyncio.run(stop_and_resume(n, before, after, stops, kw, merge))
    taken = Counter(flat([b for r in first for b in r]))
    again = Counter(flat([b for r in rest for b in r]))
    if before == after:
        for r in range(before):  # the same batches, and (in order) the same order
            if kw["in_order"]:
                assert first[r] + rest[r] == full[r]
            else:
                assert sorted(map(repr, first[r] + rest[r])) == sorted(map(repr, full[r]))
        return
    # Another world size: together the new ranks yield exactly what is left, each sample once
    # but for DistributedSampler's padding (at most after - 1 repeats) and, with drop_last,
    # each rank's short last batch. (With the same world size, the padding repeats what the
    # uninterrupted run repeats: the check above.)
    assert not set(taken) & set(again), "a sample came before and after the stop"
    # Every new rank yields as many batches as the others (a collective never hangs).
    assert len({len(r) for r in rest}) <= 1
    left = set(range(n)) - set(taken)
    size = kw["batch_size"] or 1
    assert set(again) <= left
    repeats = sum(again.values()) - len(again)
    assert repeats <= after - 1
    if not kw["drop_last"] or size == 1:
        assert set(again) == left
    else:
        assert len(left - set(again)) <= after * (size - 1)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 30), stop=st.integers(0, 12), kw=SETTINGS)
def test_worker_processes_resume_the_same_batches(n: int, stop: int, kw: dict[str, Any]) -> None:
    """``num_workers=2``: the state does not depend on the workers, and neither do the
    batches after it."""
    full, first, rest = asyncio.run(
        stop_and_resume(n, 1, 1, [stop], {**kw, "num_workers": 2}, merge=False)
    )
    if kw["in_order"]:
        assert first[0] + rest[0] == full[0]
    else:
        assert sorted(map(repr, first[0] + rest[0])) == sorted(map(repr, full[0]))


def test_plain_for_resumes_where_it_stopped_and_the_seeds_are_the_same() -> None:
    """A plain ``for`` (which reads ahead on another thread) saves what its own thread took;
    each batch's work in the workers is seeded by its place, so a resumed batch is augmented
    as the uninterrupted run augmented it."""

    def loader() -> DataLoader[Any]:
        return DataLoader(
            list(range(50)),
            batch_size=4,
            shuffle=True,
            seed=11,
            num_workers=2,
            transform=worker_fns.augment,
        )

    full = [b.tolist() for b in loader()]
    first_loader = loader()
    it = iter(first_loader)
    first = [next(it).tolist() for _ in range(5)]
    state = first_loader.state_dict()
    it.close()
    assert state["taken"] == {"through": 5, "beyond": []}
    resumed = loader()
    resumed.load_state_dict(state)
    assert first + [b.tolist() for b in resumed] == full
    # Between epochs the state is the next epoch's start; loading it runs that epoch.
    assert resumed.state_dict()["epoch"] == 1
    assert resumed.state_dict()["taken"] == {"through": 0, "beyond": []}


def test_within_one_scope_a_state_resumes_the_same_epoch() -> None:
    ds = list(range(20))
    with DataLoader(ds, batch_size=3, shuffle=True, seed=2, collate_fn=list) as loader:
        it = iter(loader)
        head = [next(it) for _ in range(3)]
        state = loader.state_dict()
        it.close()
        loader.load_state_dict(state)
        tail = list(loader)
        whole = list(loader)  # the next epoch, whole
    assert sorted(flat(head + tail)) == ds
    assert len(whole) == 7


def test_a_loader_without_seed_takes_the_saved_shuffle() -> None:
    torch.manual_seed(1)
    saved = DataLoader(list(range(30)), batch_size=5, shuffle=True, collate_fn=list)
    it = iter(saved)
    head = [next(it) for _ in range(2)]
    state = saved.state_dict()
    it.close()
    torch.manual_seed(2)  # another process: another drawn seed
    resumed = DataLoader(list(range(30)), batch_size=5, shuffle=True, collate_fn=list)
    resumed.load_state_dict(state)
    assert sorted(flat(head + list(resumed))) == list(range(30))


async def test_out_of_order_state_is_a_watermark_and_the_few_past_it() -> None:
    """With ``in_order=False`` the state records the batches actually yielded."""

    class Slow(aioloader.AsyncDataset[int]):
        def __len__(self) -> int:
            return 40

        async def get(self, index: int) -> int:
            await asyncio.sleep(0.02 if index < 4 else 0)  # batch 0 finishes last
            return index

    loader = DataLoader(Slow(), batch_size=4, in_order=False, collate_fn=list)
    got, state = await batches_of(loader, stop=3)
    assert 0 not in flat(got)  # batches 1.. came before batch 0
    taken = Taken.from_json(state["taken"], "taken")
    assert len(taken) == 3 and taken.through == 0
    resumed = DataLoader(Slow(), batch_size=4, in_order=False, collate_fn=list)
    resumed.load_state_dict(state)
    rest, _ = await batches_of(resumed)
    assert sorted(flat(got + rest)) == list(range(40))


def test_the_state_of_a_ten_million_sample_epoch_is_small() -> None:
    """A seed and counters, not an index list; resuming near its end skips in one slice."""
    n = 10_000_000
    loader = DataLoader(range(n), batch_size=1000, shuffle=True, seed=3)
    state = loader.state_dict()
    state["taken"] = {"through": 9_000, "beyond": [9_002]}  # as after 9,001 batches
    assert len(json.dumps(state)) < 400
    resumed = DataLoader(range(n), batch_size=1000, shuffle=True, seed=3)
    resumed.load_state_dict(state)
    with resumed:
        it = iter(resumed)
        first = next(it)
        rest = sum(1 for _ in it)
    order = epoch_permutation(n, 3, 0)  # RandomSampler(seed=3)'s order of epoch 0
    assert first.tolist() == order[9_000_000:9_001_000]  # batch 9000 comes first
    assert rest == 998  # then 9001 and 9003..9999


# -- the elastic rule on its own -------------------------------------------------------------


@given(
    n=st.integers(0, 60),
    world=st.integers(1, 4),
    new=st.integers(1, 4),
    size=st.integers(1, 5),
    data=st.data(),
)
def test_remainder_and_new_shares_cover_the_order(
    n: int, world: int, new: int, size: int, data: st.DataObject
) -> None:
    import numpy as np

    order = np.random.default_rng(n).permutation(n)
    share = -(-n // world) if n else 0
    taken = {}
    for r in range(world):
        k = data.draw(st.integers(0, -(-share // size)))
        taken[r] = Taken(k)
    rest = remainder(order, [Layer(world, size, False, taken)])
    took = {
        int(order[p])
        for r, t in taken.items()
        for p in share_positions(n, r, world)[: t.through * size]
    }
    assert set(rest.tolist()) == set(order.tolist()) - took
    counts = [len(list(rank_batches(rest, r, new, size, False))) for r in range(new)]
    assert len(set(counts)) <= 1
    union = {i for r in range(new) for b in rank_batches(rest, r, new, size, False) for i in b}
    assert union == set(rest.tolist())


def test_taken_advances_its_watermark_over_what_came_early() -> None:
    t = Taken()
    for seq in (2, 0, 3, 1, 6):
        t.add(seq)
    assert t.through == 4 and t.beyond == {6} and len(t) == 5
    assert 5 not in t and 6 in t and 3 in t


# -- errors ---------------------------------------------------------------------------------------


def saved(**kw: Any) -> dict[str, Any]:
    loader = make(20, kw.pop("rank", 0), kw.pop("world", 1), batch_size=4, **kw)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    it.close()
    return state


def test_a_state_that_does_not_fit_the_loader_is_named() -> None:
    state = saved(seed=1)
    with pytest.raises(ValueError, match="dataset of 20 samples; this one has 21"):
        DataLoader(list(range(21)), batch_size=4, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size=4; this loader has 5"):
        DataLoader(list(range(20)), batch_size=5, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=1; this loader has 2"):
        DataLoader(list(range(20)), batch_size=4, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="drop_last=False; this loader has True"):
        DataLoader(list(range(20)), batch_size=4, seed=1, drop_last=True).load_state_dict(state)
    two = saved(rank=1, world=2, seed=1)
    with pytest.raises(ValueError, match=r"rank 1's of a world of 2.*merge_states"):
        make(20, 0, 3, batch_size=4, seed=1).load_state_dict(two)


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        ({"format": "x"}, ValueError, "state\\['format'\\]"),
        ({"epoch": -1}, ValueError, "state\\['epoch'\\] must be >= 0"),
        ({"taken": {"through": 1}}, ValueError, "state\\['taken'\\]"),
        ({"taken": {"through": 3, "beyond": [2]}}, ValueError, "above 'through'"),
        ({"batch_size": "4"}, TypeError, "state\\['batch_size'\\] must be int"),
        ({"rank": 5}, ValueError, "outside world_size 1"),
    ],
)
def test_a_malformed_state_names_the_field(
    change: dict[str, Any], error: type[Exception], words: str
) -> None:
    state = {**saved(seed=1), **change}
    loader = DataLoader(list(range(20)), batch_size=4, seed=1)
    with pytest.raises(error, match=words):
        loader.load_state_dict(state)
    assert loader.state_dict()["taken"]["through"] == 0  # nothing was loaded


def test_set_epoch_does_not_drop_a_loaded_state_and_loading_ends_a_running_epoch() -> None:
    state = saved(seed=1)
    loader = DataLoader(list(range(20)), batch_size=4, seed=1, collate_fn=list)
    loader.load_state_dict(state)
    with pytest.raises(LoaderStateError, match="set_epoch\\(3\\) would drop it"):
        loader.set_epoch(3)
    loader.set_epoch(0)
    assert loader.state_dict() == state  # loaded, not yet run: the same state
    with loader:
        it = iter(loader)
        next(it)
        loader.load_state_dict(state)  # ends the epoch under way, as a new epoch would
        assert list(it) == []
        assert len(list(loader)) == 4  # the state's epoch, from its second batch


async def test_after_a_break_the_state_is_where_it_stopped_until_another_epoch() -> None:
    loader = DataLoader(list(range(20)), batch_size=2, shuffle=True, seed=1, collate_fn=list)
    async with loader:
        async for _ in loader:
            break
        assert loader.state_dict()["taken"]["through"] == 1
        loader.set_epoch(1)  # the broken epoch is over: the state is the next one's start
        state = loader.state_dict()
        assert (state["epoch"], state["taken"]["through"]) == (1, 0)
        loader.load_state_dict(state)
        assert len([b async for b in loader]) == 10


def test_merge_states_refuses_what_is_not_one_runs_ranks() -> None:
    a, b = saved(rank=0, world=2, seed=1), saved(rank=1, world=2, seed=1)
    with pytest.raises(ValueError, match="ranks \\[0\\]"):
        merge_states([a])
    with pytest.raises(ValueError, match="ranks \\[0, 0\\]"):
        merge_states([a, a])
    with pytest.raises(ValueError, match="states\\[1\\]\\['seed'\\]"):
        merge_states([a, saved(rank=1, world=2, seed=2)])
    with pytest.raises(TypeError, match=r"a list of DataLoader\.state_dict"):
        merge_states(a)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"states\[1\]: state must be a dict"):
        merge_states([a, 1])  # type: ignore[list-item]
    merged = merge_states([a, b])
    assert merged["rank"] is None and len(merged["layers"]) == 1
    with pytest.raises(ValueError, match="already merged"):
        merge_states([merged])


def test_a_sampler_that_cannot_replay_its_order_is_named() -> None:
    ds = list(range(10))
    loader = DataLoader(ds, sampler=torch.utils.data.RandomSampler(ds), batch_size=2)
    it = iter(loader)
    next(it)
    with pytest.raises(TypeError, match="RandomSampler may give another order"):
        loader.state_dict()
    it.close()
    replayable = DataLoader(ds, sampler=torch.utils.data.SequentialSampler(ds), batch_size=2)
    assert replayable.state_dict()["taken"]["through"] == 0


def test_a_batch_sampler_with_empty_batches_resumes_by_place() -> None:
    """A bucketing batch sampler may give empty batches: they have no place, and a resumed
    epoch numbers the others as the uninterrupted one did."""
    order = [[0, 1], [], [2, 3, 4], [], [], [5], [6, 7]]

    def make() -> DataLoader[Any]:
        return DataLoader(list(range(8)), batch_sampler=order, collate_fn=list)

    full = list(make())
    loader = make()
    it = iter(loader)
    head = [next(it), next(it)]
    state = loader.state_dict()
    it.close()
    assert state["taken"]["through"] == 2
    resumed = make()
    resumed.load_state_dict(state)
    assert head + list(resumed) == full == [[0, 1], [2, 3, 4], [5], [6, 7]]


async def test_a_files_source_resumes(tmp_path: Any) -> None:
    for i in range(30):
        (tmp_path / f"{i:02d}.bin").write_bytes(bytes([i]))

    def make() -> DataLoader[Any]:
        ds = aioloader.sources.files(tmp_path, "*.bin")
        return DataLoader(ds, batch_size=4, shuffle=True, seed=4, collate_fn=list)

    full, _ = await batches_of(make())
    head, state = await batches_of(make(), stop=3)
    resumed = make()
    resumed.load_state_dict(state)
    rest, _ = await batches_of(resumed)
    assert head + rest == full


def test_a_plain_for_reading_ahead_to_the_end_has_not_finished_the_epoch() -> None:
    """The pump of a plain ``for`` reads up to the end before the consumer has taken the last
    batches: the epoch is finished when the consumer sees its end, not before."""

    def make() -> DataLoader[Any]:
        return DataLoader(
            list(range(12)), batch_size=2, shuffle=True, seed=5, prefetch=8, collate_fn=list
        )

    loader = make()
    it = iter(loader)
    head = [next(it) for _ in range(5)]
    deadline = time.monotonic() + 10
    while not it._epoch.ended:  # until the pump has read the sixth batch and the end
        assert time.monotonic() < deadline, "the pump never read to the end"
        time.sleep(0.01)
    state = loader.state_dict()
    it.close()
    assert (state["epoch"], state["taken"]["through"]) == (0, 5)
    resumed = make()
    resumed.load_state_dict(state)
    assert sorted(flat(head + list(resumed))) == list(range(12))


def test_a_loader_without_seed_resumes_inside_its_open_scope() -> None:
    saved_loader = DataLoader(list(range(30)), batch_size=2, shuffle=True, collate_fn=list)
    it = iter(saved_loader)
    head = [next(it) for _ in range(4)]
    state = saved_loader.state_dict()
    it.close()
    with DataLoader(list(range(30)), batch_size=2, shuffle=True, collate_fn=list) as resumed:
        resumed.load_state_dict(state)  # its seeds differ: the open scope takes the saved ones
        rest = list(resumed)
    assert sorted(flat(head + rest)) == list(range(30))


def test_a_state_of_another_shuffle_is_refused() -> None:
    state = saved(seed=1, shuffle=True)
    with pytest.raises(ValueError, match="shuffle=True; this loader has shuffle=False"):
        DataLoader(list(range(20)), batch_size=4, seed=1).load_state_dict(state)


class Flaky(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> int:
        if index in (4, 5):  # batch 2 loses both samples under max_failures
            raise ValueError(f"bad sample {index}")
        return index


def test_a_batch_left_empty_by_skipped_samples_is_taken_in_its_place() -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(Flaky(), batch_size=2, max_failures=10, collate_fn=list)

    loader = make()
    it = iter(loader)
    head = [next(it) for _ in range(15)]
    state = loader.state_dict()
    it.close()
    assert state["taken"] == {"through": 16, "beyond": []}  # the empty batch 2 included
    resumed = make()
    resumed.load_state_dict(state)
    assert flat(head + list(resumed)) == [i for i in range(40) if i not in (4, 5)]
