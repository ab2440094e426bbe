"""CPU-bound benchmark: aioloader's worker processes vs torch's DataLoader on compute-heavy work.

The workloads (their data: ``cpu_data.py``) and the configurations measured on each
(``cpu_runs.py``) are described where they are defined.

Each transform configuration runs two epochs in one loader scope (aioloader: one ``async
with``; torch: ``persistent_workers=True`` when ``num_workers > 0``). Every configuration
reports:

* ``cold/s``: samples/s of epoch 1 timed from constructing the loader, so worker start-up is
  included;
* ``steady/s``: samples/s of epoch 2 (workers already up);
* ``1st batch s``: seconds from constructing the loader to the first batch;
* ``peak MiB``: the highest sum of VmRSS over this process and all its descendants, sampled
  every 50 ms from ``/proc`` by a background thread while the configuration runs (worker
  shutdown included; ``harness_processes.MemorySampler``). Shared pages (shared-memory
  batches, fork's copy-on-write pages) count once per process that maps them, so this
  over-states what the machine actually spent; ``+MiB`` is that peak minus the same sum just
  before the configuration started;
* ``peak PSS`` / ``+PSS``: the same for the proportional set size (``Pss`` of
  ``/proc/<pid>/smaps_rollup``, what psutil's ``memory_full_info().pss`` reports: a shared page
  divided among the processes mapping it), sampled every 0.2 s;
* ``main CPU s`` / ``workers CPU s``: CPU-seconds of this process (the transform itself with
  ``num_workers=0``; otherwise the loader's own overhead plus the checks) and of the rest of
  its process tree (its worker processes, and aioloader's fork server's), over both epochs:
  the larger of the reaped children's and the tree's sampled every 50 ms (a worker that exits
  loses its last poll's worth);
* ``other CPU``: the share of the machine's CPU used meanwhile by processes outside this
  benchmark's tree (steal included): on a shared machine, rows with a high figure are slowed
  by it;
* before the configurations, one small aioloader loader with a worker starts the process-wide
  fork server (as the resource tracker is started), as a training script's first loader would:
  its start is in ``bench_startup.py``'s figures, not in a row here;
* ``speed``: the single-core speed just before and after the configuration (a fixed ``spin``)
  relative to start-up: a VM's vCPU can run at very different speeds from minute to minute.

The main process runs torch with ``--main-threads`` (default 1) intra-op threads, as both
loaders' workers do: on two loaded cores torch's OpenMP threads in the consumer stall.

Ratios are against ``aio-nw1`` and ``torch-nw2-spawn`` (drop-in: ``aio-nw0`` and
``torch-nw2-fork``), as cold/steady pairs. The statistics of ``aio-nw2`` are printed for each
workload (drop-in: of its last scope, after the second epoch), with the bytes per job that
crossed the worker pipes. Each drop-in workload then prints its goals beside the figures:
``aio-nw2`` over ``torch-nw2-fork`` samples/s >= 1.0x, over ``aio-nw0`` >= 1.8x (steady and
cold, each marked met or MISSED), over ``torch-nw2-spawn`` for reference, and peak PSS of
``aio-nw2`` over ``torch-nw2-fork`` <= 1.2x. A missed goal is reported, not a failure.

A last check (``pipe``) sends one 64x3x224x224 uint8 batch (9,633,792 bytes of pixels) through
one aioloader worker and prints ``statistics().workers.bytes_received / jobs``: what crossed the
pipe for that batch, which should be a few shared-memory handles, not the pixels.

Every epoch is checked: each index delivered exactly once, the right number of batches, well
formed batches, and the output right (every pixel sum for ``decode``, a spread of recomputed
results for ``gil`` and ``dropin-py``, for ``dropin-jpeg`` every crop's channel means within 12
levels of its image's base colour: the crop is random); worker processes must be gone once a
loader is closed (or dropped). The script exits non-zero when a check fails or a configuration
raises or times out.

Run it from the repository root::

    python benchmarks/bench_cpu.py            # the full run (~5.5 min on 2 cores)
    python benchmarks/bench_cpu.py --quick    # a smoke test (gil 640 samples, decode 320,
                                              # each drop-in 640: those rows ~45 s)
    python benchmarks/bench_cpu.py --only gil
    python benchmarks/bench_cpu.py --quick --only dropin-py dropin-jpeg
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing.resource_tracker
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.utils.data

import aioloader
from aioloader._bench.cpu_data import (
    CROP_SIDE,
    DECODE_ITEMS,
    DISTINCT_IMAGES,
    DROPIN_JPEG_ITEMS,
    DROPIN_PY_ITEMS,
    EPOCHS,
    GIL_ITEMS,
    GIL_SPOT_EVERY,
    IMAGE_SIDE,
    JPEG_CROP,
    JPEG_QUALITY,
    JPEG_SIDE,
    JPEG_TOLERANCE,
    PIPE_BATCH,
    PIPE_DATA_BYTES,
    QUICK_DECODE_ITEMS,
    QUICK_DROPIN_ITEMS,
    QUICK_GIL_ITEMS,
    SPIN_TARGET_S,
    WORKLOADS,
    DropinJpegDataset,
    DropinSpinDataset,
    Image,
    SpinTransform,
    Workload,
    calibrate_spin,
    decode_sample,
    make_decode_samples,
    make_jpeg,
    pixel_sums,
    speed_probe,
    spin,
    unpack_decode,
    unpack_gil,
    unpack_jpeg,
)
from aioloader._bench.cpu_ray import RAY_ROW, measure_overhead, ray_row
from aioloader._bench.cpu_ray import describe as describe_overhead
from aioloader._bench.cpu_report import (
    format_goals,
    format_results,
    job_bytes,
)
from aioloader._bench.cpu_runs import (
    BASELINES,
    CONFIGS,
    DROPIN_BASELINES,
    DROPIN_CONFIGS,
    STATS_CONFIG,
    CpuResult,
    Runner,
    measure,
    measure_pipe,
)
from aioloader._bench.harness import report
from aioloader._bench.harness_script import (
    add_batch_size,
    add_only,
    add_quick,
    add_timeout,
    cpus_and_load,
    exit_status,
    quick_defaults,
    versions,
)

# -- main --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="aioloader vs torch DataLoader on CPU-heavy transforms (GIL-bound, decode)."
    )
    parser.add_argument(
        "--gil-items", type=int, default=None, help=f"gil samples (default {GIL_ITEMS})"
    )
    parser.add_argument(
        "--decode-items", type=int, default=None, help=f"decode samples (default {DECODE_ITEMS})"
    )
    parser.add_argument(
        "--dropin-py-items",
        type=int,
        default=None,
        help=f"dropin-py samples (default {DROPIN_PY_ITEMS})",
    )
    parser.add_argument(
        "--dropin-jpeg-items",
        type=int,
        default=None,
        help=f"dropin-jpeg samples (default {DROPIN_JPEG_ITEMS})",
    )
    add_batch_size(parser)
    parser.add_argument(
        "--main-threads",
        type=int,
        default=1,
        help="torch intra-op threads in this (the consumer's) process; workers of both loaders "
        "use 1 (default 1: on 2 cores, torch's OpenMP threads in the consumer stall on loaded "
        "cores, e.g. a 110 KB uint8 sum taking 15 ms instead of 0.1 ms)",
    )
    add_quick(
        parser,
        f"smoke test: gil {QUICK_GIL_ITEMS} samples, decode {QUICK_DECODE_ITEMS}, each "
        f"drop-in workload {QUICK_DROPIN_ITEMS}",
    )
    add_only(
        parser,
        WORKLOADS,
        metavar="WORKLOAD",
        help=f"workloads to run: {', '.join(WORKLOADS)} (default: all)",
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        metavar="CONFIG",
        choices=sorted({*CONFIGS, *DROPIN_CONFIGS}),
        help="run only these configurations (default: all of each workload's)",
    )
    add_timeout(
        parser, "seconds one configuration may take (default: max(120, 4x its serial time))"
    )
    args = parser.parse_args(argv)
    quick_defaults(
        args,
        gil_items=(QUICK_GIL_ITEMS, GIL_ITEMS),
        decode_items=(QUICK_DECODE_ITEMS, DECODE_ITEMS),
        dropin_py_items=(QUICK_DROPIN_ITEMS, DROPIN_PY_ITEMS),
        dropin_jpeg_items=(QUICK_DROPIN_ITEMS, DROPIN_JPEG_ITEMS),
    )
    sizes = (args.gil_items, args.decode_items, args.dropin_py_items, args.dropin_jpeg_items)
    if min(*sizes, args.batch_size, args.main_threads) <= 0:
        parser.error("the --*-items, --batch-size and --main-threads must be positive")
    return args


def _timeout(args: argparse.Namespace, serial_s: float) -> float:
    return float(args.timeout or max(120.0, 4 * EPOCHS * serial_s))


@functools.cache
def spin_calibration() -> tuple[int, float]:
    """``calibrate_spin(SPIN_TARGET_S)``, once for gil and dropin-py."""
    return calibrate_spin(SPIN_TARGET_S)


def gil_workload(args: argparse.Namespace) -> Workload:
    loops, per_call = spin_calibration()
    transform = SpinTransform(loops)
    items = args.gil_items
    expected = {i: spin(i, loops) for i in range(0, items, GIL_SPOT_EVERY)}
    serial = items * per_call
    print(
        f"gil: spin calibrated to {loops:,} loop rounds = {per_call * 1e3:.2f} ms per sample "
        f"(target {SPIN_TARGET_S * 1e3:g} ms); {items} samples, ~{serial:.1f} s serial per "
        f"epoch; {len(expected)} results recomputed to check",
        flush=True,
    )
    return Workload(
        name="gil",
        samples=list(range(items)),
        transform=transform,
        batch_size=args.batch_size,
        unpack=unpack_gil,
        expected=expected,
        timeout=_timeout(args, serial),
    )


def decode_workload(args: argparse.Namespace) -> Workload:
    items = args.decode_items
    start = time.perf_counter()
    samples = make_decode_samples(items)
    made = time.perf_counter() - start
    start = time.perf_counter()
    expected: dict[int, int] = {}
    for sample in samples:
        image, index = decode_sample(sample)
        expected[index] = int(pixel_sums(image[None])[0])
    per_sample = (time.perf_counter() - start) / items
    payload = sum(len(p) for _, p in samples)
    codec = "PNG via PIL" if Image is not None else "zlib + numpy.frombuffer (no PIL)"
    print(
        f"decode: {items} samples, {codec}, {payload / items / 1024:,.1f} KiB per encoded "
        f"{IMAGE_SIDE}x{IMAGE_SIDE}x3 image ({payload / 2**20:,.1f} MiB in all, made in "
        f"{made:.1f} s); transform {per_sample * 1e3:.2f} ms per sample serial "
        f"(~{items * per_sample:.1f} s per epoch); output 3x{CROP_SIDE}x{CROP_SIDE} uint8",
        flush=True,
    )
    return Workload(
        name="decode",
        samples=samples,
        transform=decode_sample,
        batch_size=args.batch_size,
        unpack=unpack_decode,
        expected=expected,
        timeout=_timeout(args, items * per_sample),
    )


def dropin_py_workload(args: argparse.Namespace) -> Workload:
    loops, per_call = spin_calibration()
    items = args.dropin_py_items
    expected = {i: spin(i, loops) for i in range(0, items, GIL_SPOT_EVERY)}
    serial = items * per_call
    print(
        f"dropin-py: a torch Dataset whose __getitem__ runs the gil spin ({loops:,} loop rounds "
        f"= {per_call * 1e3:.2f} ms); {items} samples, ~{serial:.1f} s serial per epoch; "
        f"{len(expected)} results recomputed to check",
        flush=True,
    )
    return Workload(
        name="dropin-py",
        samples=DropinSpinDataset(items, loops),
        transform=None,
        batch_size=args.batch_size,
        unpack=unpack_gil,
        expected=expected,
        timeout=_timeout(args, serial),
    )


def dropin_jpeg_workload(args: argparse.Namespace) -> Workload:
    items = args.dropin_jpeg_items
    start = time.perf_counter()
    made = [make_jpeg(k) for k in range(min(items, DISTINCT_IMAGES))]
    payloads = [payload for payload, _ in made]
    bases = np.stack([base for _, base in made])
    encode_s = time.perf_counter() - start
    dataset = DropinJpegDataset(payloads, items)
    state = random.getstate()
    random.seed(0)
    start = time.perf_counter()
    probe = min(items, 256)
    for i in range(probe):
        dataset[i]
    per_sample = (time.perf_counter() - start) / probe
    random.setstate(state)
    kib = sum(len(p) for p in payloads) / len(payloads) / 1024
    print(
        f"dropin-jpeg: a torch Dataset over {len(payloads)} distinct {JPEG_SIDE}x{JPEG_SIDE} "
        f"JPEGs in memory (quality {JPEG_QUALITY}, {kib:,.1f} KiB each, encoded in "
        f"{encode_s:.1f} s); __getitem__: Pillow decode, random resized crop to "
        f"{JPEG_CROP}x{JPEG_CROP}, random flip, CHW uint8 tensor: {per_sample * 1e3:.2f} ms per "
        f"sample serial; {items} samples, ~{items * per_sample:.1f} s per epoch; every crop's "
        f"channel means checked against its image's colour (+-{JPEG_TOLERANCE})",
        flush=True,
    )
    return Workload(
        name="dropin-jpeg",
        samples=dataset,
        transform=None,
        batch_size=args.batch_size,
        unpack=functools.partial(unpack_jpeg, bases),
        expected=dict.fromkeys(range(items), 1),
        timeout=_timeout(args, items * per_sample),
    )


def run_workload(
    workload: Workload,
    configs: dict[str, Runner],
    baselines: Sequence[str],
    reference_probe_s: float,
) -> list[CpuResult]:
    dropin = workload.transform is None
    print(
        f"\n== {workload.name}: {workload.items} samples, batch {workload.batch_size}, "
        f"{EPOCHS} epochs per configuration"
        + (" (drop-in: plain `for` over the loader, persistent_workers=True)" if dropin else "")
        + " ==",
        flush=True,
    )
    results: list[CpuResult] = []
    for name, runner in configs.items():
        result = measure(name, runner, workload, reference_probe_s)
        results.append(result)
        report(workload.name, result)
        startup = ""
        if result.statistics is not None and result.statistics.workers is not None:
            startup = f"  workers up in {result.statistics.workers.startup_s:.2f} s"
        print(
            f"  done {name:<16} cold {result.cold_per_s:>7,.0f}/s  steady "
            f"{result.steady_per_s:>7,.0f}/s  1st batch {result.first_batch_s:5.2f} s  "
            f"peak {result.peak_rss_mib:,.0f} MiB RSS, {result.peak_pss_mib:,.0f} MiB PSS"
            f"{startup}  {result.status}",
            flush=True,
        )
    print()
    print(f"{workload.name} ({workload.items} samples, batch {workload.batch_size}):")
    print(format_results(results, baselines))
    if dropin:
        print()
        print(f"{workload.name} goals (aio-nw2: aioloader.DataLoader, num_workers=2):")
        print(format_goals(results))
    stats = next((r.statistics for r in results if r.name == STATS_CONFIG), None)
    if stats is not None:
        print()
        which = "after the second epoch" if dropin else "both epochs"
        print(f"{workload.name} {STATS_CONFIG} statistics ({which}):")
        print(repr(stats))
        print(f"pipe: {job_bytes(stats)}")
    return results


def _chosen(configs: dict[str, Runner], names: Sequence[str] | None) -> dict[str, Runner]:
    """``configs`` less those ``--configs`` did not name (all of them without the flag)."""
    return {n: r for n, r in configs.items() if names is None or n in names}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    only: list[str] = args.only or list(WORKLOADS)
    torch.set_num_threads(args.main_threads)
    print(
        f"{versions('torch', 'numpy', where=True)}, {cpus_and_load()}, "
        f"{torch.get_num_threads()} torch thread(s) in the main process",
        flush=True,
    )
    # Start multiprocessing's resource tracker now, so every configuration's RSS includes it.
    multiprocessing.resource_tracker.ensure_running()
    # Likewise aioloader's process-wide fork server: a first loader with workers starts it (a
    # fork of this process, as no other thread runs yet), as a training script's first loader
    # would. Its start is in bench_startup.py's figures, not in a configuration's here.
    warm_up: aioloader.DataLoader[Any]
    with aioloader.DataLoader(list(range(4)), batch_size=2, num_workers=1) as warm_up:
        list(warm_up)
    reference_probe_s = speed_probe()
    failed: list[str] = []
    builders = {"gil": gil_workload, "decode": decode_workload}
    for name in ("gil", "decode"):
        if name in only:
            configs = _chosen(CONFIGS, args.configs)
            results = run_workload(builders[name](args), configs, BASELINES, reference_probe_s)
            failed.extend(f"{name}/{r.name}" for r in results if not r.ok)
    dropins = {"dropin-py": dropin_py_workload, "dropin-jpeg": dropin_jpeg_workload}
    for name, build in dropins.items():
        if name not in only:
            continue
        if name == "dropin-jpeg" and Image is None:
            print("\ndropin-jpeg: needs Pillow (pip install -e '.[bench]'); not run", flush=True)
            failed.append(name)
            continue
        configs = ray_row(_chosen(DROPIN_CONFIGS, args.configs), name)
        results = run_workload(build(args), configs, DROPIN_BASELINES, reference_probe_s)
        failed.extend(f"{name}/{r.name}" for r in results if not r.ok)
        if RAY_ROW in configs:
            print(describe_overhead(measure_overhead()), flush=True)
    if "pipe" in only:
        pipe = measure_pipe(_timeout(args, 1.0))
        print()
        print(
            f"pipe: one {PIPE_BATCH}x3x{IMAGE_SIDE}x{IMAGE_SIDE} uint8 batch through 1 worker: "
            f"statistics().workers.bytes_received / jobs = {pipe.per_job:,.0f} bytes "
            f"({pipe.jobs} job); the batch's data is {PIPE_DATA_BYTES:,} bytes "
            f"({pipe.per_job / PIPE_DATA_BYTES:.5%} of it crossed the pipe)  "
            f"{'ok' if pipe.error is None else 'FAIL: ' + pipe.error}"
        )
        if pipe.error is not None:
            failed.append("pipe")
    return exit_status(failed)


if __name__ == "__main__":
    sys.exit(main())
