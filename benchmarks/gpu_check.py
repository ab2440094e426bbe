"""GPU check of aioloader's device stage: correctness, overlap with compute, H2D bandwidth.

Run on a machine with a CUDA GPU (about a minute on an H100; ``--quick`` for less):

    python benchmarks/gpu_check.py [--quick] [--budget SECONDS]

1. Correctness: batches the loader puts on the GPU (``pin_memory=True, device="cuda"``, and
   unpinned) equal the CPU path bit for bit (values, dtypes, shapes, strides), over batches of
   random sizes, while the consumer's stream lags behind (``torch.cuda._sleep``) and the caching
   allocator is under pressure (tensors freed and reallocated between steps). Then a race run
   (pinned and unpinned) that fails without the consumer stream's wait, without
   ``record_stream`` or with a pinned buffer reused too early: ``device_transform`` sleeps on
   the side stream before it writes the batch, while the consumer reads each batch at once;
   then the consumer's stream falls further behind each batch while the stage's next batches
   reuse the side stream's freed memory (see :func:`check_hand_over`).
2. Overlap: a training step of about 5 ms of GPU compute (matmuls, counted by a calibration),
   fed (a) by the loader with the device stage, (b) by the loader with a plain, blocking
   ``.to("cuda")`` of pageable batches in the loop, (b2) by the loader with ``pin_memory=True``
   and ``.to("cuda", non_blocking=True)`` in the loop (torch's usual recipe), (c) from batches
   already resident on the GPU. Prints steps/s and the gaps of (a), (b) and (b2) to (c); the
   goal is (a) within 5% of (c).
3. Bandwidth: bytes per second through the device stage (copy into the pinned pool + H2D copy)
   against a plain pinned ``copy_`` measured here, with large tensors copied chunk by chunk
   (the default: each chunk's H2D copy overlaps the next chunk's host copy) and whole
   (``aioloader._device.stage._CHUNK_BYTES = 0``), for 64 MiB batches and image batches
   (256x3x224x224 uint8, 36.8 MiB); the host copy rate into pinned memory with torch's
   thread count and with one thread; then what bounds the stage: the stage's own host copy
   (``HostCopy``) at 1 to 16 threads, and the stage's rate on image batches with its copy
   threads (``_COPY_THREADS``) at 1, the default, 8 and 16, with its statistics; the stage fed
   by worker processes, whose batches arrive in blocks the stage registered once and copies
   straight out of (``_workers/blocks.py``: no host copy); and the H2D rate from shared
   memory registered with CUDA in place, the ceiling without a host copy.

Exit status: 0 when every correctness check that ran passed, 1 when one failed, 2 without CUDA.
A run the time budget left no room for is reported as skipped, not failed. The overlap goal is
reported, not enforced. A hang 25 s past the time budget dumps every thread's stack and exits.
"""

from __future__ import annotations

import argparse
import faulthandler
import itertools
import os
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
from torch.nn.utils.rnn import pad_sequence

import aioloader
from aioloader._device import stage as stage_module
from aioloader._device.hostcopy import HostCopy

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


def equals_cpu_path(indices: list[int], ids: list[str], got: dict[str, torch.Tensor]) -> bool:
    """Whether a batch read back from the GPU equals the CPU path's, bit for bit, with the ids
    and the strides ``.to("cuda")`` gives."""
    want = collate([sample(i) for i in indices])
    tensors = {k: v for k, v in want.items() if isinstance(v, torch.Tensor)}
    if ids != want["id"] or got.keys() != tensors.keys():
        return False
    for key, w in tensors.items():
        g = got[key]
        if g.dtype != w.dtype or g.shape != w.shape or g.stride() != torch.empty_like(w).stride():
            return False
        if not torch.equal(bits(g.cpu()), bits(w)):
            return False
    return True


