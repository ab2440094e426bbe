"""A rank whose workers shard by ``torch.distributed``, as webdataset's ``split_by_node`` does
(run under torchrun, 2 ranks, gloo). ``RANK`` and ``WORLD_SIZE`` are taken out of the
environment once the group is made (Lightning's launcher sets neither), so the workers know the
rank only by asking ``torch.distributed``; ``worker_init_fn`` asks it too, as per-rank seeding
does. Prints one JSON line a rank: torch's loader's batches and ours."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.utils.data

import aioloader


class ByRank(torch.utils.data.IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        if dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        else:  # what a worker without the group falls back to: every rank reads everything
            rank, world = 0, 1
        return iter(range(rank, 8, world))


def seed_by_rank(worker_id: int) -> None:
    torch.manual_seed(1000 * dist.get_rank() + worker_id)


def read(make: type[torch.utils.data.DataLoader[int]]) -> list[list[int]]:
    loader = make(ByRank(), batch_size=2, num_workers=1, worker_init_fn=seed_by_rank)
    return [batch.tolist() for batch in loader]


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        os.environ.pop(name, None)
    row = {
        "rank": rank,
        "torch": read(torch.utils.data.DataLoader),
        "ours": read(aioloader.DataLoader),
    }
    print(json.dumps(row), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
