"""``aioloader demo``: files on disk → async loader → a tiny model training on the CPU.

Owns: the demo's embedded default dataset (small image-like files written to a temporary
folder, read back with aiofiles), its training loop and what it prints. Never: needs a network,
an account or a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import sources
from .._base.progress import Progress
from .._base.retry import RetryPolicy
from .._data.dataset import AsyncDataset
from .._device.accelerator import resolve_device
from .._loader.loader import DataLoader
from .errors import UsageError
from .signals import run_until_signal

__all__ = ["add_command", "run", "write_dataset"]

_SHAPE = (3, 16, 16)
_CLASSES = 4


def write_dataset(folder: Path, n: int, seed: int = 0, first: int = 0) -> list[Path]:
    """Write files ``first..n - 1``: one label byte, then a uint8 3x16x16 image whose class
    shows in which quadrant is bright, under noise drawn from a generator seeded with
    ``seed + first``."""
    g = torch.Generator().manual_seed(seed + first)
    paths = []
    for i in range(first, n):
        label = i % _CLASSES
        image = torch.randint(0, 96, _SHAPE, generator=g, dtype=torch.uint8)
        r, c = divmod(label, 2)
        image[:, r * 8 : r * 8 + 8, c * 8 : c * 8 + 8] += 128
        path = folder / f"{i:06d}.bin"
        path.write_bytes(bytes([label]) + image.numpy().tobytes())
        paths.append(path)
    return paths


async def write_dataset_soon(folder: Path, n: int) -> None:
    """:func:`write_dataset`, 256 files at a time, letting the loop run between (a signal is
    acted on within one of them, not after the whole folder)."""
    for first in range(0, n, 256):
        write_dataset(folder, min(n, first + 256), first=first)
        await asyncio.sleep(0)


_SAMPLE_BYTES = 1 + 3 * 16 * 16


def decode(raw: bytes) -> tuple[torch.Tensor, int]:
    """bytes → (normalised float image, label); runs on a worker, off the event loop.

    Raises:
        UsageError: ``raw`` is not a demo sample (an object under ``--url`` of another size).
    """
    if len(raw) != _SAMPLE_BYTES:
        raise UsageError(
            f"--url holds an object of {len(raw)} bytes, not a demo sample (one label byte, "
            f"then a 3x16x16 uint8 image: {_SAMPLE_BYTES} bytes)"
        )
    if raw[0] >= _CLASSES:
        raise UsageError(
            f"--url holds an object whose label byte is {raw[0]}, not a demo sample's (a "
            f"class from 0 to {_CLASSES - 1})"
        )
    image = torch.frombuffer(bytearray(raw[1:]), dtype=torch.uint8).reshape(_SHAPE)
    return image.float().div_(255.0), raw[0]


async def train(args: argparse.Namespace) -> float:
    torch.manual_seed(0)
    device = torch.device(args.device) if args.device else None
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, _CLASSES)).to(device)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.5)
    loss_fn = nn.CrossEntropyLoss()
    with tempfile.TemporaryDirectory(prefix="aioloader-demo-") as tmp:
        if args.url:  # a real store: credentials and endpoint from the environment
            dataset: AsyncDataset[bytes] = sources.objects(args.url)
            where = f"{len(dataset)} objects under {args.url}"
        else:  # the embedded default: files in a temporary folder
            await write_dataset_soon(Path(tmp), args.samples)
            dataset = sources.files(tmp, suffix=".bin")
            where = f"{len(dataset)} files in {tmp}"
        print(
            f"demo: {where}, batch {args.batch_size}, max_inflight {args.max_inflight}, "
            f"{args.workers} worker(s)" + (f", batches on {device}" if device else "")
        )
        loader: DataLoader[tuple[torch.Tensor, torch.Tensor]] = DataLoader(
            dataset,
            batch_size=args.batch_size,
            shuffle=True,
            seed=0,
            transform=decode,
            num_workers=args.workers,
            max_inflight=args.max_inflight,
            prefetch=4,
            retry=RetryPolicy(),
            pin_memory=device is not None and device.type == "cuda",
            device=device,
        )
        started = time.perf_counter()
        accuracy = 0.0
        async with loader:
            for epoch in range(args.epochs):
                loader.set_epoch(epoch)
                bar = Progress(len(dataset), f"epoch {epoch + 1}/{args.epochs}")
                correct = seen = 0
                loss_sum = 0.0
                async for images, labels in loader:
                    logits = model(images)
                    loss = loss_fn(logits, labels)
                    optimiser.zero_grad()
                    loss.backward()
                    optimiser.step()
                    correct += int((logits.argmax(1) == labels).sum())  # waits for the device
                    seen += len(labels)
                    loss_sum += loss.item() * len(labels)
                    bar.update(len(labels), f"loss {loss_sum / seen:.3f}")
                accuracy = correct / max(1, seen)
                bar.close(f"loss {loss_sum / max(1, seen):.3f} accuracy {accuracy:.1%}")
        elapsed = time.perf_counter() - started
    stats = loader.statistics()
    total = stats.consumer.samples
    print(
        f"demo: {total} samples in {elapsed:.2f}s: {total / elapsed:,.0f} samples/s, "
        f"final accuracy {accuracy:.1%}"
    )
    print(stats)
    return accuracy


def _count(minimum: int) -> Any:
    """An argparse type: an int of at least ``minimum``, said in words when it is not."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {minimum} or more, got {value}")
        return value

    return parse


