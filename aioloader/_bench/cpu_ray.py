"""The drop-in JPEG workload on Ray workers: ``aio-ray-nw2`` beside ``aio-nw2`` (process
workers) and torch's ``DataLoader``, and the per-batch cost of the cluster path.

``aio-ray-nw2`` is ``aio-nw2``'s code with ``worker_mode="ray"``: two Ray actors on a local Ray
cluster of its own (``ray.init(address="local", num_cpus=2)``, started once before the
workload's rows, on this process's main thread, as a user's script would; its start is not in
the row, the actors' start is, in ``cold/s``). The fork server the other aioloader rows use was
forked before (``cpu.main``'s first loader), while this process had one thread; Ray's threads
would now stop it being forked here. The Ray row runs last.

The per-batch overhead: one worker, batches of one tiny sample (no work in them), 2 epochs of
``OVERHEAD_BATCHES``; the second epoch's milliseconds per batch, process worker and Ray actor,
printed with their difference: what a job costs on each path beyond its work.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from typing import Any

import aioloader
from aioloader._bench.harness import Result, report

RAY_ROW = "aio-ray-nw2"
OVERHEAD_BATCHES = 300


def ray_missing() -> str | None:
    """Why the Ray row cannot run here (Ray not installed), or None."""
    if importlib.util.find_spec("ray") is None:
        return "skipped: ray not installed (pip install 'aioloader[ray]')"
    return None


def start_ray(cpus: int) -> float:
    """A local Ray cluster with ``cpus`` CPUs for this process (unless one is joined already);
    the seconds it took."""
    import ray

    started = time.perf_counter()
    if not ray.is_initialized():
        # "local": a cluster of its own, even where another runs on this machine.
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
        # Ray starts a worker process per CPU as it starts, each importing Ray (seconds of CPU
        # here): a task on each, answered, means they are up, and idle during the other rows.
        ray.get([ray.remote(num_cpus=1)(_noop).remote() for _ in range(cpus)])
    return time.perf_counter() - started


def _noop() -> None:
    return None


def ray_row(configs: dict[str, Any], workload: str) -> dict[str, Any]:
    """``configs`` with the Ray row only where it belongs (``dropin-jpeg``) and can run: without
    Ray it is reported as skipped; with Ray, the local cluster is started for it now."""
    if RAY_ROW not in configs:
        return configs
    rest = {name: runner for name, runner in configs.items() if name != RAY_ROW}
    if workload != "dropin-jpeg":
        return rest
    if (why := ray_missing()) is not None:
        print(f"  {RAY_ROW}: {why}", flush=True)
        report(workload, Result(RAY_ROW, skipped=why))
        return rest
    took = start_ray(2)
    print(f"  (a local Ray cluster of 2 CPUs for {RAY_ROW}: started in {took:.1f} s)", flush=True)
    return {**rest, RAY_ROW: configs[RAY_ROW]}  # last: see the module


@dataclass
class Overhead:
    process_ms: float
    ray_ms: float
    error: str | None = None


def _ms_per_batch(**mode: Any) -> float:
    loader: aioloader.DataLoader[Any] = aioloader.DataLoader(
        list(range(OVERHEAD_BATCHES)), batch_size=1, num_workers=1, persistent_workers=True, **mode
    )
    try:
        list(loader)  # the first epoch starts the worker
        started = time.perf_counter()
        got = sum(1 for _ in loader)
        took = time.perf_counter() - started
    finally:
        loader.close()
    if got != OVERHEAD_BATCHES:
        raise RuntimeError(f"{got} batches, expected {OVERHEAD_BATCHES}")
    return took / got * 1e3


def measure_overhead() -> Overhead:
    """Milliseconds per batch of no work, through one process worker and one Ray actor."""
    try:
        return Overhead(_ms_per_batch(), _ms_per_batch(worker_mode="ray"))
    except Exception as exc:
        return Overhead(0.0, 0.0, f"{type(exc).__name__}: {exc}")


def describe(overhead: Overhead) -> str:
    if overhead.error is not None:
        return f"per-batch overhead: FAIL: {overhead.error}"
    extra = overhead.ray_ms - overhead.process_ms
    return (
        f"per-batch overhead (1 worker, batches of one tiny sample, {OVERHEAD_BATCHES} a "
        f"epoch): process worker {overhead.process_ms:.2f} ms, Ray actor {overhead.ray_ms:.2f} "
        f"ms a batch ({extra:+.2f} ms for the actor call: Ray's submission, reply and await)"
    )
