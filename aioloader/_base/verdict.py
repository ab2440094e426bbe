"""Which stage limited a loader's throughput, said in words a person can act on.

Owns: :func:`verdict`, a pure reading of a :class:`~aioloader.LoaderStatistics` snapshot: did
the consumer wait for data; if it did, were the fetches at their ``max_inflight`` cap, the
workers busy, the device copies the slow part, or none of them (the loader's own per-batch
work, or a source that gives little at a time). Never: measures anything itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .stats import LoaderStatistics

__all__ = ["SATURATED", "WAITED", "verdict"]

WAITED = 0.10  # the consumer waited at least this share of its time: data-bound
SATURATED = 0.75  # a stage's slots were busy at least this share of the time
SLOW_START = 0.25  # starting the workers took at least this share of the run (and 0.5 s)


def verdict(
    stats: LoaderStatistics,
    *,
    pinned: bool = False,
    to_device: bool = True,
    reads_in_workers: bool = False,
) -> str:
    """One sentence: what limited the run, and what to change (never an option that cannot
    apply to the run).

    Args:
        stats: The snapshot to read.
        pinned: Whether the stage already copies through pinned memory (then pinning is not
            the advice for a run its copies limited).
        to_device: Whether the ``"device"`` stage copies to a device (False: it only pins
            batches on the host, ``pin_memory=True`` without ``device``).
        reads_in_workers: Whether a blocking dataset is read in the worker processes (then
            there are no fetches in this process, and ``max_inflight`` does not apply).
    """
    c = stats.consumer
    if c.batches == 0:
        return "no batch handed out yet"
    waited = c.wait_fraction
    if waited < WAITED:
        return (
            f"the consumer was the bottleneck (it waited for data {waited:.0%} of the time): "
            "the loader is not slowing training"
        )
    head = f"the consumer waited for data {waited:.0%} of the time"
    if (start := _slow_start(stats)) is not None:
        return f"{head}; {start}"
    if stats.made_on_demand * 2 >= c.batches:
        return (
            f"{head}; its batches were made in its own calls for them (num_workers=0, as "
            "torch's loop makes them), none ahead of it: prefetch=N has them made ahead while "
            "it works, num_workers=N in worker processes"
        )
    elapsed = stats.elapsed_s
    busy = {
        s.name: u for s in stats.stages if s.completed and (u := s.utilisation(elapsed)) is not None
    }
    fetch, work = busy.get("fetch", 0.0), busy.get("transform", 0.0)
    device = busy.get("device", 0.0)
    if work >= SATURATED and work >= fetch:
        workers = stats.stage("transform").limit
        if stats.workers is not None and stats.workers.server == "ray":
            return (
                f"{head}; the cluster's Ray workers were busy {min(work, 1):.0%} of the time "
                f"({stats.workers.processes} actors on {stats.workers.server_why}): they are the "
                "limit, not the "
                "loader: more actors (num_workers) where the cluster has CPUs for them, more "
                "nodes, or a lighter transform"
            )
        return (
            f"{head}; the workers were busy {min(work, 1):.0%} of the time ({workers} of "
            "them): add workers (num_workers) or lighten the transform"
        )
    if fetch >= SATURATED:
        stage = stats.stage("fetch")
        if stage.limit == 1:  # a stream: its next sample is asked for one at a time
            return (
                f"{head}; the stream gave its samples one at a time ({stage.latency.p50 * 1e3:.1f}"
                " ms each at the median): read it in parts at once (aioloader.interleave, "
                "tar_shards' shards_in_flight) or make each sample cheaper to produce"
            )
        return (
            f"{head}; fetches ran at their cap of {stage.limit} samples at once "
            f"({min(fetch, 1):.0%} busy) with {stage.latency.p50 * 1e3:.1f} ms median latency: "
            "raise max_inflight (or the dataset's own bound: a source's connections)"
        )
    if device >= SATURATED and not to_device:
        return (
            f"{head}; pinning batches (pin_memory=True) took {min(device, 1):.0%} of the time: "
            "pin less (uint8 rather than float), or pass device= to copy them on the loader's "
            "stream"
        )
    if device >= SATURATED:
        fix = "move less" if pinned else "pin_memory=True, or move less"
        return (
            f"{head}; copying batches to the device took {min(device, 1):.0%} of the time: "
            f"{fix} (uint8 rather than float: a device_transform can widen types on the GPU)"
        )
    parts = []
    if "fetch" in busy:
        parts.append(f"fetches {fetch:.0%} of max_inflight")
    if "transform" in busy:
        parts.append(f"workers {work:.0%} busy")
    said = f" ({', '.join(parts)})" if parts else ""
    if reads_in_workers:
        return (
            f"{head}; no stage was saturated{said}: the workers read, transform and collate "
            "each batch, and too few batches were in flight: more num_workers (or "
            "prefetch_factor), or a larger batch_size if batches are cheap"
        )
    return (
        f"{head}; no stage was saturated{said}: the source gave samples slowly (its latency "
        "with too few reads in flight), or samples are so cheap that per-batch overhead "
        "shows: a larger batch_size, or more max_inflight"
    )


def _slow_start(stats: LoaderStatistics) -> str | None:
    """What to say when getting the worker processes started took a large share of the run:
    their start (``startup_s``) and, in the first loader of a process, readying the fork
    server (``server_s``, paid as the loader was built: outside ``elapsed_s``)."""
    w = stats.workers
    if w is None:
        return None
    took = w.startup_s + w.server_s
    if took < max(0.5, SLOW_START * (stats.elapsed_s + w.server_s)):
        return None
    who = "Ray actors" if w.server == "ray" else "worker processes"
    said = f"starting the {w.processes} {who} took {took:.1f} s"
    # Several epochs in the statistics' scope: its workers were kept across them already.
    kept = stats.epochs > 1
    keep = (
        f"it was paid once for the {stats.epochs} epochs so far (a longer run spreads it)"
        if kept
        else "keep them across epochs (persistent_workers=True)"
    )
    if w.main_left_unsafe:  # the standby ran the main module again: a thread or CUDA began
        how = (
            "their fork server was a fresh interpreter importing torch and the main module"
            if w.server == "interpreter"
            else "each ran the main module's top level after its fork"
        )
        return (
            f"{said}: {how} ({w.server_why}): that top level, which the server forked in "
            "reserve runs again (as torch's spawn and forkserver workers do), starts a thread "
            'or initialises CUDA; do that under `if __name__ == "__main__":`'
            + ("" if kept else ", or keep the workers across epochs (persistent_workers=True)")
        )
    if w.server == "interpreter":
        return (
            f"{said}: their fork server was a fresh interpreter importing torch and the main "
            f"module ({w.server_why}): import aioloader before CUDA is initialised and before "
            "other threads start, so that a fork server is forked in reserve"
            + ("" if kept else ", or keep the workers across epochs (persistent_workers=True)")
        )
    if w.server == "fresh standby" and w.server_s >= w.startup_s:
        return (
            f"{said}, {w.server_s:.1f} s of it waiting for the fork server started in reserve "
            f"as aioloader was imported, a fresh interpreter ({w.server_why}), to be ready (its "
            "imports, and the main module's): import aioloader earlier (in a notebook, in a "
            "cell before the loader's), or build the loader later"
        )
    if w.server == "standby" and w.server_s >= w.startup_s:
        return (
            f"{said}, {w.server_s:.1f} s of it readying the fork server forked in reserve as "
            "aioloader was imported: it imported again what the main module imports after "
            "aioloader. Import aioloader after the heavy imports (torchvision, transformers, "
            "your own packages), as the last of the imports at the top of the script"
        )
    pickled = f" (they pickle to {w.start_bytes / 2**20:.0f} MiB)" if w.start_bytes >= 2**20 else ""
    return f"{said}: {keep}, or lighten worker_init_fn and the dataset each " + (
        "actor receives (each is a Python process Ray starts, which imports torch)"
        if w.server == "ray"
        else f"worker receives{pickled}"
    )
