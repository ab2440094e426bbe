"""Train, get killed mid-epoch, start again: the data goes on where the checkpoint left it.

The script writes WebDataset-style tar shards to a temporary folder and trains on them twice, each
time in a process of its own. The first run saves a checkpoint (model, optimizer and the loader's
``state_dict()``) every 5 steps and is killed with SIGKILL at step 12, as a preempted job is: no
cleanup, workers and open shards and all. The second run loads the last checkpoint and finishes
the epoch. Across the two, every sample of the epoch is trained on once, except those of the steps
after the last checkpoint (11 and 12), which the first run took but never saved, and which the
second run takes again, the same batches in the same order.

Run: python examples/resume.py
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import torch

from aioloader import DataLoader
from aioloader.sources import tar_shards

SHARDS, PER_SHARD, BATCH, EVERY, DIE_AT = 6, 24, 8, 5, 12


def write_shards(folder: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    for s in range(SHARDS):
        with tarfile.open(folder / f"train-{s:03d}.tar", "w") as tar:
            for i in range(PER_SHARD):
                label = (s + i) % 4
                x = torch.randn(16, generator=generator) + label
                for name, data in (
                    (f"{s}-{i:03d}.x.bin", x.numpy().tobytes()),
                    (f"{s}-{i:03d}.cls", str(label).encode()),
                ):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


def decode(sample: dict[str, Any]) -> tuple[torch.Tensor, int, str]:
    """Runs in the worker processes: bytes to a tensor and a label."""
    x = torch.frombuffer(bytearray(sample["x.bin"]), dtype=torch.float32)
    return x, int(sample["cls"]), sample["__key__"]


def train(folder: Path, die_at: int | None) -> None:
    shards = sorted(str(p) for p in folder.glob("train-*.tar"))
    dataset = tar_shards(shards, shuffle_shards=True, shuffle_buffer=16, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH, transform=decode, num_workers=2)
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoint, step = folder / "checkpoint.pt", 0
    if checkpoint.exists():
        saved = torch.load(checkpoint)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        loader.load_state_dict(saved["data"])  # the epoch goes on after the saved step
        step = saved["step"]
        print(f"resumed at step {step}")
    with (folder / "seen.jsonl").open("a") as seen:
        for x, y, keys in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            seen.write(json.dumps({"step": step, "keys": list(keys)}) + "\n")
            seen.flush()
            if step % EVERY == 0:
                state = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "data": loader.state_dict(),  # small: a few numbers per open shard
                    "step": step,
                }
                torch.save(state, folder / "checkpoint.tmp")
                os.replace(folder / "checkpoint.tmp", checkpoint)
            if step == die_at:
                print(f"step {step}: killed (last checkpoint at step {step - step % EVERY})")
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
    print(f"epoch done at step {step}, loss {loss.item():.3f}")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="aioloader-resume-") as tmp:
        folder = Path(tmp)
        write_shards(folder)
        me = [sys.executable, __file__, "--train", tmp]
        first = subprocess.run([*me, "--die-at", str(DIE_AT)], check=False)
        assert first.returncode == -signal.SIGKILL, first
        subprocess.run(me, check=True)
        lines = [json.loads(line) for line in (folder / "seen.jsonl").read_text().splitlines()]
    keys = [k for line in lines for k in line["keys"]]
    again = len(keys) - len(set(keys))
    print(
        f"{len(set(keys))} of {SHARDS * PER_SHARD} samples trained on; {again} twice "
        f"(steps {DIE_AT - DIE_AT % EVERY + 1}-{DIE_AT}, taken after the last checkpoint)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--die-at", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train is not None:
        train(args.train, args.die_at)
    else:
        main()
