"""Run by ``tests/loader/test_resume_kill.py`` under ``torchrun --standalone`` (gloo, CPU).

Phase ``stop`` (2 ranks): each rank takes ``STOP`` batches of its share of a shuffled map-style
dataset, with an all-reduce per step (as DDP's backward does); the ranks' states are gathered
and rank 0 saves ``merge_states`` of them. Phase ``resume`` (3 ranks): each rank loads the
merged state with its own rank and goes on to the end of the epoch, an all-reduce per step.
Each phase writes what every rank took to ``DIR/<phase>.json``.

Usage: ddp_resume_job.py stop|resume DIR
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import aioloader

SAMPLES, BATCH, STOP = 104, 4, 7


def main() -> int:
    phase, folder = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    loader: aioloader.DataLoader[torch.Tensor] = aioloader.DataLoader(
        list(range(SAMPLES)), batch_size=BATCH, shuffle=True, seed=9, distributed=True
    )
    if phase == "resume":
        loader.load_state_dict(json.loads((folder / "merged.json").read_text()))
    taken: list[list[int]] = []
    for batch in loader:
        total = batch.sum().reshape(1).double()
        dist.all_reduce(total)  # every rank takes part in every step, or this hangs
        taken.append(batch.tolist())
        if phase == "stop" and len(taken) == STOP:
            break
    states: list[object] = [None] * world
    dist.all_gather_object(states, loader.state_dict())
    everything: list[object] = [None] * world
    dist.all_gather_object(everything, taken)
    if rank == 0:
        if phase == "stop":
            merged = aioloader.merge_states(states)  # type: ignore[arg-type]
            (folder / "merged.json").write_text(json.dumps(merged))
        (folder / f"{phase}.json").write_text(json.dumps(everything))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
