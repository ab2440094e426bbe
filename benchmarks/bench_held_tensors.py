"""A torch ``Dataset`` that holds its samples as tensors (a preloaded, decoded cache), read
through torch's ``DataLoader`` and through aioloader's with the import swapped, nothing else
changed: ``persistent_workers=False`` (torch's default), so each epoch starts its workers and
hands them the dataset again (``--persistent``: once). Each configuration runs in a fresh
interpreter, rounds interleaved.

torch's forked workers inherit the list. aioloader's workers start from a fork server, and the
dataset's tensors go with their start: copied into the start (``_workers/startcopy.py``);
before, each storage was moved into a shared-memory segment of its own, its descriptor held
open in the training process (``--compare PATH`` runs another checkout's aioloader beside this
one's, as ``aio@PATH``).

Reported per configuration: the first epoch (workers' start included), the median of the later
epochs, the descriptors the main process holds after the last epoch, and the peak PSS of the
process tree (``MemorySampler``, sampled from a thread in the child). ``--nofile N`` lowers the
open-file limit in each child first (1,024 is the usual default); a configuration that fails
prints its error.

    python benchmarks/bench_held_tensors.py [--tensors 15000] [--shape 3 64 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.utils.data

CONFIGS = ("torch", "aio")


class Cached(torch.utils.data.Dataset[torch.Tensor]):
    """The torch user's dataset: its samples decoded once, held in a list."""

    def __init__(self, count: int, shape: list[int]) -> None:
        generator = torch.Generator().manual_seed(0)
        self.held = [
            torch.randint(0, 255, shape, dtype=torch.uint8, generator=generator)
            for _ in range(count)
        ]

    def __len__(self) -> int:
        return len(self.held)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.held[index].flip(-1)


def child(config: str, args: argparse.Namespace) -> dict[str, Any]:
    if args.nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, args.nofile))
    from aioloader._bench.harness_processes import MemorySampler

    if config == "torch":
        make: Any = torch.utils.data.DataLoader
    else:
        import aioloader

        make = aioloader.DataLoader
    dataset = Cached(args.tensors, args.shape)
    epochs = []
    with MemorySampler() as memory:
        loader = make(
            dataset,
            batch_size=args.batch_size,
            num_workers=args.workers,
            persistent_workers=args.persistent,
        )
        for _ in range(args.epochs):
            start, samples = time.perf_counter(), 0
            for batch in loader:
                samples += len(batch)
            assert samples == args.tensors, samples
            epochs.append(time.perf_counter() - start)
        if hasattr(loader, "close"):
            loader.close()
    return {
        "first_s": epochs[0],
        "later_s": statistics.median(epochs[1:]),
        "fds": len(os.listdir("/proc/self/fd")),
        "pss_mib": memory.peak_pss_mib,
    }


def run(config: str, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ)
    name = config
    if config.startswith("aio@"):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [config[4:], env.get("PYTHONPATH")]))
        name = "aio"
    command = [
        sys.executable, __file__, "--child", name, "--tensors", str(args.tensors),
        "--shape", *map(str, args.shape), "--batch-size", str(args.batch_size),
        "--workers", str(args.workers), "--epochs", str(args.epochs),
        "--nofile", str(args.nofile), *(["--persistent"] if args.persistent else []),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        last = [line for line in done.stderr.splitlines() if line.strip()]
        return {"error": last[-1][:160] if last else f"exit status {done.returncode}"}
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=15_000)
    parser.add_argument("--shape", type=int, nargs="+", default=[3, 64, 64])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--nofile", type=int, default=0, help="open-file limit in each child")
    parser.add_argument("--persistent", action="store_true", help="persistent_workers=True")
    parser.add_argument("--compare", nargs="*", default=[], help="other checkouts' aioloader")
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return 0

    nbytes = args.tensors * torch.Size(args.shape).numel()
    shape = "x".join(map(str, args.shape))
    print(
        f"a torch Dataset holding {args.tensors:,} uint8 tensors of {shape}"
        f" ({nbytes / 2**20:,.0f} MiB), batch {args.batch_size}, {args.workers} workers, "
        f"{args.epochs} epochs {'with' if args.persistent else 'without'} persistent workers, "
        f"{os.cpu_count()} CPUs, open-file "
        f"limit {args.nofile or resource.getrlimit(resource.RLIMIT_NOFILE)[0]}"
    )
    configs = [*CONFIGS, *(f"aio@{path}" for path in args.compare)]
    results: dict[str, list[dict[str, Any]]] = {config: [] for config in configs}
    for round_ in range(1, args.rounds + 1):
        for config in configs:
            row = run(config, args)
            results[config].append(row)
            said = row.get("error") or (
                f"first epoch {row['first_s']:.2f} s, later {row['later_s']:.2f} s, "
                f"{row['fds']} descriptors, peak PSS {row['pss_mib']:,.0f} MiB"
            )
            print(f"  round {round_} {config:<12} {said}", flush=True)

    def median(config: str, key: str) -> float | None:
        rows = [row for row in results[config] if "error" not in row]
        return statistics.median(row[key] for row in rows) if rows else None

    print(f"\n{'config':<12} {'first s':>8} {'x torch':>8} {'later s':>8} {'x torch':>8} "
          f"{'fds':>6} {'PSS MiB':>8} {'x torch':>8}")  # fmt: skip
    for config in configs:
        cells = []
        for key, form in (
            ("first_s", ".2f"),
            ("later_s", ".2f"),
            ("fds", ".0f"),
            ("pss_mib", ",.0f"),
        ):
            value, base = median(config, key), median("torch", key)
            cells.append("failed" if value is None else format(value, form))
            if key != "fds":
                cells.append(f"{value / base:.2f}x" if value is not None and base else "")
        print(
            f"{config:<12} "
            + " ".join(f"{cell:>{8 if i != 4 else 6}}" for i, cell in enumerate(cells))
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
