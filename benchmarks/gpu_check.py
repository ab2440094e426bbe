"""GPU check of aioloader's device stage: correctness, overlap with compute, H2D bandwidth.

Run on a machine with a CUDA GPU (about a minute on an H100; ``--quick`` for less):

    python benchmarks/gpu_check.py [--quick] [--budget SECONDS]

1. Correctness: batches the loader puts on the GPU (``pin_memory=True, device="cuda"``, and
   unpinned) equal the CPU path bit for bit (values, dtypes, shapes, strides), over batches of
   random sizes, while the consumer's stream lags behind (``torch.cuda._sleep``) and the caching
   allocator is under pressure (tensors freed and reallocated between steps). The consumer
   reads each batch back asynchronously after freeing it, so a missing stream wait or
   ``record_stream`` would show up as a mismatch.
2. Overlap: a training step of about 5 ms of GPU compute (matmuls, counted by a calibration),
   fed (a) by the loader with the device stage, (b) by the loader with a plain ``.to("cuda")``
   in the loop, (c) from batches already resident on the GPU. Prints steps/s and the gaps of
   (a) and (b) to (c); the goal is (a) within 5% of (c).
3. Bandwidth: bytes per second through the device stage (copy into the pinned pool + H2D copy)
   against a plain pinned ``copy_`` measured here, and the host copy rate into pinned memory.

Exit status: 0 when every correctness check passed, 1 when one failed, 2 without CUDA. The
overlap goal is reported, not enforced. A hang past the time budget dumps every thread's stack
and exits.
"""

from __future__ import annotations

import argparse
import faulthandler
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

import aioloader

MB = 1 << 20


class Budget:
    """The script's time budget; sections shorten themselves when it runs low."""

    def __init__(self, seconds: float) -> None:
        self.start = time.perf_counter()
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)


# -- 1. correctness -----------------------------------------------------------------------------