class Results:
    """Batches read back from the GPU, compared with the CPU path after a synchronize."""

    def __init__(self, batches: list[list[int]]) -> None:
        self.batches = batches
        self.pending: list[tuple[int, dict[str, torch.Tensor], list[str]]] = []
        self.checked = self.mismatched = 0
        self.problems: list[str] = []

    def settle(self) -> None:
        torch.cuda.synchronize()
        for seq, got, ids in self.pending:
            self.checked += 1
            if not equals_cpu_path(self.batches[seq], ids, got):
                self.mismatched += 1
                self.problems.append(f"batch {seq}: differs from the CPU path")
        self.pending.clear()

    def report(self, label: str, seconds: float) -> bool | None:
        """Print the verdict: True (PASS), False (FAIL), None (nothing checked: skipped)."""
        if self.checked == 0 and not self.problems:
            print(f"    {label:<24} skipped (time budget)")
            return None
        passed = not self.problems
        print(
            f"    {label:<24} {self.checked} batches (random sizes 1-64), {self.mismatched} "
            f"mismatched, {seconds:.1f}s: {'PASS' if passed else 'FAIL'}"
        )
        for p in self.problems[:5]:
            print(f"      {p}")
        return passed


def check_correctness(
    dev: torch.device, n_batches: int, pin: bool, budget: Budget, reserve: float
) -> bool | None:
    """Batches under allocator pressure and a consumer stream that lags a little; stops when
    ``reserve`` seconds of the budget are left."""
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
    results = Results(batches)
    junk: deque[torch.Tensor] = deque()

    t0 = time.perf_counter()
    with loader:
        for seq, batch in enumerate(loader):
            if budget.left() < reserve:  # keep time for the other runs and sections
                if seq:
                    print(f"    (budget: stopped after {seq} batches)")
                break
            # The consumer lags: its stream is busy when the batch arrives and when it is freed.
            torch.cuda._sleep(rng.randint(0, 2_000_000))
            host = {}
            for key, t in batch.items():
                if isinstance(t, torch.Tensor):
                    if t.device != dev:
                        results.problems.append(f"batch {seq}: {key} on {t.device}")
                    copy = torch.empty_strided(
                        t.shape, t.stride(), dtype=t.dtype, device="cpu", pin_memory=True
                    )
                    copy.copy_(t, non_blocking=True)  # read after the sleep, on this stream
                    host[key] = copy
            results.pending.append((seq, host, batch["id"]))
            del batch, t
            # Allocator pressure: allocations of random sizes come and go between steps.
            junk.append(torch.empty(rng.randint(64 << 10, 16 * MB), dtype=torch.uint8, device=dev))
            junk[-1].fill_(seq % 251)
            if len(junk) > 8:
                junk.popleft()
            if len(results.pending) == 50:
                results.settle()
        results.settle()
    junk.clear()
    return results.report("pinned pool" if pin else "unpinned", time.perf_counter() - t0)


GROUP = 24  # batches per group of the race run: the first half fresh, the second lagging


