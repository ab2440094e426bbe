"""Run by ``tests/sources/test_resume_elastic.py`` under ``torchrun --standalone`` (gloo, CPU).

Phase ``stop`` (2 ranks): each rank reads its shards of ``DIR/shard-*.tar`` with ``tar_shards``
(split by ``torch.distributed``'s rank, shuffled, through a shuffle buffer) and takes ``STOP``
batches; the ranks' states are gathered and rank 0 saves ``merge_states(states,
world_size=3)``. Phase ``resume`` (3 ranks): rank ``k`` loads state ``k`` and takes the rest of
the epoch. No collective per step: after a re-division the ranks hold different numbers of
samples (whole pieces are dealt, nothing padded). Each phase writes what every rank took to
``DIR/<phase>.json``.

Usage: ddp_tar_resume_job.py stop|resume DIR
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

import aioloader
from aioloader.sources import tar_shards

BATCH, STOP = 2, 3


def keys(batch: list[dict[str, Any]]) -> list[str]:
    return [s["__key__"] for s in batch]


def main() -> int:
    phase, folder = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    shards = sorted(str(p) for p in folder.glob("shard-*.tar"))
    ds = tar_shards(shards, shuffle_shards=True, shuffle_buffer=4, shards_in_flight=2, seed=5)
    loader = aioloader.DataLoader(ds, batch_size=BATCH, collate_fn=keys)
    if phase == "resume":
        loader.load_state_dict(json.loads((folder / "merged.json").read_text())[rank])
    taken: list[str] = []
    for batch in loader:
        taken += batch
        if phase == "stop" and len(taken) == STOP * BATCH:
            break
    states: list[object] = [None] * world
    dist.all_gather_object(states, loader.state_dict())
    everything: list[object] = [None] * world
    dist.all_gather_object(everything, taken)
    if rank == 0:
        if phase == "stop":
            merged = aioloader.merge_states(states, world_size=3)  # type: ignore[arg-type]
            (folder / "merged.json").write_text(json.dumps(merged))
        (folder / f"{phase}.json").write_text(json.dumps(everything))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