def sample(index: int) -> dict[str, Any]:
    """Sample ``index``: several dtypes, a variable-length field, non-tensors."""
    g = torch.Generator().manual_seed(index)
    length = int(torch.randint(1, 300, (), generator=g))
    return {
        "image": torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=g),
        "feat": torch.randn(17, generator=g).to(torch.bfloat16),
        "half": torch.randn(5, 3, generator=g).half(),
        "mask": torch.rand(5, generator=g) > 0.5,
        "tokens": torch.randint(0, 50_000, (length,), generator=g),
        "label": index,
        "id": f"sample-{index}",
    }


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Collate with a padded field (so batch byte sizes vary) and a channels-last image."""
    return {
        "image": torch.stack([s["image"] for s in samples]).contiguous(
            memory_format=torch.channels_last
        ),
        "feat": torch.stack([s["feat"] for s in samples]),
        "half_t": torch.stack([s["half"] for s in samples]).transpose(1, 2),  # permuted, dense
        "mask": torch.stack([s["mask"] for s in samples]),
        "tokens": pad_sequence([s["tokens"] for s in samples], batch_first=True, padding_value=-1),
        "label": torch.tensor([s["label"] for s in samples]),
        "id": [s["id"] for s in samples],
    }


class Samples(torch.utils.data.Dataset[dict[str, Any]]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        return sample(index)


def random_batches(n_batches: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out, start = [], 0
    for _ in range(n_batches):
        size = rng.randint(1, 64)
        out.append(list(range(start, start + size)))
        start += size
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def check_correctness(dev: torch.device, n_batches: int, pin: bool, budget: Budget) -> bool:
    batches = random_batches(n_batches, seed=1234 + int(pin))
    n = batches[-1][-1] + 1
    rng = random.Random(7)
    loader = aioloader.DataLoader(
        Samples(n),
        batch_sampler=batches,
        collate_fn=collate,
        num_workers=2,
        worker_mode="thread",
        pin_memory=pin,
        device="cuda",
        prefetch=4,
    )
    pending: list[tuple[int, dict[str, torch.Tensor], dict[str, Any]]] = []
    junk: deque[torch.Tensor] = deque()
    checked = mismatches = 0
    problems: list[str] = []

    def settle() -> None:
        nonlocal checked, mismatches
        torch.cuda.synchronize()
        for seq, host, got_rest in pending:
            want = collate([sample(i) for i in batches[seq]])  # the CPU path
            ok = got_rest["id"] == want["id"]
            for key, copy in host.items():
                w = want[key]
                ok = ok and copy.dtype == w.dtype and copy.shape == w.shape
                ok = ok and got_rest["strides"][key] == torch.empty_like(w).stride()
                ok = ok and torch.equal(bits(copy), bits(w))
            checked += 1
            if not ok:
                mismatches += 1
                if len(problems) < 5:
                    problems.append(f"batch {seq}")
        pending.clear()

    t0 = time.perf_counter()
    with loader:
        for seq, batch in enumerate(loader):
            if budget.left() < 60:  # keep time for the other sections
                print(f"    (budget: stopped after {seq} batches)")
                break
            # The consumer lags: its stream is busy when the batch arrives and when it is freed.
            torch.cuda._sleep(rng.randint(0, 2_000_000))
            host = {}
            strides = {}
            for key, t in batch.items():
                if isinstance(t, torch.Tensor):
                    if t.device != dev:
                        problems.append(f"batch {seq}: {key} on {t.device}")
                    copy = torch.empty_strided(
                        t.shape, t.stride(), dtype=t.dtype, device="cpu", pin_memory=True
                    )
                    copy.copy_(t, non_blocking=True)  # read after the sleep, on this stream
                    host[key] = copy
                    strides[key] = t.stride()
            pending.append((seq, host, {"id": batch["id"], "strides": strides}))
            del batch, t  # freed before the reads above ran: record_stream must hold it
            # Allocator pressure: allocations of random sizes come and go between steps.
            junk.append(torch.empty(rng.randint(64 << 10, 16 * MB), dtype=torch.uint8, device=dev))
            junk[-1].fill_(seq % 251)
            if len(junk) > 8:
                junk.popleft()
            if len(pending) == 50:
                settle()
        settle()
    junk.clear()
    dt = time.perf_counter() - t0
    kind = "pinned pool" if pin else "unpinned"
    verdict = "PASS" if mismatches == 0 and not problems and checked else "FAIL"
    print(
        f"    {kind:<12} {checked} batches (random sizes 1-64), {mismatches} mismatched, "
        f"{dt:.1f}s: {verdict}"
    )
    for p in problems:
        print(f"      {p}")
    return verdict == "PASS"


# -- 2. overlap ---------------------------------------------------------------------------------


class Step:
    """A training step of about ``target_ms`` of GPU compute that depends on the batch."""

    def __init__(self, dev: torch.device, target_ms: float) -> None:
        n = 4096
        self.n = n
        g = torch.Generator(device=dev).manual_seed(0)
        self.a = torch.randn(n, n, device=dev, dtype=torch.bfloat16, generator=g)
        self.w = torch.randn(n, n, device=dev, dtype=torch.bfloat16, generator=g) / n**0.5
        self.acc = torch.zeros((), device=dev)
        for _ in range(5):
            torch.mm(self.a, self.w)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(20):
            torch.mm(self.a, self.w)
        end.record()
        end.synchronize()
        self.mm_ms = start.elapsed_time(end) / 20
        self.k = max(1, round(target_ms / self.mm_ms))

    def __call__(self, batch: dict[str, torch.Tensor]) -> None:
        x = batch["image"]
        scale = x.float().mean() * 1e-6 + 1  # reads the whole batch: the step waits for it
        h = self.a * scale.to(torch.bfloat16)
        for _ in range(self.k):
            h = torch.mm(h, self.w)
        self.acc += h[0, 0].float()


def run_steps(
    batches: Iterator[dict[str, torch.Tensor]], step: Step, warmup: int, steps: int
) -> float:
    """Steps per second over ``steps`` steps after ``warmup``; the host stays at most two
    steps ahead of the GPU (as a training loop that reads its loss now and then does)."""
    inflight: deque[torch.cuda.Event] = deque()
    t0 = 0.0
    for i, batch in enumerate(batches):
        if i == warmup:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        step(batch)
        event = torch.cuda.Event()
        event.record()
        inflight.append(event)
        if len(inflight) > 2:
            inflight.popleft().synchronize()
        if i + 1 == warmup + steps:
            break
    torch.cuda.synchronize()
    return steps / (time.perf_counter() - t0)


class Pool(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Whole batches (as a worker would hand them over), cycled from a few prepared ones."""

    def __init__(self, batches: list[dict[str, torch.Tensor]], n: int) -> None:
        self.batches, self.n = batches, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.batches[index % len(self.batches)]


