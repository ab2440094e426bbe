"""Run by ``tests/data/test_ranks.py`` under ``torchrun --standalone --nproc-per-node 2`` (gloo,
CPU): every rank iterates a stream whose length is not a multiple of the batch size, with an
all-reduce per step (as DDP's backward does); a rank with one batch more would hang here."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from datetime import timedelta

import torch
import torch.distributed as dist

import aioloader

SAMPLES, BATCH = 101, 10


async def stream() -> AsyncIterator[int]:
    for i in range(SAMPLES):
        yield i


def main() -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    loader: aioloader.DataLoader[list[int]] = aioloader.DataLoader(
        stream, batch_size=BATCH, collate_fn=list, distributed=True
    )
    steps, seen = 0, []
    for epoch in range(2):
        loader.set_epoch(epoch)
        for batch in loader:
            total = torch.tensor([float(len(batch))])
            dist.all_reduce(total)  # every rank must take part in every step
            steps += 1
            seen += batch
    counts = torch.tensor([steps])
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, counts)
    everything = [None] * world
    dist.all_gather_object(everything, sorted(set(seen)))
    dist.destroy_process_group()
    if rank == 0:
        union = sorted({x for part in everything for x in part})  # type: ignore[union-attr]
        print(f"steps per rank: {[int(g) for g in gathered]}; samples read: {len(union)}")
        assert union == list(range(SAMPLES)), "a sample was lost"
    return 0


if __name__ == "__main__":
    sys.exit(main())
