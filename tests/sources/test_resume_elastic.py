"""Resuming a ``tar_shards`` epoch on another number of ranks (issue 26, part 2), end to end:
real tar files in a temporary folder, real loaders, ``merge_states(states, world_size=W')``
between the phases. What every rank of every phase took is the epoch, each sample once."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aioloader
from aioloader import DataLoader, merge_states
from aioloader.sources import tar_shards
from tests.sources.test_tar import EXTS, make_shard, make_shards, payload
from tests.support.torchrun import torchrun

ROOT = Path(__file__).parents[2]

SIZES = (3, 5, 0, 4, 6, 2)  # samples per shard: six shards, one of them empty


def write_shards(root: Path, compressed: bool) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for s, n in enumerate(SIZES):
        members = [(f"s{s}/{j:04d}.{ext}", payload(s, j, ext)) for j in range(n) for ext in EXTS]
        path = make_shard(root / f"shard-{s}.tar", members)
        if compressed:
            path.write_bytes(gzip.compress(path.read_bytes()))
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, list[str]]:
    root = tmp_path_factory.mktemp("elastic")
    return {z: write_shards(root / ("gz" if z else "plain"), z) for z in (False, True)}


def keys(batch: list[dict[str, Any]]) -> list[str]:
    return [s["__key__"] for s in batch]


def loader(
    paths: list[str], rank: int, world: int, options: dict[str, Any], batch: int
) -> DataLoader[Any]:
    ds = tar_shards(paths, seed=3, rank=rank, world_size=world, **options)
    return DataLoader(ds, batch_size=batch, collate_fn=keys)


def run_rank(made: DataLoader[Any], state: dict[str, Any] | None, stop: int | None) -> Any:
    """Load ``state``, take up to ``stop`` batches of epoch 0 (all: None); return what was
    taken and the state after it (through JSON, as a checkpoint holds it)."""
    taken: list[str] = []
    if state is not None:
        made.load_state_dict(state)
        if state["epoch"] > 0:  # its ranks took all of epoch 0: nothing to take here
            return taken, made.state_dict()
    it = iter(made)
    try:
        while stop is None or stop > 0:
            batch = next(it, None)
            if batch is None:
                break
            taken += batch
            stop = None if stop is None else stop - 1
        return taken, json.loads(json.dumps(made.state_dict()))
    finally:
        it.close()


def the_epoch(paths: list[str], world: int, options: dict[str, Any]) -> Counter[str]:
    """Epoch 0 as ``world`` ranks split it (the last ``6 % world`` shards of its order are
    left out, as ``tar_shards`` leaves them out)."""
    names = {p: s for s, p in enumerate(paths)}
    read = [
        names[p]
        for r in range(world)
        for p in tar_shards(paths, seed=3, rank=r, world_size=world, **options).epoch_shards(0)
    ]
    return Counter(f"s{s}/{j:04d}" for s in read for j in range(SIZES[s]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    worlds=st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4)),
    stops=st.lists(st.integers(0, 4), min_size=8, max_size=8),
    shuffle=st.booleans(),
    compressed=st.booleans(),
    in_flight=st.integers(1, 3),
    batch=st.sampled_from([1, 3]),
)
def test_w_ranks_stop_resume_on_w2_stop_again_and_w3_finish_the_epoch_once(
    shards: dict[bool, list[str]],
    worlds: tuple[int, int, int],
    stops: list[int],
    shuffle: bool,
    compressed: bool,
    in_flight: int,
    batch: int,
) -> None:
    """W ranks stop at random points and save; merge_states deals what they left to W' ranks,
    which stop at random points again; merged once more, W'' ranks finish. Every sample of
    the epoch (as W ranks split it) is taken once: none lost, none twice."""
    paths = shards[compressed]
    options: dict[str, Any] = {"shards_in_flight": in_flight}
    if shuffle:
        options |= {"shuffle_shards": True, "shuffle_buffer": 4}
    taken: Counter[str] = Counter()
    states: list[dict[str, Any]] | list[None] = [None] * worlds[0]
    for phase, world in enumerate(worlds):
        assert len(states) == world
        last = phase == len(worlds) - 1
        saved = []
        for rank in range(world):
            stop = None if last else stops[(phase * 4 + rank) % len(stops)]
            got, state = run_rank(loader(paths, rank, world, options, batch), states[rank], stop)
            taken.update(got)
            saved.append(state)
        if not last:
            states = merge_states(saved, world_size=worlds[phase + 1])
            assert all(len(json.dumps(s)) < 4000 for s in states)  # small JSON
    assert taken == the_epoch(paths, worlds[0], options)


def stopped(paths: list[str], world: int, stop: int, **kw: Any) -> list[dict[str, Any]]:
    options = {"seed": 3, "shuffle_shards": True, "shuffle_buffer": 4, **kw.pop("tar", {})}
    states = []
    for rank in range(world):
        made = DataLoader(
            tar_shards(paths, rank=rank, world_size=world, **options),
            batch_size=2,
            collate_fn=keys,
            **kw,
        )
        states.append(run_rank(made, None, stop)[1])
    return states


def test_a_merged_state_goes_to_its_own_rank(shards: dict[bool, list[str]]) -> None:
    """Rank k of the new world loads states[k]; rank 1's state in rank 0's loader is refused,
    naming both."""
    new = merge_states(stopped(shards[False], 2, 1), world_size=3)
    assert [s["stream"]["dataset"]["split"] for s in new] == [[0, 3], [1, 3], [2, 3]]
    wrong = loader(shards[False], 0, 3, {"shuffle_shards": True, "shuffle_buffer": 4}, 2)
    wrong.load_state_dict(new[1])
    with pytest.raises(ValueError, match=r"rank 1's of 3; this tar_shards is rank 0 of 3"):
        list(wrong)


def test_merge_states_refuses_what_it_cannot_redivide(shards: dict[bool, list[str]]) -> None:
    paths = shards[False]
    two = stopped(paths, 2, 1)
    with pytest.raises(ValueError, match=r"states\[0\] is of a stream.*world_size=W"):
        merge_states(two)
    with pytest.raises(ValueError, match=r"world_size must be a positive int"):
        merge_states(two, world_size=0)
    with pytest.raises(ValueError, match=r"ranks \[\[0, 2\], \[0, 2\]\].*each once"):
        merge_states([two[0], two[0]], world_size=3)
    with pytest.raises(ValueError, match=r"ranks \[\[0, 2\]\]"):
        merge_states(two[:1], world_size=3)
    reseeded = stopped(paths, 2, 1, tar={"seed": 4})
    with pytest.raises(ValueError, match=r"states\[1\]'s stream 'dataset' is .*not of one run"):
        merge_states([two[0], reseeded[1]], world_size=3)
    later = json.loads(json.dumps(two[1]))
    later["epoch"] = 2
    with pytest.raises(ValueError, match=r"states are at different epochs: \[0, 2\]"):
        merge_states([two[0], later], world_size=3)
    out_of_order = stopped(paths, 2, 3, in_order=False)
    out_of_order[0]["taken"] = {"through": 1, "beyond": [2]}
    with pytest.raises(ValueError, match=r"states\[0\] took batches \[2\] out of order"):
        merge_states(out_of_order, world_size=3)
    mapped = DataLoader(list(range(8)), batch_size=2).state_dict()
    with pytest.raises(ValueError, match=r"states\[0\] is of a stream, states\[1\] of a map"):
        merge_states([two[0], mapped], world_size=3)


async def test_an_interleave_of_async_iterables_is_not_redivided() -> None:
    async def part(start: int) -> Any:
        for i in range(start, start + 3):
            yield i

    made = DataLoader(
        aioloader.interleave([lambda s=s: part(10 * s) for s in range(3)]),
        batch_size=2,
        collate_fn=list,
    )
    with pytest.raises(ValueError, match=r"states\[0\] is of a stream that names no place"):
        merge_states([made.state_dict()], world_size=2)  # before its first batch
    async with made:
        batches = aiter(made)
        await anext(batches)
        state = made.state_dict()
    with pytest.raises(ValueError, match=r"states\[0\]: the stream's state names no split"):
        merge_states([state], world_size=2)


@pytest.mark.timeout(200)
def test_torchrun_two_ranks_stop_and_three_finish_the_epoch(tmp_path: Path) -> None:
    """torchrun with 2 ranks (tar_shards split by torch.distributed's rank) takes 3 batches
    each and saves merge_states(..., world_size=3); torchrun with 3 ranks loads one state
    each and finishes: every sample of the epoch once, on one rank."""
    make_shards(tmp_path, n_shards=6, n_samples=5)
    job = ROOT / "tests" / "support" / "ddp_tar_resume_job.py"
    torchrun(2, job, "stop", str(tmp_path), cwd=tmp_path)
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert [s["stream"]["dataset"]["split"] for s in merged] == [[0, 3], [1, 3], [2, 3]]
    torchrun(3, job, "resume", str(tmp_path), cwd=tmp_path)
    before = json.loads((tmp_path / "stop.json").read_text())
    after = json.loads((tmp_path / "resume.json").read_text())
    assert [len(r) for r in before] == [6, 6]
    assert all(after)  # each new rank had some of the 18 left
    flat = [k for r in before + after for k in r]
    assert sorted(flat) == sorted(f"s{s}/{j:04d}" for s in range(6) for j in range(5))
