"""Run by ``tests/data/test_ranks.py``: loaders with ``distributed=True`` built in the parent,
before any process group exists, and handed to ``torch.multiprocessing.spawn``'s two children
(pickled, as ``mp.spawn`` sends its arguments). Each child, for each case in turn, starts a
group (gloo, through a file in the case's folder ``argv[1]/<case>``), reads an epoch and
destroys the group. It writes what it read, what ``len(loader)`` said and the rank its
``state_dict()`` named to ``argv[1]/<case>/rank-<r>.json``.

``argv[2]``, the cases, comma-separated (run in one pair of children, to start them once):
- ``map``: a list of 20, shuffled; ``stream``: an async generator of 20.
- ``resumed``: the map case, 3 batches of 2 taken in the parent and its state loaded again
  there, before the group exists: the ranks share the 14 samples left. ``resumed-copy``: each
  rank reads a ``copy.copy`` of it made after the group started; ``resumed-set``: each rank
  changes a setting (``timeout``) first.
- ``stream-loaded``: a stream that keeps a state, its state loaded before the group: a stream
  split among ranks cannot resume, so the first epoch raises (``error``), once, even after a
  probe of ``len()`` (which raises nothing); the next reads.
- ``retry``: not split (each rank reads all 20), 2 worker processes and a retry policy naming
  this script's exception: each sample fails once (a marker file per index), and is retried.
- ``given``: the loader built in each child, after the group, with ``rank`` given (the world
  size left to the group), and read after the group was destroyed: the share stays.
- ``scoped``: the loader's scope opened (``with loader:``) in each child before the group:
  that scope keeps its plan (all of it), ``len()`` too; the next scope takes the share.
  ``seen`` is that next scope's epoch; ``len`` is what ``len()`` said inside the first.
"""

from __future__ import annotations

import copy
import json
import operator
import sys
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import aioloader

SAMPLES = 20


async def stream() -> AsyncIterator[int]:
    for i in range(SAMPLES):
        yield i


class Kept:
    """A stream that keeps a state: where it starts."""

    def __init__(self) -> None:
        self.start = 0

    async def __aiter__(self) -> AsyncIterator[int]:
        for i in range(self.start, SAMPLES):
            yield i

    def __len__(self) -> int:  # what tools probe with len() (tqdm: a TypeError is "no length")
        return SAMPLES - self.start

    def state_dict(self) -> dict[str, int]:
        return {"start": self.start}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["start"]


class Flaky(Exception):
    pass


class Once(torch.utils.data.Dataset[int]):
    """Each index fails the first time it is read (in any process), then reads."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> int:
        mark = Path(self.folder, f"tried-{index}")
        if not mark.exists():
            mark.touch()
            raise Flaky(index)
        return index


def build(kind: str, folder: str = "", **given: Any) -> aioloader.DataLoader[list[int]]:
    dataset: Any = list(range(SAMPLES))
    if kind in ("stream", "stream-loaded"):
        dataset = stream if kind == "stream" else Kept()
    elif kind == "retry":
        dataset = Once(folder)
        retry = aioloader.RetryPolicy(retry_on=(Flaky,), initial_backoff=0.001)
        given.update(num_workers=2, retry=retry)  # not split: the copy is not planned again
    return aioloader.DataLoader(  # for a share, only for the process it is in
        dataset, batch_size=2, shuffle=not kind.startswith("stream"), collate_fn=list,
        distributed=kind != "retry", **given,
    )  # fmt: skip


def train(
    rank: int, loader: aioloader.DataLoader[list[int]] | None, folder: str, kind: str
) -> None:
    if kind == "scoped":
        scoped(rank, folder)
        return
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2,
        timeout=timedelta(seconds=30),
    )  # fmt: skip
    state: dict[str, Any] = {}
    error = None
    if loader is None:  # "given"
        loader = build("map", rank=rank)
        dist.barrier()
        dist.destroy_process_group()
    elif kind == "resumed-copy":
        loader = copy.copy(loader)
    elif kind == "resumed-set":
        loader.timeout = 30
    if kind == "stream-loaded":
        try:
            operator.length_hint(loader)  # a probe of len() does not take the error away
            list(loader)
        except TypeError as exc:
            error = "\n".join([str(exc), *getattr(exc, "__notes__", [])])
    elif isinstance(loader.dataset, list):  # a state before the epoch: this rank's
        state = loader.state_dict()
    length = len(loader) if isinstance(loader.dataset, list | Once) else None  # streams: none
    seen = [x for batch in loader for x in batch]
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    record = {
        "len": length, "seen": seen, "state": [state.get("rank"), state.get("world_size")],
        "error": error,
    }  # fmt: skip
    Path(folder, f"rank-{rank}.json").write_text(json.dumps(record))


def scoped(rank: int, folder: str) -> None:
    loader = build("map")
    with loader:
        before = sum(1 for _ in loader)
        dist.init_process_group(
            "gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2,
            timeout=timedelta(seconds=30),
        )  # fmt: skip
        length, inside = len(loader), sum(1 for _ in loader)
    seen = [x for batch in loader for x in batch]
    dist.barrier()
    dist.destroy_process_group()
    record = {"len": length, "seen": seen, "scope": [before, inside], "state": [None, None]}
    Path(folder, f"rank-{rank}.json").write_text(json.dumps(record))


def prepare(kind: str, folder: str) -> aioloader.DataLoader[list[int]] | None:
    """The loader of ``kind``, built (and read from, or loaded) before any group exists."""
    loader = None if kind in ("given", "scoped") else build(kind, folder)
    if kind == "stream-loaded":
        assert loader is not None
        loader.load_state_dict(loader.state_dict())  # at the epoch's start, before the group
    if kind.startswith("resumed"):
        assert loader is not None
        taken = [x for _, batch in zip(range(3), loader, strict=False) for x in batch]
        saved = loader.state_dict()
        loader.load_state_dict(saved)  # loaded before the group: resolved for rank 0 of 1
        Path(folder, "taken.json").write_text(json.dumps(taken))
    elif kind == "map":
        assert loader is not None
        assert len(loader) == SAMPLES // 2  # no group yet: rank 0 of 1, all of it
    return loader


def train_each(
    rank: int, loaders: dict[str, aioloader.DataLoader[list[int]] | None], folder: str
) -> None:
    for kind, loader in loaders.items():  # one group after another, each in its own folder
        train(rank, loader, str(Path(folder, kind)), kind)


if __name__ == "__main__":
    folder, kinds = sys.argv[1], sys.argv[2].split(",")
    loaders = {}
    for kind in kinds:
        Path(folder, kind).mkdir()
        loaders[kind] = prepare(kind, str(Path(folder, kind)))
    mp.spawn(train_each, args=(loaders, folder), nprocs=2)  # all of them pickled together