def check_overlap(dev: torch.device, steps: int, budget: Budget) -> None:
    step = Step(dev, target_ms=5.0)
    print(
        f"    step: {step.k} matmuls {step.n}x{step.n} bf16 of {step.mm_ms:.3f} ms "
        f"= {step.k * step.mm_ms:.2f} ms GPU compute"
    )
    g = torch.Generator().manual_seed(0)
    prepared = [
        {
            "image": torch.randint(0, 256, (64, 3, 224, 224), dtype=torch.uint8, generator=g),
            "label": torch.randint(0, 1000, (64,), generator=g),
        }
        for _ in range(6)
    ]
    nbytes = sum(t.numel() * t.element_size() for t in prepared[0].values())
    print(f"    batch: 64x3x224x224 uint8 + labels = {nbytes / MB:.1f} MiB")
    warmup = 20
    total = warmup + steps

    def resident() -> Iterator[dict[str, torch.Tensor]]:
        on_gpu = [{k: v.to(dev) for k, v in b.items()} for b in prepared]
        return (on_gpu[i % len(on_gpu)] for i in range(total))

    def staged(loader: aioloader.DataLoader[Any]) -> Iterator[dict[str, torch.Tensor]]:
        return iter(loader)

    def plain_to(loader: aioloader.DataLoader[Any]) -> Iterator[dict[str, torch.Tensor]]:
        for batch in loader:
            yield {k: v.to("cuda") for k, v in batch.items()}

    def with_loader(
        make: Callable[[aioloader.DataLoader[Any]], Iterator[dict[str, torch.Tensor]]],
        **options: Any,
    ) -> float:
        loader = aioloader.DataLoader(Pool(prepared, total), batch_size=None, **options)
        with loader:  # workers and the device stage start before the timing
            return run_steps(make(loader), step, warmup, steps)

    results: dict[str, float] = {}
    results["c0"] = run_steps(resident(), step, warmup, steps)
    if budget.left() > 30:
        results["a"] = with_loader(staged, pin_memory=True, device="cuda", prefetch=4)
    if budget.left() > 30:
        results["b"] = with_loader(plain_to, prefetch=4)
    results["c1"] = run_steps(resident(), step, warmup, steps)
    c = max(results["c0"], results["c1"])  # the better baseline: gaps are not flattered
    print(
        f"    (c) resident on the GPU        {c:8.1f} steps/s "
        f"(runs: {results['c0']:.1f}, {results['c1']:.1f})"
    )
    labels = {"a": "(a) loader, device stage", "b": '(b) loader + .to("cuda")'}
    for key, label in labels.items():
        if key not in results:
            print(f"    {label:<30} skipped (time budget)")
            continue
        gap = (c - results[key]) / c
        goal = ""
        if key == "a":
            goal = "   goal <= 5%: " + ("met" if gap <= 0.05 else "MISSED")
        print(f"    {label:<30} {results[key]:8.1f} steps/s   gap to (c) {gap:6.1%}{goal}")


