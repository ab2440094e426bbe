"""Run by ``tests/data/test_ranks.py``: a loader with ``distributed=True`` built in the parent,
before any process group exists, and handed to ``torch.multiprocessing.spawn``'s two children
(pickled, as ``mp.spawn`` sends its arguments), each of which then starts the group (gloo,
through a file in ``argv[1]``) and reads an epoch. Each child writes what it read, and what
``len(loader)`` said, to ``argv[1]/rank-<r>.json``.

``argv[2]`` is ``map`` (a list, shuffled) or ``stream`` (an async generator)."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

import aioloader

SAMPLES = 20


async def stream() -> AsyncIterator[int]:
    for i in range(SAMPLES):
        yield i


def train(rank: int, loader: aioloader.DataLoader[list[int]], folder: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2,
        timeout=timedelta(seconds=30),
    )  # fmt: skip
    length = len(loader) if isinstance(loader.dataset, list) else None  # a stream has none
    seen = [x for batch in loader for x in batch]
    dist.barrier()
    dist.destroy_process_group()
    Path(folder, f"rank-{rank}.json").write_text(json.dumps({"len": length, "seen": seen}))


if __name__ == "__main__":
    folder, kind = sys.argv[1], sys.argv[2]
    dataset = list(range(SAMPLES)) if kind == "map" else stream
    loader = aioloader.DataLoader(
        dataset, batch_size=2, shuffle=kind == "map", collate_fn=list, distributed=True
    )
    if kind == "map":
        assert len(loader) == SAMPLES // 2  # no group yet: rank 0 of 1, all of it
    mp.spawn(train, args=(loader, folder), nprocs=2)
