"""torch's DataPipes read as torch's ``DataLoader`` reads them, with torch's loader beside ours
in each test: each reader (a worker, or the main process) keeps its share of a
``sharding_filter`` (ours gave every worker the whole pipe: each sample ``num_workers`` times),
and ``shuffle`` switches the pipe's shufflers, seeded alike in every reader at each epoch from
``generator`` or torch's default generator."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data

import aioloader
from tests.support.torchrun import ROOT, torchrun

datapipes = pytest.importorskip("torch.utils.data.datapipes")

Loader = Any


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DataPipes' deprecation, torch's CPU-count advice
        yield


def sharded(n: int) -> Any:
    return datapipes.iter.IterableWrapper(range(n)).sharding_filter()


def shuffled(n: int, buffer: int = 8) -> Any:
    return datapipes.iter.IterableWrapper(range(n)).shuffle(buffer_size=buffer).sharding_filter()


def values(loader: Loader) -> list[int]:
    return [int(x) for x in loader]


@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
def test_each_worker_keeps_its_share_of_a_sharding_filter(num_workers: int) -> None:
    options = {"num_workers": num_workers, "batch_size": None}
    theirs = values(torch.utils.data.DataLoader(sharded(23), **options))
    ours = values(aioloader.DataLoader(sharded(23), **options))
    assert sorted(ours) == list(range(23))
    assert ours == theirs  # in torch's order too: the workers' shares in turn


def test_without_a_sharding_filter_every_worker_reads_the_whole_pipe_as_torchs() -> None:
    pipe = datapipes.iter.IterableWrapper(range(5))
    options = {"num_workers": 2, "batch_size": 2}
    theirs = [b.tolist() for b in torch.utils.data.DataLoader(pipe, **options)]
    ours = [b.tolist() for b in aioloader.DataLoader(pipe, **options)]
    assert ours == theirs


@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_shuffle_seeds_each_epoch_from_torchs_generator(num_workers: int, persistent: bool) -> None:
    dl = aioloader.DataLoader(
        shuffled(40), shuffle=True, num_workers=num_workers, persistent_workers=persistent
    )
    try:
        torch.manual_seed(123)
        first = values(dl)
        torch.manual_seed(123)
        again = values(dl)
        torch.manual_seed(321)
        other = values(dl)
        unseeded = values(dl)
    finally:
        dl.close()
    assert first == again  # torch.manual_seed before an epoch repeats it, as with torch's
    assert sorted(first) == sorted(other) == sorted(unseeded) == list(range(40))
    assert first != other and first != list(range(40))


def test_a_generator_gives_the_same_epochs_in_two_loaders() -> None:
    def epochs() -> list[list[int]]:
        generator = torch.Generator().manual_seed(7)
        dl = aioloader.DataLoader(shuffled(30), shuffle=True, num_workers=2, generator=generator)
        return [values(dl) for _ in range(2)]

    one, two = epochs(), epochs()
    assert one == two and one[0] != one[1]


def test_shuffle_false_turns_the_pipes_shuffler_off_as_torchs() -> None:
    options = {"num_workers": 2, "batch_size": None, "shuffle": False}
    theirs = values(torch.utils.data.DataLoader(shuffled(20), **options))
    ours = values(aioloader.DataLoader(shuffled(20), **options))
    assert ours == theirs == sorted(ours)  # the shares in turn: 0, 1, 2, ...


def test_shuffle_unset_leaves_the_pipes_shuffler_as_it_is() -> None:
    ours = values(aioloader.DataLoader(shuffled(20), num_workers=2, batch_size=None))
    assert sorted(ours) == list(range(20)) and ours != list(range(20))


def test_a_sampler_is_still_refused_for_an_iterable_pipe() -> None:
    sampler = torch.utils.data.SequentialSampler(range(3))
    for loader in (torch.utils.data.DataLoader, aioloader.DataLoader):
        with pytest.raises(ValueError, match="expected unspecified sampler option"):
            loader(sharded(3), sampler=sampler)


def test_ranks_share_rank_0s_seed_so_their_shares_are_every_sample_once(tmp_path: Path) -> None:
    """Two ranks under torchrun, their default generators seeded apart: torch broadcasts rank
    0's pipe seed; ours drew each rank's own, and 8 of 24 samples came twice, 8 never."""
    output = torchrun(2, ROOT / "tests/support/ddp_datapipe_job.py", cwd=tmp_path, timeout=90)
    ranks = [json.loads(line) for line in output.splitlines() if line.startswith('{"rank"')]
    assert sorted(r["rank"] for r in ranks) == [0, 1], output
    for name in ("torch-0", "torch-2", "aio-0", "aio-2"):
        union = sorted(x for r in ranks for x in r["seen"][name])
        assert union == list(range(24)), (name, union)


def test_distributed_true_is_refused_for_a_pipe_that_its_sharding_filter_splits() -> None:
    """``distributed=True`` split each rank's share again: each rank kept 1/world_size²."""
    with pytest.raises(ValueError, match="leave distributed unset"):
        aioloader.DataLoader(sharded(8), distributed=True, rank=0, world_size=2)


