"""More CPU than one machine has: a torch Dataset's decoding in Ray actors.

The dataset is what a torch user already has (JPEG decode, random crop and flip in
``__getitem__``); the loader's only change is ``worker_mode=aioloader.RayWorkers(...)``. Run it
as it is and aioloader starts a local Ray cluster for it (or joins the one ``RAY_ADDRESS`` or a
``ray start`` on this machine names); pass ``--address`` to join a real one::

    python examples/ray_workers.py                      # a local cluster
    python examples/ray_workers.py --address auto       # the cluster `ray start` began here
    python examples/ray_workers.py --address ray://head:10001 --num-cpus 2

On a real cluster every node needs this script's imports (torch, Pillow, aioloader) in the same
versions, and the dataset's class importable there: pass
``options={"runtime_env": {"working_dir": "."}}`` to ship this folder with the job.
"""

from __future__ import annotations

import argparse
import io
import os
import random

import numpy as np
import torch
import torch.utils.data
from PIL import Image

import aioloader


class Jpegs(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """``n`` JPEGs made in memory, decoded, randomly cropped and flipped where they are read."""

    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(0)
        self.images = []
        for _ in range(min(n, 32)):
            pixels = rng.integers(0, 256, (96, 96, 3), dtype=np.uint8)
            out = io.BytesIO()
            Image.fromarray(pixels).save(out, format="JPEG", quality=85)
            self.images.append(out.getvalue())
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = Image.open(io.BytesIO(self.images[index % len(self.images)])).convert("RGB")
        left, top = random.randint(0, 32), random.randint(0, 32)
        image = image.crop((left, top, left + 64, top + 64))
        if random.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        pixels = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)
        return pixels, os.getpid()  # the pid shows the batch was made in an actor


def to_batch(samples: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Collation defined in this script: Ray's actors get it by value (their ``__main__`` is
    Ray's, not this script)."""
    images, pids = zip(*samples, strict=True)
    return torch.stack(images), torch.tensor(pids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--address", help="the Ray cluster to join (default: a local one)")
    parser.add_argument("--num-cpus", type=float, default=1.0, help="CPUs each actor reserves")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    workers = aioloader.RayWorkers(address=args.address, num_cpus=args.num_cpus)
    loader = aioloader.DataLoader(
        Jpegs(256),
        batch_size=32,
        shuffle=True,
        num_workers=args.workers,
        worker_mode=workers,
        collate_fn=to_batch,
        persistent_workers=True,
        seed=0,
    )
    for epoch in range(2):
        pids: set[int] = set()
        for images, read_by in loader:
            assert images.shape[1:] == (3, 64, 64)
            assert images.dtype == torch.uint8
            pids.update(read_by.tolist())
        print(f"epoch {epoch}: 256 images, made by Ray actors with pids {sorted(pids)}")
    print(loader.statistics())
    loader.close()


if __name__ == "__main__":
    main()
