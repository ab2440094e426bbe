"""GPU workload (issue 25): the ImageFolder pipeline a torch user writes, torch's ``DataLoader``
beside aioloader's, on one CUDA device, each configuration in a fresh interpreter.

The data: ``--images`` (6,144) JPEGs in 16 class folders, written once per run into a temporary
folder: 320x256, quality 92, about 56 KiB each (256 distinct pictures, deterministic: a colour,
a smooth pattern and pixel noise, cycled over the files). The pipeline: torchvision's
``ImageFolder`` with ``RandomResizedCrop(224)``, ``RandomHorizontalFlip()`` and ``PILToTensor()``
(uint8), ``batch_size=256``, ``shuffle=True``, ``num_workers=12``, ``pin_memory=True``; without
torchvision an equivalent torch ``Dataset`` of Pillow and NumPy (``gpu_rows.PillowFolder``; the
row's ``dataset`` says which ran).

The configurations (the columns of the issue's table):

* ``torch``: ``torch.utils.data.DataLoader``, the batch moved with ``.to("cuda",
  non_blocking=True)`` in the loop;
* ``aio-swapped``: ``aioloader.DataLoader`` with the same arguments (the import swapped);
* ``aio-device``: the same with ``device="cuda"`` (the loader's device stage moves the batch);
* ``aio-first``: ``aio-swapped`` in a script that imports aioloader before torchvision (the
  data table only): what the standby fork server costs when it has to import again what
  the script imports after aioloader (``server_s``);
* ``aio-files``: ``aioloader.sources.files(root, suffix=".jpg", with_keys=True)`` with a
  module-level ``transform`` doing the same decode and augment, and ``device="cuda"``.

The tables (modes): ``gpu-data`` (iterate; each batch moved to the device, its labels counted
there; one synchronisation an epoch) and ``gpu-train`` (a resnet18 step from
``torchvision.models``, else ``gpu_rows.TinyNet``: normalisation on the GPU, bf16 autocast,
channels_last, SGD; ``step_ms``: the step's host wall and main-thread CPU time, medians,
alone before the loader is built and beside it in the steady epochs), both with
``persistent_workers=True`` and 3 epochs: ``samples/s`` is the
steady rate, the median of epochs 2 and 3; ``first_epoch_s`` is epoch 1 timed from building the
dataset, worker start included. ``gpu-fresh``: ``persistent_workers=False`` (torch's default),
data mode, 2 epochs, ``samples/s`` over both, each epoch starting its workers.

Each configuration runs in a fresh interpreter, never a fork of this process or of a preloaded
server, because what is measured is a user's fresh ``python train.py``: a script written into
the run's folder (:func:`user_script`) whose imports come at the top, ``torch``, then
``torchvision``, then ``aioloader`` (which forks its standby fork server then; ``aio-first``
swaps the last two), then ``gpu_rows``'s ``main``: CUDA initialised and the model moved to the
GPU, then the dataset and the loader. (Run as ``python -m aioloader._bench.gpu_rows``, the
package ``aioloader`` would be imported before anything else, and the standby would import
torchvision again as it woke: that is ``aio-first``'s case, measured on its own.)
The ``torch`` child imports aioloader too (``-m`` imports the package), with
``AIOLOADER_STANDBY=0``: no standby process in torch's tree, only aioloader's modules.
This process samples the child's process tree (``harness_processes.MemorySampler``: the peak
PSS, from its start to its exit) and reads its JSON line: per-epoch times, the first batch,
``statistics().workers.startup_s`` / ``server`` / ``server_why`` per epoch (aioloader's rows),
and PSS by process (main, fork server, workers, other) read from ``/proc/PID/smaps_rollup`` by
the child at the middle batch of its last epoch. Every epoch is checked: each class's count of
labels as the folder holds (every sample once, on the device), each batch ``(B, 3, 224, 224)``
uint8; the child's processes must be gone once it has exited.

Time, on the GPU box (16 cores, one H100/H200): 12 children, each about 4-6 s of interpreter
start, imports (torch, torchvision), CUDA initialisation and teardown, plus its epochs; at a
conservative 3,000 images/s (12 workers decoding 320x256 JPEGs) an epoch of 6,144 is about 2 s,
a first epoch about 3 s with the workers' start. Persistent: 8 x (5 + 3 + 2 x 2) = 96 s; fresh:
4 x (5 + 2 x 3) = 44 s; the images written: about 5 s. About 2.5 minutes in all, 5 at half that
rate; ``--quick`` (2,048 images) about a minute. Without CUDA (and without ``--smoke``) the
workload is one skipped row.

``--smoke``: the code run end to end on the CPU, for CI: 48 images, 2 workers, batch 8,
``device="cpu"``, the Pillow dataset and ``TinyNet`` (torchvision not needed), three children
(``gpu-data/torch``, ``gpu-train/aio-files``, ``gpu-fresh/aio-swapped``).

Run it (on a GPU box)::

    python -m aioloader bench --only gpu --out OUT     # the table in OUT/aioloader-bench.*
    python -m aioloader._bench.gpu [--quick] [--only torch aio-files] [--tables gpu-data]
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aioloader._bench.gpu_results import GpuResult, format_issue_table, format_run
from aioloader._bench.harness import Result, report
from aioloader._bench.harness_processes import (
    MemorySampler,
    kill_group,
    process_group,
    process_tree,
    wait_until_gone,
)
from aioloader._bench.harness_script import exit_status, versions

CONFIGS = ("torch", "aio-swapped", "aio-device", "aio-files", "aio-first")
DATA_ONLY = ("aio-first",)  # configurations measured in the gpu-data table only (time)
TABLES = ("gpu-data", "gpu-train", "gpu-fresh")
ROW_PREFIX = "aioloader-gpu-row "  # the child's JSON line on its stdout
IMAGES, QUICK_IMAGES, SMOKE_IMAGES = 6144, 2048, 48
CLASSES, SMOKE_CLASSES = 16, 4
WIDTH, HEIGHT, QUALITY = 320, 256, 92  # about 56 KiB a JPEG
DISTINCT = 256  # pictures encoded; the files cycle through them
CROP = 224
CHILD_TIMEOUT_S = 150.0  # one configuration, interpreter start to exit
LEFT_WAIT_S = 10.0  # for its processes to exit after it did
SMOKE_RUNS = (("gpu-data", "torch"), ("gpu-train", "aio-files"), ("gpu-fresh", "aio-swapped"))


@dataclass(frozen=True)
class Run:
    """One child: ``config`` in ``table``'s mode."""

    table: str
    config: str

    @property
    def mode(self) -> str:
        return "train" if self.table == "gpu-train" else "data"

    @property
    def persistent(self) -> bool:
        return self.table != "gpu-fresh"

    @property
    def epochs(self) -> int:
        return 3 if self.persistent else 2


