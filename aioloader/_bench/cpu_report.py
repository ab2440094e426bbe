"""The CPU workloads' tables: each configuration's figures with its ratios to the baselines,
the drop-in workloads' goals marked met or missed, and the bytes per job the worker pipes
carried."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import aioloader
from aioloader._bench.cpu_runs import (
    BASELINES,
    DROPIN_GOALS,
    CpuResult,
)
from aioloader._bench.harness_table import Column, format_table, ratio_to

# -- output ------------------------------------------------------------------------------------


def format_results(results: Iterable[CpuResult], baselines: Sequence[str] = BASELINES) -> str:
    results = list(results)
    columns: list[Column[CpuResult]] = [
        Column("cold/s", 9, lambda r: f"{r.cold_per_s:,.0f}"),
        Column("steady/s", 10, lambda r: f"{r.steady_per_s:,.0f}"),
        Column("1st batch s", 13, lambda r: f"{r.first_batch_s:.2f}"),
        Column("peak MiB", 10, lambda r: f"{r.peak_rss_mib:,.0f}"),
        Column("+MiB", 7, lambda r: f"{r.peak_rss_mib - r.start_rss_mib:,.0f}"),
        Column("peak PSS", 10, lambda r: f"{r.peak_pss_mib:,.0f}"),
        Column("+PSS", 7, lambda r: f"{r.peak_pss_mib - r.start_pss_mib:,.0f}"),
        Column("main CPU s", 12, lambda r: f"{r.main_cpu_s:.1f}"),
        Column("workers CPU s", 15, lambda r: f"{r.worker_cpu_s:.1f}"),
        Column("other CPU", 11, lambda r: f"{r.other_load:.0%}"),
        Column("speed", 7, lambda r: f"{r.speed:.2f}"),
    ]
    for peer in baselines:
        cold_steady = ratio_to(results, peer, lambda r: r.cold_per_s, lambda r: r.steady_per_s)
        columns.append(Column(f"vs {peer}", max(14, len(peer) + 5), cold_steady))
    note = (
        "(ratios: cold/steady samples/s of the row over the column's; MiB: summed RSS, PSS: "
        "summed proportional set size,\n both in MiB over this process and its workers, "
        "+: peak minus the sum before the row;\n CPU s: both epochs, start-up and shutdown "
        "included; other CPU: share of the machine's CPU used by other\n processes "
        "meanwhile; speed: single-core speed around the run over that at start-up (1.00 = the "
        "same))"
    )
    return format_table(results, 17, columns, lambda r: r.status, note=note)


def _verdict(value: float, goal: float | None, higher_is_better: bool) -> str:
    if goal is None:
        return "(no goal)"
    if math.isnan(value):
        return "n/a"
    met = value >= goal if higher_is_better else value <= goal
    return "met" if met else "MISSED"


def format_goals(results: Iterable[CpuResult]) -> str:
    """The drop-in goals, each ratio beside its goal: samples/s as steady and cold (cold
    includes constructing the loader and starting its workers), peak PSS as is."""
    by_name = {r.name: r for r in results}
    lines = []
    for row, over, what, goal, higher in DROPIN_GOALS:
        a, b = by_name.get(row), by_name.get(over)
        label = f"  {what:<10} {row} / {over}"
        sign = ">=" if higher else "<="
        goal_text = f"goal {sign} {goal:.1f}x" if goal is not None else "(for reference)"
        if a is None or b is None or not a.ok or not b.ok:
            lines.append(f"{label:<44} n/a (a row is missing or failed)")
            continue
        if what == "peak PSS":
            value = a.peak_pss_mib / b.peak_pss_mib if b.peak_pss_mib else math.nan
            figures = f"{value:.2f}x ({a.peak_pss_mib:,.0f} / {b.peak_pss_mib:,.0f} MiB)"
            verdict = _verdict(value, goal, higher)
        else:
            steady = a.steady_per_s / b.steady_per_s if b.steady_per_s else math.nan
            cold = a.cold_per_s / b.cold_per_s if b.cold_per_s else math.nan
            figures = f"steady {steady:.2f}x, cold {cold:.2f}x"
            verdict = (
                f"steady {_verdict(steady, goal, higher)}, cold {_verdict(cold, goal, higher)}"
                if goal is not None
                else ""
            )
        lines.append(f"{label:<44} {figures:<30} {goal_text:<16} {verdict}".rstrip())
    return "\n".join(lines)


def job_bytes(stats: aioloader.LoaderStatistics) -> str:
    workers = stats.workers
    if workers is None or workers.jobs == 0:
        return "no worker jobs recorded"
    return (
        f"{workers.jobs} jobs: {workers.bytes_sent / workers.jobs:,.0f} bytes sent and "
        f"{workers.bytes_received / workers.jobs:,.0f} bytes received per job (batch)"
    )
