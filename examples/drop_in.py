"""A torch training loop that switches loaders by changing one import.

Run: python examples/drop_in.py
"""

from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset

from aioloader import DataLoader  # was: from torch.utils.data import DataLoader


class Blocking(Dataset[torch.Tensor]):
    """An ordinary map-style dataset whose reads block (a file system, a database)."""

    def __len__(self) -> int:
        return 512

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.001)
        return torch.full((8,), float(index))


def main() -> None:
    loader = DataLoader(Blocking(), batch_size=32, shuffle=True, drop_last=True)
    print(f"{len(loader)} batches per epoch")
    with loader:  # optional: keeps one background loop and its threads for every epoch
        for epoch in range(2):
            total = sum(float(batch.sum()) for batch in loader)
            print(f"epoch {epoch}: sum {total:.0f}")


if __name__ == "__main__":
    main()
