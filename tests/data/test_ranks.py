"""``distributed=True`` over a stream: every rank yields as many batches (a rank with one more
would hang the next collective), whatever the dataset kind, its length and the batch size."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import aioloader
from aioloader._data.sharding import StreamShare
from tests.support.torchrun import torchrun


def shares(n: int, world: int) -> list[list[int]]:
    out = []
    for rank in range(world):
        share: StreamShare[int] = StreamShare(rank, world)
        mine = [x for x in range(n) if share.mine(x)]
        out.append(mine + [x for _, x in share.padding()])
    return out


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 60), st.integers(1, 9))
def test_every_rank_gets_as_many_and_every_sample_is_read(n: int, world: int) -> None:
    got = shares(n, world)
    assert {len(g) for g in got} == {-(-n // world)}  # ceil(N / W) each
    for rank, g in enumerate(got):  # its own positions first, in order
        assert g[: len(range(rank, n, world))] == list(range(rank, n, world))
    assert set(range(n)) <= {x for g in got for x in g}  # nothing is lost
    padded = sum(len(g) for g in got) - n
    assert 0 <= padded < world  # at most one round is padded


def test_padding_follows_distributed_sampler() -> None:
    """The same shares as torch's DistributedSampler without shuffling."""
    for n in (0, 1, 5, 7, 8, 13):
        for world in (1, 2, 3, 8):
            if n == 0:
                continue
            sampler_shares = [
                list(
                    torch.utils.data.DistributedSampler(
                        range(n), num_replicas=world, rank=r, shuffle=False
                    )
                )
                for r in range(world)
            ]
            assert shares(n, world) == sampler_shares


class Counting(torch.utils.data.IterableDataset[int]):
    """Sharded over workers as torch users do: worker ``i`` of ``k`` yields ``i, i + k, ...``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        info = torch.utils.data.get_worker_info()
        step, first = (info.num_workers, info.id) if info is not None else (1, 0)
        return iter(range(first, self.n, step))


def async_counting(n: int) -> Any:
    async def gen() -> AsyncIterator[int]:
        for i in range(n):
            yield i

    return gen


@pytest.mark.parametrize(
    ("kind", "n", "batch_size", "world", "drop_last"),
    [
        ("async", 101, 10, 2, False),
        ("async", 101, 10, 2, True),
        ("async", 7, 3, 4, False),
        ("blocking", 101, 10, 2, False),
        ("blocking", 3, 2, 5, False),
        ("workers", 101, 10, 2, False),
        ("workers", 23, 4, 3, True),
    ],
)
def test_ranks_yield_the_same_number_of_batches(
    kind: str, n: int, batch_size: int, world: int, drop_last: bool
) -> None:
    counts, seen = [], set()
    for rank in range(world):
        dataset: Any = async_counting(n) if kind == "async" else Counting(n)
        loader: aioloader.DataLoader[list[int]] = aioloader.DataLoader(
            dataset,
            batch_size=batch_size,
            drop_last=drop_last,
            collate_fn=list,
            num_workers=2 if kind == "workers" else 0,
            distributed=True,
            rank=rank,
            world_size=world,
        )
        batches = list(loader)
        counts.append(len(batches))
        seen |= {x for b in batches for x in b}
    assert len(set(counts)) == 1, counts
    if not drop_last:
        assert seen == set(range(n))


def test_torchrun_two_ranks_over_a_stream_never_hang(tmp_path: Path) -> None:
    """Two real processes under torchrun (gloo): 101 samples in batches of 10 gave rank 0 six
    batches and rank 1 five, and the sixth all-reduce waited for ever."""
    job = Path(__file__).parents[1] / "support" / "ddp_stream_job.py"
    output = torchrun(2, job, cwd=tmp_path, timeout=45)
    assert "steps per rank: [12, 12]; samples read: 101" in output


def test_a_loader_built_before_the_process_group_takes_its_rank_when_it_runs(
    tmp_path: Path,
) -> None:
    """Built with ``distributed=True`` before ``init_process_group`` and sent to ``mp.spawn``'s
    children: each rank read all 20 samples (it had resolved rank 0 of 1 as it was built). The
    share is now taken as the epoch starts; ``len()`` and ``state_dict()`` follow it, and a
    state loaded before the group is divided among the ranks (found by review: 6 of its 14
    samples were lost; by a copy made, or a setting changed, after the group started too).
    A rank given with the world size left to the group keeps its share once the group is
    destroyed (found by review: ``len()`` raised). A scope open as the group starts keeps its
    plan, and ``len()`` says so (found by review: it said the new share). A stream's state
    loaded before the group cannot be divided: one clear error, and the loader reads on
    (found by review: every later call raised). A retry policy naming the script's exception
    still reaches the unpickled loader's workers (found by review: it failed to pickle). The
    cases run one after another in one pair of ranks (each started its own pair before: 7 s a
    case)."""
    job = Path(__file__).parents[1] / "support" / "ddp_spawn_job.py"
    kinds = ["map", "stream", "resumed", "resumed-copy", "resumed-set", "given", "scoped"]
    kinds += ["stream-loaded", "retry"]
    done = subprocess.run(
        [sys.executable, str(job), str(tmp_path), ",".join(kinds)],
        capture_output=True, text=True, timeout=150, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for kind in kinds:
        check_the_ranks(tmp_path / kind, kind)


def check_the_ranks(folder: Path, kind: str) -> None:
    """What the two ranks of case ``kind`` wrote in ``folder`` (see ``ddp_spawn_job.py``)."""
    ranks = [json.loads((folder / f"rank-{r}.json").read_text()) for r in (0, 1)]
    left = list(range(20))
    if kind.startswith("resumed"):
        taken = json.loads((folder / "taken.json").read_text())
        assert len(taken) == 6, kind
        left = sorted(set(left) - set(taken))
    if kind == "retry":  # not split; each sample failed once, in a worker, and was read again
        assert [sorted(r["seen"]) for r in ranks] == [left, left]
        assert len(list(folder.glob("tried-*"))) == 20
        return
    share = len(left) // 2
    assert [len(r["seen"]) for r in ranks] == [share, share], kind
    assert sorted(ranks[0]["seen"] + ranks[1]["seen"]) == left, kind
    # resumed: the whole epoch's; scoped: said in the scope opened before the group
    length = {"stream": None, "stream-loaded": None, "scoped": 10}.get(kind, 5)
    assert [r["len"] for r in ranks] == [length] * 2, kind
    if kind in ("map", "resumed", "resumed-copy", "resumed-set"):
        assert [r["state"] for r in ranks] == [[0, 2], [1, 2]], kind
    if kind == "scoped":  # the open scope's epochs kept its plan, as len() said
        assert [r["scope"] for r in ranks] == [[10, 10], [10, 10]]
    if kind == "stream-loaded":
        for r, rank in enumerate(ranks):
            assert "split across ranks by distributed=True" in rank["error"]
            assert f"cannot go on as rank {r} of 2; it was dropped" in rank["error"]
