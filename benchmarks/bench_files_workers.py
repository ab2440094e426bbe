"""Where a folder of JPEGs is read with worker processes, and what that costs the training
process: the main process's own CPU time per batch (``getrusage(RUSAGE_SELF)``: all its threads,
not its children's) and the steady rate, torch's ``DataLoader`` beside aioloader's in the same
run, each configuration in a fresh interpreter, rounds interleaved.

Configurations (batch ``--batch-size``, ``--workers`` processes, shuffled, persistent workers):

* ``torch``: ``torch.utils.data.DataLoader`` over a torch ``Dataset`` whose ``__getitem__``
  reads file ``i`` and decodes it (Pillow, a crop, a uint8 CHW tensor);
* ``aio-swapped``: the same dataset through ``aioloader.DataLoader`` (the import swapped);
* ``aio-files``: ``aioloader.sources.files(root, suffix=".jpg", with_keys=True)`` with the
  decode as ``transform``: the workers read the files (``FileDataset.for_workers``);
* ``aio-files-here``: the same with ``max_inflight_bytes`` set (1 TiB: no bound in practice),
  which keeps the reads in the loader's process, as every ``sources.files`` loader read before
  the workers read for themselves: the batch's bytes are read there and sent to the workers.

    python benchmarks/bench_files_workers.py [--images 2048] [--rounds 3] [--epochs 4]

The images are the GPU workload's (``aioloader._bench.gpu.write_folder``: 320x256, about 56 KiB).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from _steady import rounds, steady, table

CONFIGS = ("torch", "aio-swapped", "aio-files", "aio-files-here")
CROP = 160


def decode(item: tuple[str, bytes]) -> tuple[Any, int]:
    """``(key, JPEG bytes)`` to a uint8 CHW crop and its class (the folder's number)."""
    import numpy as np
    import torch
    from PIL import Image

    key, data = item
    pixels = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))[:CROP, :CROP]
    return torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1), int(key[1:3])


class Folder:
    """The torch user's dataset: reads file ``i`` and decodes it."""

    def __init__(self, root: str, keys: list[str]) -> None:
        self.root, self.keys = root, keys

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        with open(os.path.join(self.root, self.keys[index]), "rb") as f:
            return decode((self.keys[index], f.read()))


def child(config: str, root: str, batch_size: int, workers: int, epochs: int) -> dict[str, Any]:
    """One configuration's epochs; its steady rate and CPU per batch (medians of epochs 2..)."""
    import torch

    import aioloader
    from aioloader.sources import files

    common: dict[str, Any] = {
        "batch_size": batch_size,
        "shuffle": True,
        "num_workers": workers,
        "persistent_workers": True,
    }
    loader: Any
    if config.startswith("aio-files"):
        here = {"max_inflight_bytes": 1 << 40} if config == "aio-files-here" else {}
        source = files(root, suffix=".jpg", with_keys=True)
        loader = aioloader.DataLoader(source, transform=decode, **common, **here)
    else:
        dataset = Folder(root, files(root, suffix=".jpg").keys)
        make = torch.utils.data.DataLoader if config == "torch" else aioloader.DataLoader
        loader = make(dataset, **common)
    return steady(loader, epochs, lambda batch: len(batch[1]))  # (images, labels)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        row = child(args.child, args.root, args.batch_size, args.workers, args.epochs)
        print(json.dumps(row))
        return 0

    from aioloader._bench.gpu import write_folder

    with tempfile.TemporaryDirectory(prefix="aioloader-files-workers-") as tmp:
        kib = write_folder(Path(tmp), args.images, 4)
        print(
            f"{args.images} JPEGs ({kib:.1f} KiB on average), batch {args.batch_size}, "
            f"{args.workers} workers, {os.cpu_count()} CPUs, {args.epochs} epochs, steady = "
            "median of epochs 2 on"
        )

        def command(config: str) -> list[str]:
            return [
                sys.executable, __file__, "--child", config, "--root", tmp,
                "--batch-size", str(args.batch_size), "--workers", str(args.workers),
                "--epochs", str(args.epochs),
            ]  # fmt: skip

        results = rounds(args.only, args.rounds, command)
    table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
