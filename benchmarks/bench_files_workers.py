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
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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


def self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


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
    rates, cpu_ms = [], []
    for _ in range(epochs):
        start, cpu, samples, batches = time.perf_counter(), self_cpu_s(), 0, 0
        for _images, labels in loader:
            samples += len(labels)
            batches += 1
        rates.append(samples / (time.perf_counter() - start))
        cpu_ms.append((self_cpu_s() - cpu) / batches * 1e3)
    if hasattr(loader, "close"):
        loader.close()
    return {"rate": statistics.median(rates[1:]), "cpu_ms": statistics.median(cpu_ms[1:])}


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

    results: dict[str, list[dict[str, Any]]] = {c: [] for c in args.only}
    with tempfile.TemporaryDirectory(prefix="aioloader-files-workers-") as tmp:
        kib = write_folder(Path(tmp), args.images, 4)
        print(
            f"{args.images} JPEGs ({kib:.1f} KiB on average), batch {args.batch_size}, "
            f"{args.workers} workers, {os.cpu_count()} CPUs, {args.epochs} epochs, steady = "
            "median of epochs 2 on"
        )
        for round_ in range(1, args.rounds + 1):
            for config in args.only:
                command = [
                    sys.executable, __file__, "--child", config, "--root", tmp,
                    "--batch-size", str(args.batch_size), "--workers", str(args.workers),
                    "--epochs", str(args.epochs),
                ]  # fmt: skip
                out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
                row = json.loads(out.strip().splitlines()[-1])
                results[config].append(row)
                print(
                    f"  round {round_} {config:<15} {row['rate']:>8,.0f} samples/s  main "
                    f"process {row['cpu_ms']:6.2f} ms CPU a batch",
                    flush=True,
                )
    base = results.get("torch")
    print(f"\n{'config':<15} {'samples/s':>10} {'x torch':>8} {'CPU ms/batch':>13} {'x torch':>8}")
    for config, rows in results.items():
        rate = statistics.median(r["rate"] for r in rows)
        cpu = statistics.median(r["cpu_ms"] for r in rows)
        ratios = ("", "")
        if base:
            b_rate = statistics.median(r["rate"] for r in base)
            b_cpu = statistics.median(r["cpu_ms"] for r in base)
            ratios = (f"{rate / b_rate:.2f}x", f"{cpu / b_cpu:.2f}x")
        print(f"{config:<15} {rate:>10,.0f} {ratios[0]:>8} {cpu:>13.2f} {ratios[1]:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
