"""Samples that are tensors the loader's process holds (an in-memory cache, an async source's
decoded records), transformed in worker processes: what each batch costs to send, and what the
training process keeps open. torch's ``DataLoader`` beside aioloader's in the same run, each
configuration in a fresh interpreter, rounds interleaved.

Configurations (``--images`` uint8 images of 3x``--side``x``--side`` held in a list, batch
``--batch-size``, ``--workers`` processes, persistent workers, a flip and a crop per sample):

* ``torch``: ``torch.utils.data.DataLoader`` over a torch ``Dataset`` of the list, the
  transform in ``__getitem__``: its forked workers inherit the list, no sample crosses to them;
* ``aio-swapped``: the same dataset through ``aioloader.DataLoader`` (the import swapped);
* ``aio-async``: an ``aioloader.AsyncDataset`` of the list (``await get(i)``, as a cache or an
  async source answers) with the transform as ``transform``: each sample crosses to a worker
  in its batch's job.

Reported: the steady rate and the main process's own CPU time per batch (``RUSAGE_SELF``, all
its threads; medians of epochs 2 on), and the shared-memory descriptors the main process holds
at the end (``/proc/self/fd`` entries under ``/dev/shm``).

    python benchmarks/bench_job_tensors.py [--images 4096] [--rounds 3] [--epochs 4]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any

from _steady import rounds, steady, table

CONFIGS = ("torch", "aio-swapped", "aio-async")


def augment(image: Any) -> Any:
    """A flip and a crop: cheap, so that what a batch costs to send shows."""
    side = image.shape[-1]
    return image.flip(-1)[:, : side - 8, : side - 8]


def images(count: int, side: int) -> list[Any]:
    import torch

    generator = torch.Generator().manual_seed(0)
    return [
        torch.randint(0, 255, (3, side, side), dtype=torch.uint8, generator=generator)
        for _ in range(count)
    ]


class Cached:
    """The torch user's dataset: its images in memory, augmented as they are read."""

    def __init__(self, held: list[Any]) -> None:
        self.held = held

    def __len__(self) -> int:
        return len(self.held)

    def __getitem__(self, index: int) -> Any:
        return augment(self.held[index])


def shm_descriptors() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/shm/")
    return count


def child(config: str, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration's epochs; its steady rate and CPU per batch (medians of epochs 2..)."""
    import torch

    import aioloader

    held = images(args.images, args.side)
    common: dict[str, Any] = {
        "batch_size": args.batch_size,
        "shuffle": True,
        "num_workers": args.workers,
        "persistent_workers": True,
    }
    loader: Any
    if config == "aio-async":

        class Async(aioloader.AsyncDataset[Any]):
            def __len__(self) -> int:
                return len(held)

            async def get(self, index: int) -> Any:
                return held[index]

        loader = aioloader.DataLoader(Async(), transform=augment, **common)
    else:
        make = torch.utils.data.DataLoader if config == "torch" else aioloader.DataLoader
        loader = make(Cached(held), **common)
    row = steady(loader, args.epochs, len)
    return {**row, "shm": shm_descriptors()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--side", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return 0

    print(
        f"{args.images} images of 3x{args.side}x{args.side} uint8 in memory, batch "
        f"{args.batch_size}, {args.workers} workers, {os.cpu_count()} CPUs, {args.epochs} "
        "epochs, steady = median of epochs 2 on"
    )

    def command(config: str) -> list[str]:
        return [
            sys.executable, __file__, "--child", config, "--images", str(args.images),
            "--side", str(args.side), "--batch-size", str(args.batch_size),
            "--workers", str(args.workers), "--epochs", str(args.epochs),
        ]  # fmt: skip

    results = rounds(
        args.only, args.rounds, command, lambda row: f", {row['shm']:>5} shm descriptors"
    )
    table(results, ("shm fds", lambda rows: str(max(r["shm"] for r in rows))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
