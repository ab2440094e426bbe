"""One configuration of the ``gpu`` workload (``gpu.py``): the body of a user's training
script. ``gpu.user_script`` writes the script (its imports at the top, in the order the
configuration measures: aioloader forks its standby fork server as it is imported), which
calls :func:`main` under ``if __name__ == "__main__":``: the model is built and moved to the
device (CUDA initialised), and only then the dataset and the loader. It prints one JSON line,
prefixed ``gpu.ROW_PREFIX``, on stdout.

The dataset's class, the transform and the model are defined here, at module level: aioloader's
workers unpickle them from this module, which its standby fork server imports as it runs the
script again as ``__mp_main__`` (torch's forked workers inherit them).
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import io
import json
import os
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.data
from PIL import Image

import aioloader
from aioloader._bench.cpu_data import random_resized_crop_box
from aioloader._bench.gpu import CONFIGS, CROP, ROW_PREFIX
from aioloader._bench.gpu_memory import children_cpu_s, pss_by_process, threads_cpu_s
from aioloader._bench.harness import error_text
from aioloader.sources import files

tv: Any  # torchvision, when it imports (the GPU box has it; a wheel for another torch fails)
try:
    tv = importlib.import_module("torchvision")
    TV_MISSING = ""
except Exception as exc:  # ImportError, or an ABI mismatch raised as something else
    tv, TV_MISSING = None, error_text(exc)

MEAN = (0.485, 0.456, 0.406)  # ImageNet's, as every torchvision recipe normalises
STD = (0.229, 0.224, 0.225)


def classes_of(root: str) -> dict[str, int]:
    """ImageFolder's ``class_to_idx``: the sorted folder names."""
    names = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    return {name: index for index, name in enumerate(names)}


def augment(image: Image.Image, crop: int) -> torch.Tensor:
    """torchvision's ``RandomResizedCrop(crop)`` (scale (0.08, 1), ratio (3/4, 4/3), bilinear
    with antialiasing, as Pillow resizes), ``RandomHorizontalFlip()`` and ``PILToTensor()``."""
    box = random_resized_crop_box(*image.size)
    out = image.resize((crop, crop), Image.Resampling.BILINEAR, box=box)
    if random.random() < 0.5:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return torch.from_numpy(np.array(out)).permute(2, 0, 1).contiguous()


def torchvision_augment(crop: int) -> Callable[[Image.Image], torch.Tensor]:
    t = tv.transforms
    composed: Callable[[Image.Image], torch.Tensor] = t.Compose(
        [t.RandomResizedCrop(crop), t.RandomHorizontalFlip(), t.PILToTensor()]
    )
    return composed