# -- the data --------------------------------------------------------------------------------


def picture(k: int) -> bytes:
    """Picture ``k``: a base colour, a smooth pattern (a random grid upscaled bicubic, +-120)
    and +-24 of pixel noise, as a JPEG of ``QUALITY`` (about 56 KiB at 320x256)."""
    from PIL import Image  # the bench extra; the suite's ``needs`` checks it

    rng = np.random.default_rng(2500 + k)
    base = rng.integers(64, 193, 3)
    grid = rng.integers(0, 256, (HEIGHT // 4, WIDTH // 4, 3), dtype=np.uint8)
    smooth = Image.fromarray(grid).resize((WIDTH, HEIGHT), Image.Resampling.BICUBIC)
    pattern = (np.asarray(smooth, dtype=np.int16) - 128) * 120 // 128
    noise = rng.integers(-24, 25, (HEIGHT, WIDTH, 3))
    pixels = np.clip(base + pattern + noise, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=QUALITY)
    return out.getvalue()


def write_folder(root: Path, images: int, classes: int) -> float:
    """``images`` JPEGs in ``classes`` folders (``c00/000017.jpg``; file ``i`` in class ``i %
    classes``); return their mean size in KiB."""
    payloads = [picture(k) for k in range(min(images, DISTINCT))]
    for c in range(classes):
        (root / f"c{c:02d}").mkdir(parents=True)
    total = 0
    for i in range(images):
        data = payloads[i % len(payloads)]
        (root / f"c{i % classes:02d}" / f"{i:06d}.jpg").write_bytes(data)
        total += len(data)
    return total / images / 1024


# -- one configuration in a fresh interpreter ------------------------------------------------


SCRIPT = """\
\"\"\"A user's train.py: the imports at the top ({order}), then the training script's body
(``aioloader._bench.gpu_rows.main``).\"\"\"
import sys

import torch
{imports}
from aioloader._bench.gpu_rows import main

if __name__ == "__main__":
    sys.exit(main())
"""
TORCHVISION = """\
try:
    import torchvision
except Exception:  # a CPU box's CUDA wheel: the Pillow dataset runs instead
    pass"""


def user_script(folder: Path, aioloader_first: bool) -> Path:
    """Write the script a configuration runs as: torch, torchvision, aioloader (``aioloader
    first``: torch, aioloader, torchvision); its path."""
    names = ["aioloader", "torchvision"] if aioloader_first else ["torchvision", "aioloader"]
    imports = [TORCHVISION if name == "torchvision" else "import aioloader" for name in names]
    order = " ".join(["torch", *names])
    path = folder / ("train_aioloader_first.py" if aioloader_first else "train.py")
    path.write_text(SCRIPT.format(order=order, imports="\n".join(imports)))
    return path


def child_command(run: Run, args: argparse.Namespace, root: Path) -> list[str]:
    script = user_script(root.parent, aioloader_first=run.config == "aio-first")
    command = [
        sys.executable, str(script),
        "--config", run.config, "--mode", run.mode, "--epochs", str(run.epochs),
        "--root", str(root), "--workers", str(args.workers),
        "--batch-size", str(args.batch_size), "--device", args.device,
        "--timeout", str(args.timeout),
    ]  # fmt: skip
    if run.persistent:
        command.append("--persistent")
    if args.smoke:
        command += ["--dataset", "pillow", "--model", "tiny", "--thread"]
    return command


def measure(run: Run, args: argparse.Namespace, root: Path) -> GpuResult:
    """Run ``run`` in a fresh interpreter of its own (a session of its own, so that whatever it
    leaves is found and killed), its process tree sampled from here; its row."""
    result = GpuResult(run.config, persistent=run.persistent)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOLOADER_BENCH")}
    if run.config == "torch":
        env["AIOLOADER_STANDBY"] = "0"  # a torch user's script has no standby fork server
    process = subprocess.Popen(
        child_command(run, args, root), stdout=subprocess.PIPE, env=env, start_new_session=True
    )
    memory = MemorySampler(functools.partial(process_tree, process.pid))
    out = b""
    try:
        with memory:
            try:
                out, _ = process.communicate(timeout=args.timeout + 30)
            except subprocess.TimeoutExpired:
                result.error = f"past {args.timeout + 30:g} s; its processes were killed"
    finally:
        left = wait_until_gone(
            lambda: process_group(process.pid), 0 if result.error else LEFT_WAIT_S
        )
        if left:
            kill_group(process.pid)
            if result.error is None:
                result.error = f"{len(left)} of its processes were left after it exited; killed"
        process.wait()
    result.record_memory(memory)
    lines = [x for x in out.decode(errors="replace").splitlines() if x.startswith(ROW_PREFIX)]
    if lines:
        result.payload = json.loads(lines[-1].removeprefix(ROW_PREFIX))
        result.samples, result.wall_s = result.images * len(result.epoch_s), sum(result.epoch_s)
        result.error = result.payload.get("error") or result.error
    elif result.error is None:
        result.error = f"no row came (exit status {process.returncode}; see its stderr)"
    if result.error is None and process.returncode != 0:
        result.error = f"exited with status {process.returncode}"
    return result


def extra(result: GpuResult) -> dict[str, Any]:
    """The figures a row carries into ``aioloader-bench.json`` beside samples/s and PSS."""
    keys = (
        "mode", "persistent", "images", "batch_size", "workers", "device", "dataset",
        "model", "epoch_s", "samples", "first_epoch_s", "first_batch_s", "startup_s", "server",
        "server_s", "server_why", "pss_by_process", "step_ms", "threads_cpu_ms", "children_cpu_ms",
        "statistics", "batch_shape",
        "batch_dtype", "batch_device",
    )  # fmt: skip
    payload = result.payload or {}
    return {key: payload.get(key) for key in keys}


# -- main ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_IMAGES} images")
    parser.add_argument("--smoke", action="store_true", help="tiny, on the CPU (CI's check)")
    parser.add_argument("--images", type=int, default=None, help=f"default {IMAGES}")
    parser.add_argument("--workers", type=int, default=None, help="num_workers (default 12)")
    parser.add_argument("--batch-size", type=int, default=None, help="default 256")
    parser.add_argument("--only", nargs="+", choices=CONFIGS, metavar="CONFIG", help="configs")
    parser.add_argument("--tables", nargs="+", choices=TABLES, metavar="TABLE", help="tables")
    parser.add_argument(
        "--timeout", type=float, default=CHILD_TIMEOUT_S, help="seconds a configuration may run"
    )
    args = parser.parse_args(argv)
    smoke = args.smoke
    args.images = args.images or (SMOKE_IMAGES if smoke else QUICK_IMAGES if args.quick else IMAGES)
    args.workers = args.workers or (2 if smoke else 12)
    args.batch_size = args.batch_size or (8 if smoke else 256)
    args.classes = SMOKE_CLASSES if smoke else CLASSES
    args.device = "cpu" if smoke else "cuda"
    if min(args.images, args.workers, args.batch_size) <= 0:
        parser.error("--images, --workers and --batch-size must be positive")
    return args


def plan(args: argparse.Namespace) -> list[Run]:
    """The children to run, in order."""
    if args.smoke and not (args.only or args.tables):
        return [Run(table, config) for table, config in SMOKE_RUNS]
    return [
        Run(table, config)
        for table in args.tables or TABLES
        for config in args.only or CONFIGS
        if not (table != "gpu-data" and config in DATA_ONLY and not args.only)
    ]


def cuda_missing() -> str | None:
    """Why there is no CUDA device to measure on, or None."""
    import torch

    if not torch.cuda.is_available():
        return f"needs a CUDA device (torch {torch.__version__}: no CUDA device is available)"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    print(versions("torch", "torchvision", "pillow"), flush=True)
    if not args.smoke and (why := cuda_missing()) is not None:
        print(f"gpu: skipped: {why}", flush=True)
        report(TABLES[0], Result("-", skipped=why))
        return 0
    # SIGTERM (``aioloader bench`` stopping the workload) unwinds, so the child's session is
    # killed on the way out: it is not in this process's group.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    results: dict[Run, GpuResult] = {}
    with tempfile.TemporaryDirectory(prefix="aioloader-gpu-") as tmp:
        root = Path(tmp, "images")  # the scripts are written beside it
        kib = write_folder(root, args.images, args.classes)
        print(
            f"{args.images} JPEGs ({WIDTH}x{HEIGHT}, {kib:.1f} KiB on average) in {args.classes} "
            f"class folders; batch {args.batch_size}, {args.workers} workers, {args.device}",
            flush=True,
        )
        for run in plan(args):
            result = measure(run, args, root)
            results[run] = result
            report(run.table, result, **extra(result))
            print(format_run(run.table, result), flush=True)
    print()
    by_cell = {(run.table, run.config): result for run, result in results.items()}
    print(format_issue_table(by_cell, args.only or CONFIGS, args.images))
    return exit_status([f"{r.table}/{r.config}" for r, res in results.items() if not res.ok])


if __name__ == "__main__":
    sys.exit(main())