def sleep_cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of ``torch.cuda._sleep``: the higher of two
    measurements, so that sleeps sized with it last at least about as long as asked."""
    rates: list[float] = []
    for _ in range(2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        rates.append(20_000_000 / max(start.elapsed_time(end), 1e-3))
    return max(rates)


def check_hand_over(
    dev: torch.device,
    n_batches: int,
    pin: bool,
    budget: Budget,
    reserve: float,
    cycles_per_ms: float,
) -> bool | None:
    """The race run: fails without the consumer stream's wait for the side stream, without
    ``record_stream``, or with a pinned buffer reused while a copy out of it is still queued.

    Batches come in groups of ``GROUP``, compared with the CPU path after a synchronize that
    ends each group (so both streams start the next one idle):

    - fresh (first half): ``device_transform`` sleeps ~10 ms on the side stream, then writes
      the batch anew (a clone), so the side stream falls behind the host (copies out of the
      pinned buffers stay queued too); the consumer reads each batch at once, on its idle
      stream. Without the wait it would read memory the transform has not written yet.
    - lagging (second half): the transform does not sleep; the consumer's stream sleeps ~8 ms
      before each read (so it falls further behind every batch), and the host drops the batch
      as soon as the read is enqueued. The stage's next batches allocate and write on the side
      stream (copies, clones, and a scribble of the same sizes over free memory): without
      ``record_stream`` they would reuse the dropped batch's memory before the read ran.
    """
    batches = random_batches(n_batches, seed=4321 + int(pin))
    n = batches[-1][-1] + 1
    side_sleep, lag_sleep = int(10 * cycles_per_ms), int(8 * cycles_per_ms)
    staged = itertools.count()  # device_transform runs once per batch, in order

    def lagging(seq: int) -> bool:
        return seq % GROUP >= GROUP // 2

    def transform(batch: dict[str, Any]) -> dict[str, Any]:  # on the side stream
        if not lagging(next(staged)):
            torch.cuda._sleep(side_sleep)
        out = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        for v in out.values():  # scribble over the side stream's free blocks
            if isinstance(v, torch.Tensor):
                size = v.numel() * v.element_size()
                torch.empty(size, dtype=torch.uint8, device=dev).fill_(0xA5)
        return out

    loader = aioloader.DataLoader(
        Samples(n),
        batch_sampler=batches,
        collate_fn=collate,
        num_workers=2,
        worker_mode="thread",
        pin_memory=pin,
        device="cuda",
        prefetch=4,
        device_transform=transform,
    )
    results = Results(batches)
    t0 = time.perf_counter()
    with loader:
        seq = 0
        for batch in loader:  # not enumerate(): its cached tuple would keep the batch alive
            if budget.left() < reserve:
                if seq:
                    print(f"    (budget: stopped after {seq} batches)")
                break
            if lagging(seq):
                torch.cuda._sleep(lag_sleep)  # the consumer's stream falls further behind
            got = {}
            for key, t in batch.items():
                if isinstance(t, torch.Tensor):
                    if t.device != dev:
                        results.problems.append(f"batch {seq}: {key} on {t.device}")
                    got[key] = t.clone()  # a read on this stream, into a fresh tensor
            results.pending.append((seq, got, batch["id"]))
            del batch, t  # dropped before the read ran: only record_stream keeps its memory
            seq += 1  # noqa: SIM113 (see the loop)
            if seq % GROUP == 0:
                results.settle()
        results.settle()
    label = ("pinned pool" if pin else "unpinned") + ", race run"
    return results.report(label, time.perf_counter() - t0)


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
        for batch in loader:  # pageable batches: each copy blocks the host
            yield {k: v.to("cuda") for k, v in batch.items()}

    def pinned_to(loader: aioloader.DataLoader[Any]) -> Iterator[dict[str, torch.Tensor]]:
        for batch in loader:  # pinned by the loader: the copies overlap the step
            yield {k: v.to("cuda", non_blocking=True) for k, v in batch.items()}

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
    if budget.left() > 30:
        results["b2"] = with_loader(pinned_to, pin_memory=True, prefetch=4)
    results["c1"] = run_steps(resident(), step, warmup, steps)
    c = max(results["c0"], results["c1"])  # the better baseline: gaps are not flattered
    labels = {
        "a": "(a) loader, device stage",
        "b": "(b) plain .to('cuda') in the loop, pageable, blocking",
        "b2": "(b2) pin_memory=True + .to('cuda', non_blocking=True) in the loop",
    }
    width = max(len(label) for label in labels.values())
    print(
        f"    {'(c) resident on the GPU':<{width}} {c:8.1f} steps/s "
        f"(runs: {results['c0']:.1f}, {results['c1']:.1f})"
    )
    for key, label in labels.items():
        if key not in results:
            print(f"    {label:<{width}} skipped (time budget)")
            continue
        gap = (c - results[key]) / c
        goal = ""
        if key == "a":
            goal = "   goal <= 5%: " + ("met" if gap <= 0.05 else "MISSED")
        print(f"    {label:<{width}} {results[key]:8.1f} steps/s   gap to (c) {gap:6.1%}{goal}")


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


class Same(torch.utils.data.Dataset[torch.Tensor]):
    """``length`` samples, each ``tensor`` (picklable: worker processes get a copy)."""

    def __init__(self, tensor: torch.Tensor, length: int) -> None:
        self.tensor, self.length = tensor, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tensor


def stage_rate(
    tensor: torch.Tensor, count: int, workers: int = 0
) -> tuple[float, int, Any, Any, str]:
    """Bytes per second through the device stage (``pin_memory=True, device="cuda"``) of
    ``count`` batches, each ``tensor``; with the batches counted, the pool's allocations and
    capacity, and the stage's figures from the loader's statistics. With ``workers``, worker
    processes make the batches: they arrive in the workers' blocks (``_workers/blocks.py``)."""
    size = tensor.numel() * tensor.element_size()
    prefetch = 2  # staged batches ahead of the consumer, at most
    warm = 3 * max(1, workers)  # the pool's buffers, or the workers' blocks, are made here
    ahead: dict[str, Any] = (
        {"num_workers": workers, "persistent_workers": True} if workers else {"prefetch": prefetch}
    )
    loader = aioloader.DataLoader(
        Same(tensor, warm + prefetch + count), batch_size=None, pin_memory=True, device="cuda",
        **ahead,
    )  # fmt: skip
    with loader:
        it = iter(loader)
        for _ in range(warm):
            next(it)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        # Up to `prefetch` batches were staged (or being staged) before t0: received in the
        # timed span but not counted (an underestimate by at most one partly staged batch).
        for _ in range(prefetch):
            next(it)
        n = sum(1 for _ in it)
        torch.cuda.synchronize()
        rate = n * size / (time.perf_counter() - t0)
        scope = getattr(loader, "_scope", None)
        pool = getattr(getattr(scope, "device", None), "pool", None)
        stats = loader.statistics()
    device = stats.stage("device")
    figures = (
        f"stage p50 {device.latency.p50 * 1e3:.2f} ms a batch, busy "
        f"{device.utilisation(stats.elapsed_s) or 0:.0%}; consumer waited "
        f"{stats.consumer.wait_fraction:.0%}"
    )
    return rate, n, getattr(pool, "allocations", "?"), getattr(pool, "capacity", "?"), figures


