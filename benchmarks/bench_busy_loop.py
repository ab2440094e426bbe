"""A training loop that holds the GIL between batches, with the import swapped: whether the
worker processes wait for the loader's event loop thread between jobs.

The loop's step is ``--step-ms`` of pure Python (as a training step's Python holds the GIL:
kernel launches, logging, a metric); the dataset is the JPEG decode of ``bench_cpu.py``'s
``dropin-jpeg`` (a torch ``Dataset``: Pillow decode, random resized crop, flip), small batches
(``--batch-size``, default 4: a job of about 3 ms) on ``--workers`` worker processes (default
1, so that on two cores the worker and the loop each have one). A worker that sends a batch
back runs the next job at once if it is already waiting in its pipe, as torch's workers find
their next indices in their queue; sent only once the event loop's thread, which waits for the
GIL, has read the reply, it waits that long. Each configuration runs in a fresh interpreter,
rounds interleaved:

* ``torch``: ``torch.utils.data.DataLoader``, persistent workers;
* ``aio-swapped``: the same code with ``aioloader.DataLoader``;
* ``torch-files``: torch's loader over the same JPEGs written to a folder, a torch ``Dataset``
  that opens and reads file ``i`` in ``__getitem__`` (issue 25's ``ImageFolder``);
* ``aio-files``: ``aioloader.sources.files(folder, suffix=".jpg", with_keys=True)`` with the
  decode as its ``transform`` (the workers read the files: only indices cross the pipe).

Reported: the steady rate and the main process's CPU per batch (medians of epochs 2 on), and
the ratios to torch's.

    python benchmarks/bench_busy_loop.py [--rounds 3] [--step-ms 2] [--batch-size 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

from _steady import rounds, steady, table

CONFIGS = ("torch", "aio-swapped", "torch-files", "aio-files")


def busy(ms: float) -> None:
    """Pure Python for ``ms``: the GIL held, as a training step's Python holds it."""
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def child(config: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from _jpeg_folder import FolderJpegs, decode_keyed, write_jpeg_folder

    import aioloader
    from aioloader._bench.cpu_data import DropinJpegDataset, make_jpeg

    torch.set_num_threads(1)
    common: dict[str, Any] = {
        "batch_size": args.batch_size,
        "num_workers": args.workers,
        "persistent_workers": True,
    }
    with tempfile.TemporaryDirectory(prefix="busy-loop-") as root:
        loader: Any
        if config == "aio-files":
            write_jpeg_folder(root, args.images)
            source = aioloader.sources.files(root, suffix=".jpg", with_keys=True)
            loader = aioloader.DataLoader(source, transform=decode_keyed, **common)
        elif config == "torch-files":
            loader = torch.utils.data.DataLoader(
                FolderJpegs(write_jpeg_folder(root, args.images)), **common
            )
        else:
            dataset = DropinJpegDataset([make_jpeg(k)[0] for k in range(128)], args.images)
            make = torch.utils.data.DataLoader if config == "torch" else aioloader.DataLoader
            loader = make(dataset, **common)
        return steady(
            loader, args.epochs, lambda batch: len(batch[0]), lambda _: busy(args.step_ms)
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=3200)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--step-ms", type=float, default=2.0)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="+", choices=CONFIGS, default=CONFIGS, help="configs")
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return 0
    print(
        f"{args.images} JPEG decodes an epoch, batch {args.batch_size}, {args.workers} "
        f"worker(s), a {args.step_ms:g} ms Python step a batch, {os.cpu_count()} CPUs, "
        f"{args.epochs} epochs, steady = median of epochs 2 on"
    )

    def command(config: str) -> list[str]:
        return [
            sys.executable, __file__, "--child", config, "--images", str(args.images),
            "--batch-size", str(args.batch_size), "--workers", str(args.workers),
            "--step-ms", str(args.step_ms), "--epochs", str(args.epochs),
        ]  # fmt: skip

    peer = {"aio-swapped": "torch", "aio-files": "torch-files"}
    table(rounds(args.only, args.rounds, command), peer=lambda config: peer.get(config, "torch"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
