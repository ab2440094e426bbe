"""The device stage's host copy (``aioloader._device.hostcopy.HostCopy``) against torch's
``copy_``, each called from a thread of its own as the stage calls it, a copy every ``--gap``
seconds (a batch arriving): the process's CPU time per copy (torch's OpenMP threads spin for
more work after each copy; HostCopy's threads block) and the copy's rate. As in a GPU training
process, the main thread runs no OpenMP work of its own first (where it has, libgomp spins
for less: its threads then outnumber the cores).

    python benchmarks/bench_hostcopy.py [--mib 37] [--copies 30] [--gap 0.08]

No GPU needed: both copies are host to host (into pinned memory where CUDA is there).
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable

import torch

from aioloader._device import stage
from aioloader._device.hostcopy import HostCopy

MIB = 1 << 20


def process_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def measure(copy: Callable[[], None], copies: int, gap: float) -> tuple[float, float]:
    """(CPU seconds of the whole process per copy, seconds per copy), on a fresh thread."""
    took: list[float] = []

    def body() -> None:
        copy()  # warm: pages touched, threads started
        for _ in range(copies):
            start = time.perf_counter()
            copy()
            took.append(time.perf_counter() - start)
            time.sleep(gap)

    before = process_cpu_s()
    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    return (process_cpu_s() - before) / copies, sorted(took)[len(took) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=36.75, help="MiB a copy (256x3x224x224)")
    parser.add_argument("--copies", type=int, default=30)
    parser.add_argument("--gap", type=float, default=0.08, help="seconds between copies")
    args = parser.parse_args()
    size = int(args.mib * MIB)
    pinned = torch.cuda.is_available()
    src = torch.randint(0, 256, (size,), dtype=torch.uint8)
    dst = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
    host = HostCopy(stage._COPY_THREADS)
    idle, _ = measure(lambda: None, args.copies, args.gap)
    rows = {
        f"torch copy_ ({torch.get_num_threads()} OpenMP threads)": lambda: dst.copy_(src),
        f"HostCopy ({host.threads} threads)": lambda: host.copy(dst, src),
    }
    print(
        f"{os.cpu_count()} cores; {size / MIB:.1f} MiB into {'pinned' if pinned else 'pageable'}"
        f" memory, a copy every {args.gap * 1e3:.0f} ms, {args.copies} copies"
    )
    results = {}
    for name, copy in rows.items():
        cpu, wall = measure(copy, args.copies, args.gap)
        results[name] = cpu - idle
        rate = size / wall / 1e9
        print(f"  {name:<34} {(cpu - idle) * 1e3:7.1f} ms CPU a copy  {rate:6.1f} GB/s")
    host.close()
    torch_cpu, ours = results.values()
    print(f"  CPU a copy, HostCopy / torch copy_: {ours / torch_cpu:.2f}x")


if __name__ == "__main__":
    main()