def host_rate(dst: torch.Tensor, src: torch.Tensor, threads: int) -> float:
    """Bytes per second of ``dst.copy_(src)`` on the host with ``threads`` intra-op threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dst.copy_(src)
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src)
        return 5 * src.numel() * src.element_size() / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)


def hostcopy_rate(dst: torch.Tensor, src: torch.Tensor, threads: int) -> float:
    """Bytes per second of the device stage's own host copy (``HostCopy``) on ``threads``."""
    host = HostCopy(threads)
    try:
        host.copy(dst, src)
        t0 = time.perf_counter()
        for _ in range(5):
            host.copy(dst, src)
        return 5 * src.numel() * src.element_size() / (time.perf_counter() - t0)
    finally:
        host.close()


def registered_rate(dev: torch.device, nbytes: int) -> tuple[float, float, float]:
    """H2D bytes per second from shared memory (a worker's result is a ``/dev/shm``
    segment) registered with CUDA in place (``cudaHostRegister``), no host copy: with the
    register and unregister calls' seconds. The ceiling of a pool of registered segments that
    workers write into, reused across batches (not built)."""
    shared = torch.empty(nbytes, dtype=torch.uint8).share_memory_()
    shared.fill_(7)
    cudart = torch.cuda.cudart()
    t0 = time.perf_counter()
    error = cudart.cudaHostRegister(shared.data_ptr(), nbytes, 0)
    registered = time.perf_counter() - t0
    if int(error) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {error}")
    try:
        rate = timed_copies(torch.empty(nbytes, dtype=torch.uint8, device=dev), shared, 20)
    finally:
        t0 = time.perf_counter()
        cudart.cudaHostUnregister(shared.data_ptr())
        unregistered = time.perf_counter() - t0
    return rate, registered, unregistered