def test_seed_derives_each_epochs_pipe_seed_without_drawing() -> None:
    def epochs(**options: Any) -> list[list[int]]:
        dl = aioloader.DataLoader(shuffled(30), shuffle=True, num_workers=2, **options)
        return [values(dl) for _ in range(2)]

    state = torch.get_rng_state()
    one = epochs(seed=3)
    assert torch.equal(torch.get_rng_state(), state)  # seed=: torch's generator untouched
    torch.manual_seed(99)  # whatever the generator says
    assert epochs(seed=3) == one and one[0] != one[1]
    assert sorted(one[1]) == list(range(30))


class Skipping(torch.utils.data.IterDataPipe[int]):  # type: ignore[misc]
    """A pipe that resumes: it skips the samples a saved state says were read."""

    def __init__(self, source: Any) -> None:
        self.source, self.read, self.skip = source, 0, 0

    def __iter__(self) -> Any:
        self.read = 0
        for i, x in enumerate(self.source):
            if i >= self.skip:
                self.read = i + 1
                yield x
        self.skip = 0

    def state_dict(self) -> dict[str, int]:
        return {"read": self.read}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skip = state["read"]


def resumable(n: int) -> Any:
    return Skipping(datapipes.iter.IterableWrapper(range(n)).shuffle(buffer_size=n))


def test_a_shuffled_pipe_resumes_with_seed_and_is_refused_without() -> None:
    first = aioloader.DataLoader(resumable(20), batch_size=4, shuffle=True, seed=5)
    it = iter(first)
    taken = [int(x) for _ in range(2) for x in next(it)]
    state = first.state_dict()
    del it
    again = aioloader.DataLoader(resumable(20), batch_size=4, shuffle=True, seed=5)
    again.load_state_dict(state)
    rest = [int(x) for batch in again for x in batch]
    assert sorted(taken + rest) == list(range(20))  # the same shuffle, every sample once

    drawn = aioloader.DataLoader(resumable(20), batch_size=4, shuffle=True)
    it = iter(drawn)
    next(it)
    with pytest.raises(TypeError, match="pass seed="):
        drawn.state_dict()
    del it


def test_epochs_after_the_first_shuffle_as_torchs_with_workers() -> None:
    """torch's multiprocessing iterator draws once more as its workers start (a seed they
    never get); without that draw, ours went on from another state of the generator: only
    the first epoch came in torch's order."""

    def epochs(loader_class: Any, workers: int, persistent: bool, after: bool) -> list[list[int]]:
        if not after:
            torch.manual_seed(5)  # once, before the loader is built (building draws nothing)
        dl = loader_class(
            shuffled(24), shuffle=True, num_workers=workers, persistent_workers=persistent
        )
        if after:
            torch.manual_seed(5)  # once, after the loader is built
        try:
            return [values(dl) for _ in range(3)]
        finally:
            del dl

    for workers, persistent in ((0, False), (2, False), (2, True)):
        for after in (False, True):
            theirs = epochs(torch.utils.data.DataLoader, workers, persistent, after)
            ours = epochs(aioloader.DataLoader, workers, persistent, after)
            assert ours == theirs, (workers, persistent, after)


def test_shuffle_leaves_a_map_pipe_alone_as_torchs() -> None:
    """torch sets the shufflers of an iterable pipe only; ours asked a map pipe too, and torch
    warned that it added a shuffler to it."""
    pipe = datapipes.map.SequenceWrapper(list(range(6)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = aioloader.DataLoader(pipe, batch_size=None, shuffle=True, seed=1)
    assert sorted(int(x) for x in loader) == list(range(6))


def test_a_pipe_whose_shuffler_is_switched_off_resumes_without_seed() -> None:
    """Its shuffler draws nothing: the refusal was for any pipe with a ``set_seed``."""
    first = aioloader.DataLoader(resumable(20), batch_size=4, shuffle=False)
    it = iter(first)
    taken = [int(x) for _ in range(2) for x in next(it)]
    state = first.state_dict()
    del it
    again = aioloader.DataLoader(resumable(20), batch_size=4, shuffle=False)
    again.load_state_dict(state)
    assert taken + [int(x) for batch in again for x in batch] == list(range(20))