class PillowFolder(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """``ImageFolder`` with the pipeline's transforms, written with Pillow and NumPy (for a
    machine without torchvision): ``(uint8 CHW crop, class index)``."""

    def __init__(self, root: str, crop: int) -> None:
        self.class_to_idx = classes_of(root)
        self.samples = [
            (str(path), index)
            for name, index in self.class_to_idx.items()
            for path in sorted(Path(root, name).glob("*.jpg"))
        ]
        self.crop = crop

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        with open(path, "rb") as file:
            image = Image.open(file).convert("RGB")
        return augment(image, self.crop), label


class DecodeAugment:
    """aio-files's ``transform``: ``(relative path, JPEG bytes)`` to ``(uint8 CHW crop, class
    index)``, the same decode and augment as the torch dataset's (torchvision's when it ran)."""

    def __init__(self, class_to_idx: dict[str, int], crop: int, torchvision: bool) -> None:
        self.class_to_idx = class_to_idx
        self.crop = crop
        self.composed = torchvision_augment(crop) if torchvision else None

    def __call__(self, item: tuple[str, bytes]) -> tuple[torch.Tensor, int]:
        key, data = item
        image = Image.open(io.BytesIO(data)).convert("RGB")
        pixels = augment(image, self.crop) if self.composed is None else self.composed(image)
        return pixels, self.class_to_idx[key.split("/", 1)[0]]


class TinyNet(torch.nn.Sequential):
    """The model without torchvision (and in the smoke run): two convolutions and a linear."""

    def __init__(self, classes: int) -> None:
        super().__init__(
            torch.nn.Conv2d(3, 16, 7, stride=4, padding=3),
            torch.nn.BatchNorm2d(16),
            torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, stride=2, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(32, classes),
        )


# -- the script ------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="one configuration of the gpu workload")
    parser.add_argument("--config", choices=CONFIGS, required=True)
    parser.add_argument("--mode", choices=("data", "train"), required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("--root", required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dataset", choices=("torchvision", "pillow"), default=None)
    parser.add_argument("--model", choices=("resnet18", "tiny"), default=None)
    parser.add_argument("--timeout", type=float, default=150.0)
    parser.add_argument(
        "--thread",
        action="store_true",
        help="start a thread before the loader (the CPU smoke run's stand-in for CUDA's: the "
        "process is then unsafe to fork, and aioloader's workers come from its standby)",
    )
    return parser.parse_args()


def build_loader(args: argparse.Namespace, torchvision: bool) -> Any:
    """The configuration's loader, as its user writes it (the dataset made here too)."""
    device = torch.device(args.device)
    common: dict[str, Any] = {
        "batch_size": args.batch_size,
        "shuffle": True,
        "num_workers": args.workers,
        "pin_memory": device.type == "cuda",
        "persistent_workers": args.persistent,
    }
    if args.config == "aio-files":
        classes = classes_of(args.root)
        source = files(args.root, suffix=".jpg", with_keys=True)
        transform = DecodeAugment(classes, CROP, torchvision)
        return aioloader.DataLoader(source, transform=transform, device=device, **common)
    if torchvision:
        t = tv.transforms
        pipeline = t.Compose([t.RandomResizedCrop(CROP), t.RandomHorizontalFlip(), t.PILToTensor()])
        dataset: Any = tv.datasets.ImageFolder(args.root, transform=pipeline)
    else:
        dataset = PillowFolder(args.root, CROP)
    if args.config == "torch":
        return torch.utils.data.DataLoader(dataset, **common)
    if args.config == "aio-device":
        return aioloader.DataLoader(dataset, device=device, **common)
    return aioloader.DataLoader(dataset, **common)  # aio-swapped, aio-first


def make_step(
    model: torch.nn.Module | None, device: torch.device
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """The loop's body: the batch to the device (a no-op where the loader put it there); with a
    model, a training step (normalised on the device, channels_last, bf16 autocast, SGD)."""
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if model else None

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        if model is None or optimizer is None:
            return
        x = images.contiguous(memory_format=torch.channels_last).float().sub_(mean).div_(std)
        # bf16 on CUDA; the CPU smoke run keeps float32 (bf16 convolutions are slow there).
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = F.cross_entropy(model(x), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()

    return step


class StepClock:
    """The training step's cost to the main thread: per step, its wall time on the host (the
    kernels' launches; the GPU's queue is empty when a data-bound loop calls it) and the main
    thread's CPU time. Beside a loader, the wall time over the CPU time is time the main thread
    waited for the GIL (or was descheduled): what the loader's threads cost the training loop."""

    def __init__(self) -> None:
        self.host_s: list[float] = []
        self.cpu_s: list[float] = []

    def timed(self, step: Callable[[], None]) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        step()
        self.cpu_s.append(time.thread_time() - cpu)
        self.host_s.append(time.perf_counter() - wall)

    def summary(self) -> dict[str, float]:
        """Medians, in milliseconds, and the steps counted."""
        if not self.host_s:
            return {}
        return {
            "host_ms": round(float(np.median(self.host_s)) * 1e3, 3),
            "cpu_ms": round(float(np.median(self.cpu_s)) * 1e3, 3),
            "steps": len(self.host_s),
        }


def step_alone(
    step: Callable[[torch.Tensor, torch.Tensor], None], args: argparse.Namespace, classes: int
) -> dict[str, float]:
    """The step's cost with no loader in the process: ``STEPS_ALONE`` steps on one batch
    resident on the device, each after the device is idle (as a data-bound loop calls it);
    the first few (cuDNN's autotuning) left out."""
    device = torch.device(args.device)
    images = torch.randint(0, 256, (args.batch_size, 3, CROP, CROP), dtype=torch.uint8)
    images, labels = images.to(device), torch.randint(0, classes, (args.batch_size,)).to(device)
    clock = StepClock()
    for index in range(STEPS_ALONE + WARM_STEPS):
        if index == WARM_STEPS:
            clock = StepClock()
        clock.timed(lambda: step(images, labels))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return clock.summary()


STEPS_ALONE, WARM_STEPS = 30, 5


class ThreadsCpu:
    """CPU seconds by thread name summed over spans: each span from a reading with ``first``
    to the next reading, over the threads seen at both (a thread that ended between them
    leaves its span out)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self._start: dict[str, float] = {}

    def __call__(self, now: dict[str, float], *, first: bool) -> None:
        if first:
            self._start = now
            return
        for name, seconds in now.items():
            if name in self._start and seconds > self._start[name]:
                self.sums[name] = self.sums.get(name, 0.0) + seconds - self._start[name]


def epochs(
    loader: Any, args: argparse.Namespace, model: torch.nn.Module | None, begun: float
) -> dict[str, Any]:
    """Run the epochs (a training step each batch with ``model``); every figure the row
    reports, or the first error found."""
    device = torch.device(args.device)
    expected = folder_counts(args.root)
    counts = torch.zeros(len(expected), dtype=torch.int64, device=device)
    row: dict[str, Any] = {"epoch_s": [], "samples": [], "startup_s": [], "server": ""}
    row["server_why"] = ""
    step = make_step(model, device)
    cpu_by_thread = ThreadsCpu()
    cpu_of_children = ThreadsCpu()  # the same sums, by child process
    clock = StepClock()  # the steady epochs' steps
    batches = -(-len(loader.dataset) // args.batch_size)
    for epoch in range(args.epochs):
        started = begun if epoch == 0 else time.perf_counter()
        counts.zero_()
        for index, (images, labels) in enumerate(loader):
            if "first_batch_s" not in row:
                row["first_batch_s"] = time.perf_counter() - begun
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            if tuple(images.shape[1:]) != (3, CROP, CROP) or images.dtype != torch.uint8:
                return {**row, "error": f"a batch of {tuple(images.shape)} {images.dtype}"}
            row.setdefault("batch_shape", list(images.shape))
            row.setdefault("batch_dtype", str(images.dtype).removeprefix("torch."))
            row.setdefault("batch_device", str(images.device))
            counts += torch.bincount(labels, minlength=len(expected))
            if model is not None and epoch > 0:
                clock.timed(lambda: step(images, labels))  # noqa: B023 (called at once)
            else:
                step(images, labels)
            if epoch > 0 and index in (0, batches - 1):  # CPU by thread, while they run
                cpu_by_thread(threads_cpu_s(), first=index == 0)
                cpu_of_children(children_cpu_s(), first=index == 0)
            if epoch == args.epochs - 1 and index == batches // 2:
                row["pss_by_process"] = pss_by_process()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        row["epoch_s"].append(time.perf_counter() - started)
        row["samples"].append(sum(seen := counts.tolist()))
        if seen != expected:
            return {**row, "error": f"epoch {epoch + 1}: labels counted {seen}, not {expected}"}
        if isinstance(loader, aioloader.DataLoader):
            workers = loader.statistics().workers
            if workers is not None and (epoch == 0 or not args.persistent):  # a start each
                row["startup_s"].append(round(workers.startup_s, 3))
                row["server"], row["server_why"] = workers.server, workers.server_why
                row["server_s"] = max(row.get("server_s", 0.0), round(workers.server_s, 3))
    row["first_epoch_s"] = row["epoch_s"][0]
    if args.epochs > 1:  # ms of CPU per batch, by thread of this process, in epochs 2 on
        steady = (batches - 1) * (args.epochs - 1)
        row["threads_cpu_ms"] = {
            name: round(seconds * 1e3 / steady, 2) for name, seconds in cpu_by_thread.sums.items()
        }
        row["children_cpu_ms"] = round(sum(cpu_of_children.sums.values()) * 1e3 / steady, 2)
    if isinstance(loader, aioloader.DataLoader):
        row["statistics"] = repr(loader.statistics())
    if model is not None:
        row["step_ms"] = {"loop": clock.summary()}
    return row


def folder_counts(root: str) -> list[int]:
    return [len(list(Path(root, name).glob("*.jpg"))) for name in classes_of(root)]


def model_for(
    args: argparse.Namespace, classes: int, device: torch.device
) -> tuple[torch.nn.Module, str]:
    """The model, on ``device``, channels_last: resnet18 when torchvision imports."""
    if (args.model or ("resnet18" if tv is not None else "tiny")) == "resnet18":
        model: torch.nn.Module = tv.models.resnet18(num_classes=classes)
        name = "torchvision resnet18"
    else:
        model, name = TinyNet(classes), "TinyNet"
    channels_last = model.to(device, memory_format=torch.channels_last)  # type: ignore[call-overload]
    return channels_last, name


def main() -> int:
    args = parse_args()
    faulthandler.dump_traceback_later(args.timeout, exit=True)
    torchvision = tv is not None if args.dataset is None else args.dataset == "torchvision"
    row: dict[str, Any] = {
        "config": args.config, "mode": args.mode, "persistent": args.persistent,
        "workers": args.workers, "batch_size": args.batch_size, "device": args.device,
        "dataset": "torchvision ImageFolder" if torchvision else "PillowFolder (Pillow, NumPy)"
        + (f"; torchvision: {TV_MISSING}" if TV_MISSING else ""),
    }  # fmt: skip
    try:
        device = torch.device(args.device)
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = True
        # The model on the device (CUDA initialised) before the loader, as in a train.py; the
        # data mode holds it unused.
        model, row["model"] = model_for(args, len(classes_of(args.root)), device)
        if args.thread:
            threading.Thread(target=threading.Event().wait, name="metrics", daemon=True).start()
        alone = {}
        if args.mode == "train":  # before the loader: its cost with nothing else running
            alone = step_alone(make_step(model, device), args, len(classes_of(args.root)))
        begun = time.perf_counter()
        loader = build_loader(args, torchvision)
        row["images"] = len(loader.dataset)
        row.update(epochs(loader, args, model if args.mode == "train" else None, begun))
        if "step_ms" in row:
            row["step_ms"]["alone"] = alone
        if isinstance(loader, aioloader.DataLoader):
            loader.close()
        del loader
    except Exception as exc:
        traceback.print_exc()
        row["error"] = error_text(exc)
    print(ROW_PREFIX + json.dumps(row), flush=True)
    return 1 if "error" in row else 0


if __name__ == "__main__":
    sys.exit(main())