def check_copy_threads(images: torch.Tensor, count: int, budget: Budget, peak: float) -> None:
    """What bounds the device stage: its host copy into the pool, at each thread count
    (``HostCopy``), and the stage's rate on an image batch with ``_COPY_THREADS`` at each."""
    pinned = torch.empty(images.numel(), dtype=torch.uint8, pin_memory=True)
    flat = images.view(-1)
    rates = {n: hostcopy_rate(pinned, flat, n) for n in (1, 2, 4, 8, 16)}
    del pinned
    print(
        "    HostCopy into pinned memory (36.8 MiB): "
        + ", ".join(f"{n} threads {r / 1e9:.1f} GB/s" for n, r in rates.items())
    )
    default = stage_module._COPY_THREADS
    for threads in (1, default, 8, 16) if default not in (1, 8, 16) else (1, 4, 8, 16):
        if budget.left() < 5:
            print(f"      stage, {threads:>2} copy threads: skipped (time budget)")
            continue
        with mock.patch.object(stage_module, "_COPY_THREADS", threads):
            rate, n, _, _, figures = stage_rate(images, count)
        mark = " (the default here)" if threads == default else ""
        print(
            f"      stage, {threads:>2} copy threads: {rate / 1e9:6.1f} GB/s = {rate / peak:4.0%} "
            f"of peak over {n} image batches{mark}; {figures}"
        )


