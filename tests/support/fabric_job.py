"""Lightning Fabric's ``setup_dataloaders`` on two CPU ranks (``python fabric_job.py OUT``:
``fabric.launch`` starts the second rank): the same shuffled loader through torch's
``DataLoader`` and through ``aioloader.DataLoader``, two epochs each; each rank writes what it
read, per epoch, to ``OUT/<loader>-<rank>.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric

import aioloader


class Numbers(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index)])


def run(fabric: Fabric) -> None:
    for name, cls in (("torch", torch.utils.data.DataLoader), ("aio", aioloader.DataLoader)):
        loader = fabric.setup_dataloaders(cls(Numbers(), batch_size=4, shuffle=True))
        seen = []
        for epoch in range(2):
            loader.sampler.set_epoch(epoch)  # Fabric's DistributedSampler, as its docs say
            seen.append([int(x) for batch in loader for x in batch.flatten()])
        out = Path(sys.argv[1]) / f"{name}-{fabric.global_rank}.json"
        out.write_text(json.dumps({"train": seen}))


if __name__ == "__main__":
    Fabric(accelerator="cpu", devices=2, strategy="ddp").launch(run)