# -- 3. bandwidth -------------------------------------------------------------------------------


def timed_copies(dst: torch.Tensor, src: torch.Tensor, repeats: int) -> float:
    """Bytes per second of ``dst.copy_(src, non_blocking=True)``, timed with CUDA events."""
    for _ in range(2):
        dst.copy_(src, non_blocking=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return repeats * src.numel() * src.element_size() / (start.elapsed_time(end) / 1e3)


def check_bandwidth(dev: torch.device, count: int) -> None:
    size = 64 * MB
    pageable = torch.randint(0, 256, (size,), dtype=torch.uint8)
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    on_gpu = torch.empty(size, dtype=torch.uint8, device=dev)
    peak = timed_copies(on_gpu, pinned, repeats=20)
    from_pageable = timed_copies(on_gpu, pageable, repeats=5)
    t0 = time.perf_counter()
    for _ in range(5):
        pinned.copy_(pageable)
    host = 5 * size / (time.perf_counter() - t0)
    del on_gpu

    class Same(torch.utils.data.Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return count + 3

        def __getitem__(self, index: int) -> torch.Tensor:
            return pageable

    loader = aioloader.DataLoader(
        Same(), batch_size=None, pin_memory=True, device="cuda", prefetch=2
    )
    with loader:
        it = iter(loader)
        for _ in range(3):  # the pool's buffers are allocated here
            next(it)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = sum(1 for _ in it)
        torch.cuda.synchronize()
        stage = n * size / (time.perf_counter() - t0)
        scope = getattr(loader, "_scope", None)
        pool = getattr(getattr(scope, "device", None), "pool", None)
        allocations = getattr(pool, "allocations", "?")
        capacity = getattr(pool, "capacity", "?")
    gb = 1e9
    print(f"    torch pinned copy_ peak (H2D)      {peak / gb:6.1f} GB/s")
    print(f"    torch pageable copy_ (H2D)         {from_pageable / gb:6.1f} GB/s")
    print(f"    host copy into pinned memory       {host / gb:6.1f} GB/s (one call)")
    print(
        f"    device stage (pool + H2D)          {stage / gb:6.1f} GB/s = {stage / peak:.0%} of "
        f"peak; {n} batches of {size // MB} MiB; pinned buffers allocated: {allocations} "
        f"(pool capacity {capacity})"
    )


# -- main -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches and steps")
    parser.add_argument(
        "--budget",
        type=float,
        default=170.0,
        help="total seconds (default 170); sections "
        "shorten themselves when it runs low, and a hang past it aborts with stack dumps",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device (torch.cuda.is_available() is False); this script "
            "checks the device stage on a GPU and has nothing to do here",
            file=sys.stderr,
        )
        return 2
    budget = Budget(args.budget)
    faulthandler.dump_traceback_later(args.budget + 30, exit=True)
    dev = torch.device("cuda", torch.cuda.current_device())
    print(
        f"gpu_check: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, "
        f"aioloader {aioloader.__version__}{' (quick)' if args.quick else ''}"
    )

    print("[1] correctness: GPU batches vs the CPU path, bit for bit")
    ok = check_correctness(dev, 100 if args.quick else 500, pin=True, budget=budget)
    ok = check_correctness(dev, 50 if args.quick else 100, pin=False, budget=budget) and ok

    print("[2] overlap: steps/s of a ~5 ms training step")
    if budget.left() > 45:
        check_overlap(dev, 100 if args.quick else 300, budget)
    else:
        print("    skipped (time budget)")

    print("[3] H2D bandwidth")
    if budget.left() > 15:
        check_bandwidth(dev, 16 if args.quick else 48)
    else:
        print("    skipped (time budget)")

    faulthandler.cancel_dump_traceback_later()
    elapsed = time.perf_counter() - budget.start
    print(f"gpu_check: {'all correctness checks passed' if ok else 'FAILED'} in {elapsed:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
