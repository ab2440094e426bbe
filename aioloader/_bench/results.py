"""What ``aioloader bench`` reports: its rows, the tables it prints and the JSON it writes.

Pure: rows in, text and JSON-ready dicts out; nothing here runs a workload (``suite.py`` does)
or draws (``chart.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# The loader a configuration measures, by the start of its name, and how a table names it.
FAMILIES: tuple[tuple[str, str], ...] = (
    ("aio", "aioloader"),
    ("batcher", "aioloader"),  # serving: aioloader's DynamicBatcher
    ("torch", "torch DataLoader"),
    ("wds", "webdataset + torch DataLoader"),
    ("tdnodes", "torchdata.nodes"),
    ("spdl", "SPDL"),
    ("asyncio", "plain asyncio"),
    ("plain", "plain loop"),
    ("threads", "thread pool"),
    ("serial", "one model call a request"),
    ("naive", "hand-written batching"),
    ("ray", "Ray Serve @serve.batch"),
)
OURS = "aioloader"


# A row that stands for a workload, not a configuration: one not run (a module it needs is not
# installed) or one that failed as a whole.
PLACEHOLDERS = ("-", "(workload)")


def family(config: str) -> str:
    """The loader of ``config`` (its row's name): ``aio-conn64`` -> ``aioloader``,
    ``threads32`` -> ``thread pool``."""
    for prefix, name in FAMILIES:
        rest = config.removeprefix(prefix)
        if rest != config and (not rest or rest[0] in "-@0123456789"):
            return name
    # A peer's "not installed" row is named after the peer itself ("spdl", "torchdata").
    return {"torchdata": "torchdata.nodes", "spdl": "SPDL"}.get(config, config)


@dataclass
class Row:
    """One configuration of one table: ``samples_per_s`` (None when it was not measured),
    the CPU time and peak PSS of its processes (None where the workload does not measure them),
    ``status`` (``ok``, ``FAIL: ...`` or ``skipped: ...``) and the workload's own figures
    (``extra``: e.g. ``in_flight``)."""

    table: str
    config: str
    samples_per_s: float | None
    cpu_s: float | None = None
    peak_pss_mib: float | None = None
    status: str = "ok"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def loader(self) -> str:
        return family(self.config)

    @property
    def failed(self) -> bool:
        return not (self.status == "ok" or self.status.startswith("skipped"))

    @property
    def measured(self) -> bool:
        return self.status == "ok" and self.samples_per_s is not None

    @classmethod
    def from_report(cls, line: Mapping[str, Any]) -> Row:
        """A row from one line a workload wrote (``harness.report``)."""
        known = {"table", "config", "samples_per_s", "cpu_s", "peak_pss_mib", "status"}
        skipped, ok = line.get("skipped"), line.get("ok", False)
        status = f"skipped: {skipped}" if skipped else str(line.get("status", "FAIL"))
        if not ok and not status.startswith("FAIL") and not skipped:
            status = f"FAIL: {status}"
        extra = {k: v for k, v in line.items() if k not in known | {"ok", "skipped"}}
        return cls(
            str(line["table"]),
            str(line["config"]),
            line.get("samples_per_s"),
            line.get("cpu_s"),
            line.get("peak_pss_mib"),
            status,
            extra,
        )

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "loader": self.loader}


@dataclass(frozen=True)
class Summary:
    """A table's best aioloader row and its ratio to each other loader's best row (``None``:
    that loader's rows were not measured, e.g. not installed or failed)."""

    table: str
    ours: Row | None
    ratios: dict[str, float | None]


def summarize(rows: Iterable[Row]) -> list[Summary]:
    """A :class:`Summary` per table, in the order the tables came."""
    tables: dict[str, list[Row]] = {}
    for row in rows:
        tables.setdefault(row.table, []).append(row)
    summaries = []
    for table, members in tables.items():
        best: dict[str, Row] = {}
        loaders: list[str] = []
        for row in members:
            if row.config in PLACEHOLDERS:
                continue
            if row.loader not in loaders:
                loaders.append(row.loader)
            if row.measured and (
                row.loader not in best
                or (row.samples_per_s or 0) > (best[row.loader].samples_per_s or 0)
            ):
                best[row.loader] = row
        ours = best.get(OURS)
        ratios: dict[str, float | None] = {}
        for loader in loaders:
            if loader == OURS:
                continue
            peer = best.get(loader)
            if ours is None or peer is None or not peer.samples_per_s:
                ratios[loader] = None
            else:
                ratios[loader] = (ours.samples_per_s or 0.0) / peer.samples_per_s
        summaries.append(Summary(table, ours, ratios))
    return summaries


def _number(value: float | None, fmt: str) -> str:
    return "-" if value is None or math.isnan(value) else format(value, fmt)


def format_rows(rows: Sequence[Row], titles: Mapping[str, str]) -> str:
    """Every row: its table, configuration, loader, samples/s, CPU s, peak PSS and check."""
    lines = [
        f"{'table':<14} {'config':<20} {'loader':<29} {'samples/s':>10} {'CPU s':>7} "
        f"{'PSS MiB':>8}  check"
    ]
    lines.append("-" * len(lines[0]))
    previous = None
    for row in rows:
        if previous is not None and row.table != previous:
            lines.append("")
        previous = row.table
        lines.append(
            f"{row.table:<14} {row.config:<20} {row.loader:<29} "
            f"{_number(row.samples_per_s, ',.0f'):>10} {_number(row.cpu_s, '.2f'):>7} "
            f"{_number(row.peak_pss_mib, ',.0f'):>8}  {row.status}"
        )
    named = [f"  {t}: {titles[t]}" for t in dict.fromkeys(r.table for r in rows) if titles.get(t)]
    return "\n".join([*lines, "", "tables:", *named])


def format_summary(summaries: Sequence[Summary]) -> str:
    """A line per table: aioloader's best configuration, its samples/s and ``N.NNx`` against
    each other loader's best in the same table (``-``: not measured)."""
    lines = []
    for s in summaries:
        ours = "no aioloader row measured"
        if s.ours is not None:
            ours = f"aioloader {s.ours.config} {_number(s.ours.samples_per_s, ',.0f')}/s"
        ratios = ", ".join(
            f"{_number(r, '.2f')}x {loader}" if r is not None else f"- {loader}"
            for loader, r in s.ratios.items()
        )
        lines.append(f"{s.table:<14} {ours:<36} {ratios}")
    return "\n".join(lines)


def failures(rows: Iterable[Row]) -> list[str]:
    """``table/config`` of every row whose check failed (a skipped row is not a failure)."""
    return [f"{r.table}/{r.config}" for r in rows if r.failed]
