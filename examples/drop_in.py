"""A torch training loop that switches loaders by changing one import.

The dataset is written for torch: its work is in ``__getitem__``, and it asks torch which worker
it runs in. With ``num_workers=2`` each worker process holds its own copy of it, as in torch.

Run: python examples/drop_in.py
"""

from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset, get_worker_info

from aioloader import DataLoader  # was: from torch.utils.data import DataLoader


class Squares(Dataset[tuple[torch.Tensor, int]]):
    """An ordinary map-style dataset whose reads take CPU time (decode, augment)."""

    def __len__(self) -> int:
        return 512

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        deadline = time.perf_counter() + 0.0005  # half a millisecond of Python work
        while time.perf_counter() < deadline:
            pass
        info = get_worker_info()  # torch's own function: it answers inside our workers too
        return torch.full((8,), float(index * index)), -1 if info is None else info.id


def main() -> None:
    loader = DataLoader(
        Squares(), batch_size=32, shuffle=True, num_workers=2, persistent_workers=True
    )
    print(f"{len(loader)} batches per epoch")
    for epoch in range(2):  # a plain for: the workers persist from one epoch to the next
        workers: set[int] = set()
        total = 0.0
        for batch, worker_ids in loader:
            total += float(batch[:, 0].sum())
            workers.update(worker_ids.tolist())
        print(f"epoch {epoch}: sum {total:.0f}, read by workers {sorted(workers)}")
    loader.close()  # optional: the workers also end with the loader, or at exit


if __name__ == "__main__":
    main()
