"""accelerate's ``prepare`` on two CPU ranks (under torchrun): the same shuffled loader through
torch's ``DataLoader`` and through ``aioloader.DataLoader``, two epochs each; each rank writes
what it read, per epoch, to ``OUT/<loader>-<rank>.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

import aioloader

N = 64


class Numbers(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index)])


if __name__ == "__main__":
    accelerator = Accelerator(cpu=True)
    for name, cls in (("torch", torch.utils.data.DataLoader), ("aio", aioloader.DataLoader)):
        prepared = accelerator.prepare(cls(Numbers(), batch_size=4, shuffle=True))
        seen = []
        for epoch in range(2):
            prepared.set_epoch(epoch)
            seen.append([int(x) for batch in prepared for x in batch.flatten()])
        out = Path(sys.argv[1]) / f"{name}-{accelerator.process_index}.json"
        out.write_text(json.dumps({"type": type(prepared).__name__, "seen": seen}))
