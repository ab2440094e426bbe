"""Run by ``tests/loader/test_datapipes.py`` under ``torchrun --standalone --nproc-per-node 2``
(gloo, CPU): a shuffled DataPipe with a ``sharding_filter``, read by torch's ``DataLoader`` and
by ours on each rank, each rank's default generator seeded differently (as any rank-dependent
draw leaves it). torch broadcasts rank 0's seed for the pipe; the ranks' shares together are
every sample once. Prints one JSON line per rank: its samples per loader and worker count."""

from __future__ import annotations

import json
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.utils.data
import torch.utils.data.datapipes as dp

import aioloader

SAMPLES = 24


def main() -> int:
    warnings.simplefilter("ignore")  # DataPipes' deprecation
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    seen: dict[str, list[int]] = {}
    for name, loader_class in (
        ("torch", torch.utils.data.DataLoader),
        ("aio", aioloader.DataLoader),
    ):
        for workers in (0, 2):
            pipe = dp.iter.IterableWrapper(range(SAMPLES)).shuffle().sharding_filter()
            loader = loader_class(pipe, batch_size=None, shuffle=True, num_workers=workers)
            seen[f"{name}-{workers}"] = [int(x) for x in loader]
    print(json.dumps({"rank": rank, "seen": seen}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