DESCRIPTION = """\
Train a tiny model on the CPU (or --device cuda) from small image files streamed through an
aioloader.DataLoader: by default 4,096 files written to a temporary folder (removed at the end,
on Ctrl-C and on SIGTERM too), or the objects under --url. Prints a progress bar per epoch and
the loader's statistics."""


def add_command(commands: Any) -> None:
    """Add ``demo`` to the command line's sub-commands."""
    parser = commands.add_parser(
        "demo",
        help="train a tiny model on files streamed through the loader (no setup needed)",
        description=DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--samples", type=_count(1), default=4096, help="files to write")
    parser.add_argument("--epochs", type=_count(1), default=3, help="passes over the data")
    parser.add_argument("--batch-size", type=_count(1), default=64, help="samples per batch")
    parser.add_argument(
        "--workers", type=_count(0), default=0, help="worker processes that decode (0: threads)"
    )
    parser.add_argument(
        "--max-inflight", type=_count(1), default=64, help="most file or object reads at once"
    )
    parser.add_argument(
        "--device", default=None, help="train on this device, e.g. cuda (None: the CPU)"
    )
    parser.add_argument(
        "--url",
        default=None,
        help="read the samples from an object store instead, e.g. s3://bucket/prefix/ "
        "(credentials, region and endpoint from the AWS_* environment variables; each object "
        "is one label byte, then a 3x16x16 uint8 image)",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="show the traceback of a failure too"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit status (1 if the model did not learn).

    Raises:
        UsageError: ``--device`` names a device this machine does not have.
        KeyboardInterrupt, Terminated: Ctrl-C or SIGTERM, after cleaning up.
        Exception: Reading ``--url`` failed (see ``_cli/errors.py`` for what is said).
    """
    if args.device is not None:
        try:
            resolve_device(args.device)
        except (TypeError, ValueError):
            if str(args.device).startswith("cuda"):
                raise UsageError(
                    f"--device {args.device}: this machine has no CUDA device (torch "
                    f"{torch.__version__}); leave --device out to train on the CPU"
                ) from None
            raise UsageError(f"--device {args.device}: not a device torch knows") from None
    if args.url is not None and "://" not in args.url:
        raise UsageError(
            f"--url {args.url}: give a store URL: s3://bucket/prefix/, gs://..., az://..., "
            "file:///absolute/path/"
        )
    accuracy = run_until_signal(train(args))
    if accuracy > 1 / _CLASSES:
        return 0
    print(
        f"aioloader demo: the model reached {accuracy:.1%}, no better than chance: are these "
        "demo samples (a label byte, then an image whose class shows as a bright quadrant)?",
        file=sys.stderr,
    )
    return 1
