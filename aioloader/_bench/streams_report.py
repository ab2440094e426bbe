"""The shards workload's table: each configuration's figures with its ratios to the same
decode's ``asyncio-ref`` and ``wds-nw8`` rows."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from aioloader._bench.harness_table import Column, format_table, ratio_to
from aioloader._bench.streams_runs import (
    Outcome,
    StreamResult,
)

# -- output -------------------------------------------------------------------------------------


def format_results(results: Sequence[StreamResult]) -> str:
    """The table of one decode; a skipped row shows "-" in every column, a row whose child sent
    no outcome "-" in the epoch columns."""

    def epoch(cell: Callable[[StreamResult, Outcome], str]) -> Callable[[StreamResult], str]:
        return lambda r: "-" if r.outcome is None else cell(r, r.outcome)

    def first_batch(r: StreamResult, o: Outcome) -> str:
        return "-" if o.first_s is None else f"{o.first_s:.2f}"

    columns: list[Column[StreamResult]] = [
        Column("samples/s", 11, epoch(lambda r, o: f"{r.samples_per_s:,.0f}")),
        Column("first batch s", 15, epoch(first_batch)),
        Column("steady samples/s", 18, epoch(lambda r, o: f"{r.steady_per_s:,.0f}")),
        Column("wall s", 9, epoch(lambda r, o: f"{o.wall_s:.2f}")),
        Column("base PSS MiB", 14, lambda r: f"{r.start_pss_mib:,.0f}"),
        Column("peak RSS MiB", 14, lambda r: f"{r.peak_rss_mib:,.0f}"),
        Column("peak PSS MiB", 14, lambda r: f"{r.peak_pss_mib:,.0f}"),
        Column("vs asyncio-ref", 16, ratio_to(results, "asyncio-ref", lambda r: r.samples_per_s)),
        Column("vs wds-nw8", 12, ratio_to(results, "wds-nw8", lambda r: r.samples_per_s)),
        Column("steady vs wds-nw8", 19, ratio_to(results, "wds-nw8", lambda r: r.steady_per_s)),
        Column("PSS vs wds-nw8", 16, ratio_to(results, "wds-nw8", lambda r: r.peak_pss_mib)),
    ]
    return format_table(
        results, 16, columns, lambda r: r.status, blank=lambda r: r.skipped is not None
    )