def check_bandwidth(dev: torch.device, count: int, budget: Budget) -> None:
    """The H2D peak and host copy rates, then the device stage with its large tensors copied
    chunk by chunk (the default) and whole (``_CHUNK_BYTES = 0``), at 64 MiB and at an image
    batch's size; each stage run is skipped once fewer than 5 s of the budget are left."""
    size = 64 * MB
    g = torch.Generator().manual_seed(0)
    pageable = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
    images = torch.randint(0, 256, (256, 3, 224, 224), dtype=torch.uint8, generator=g)
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    on_gpu = torch.empty(size, dtype=torch.uint8, device=dev)
    peak = timed_copies(on_gpu, pinned, repeats=20)
    from_pageable = timed_copies(on_gpu, pageable, repeats=5)
    threads = torch.get_num_threads()
    host = host_rate(pinned, pageable, threads)
    host_one = host_rate(pinned, pageable, 1)
    del on_gpu, pinned
    gb = 1e9
    chunk = stage_module._CHUNK_BYTES
    print(f"    torch pinned copy_ peak (H2D)      {peak / gb:6.1f} GB/s")
    print(f"    torch pageable copy_ (H2D)         {from_pageable / gb:6.1f} GB/s")
    print(
        f"    host copy into pinned memory       {host / gb:6.1f} GB/s with torch's {threads} "
        f"threads, {host_one / gb:.1f} GB/s with 1 (one call of {size // MB} MiB)"
    )
    print(
        f"    device stage (pool + H2D), large tensors in chunks (over "
        f"{stage_module._CHUNKED_OVER} chunks; default {chunk / MB:g} MiB) or whole:"
    )
    batches = {"64 MiB, flat uint8": pageable, "256x3x224x224 uint8": images}
    sizes = [*sorted({chunk, 4 * MB, 16 * MB} - {0}), 0]
    for label, chunk_bytes in [(label, c) for label in batches for c in sizes]:
        tensor = batches[label]
        mode = f"chunks of {chunk_bytes // MB} MiB" if chunk_bytes else "whole"
        if budget.left() < 5:
            print(f"      {label:<20} {mode:<16} skipped (time budget)")
            continue
        with mock.patch.object(stage_module, "_CHUNK_BYTES", chunk_bytes):
            rate, n, allocations, capacity, _ = stage_rate(tensor, count)
        nbytes = tensor.numel() * tensor.element_size()
        print(
            f"      {label:<20} {mode:<16} {rate / gb:6.1f} GB/s = {rate / peak:4.0%} of peak; "
            f"{n} batches of {nbytes / MB:.1f} MiB; pinned buffers allocated: {allocations} "
            f"(pool capacity {capacity})"
        )
    workers = min(8, max(2, (os.cpu_count() or 2) // 2))
    if budget.left() > 10:
        rate, n, allocations, _, figures = stage_rate(images, count, workers=workers)
        print(
            f"    device stage out of worker blocks ({workers} workers, image batches): "
            f"{rate / gb:.1f} GB/s = {rate / peak:.0%} of peak over {n} batches; pinned "
            f"buffers allocated: {allocations} (0: no host copy); {figures}"
        )
    else:
        print("    device stage out of worker blocks: skipped (time budget)")
    label = "    H2D from shared memory registered in place (36.8 MiB, no host copy):"
    try:
        rate, registered, unregistered = registered_rate(dev, images.numel())
    except (RuntimeError, AttributeError) as exc:  # a torch without cudart's bindings
        print(f"{label} not measured ({type(exc).__name__}: {exc})")
    else:
        print(
            f"{label} {rate / gb:.1f} GB/s = {rate / peak:.0%} of peak; cudaHostRegister "
            f"{registered * 1e3:.2f} ms, cudaHostUnregister {unregistered * 1e3:.2f} ms"
        )
    check_copy_threads(images, count, budget, peak)


# -- main -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches and steps")
    parser.add_argument(
        "--budget",
        type=float,
        default=140.0,
        help="total seconds (default 140); sections shorten themselves when it runs low, and "
        "a hang 25 s past it aborts with stack dumps",
    )
    parser.add_argument(
        "--sections", type=int, nargs="+", choices=(1, 2, 3), default=[1, 2, 3],
        help="which sections to run (default all)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device (torch.cuda.is_available() is False); this script "
            "checks the device stage on a GPU and has nothing to do here",
            file=sys.stderr,
        )
        return 2
    budget = Budget(args.budget)
    faulthandler.dump_traceback_later(args.budget + 25, exit=True)
    dev = torch.device("cuda", torch.cuda.current_device())
    print(
        f"gpu_check: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, "
        f"aioloader {aioloader.__version__}{' (quick)' if args.quick else ''}"
    )

    verdicts: list[bool | None] = []
    if 1 in args.sections:
        print("[1] correctness: GPU batches vs the CPU path, bit for bit")
        verdicts += [
            check_correctness(dev, 100 if args.quick else 500, True, budget, reserve=75),
            check_correctness(dev, 50 if args.quick else 100, False, budget, reserve=75),
        ]
        cycles_per_ms = sleep_cycles_per_ms()
        for pin in (True, False):
            n = 96 if args.quick else 192
            verdicts.append(check_hand_over(dev, n, pin, budget, 60, cycles_per_ms))

    print("[2] overlap: steps/s of a ~5 ms training step")
    if 2 in args.sections and budget.left() > 45:
        check_overlap(dev, 100 if args.quick else 300, budget)
    else:
        print("    skipped (time budget)" if 2 in args.sections else "    not asked for")

    print("[3] H2D bandwidth")
    if 3 not in args.sections:
        print("    not asked for")
    elif budget.left() > 15:
        check_bandwidth(dev, 16 if args.quick else 48, budget)
    else:
        print("    skipped (time budget)")

    faulthandler.cancel_dump_traceback_later()
    elapsed = time.perf_counter() - budget.start
    if False in verdicts:
        outcome = "FAILED"
    elif None in verdicts:
        outcome = "the correctness checks that ran passed; some were skipped (time budget)"
    else:
        outcome = "all correctness checks passed"
    print(f"gpu_check: {outcome} in {elapsed:.0f}s")
    return 1 if False in verdicts else 0


if __name__ == "__main__":
    sys.exit(main())
