"""The ``gpu`` workload's row (:class:`GpuResult`) and how it is printed: a line a configuration
as it finishes, then the issue's table (loaders across, figures down) in Markdown, ready for the
README, with which fork server each aioloader column's workers came from and why."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aioloader._bench.harness import Result

ROLES = (("main", "main"), ("fork server", "fs"), ("workers", "workers"), ("other", "other"))


@dataclass
class GpuResult(Result):
    """A child's row: ``payload`` is its JSON line (None when none came); ``persistent``: its
    rate is the steady one (the median of epochs 2 on), else over every epoch."""

    persistent: bool = True
    payload: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def epoch_s(self) -> list[float]:
        return list((self.payload or {}).get("epoch_s") or [])

    @property
    def images(self) -> int:
        return int((self.payload or {}).get("images") or 0)

    @property
    def rate(self) -> float:
        epochs, images = self.epoch_s, self.images
        if not epochs or not images:
            return 0.0
        if not self.persistent:
            return images * len(epochs) / sum(epochs)
        steady = sorted(epochs[1:]) or epochs
        middle = len(steady) // 2
        median = steady[middle] if len(steady) % 2 else (steady[middle - 1] + steady[middle]) / 2
        return images / median


def _pss(payload: Mapping[str, Any]) -> str:
    """``main 2,104 / fs 310 / workers 12x 1,950 MiB``: PSS by role, mid-epoch."""
    by_role = payload.get("pss_by_process") or {}
    parts = []
    for key, label in ROLES:
        if (entry := by_role.get(key)) is not None:
            count = f"{entry['processes']}x " if entry["processes"] > 1 else ""
            parts.append(f"{label} {count}{entry['pss_mib']:,.0f}")
    return " / ".join(parts) + " MiB" if parts else "-"


def _step(payload: Mapping[str, Any]) -> str:
    """``8.1 / 8.0 -> 9.4 / 8.2 ms``: the training step's host wall / main-thread CPU time
    alone, then beside the loader (medians)."""
    step = payload.get("step_ms") or {}
    alone, loop = step.get("alone") or {}, step.get("loop") or {}
    if not loop:
        return "-"

    def pair(d: Mapping[str, float]) -> str:
        return f"{d['host_ms']:.1f} / {d['cpu_ms']:.1f}" if d else "?"

    return f"{pair(alone)} -> {pair(loop)} ms"


def _threads(payload: Mapping[str, Any]) -> str:
    """``main 9.1 / aioloader-loop 2.0 / ...``: CPU ms per batch by thread, busiest first."""
    threads = payload.get("threads_cpu_ms") or {}
    top = sorted(threads.items(), key=lambda kv: -kv[1])[:4]
    return " / ".join(f"{name} {ms:.1f}" for name, ms in top) or "-"


def _startup(payload: Mapping[str, Any]) -> str:
    startup = payload.get("startup_s") or []
    if not startup:
        return "-"
    ready = f", ready in {payload['server_s']:.2f}" if payload.get("server_s") else ""
    return "/".join(f"{s:.2f}" for s in startup) + f" ({payload.get('server') or '?'}{ready})"


def format_run(table: str, result: GpuResult) -> str:
    """One configuration's line, as it finishes."""
    payload = result.payload or {}
    name = f"{table}/{result.name}"
    if not result.measured:
        return f"  {name:<22} {result.status}"
    first = payload.get("first_epoch_s") or 0.0
    kind = "steady" if result.persistent else "2 epochs"
    return (
        f"  {name:<22} {kind} {result.rate:>7,.0f}/s  first epoch {first:5.2f} s  "
        f"first batch {payload.get('first_batch_s', 0.0):5.2f} s  peak PSS "
        f"{result.peak_pss_mib:,.0f} MiB  workers up {_startup(payload)}  "
        f"PSS {_pss(payload)}  CPU ms/batch: main {_main_cpu(payload)}, children "
        f"{payload.get('children_cpu_ms', '-')}  {result.status}"
    )


def _main_cpu(payload: Mapping[str, Any]) -> str:
    """The main process's CPU ms per steady batch, its threads summed (``-`` unmeasured)."""
    threads = payload.get("threads_cpu_ms")
    return f"{sum(threads.values()):.1f}" if threads else "-"


def format_issue_table(
    results: Mapping[tuple[str, str], GpuResult], configs: Sequence[str], images: int
) -> str:
    """The issue's table: a column a configuration, a row a figure; "-" where not measured.
    Below it, each aioloader column's ``server_why`` where it says one."""

    def cell(table: str, config: str, value: Any) -> str:
        result = results.get((table, config))
        if result is None:
            return "-"
        if not result.measured:
            return "FAIL" if not result.ok else "skipped"
        return str(value(result, result.payload or {}))

    rows: list[tuple[str, str, Any]] = [
        (f"first epoch s, worker start included ({images:,} images)", "gpu-data",
         lambda r, p: f"{p.get('first_epoch_s', 0.0):.2f}"),
        ("steady, data only (samples/s)", "gpu-data", lambda r, p: f"{r.rate:,.0f}"),
        ("steady, with the training step (samples/s)", "gpu-train", lambda r, p: f"{r.rate:,.0f}"),
        ("`persistent_workers=False`, 2 epochs (samples/s)", "gpu-fresh",
         lambda r, p: f"{r.rate:,.0f}"),
        ("training step's host / CPU time, alone -> beside the loader", "gpu-train",
         lambda r, p: _step(p)),
        ("main process's CPU ms per batch by thread (train)", "gpu-train",
         lambda r, p: _threads(p)),
        ("peak PSS, process tree (MiB, data)", "gpu-data", lambda r, p: f"{r.peak_pss_mib:,.0f}"),
        ("peak PSS, process tree (MiB, train)", "gpu-train",
         lambda r, p: f"{r.peak_pss_mib:,.0f}"),
        ("PSS by process mid-epoch (data)", "gpu-data", lambda r, p: _pss(p)),
        ("`startup_s` (server), data", "gpu-data", lambda r, p: _startup(p)),
        ("`startup_s` (server), train", "gpu-train", lambda r, p: _startup(p)),
        ("`startup_s` per epoch (server), fresh", "gpu-fresh", lambda r, p: _startup(p)),
    ]  # fmt: skip
    lines = [
        "| | " + " | ".join(f"`{c}`" for c in configs) + " |",
        "| --- |" + " ---: |" * len(configs),
    ]
    for label, table, value in rows:
        lines.append(f"| {label} | " + " | ".join(cell(table, c, value) for c in configs) + " |")
    whys: dict[str, list[str]] = {}
    for (table, config), r in results.items():
        if why := (r.payload or {}).get("server_why"):
            whys.setdefault(why, []).append(f"{table}/{config}")
    lines += [f"server_why: {why} ({', '.join(cells)})" for why, cells in whys.items()]
    used = {(r.payload or {}).get(k) for r in results.values() for k in ("dataset", "model")}
    lines.append("with: " + "; ".join(sorted(str(u) for u in used if u)))
    return "\n".join(lines)
