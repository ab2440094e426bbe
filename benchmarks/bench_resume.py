"""Resuming: how big a loader's state is, and how long from ``load_state_dict`` to the first
batch, beside torchdata's ``StatefulDataLoader`` (the peer with the same interface) in the same
run.

Workloads:

* map-style: ``range(N)`` shuffled, batch 256, ``num_workers=0``; each loader takes half the
  epoch, saves its state, and a new loader loads it and takes one batch (timed). The state's
  size is that of ``torch.save`` (what a checkpoint holds). Our resumed batch is checked
  against the uninterrupted epoch's batch at that place.
* ours alone at 10 million samples (the state written as after half the epoch).
* tar shards (ours alone; no peer resumes mid-shard): 16 local shards of 1,000 samples, 4 read
  at once, a shuffle buffer of 1,000; the first batch of a fresh epoch, and of one resumed at
  half (the open shards read again to their place, the buffer's 1,000 samples read again).

Run: python benchmarks/bench_resume.py [--quick]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tarfile
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import aioloader
from aioloader.sources import tar_shards


def saved_size(state: Any) -> int:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.tell()


def best_of(runs: int, once: Callable[[], float]) -> float:
    return statistics.median(once() for _ in range(runs))


def ours_map(n: int, runs: int) -> dict[str, Any]:
    batches = -(-n // 256)
    half = batches // 2
    loader = aioloader.DataLoader(range(n), batch_size=256, shuffle=True, seed=3)
    state = loader.state_dict()
    state["taken"] = {"through": half, "beyond": []}  # as after half the epoch
    state["samples"] = half * 256
    expected = aioloader.DataLoader(range(n), batch_size=256, shuffle=True, seed=3)
    order = aioloader.RandomSampler(n, seed=3)
    want = list(order)[half * 256 : (half + 1) * 256]

    def once() -> float:
        resumed = aioloader.DataLoader(range(n), batch_size=256, shuffle=True, seed=3)
        start = time.perf_counter()
        resumed.load_state_dict(state)
        with resumed:
            first = next(iter(resumed))
        took = time.perf_counter() - start
        assert first.tolist() == want, "the resumed batch is not the epoch's batch at its place"
        return took

    def fresh() -> float:
        start = time.perf_counter()
        with expected:
            next(iter(expected))
        return time.perf_counter() - start

    return {
        "state_json": len(json.dumps(state)),
        "state_saved": saved_size(state),
        "resume_s": best_of(runs, once),
        "fresh_s": best_of(runs, fresh),
    }


def torchdata_map(n: int, runs: int) -> dict[str, Any]:
    warnings.filterwarnings("ignore", "'set_vital' is deprecated")  # torchdata's own
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make() -> Any:
        return StatefulDataLoader(
            range(n), batch_size=256, shuffle=True, generator=torch.Generator().manual_seed(3)
        )

    half = -(-n // 256) // 2
    loader = make()
    it = iter(loader)
    for _ in range(half):
        next(it)
    state = loader.state_dict()

    def once() -> float:
        resumed = make()
        start = time.perf_counter()
        resumed.load_state_dict(state)
        next(iter(resumed))
        return time.perf_counter() - start

    def fresh() -> float:
        start = time.perf_counter()
        next(iter(make()))
        return time.perf_counter() - start

    return {
        "state_json": None,
        "state_saved": saved_size(state),
        "resume_s": best_of(runs, once),
        "fresh_s": best_of(runs, fresh),
    }


def write_shards(folder: Path, shards: int, per_shard: int) -> list[str]:
    payload = bytes(1024)
    paths = []
    for s in range(shards):
        path = folder / f"shard-{s:03d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(per_shard):
                info = tarfile.TarInfo(f"{s}-{i:05d}.bin")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
        paths.append(str(path))
    return paths


def keys(batch: list[dict[str, Any]]) -> list[str]:
    return [s["__key__"] for s in batch]


def ours_tar(folder: Path, runs: int) -> dict[str, Any]:
    paths = write_shards(folder, 16, 1000)

    def make() -> aioloader.DataLoader[Any]:
        ds = tar_shards(paths, shuffle_shards=True, shuffle_buffer=1000, shards_in_flight=4)
        return aioloader.DataLoader(ds, batch_size=256, collate_fn=keys)

    loader = make()
    with loader:
        it = iter(loader)
        for _ in range(31):  # half of 62 batches
            next(it)
        state = loader.state_dict()
        want = next(it)
        it.close()

    def once() -> float:
        resumed = make()
        start = time.perf_counter()
        resumed.load_state_dict(state)
        with resumed:
            first = next(iter(resumed))
        took = time.perf_counter() - start
        assert first == want, "the resumed batch is not the epoch's batch at its place"
        return took

    def fresh() -> float:
        start = time.perf_counter()
        with make() as fresh_loader:
            next(iter(fresh_loader))
        return time.perf_counter() - start

    return {
        "state_json": len(json.dumps(state)),
        "state_saved": saved_size(state),
        "resume_s": best_of(runs, once),
        "fresh_s": best_of(runs, fresh),
    }


def row(name: str, r: dict[str, Any], peer: dict[str, Any] | None) -> str:
    json_size = "-" if r["state_json"] is None else f"{r['state_json']:,}"
    ratio = "" if peer is None else f"{r['resume_s'] / peer['resume_s']:.2f}x"
    return (
        f"| {name} | {json_size} | {r['state_saved']:,} | {r['fresh_s'] * 1e3:,.0f} | "
        f"{r['resume_s'] * 1e3:,.0f} | {ratio} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller epochs, one run each")
    args = parser.parse_args()
    runs = 1 if args.quick else 3
    n = 200_000 if args.quick else 2_000_000
    print(f"torch {torch.__version__}; median of {runs}; times in ms")
    print(
        "| workload | state JSON bytes | torch.save bytes | first batch, fresh | "
        "first batch, resumed at half | resumed vs torchdata |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    try:
        peer = torchdata_map(n, runs)
    except ImportError:
        peer = None
        print(f"| torchdata StatefulDataLoader, {n:,} shuffled | not installed | | | | |")
    ours = ours_map(n, runs)
    if peer is not None:
        print(row(f"torchdata StatefulDataLoader, {n:,} shuffled", peer, None))
    print(row(f"aioloader, {n:,} shuffled", ours, peer))
    if not args.quick:
        print(row("aioloader, 10,000,000 shuffled", ours_map(10_000_000, runs), None))
    with tempfile.TemporaryDirectory() as tmp:
        print(
            row("aioloader tar_shards, 16 x 1,000, buffer 1,000", ours_tar(Path(tmp), runs), None)
        )


if __name__ == "__main__":
    main()
