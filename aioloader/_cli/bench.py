"""``aioloader bench``: every workload against the peers installed, in one run; a table, JSON
and a PNG chart.

What runs is ``aioloader/_bench`` (``suite.py`` lists the workloads); this module is the
command: its flags, its progress lines and where the results are written.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .._bench import chart, suite
from .._bench.harness_script import machine, versions
from .._bench.results import Row, failures, format_rows, format_summary, summarize
from .signals import run_until_signal

PEERS = ("torch", "torchdata", "spdl-core", "webdataset", "moto", "pillow", "matplotlib")
JSON_NAME, CHART_NAME, LOG_NAME = (
    "aioloader-bench.json",
    "aioloader-bench.png",
    "aioloader-bench.log",
)

DESCRIPTION = """\
Runs each workload against the loaders installed, in one run: torch's DataLoader, torchdata.nodes,
SPDL, webdataset, and a plain asyncio loop or a plain loop as ceilings. Every row checks that each
sample came once and right, and has its peak memory (PSS) and CPU time: each configuration of the
I/O workloads runs in a process of its own, measured from outside; the CPU workloads run theirs
one after another in their own process; the serving workload measures each server process
(requests served per second, its CPU time and peak PSS). Peers that are not installed are a row
that says so (pip install -e '.[bench]').

Writes aioloader-bench.json (every row, the machine, the versions), aioloader-bench.png (the
chart) and aioloader-bench.log (each workload's own output) into --out.
"""


def add_command(commands: Any) -> None:
    """Add ``bench`` to the command line's sub-commands."""
    parser = commands.add_parser(
        "bench",
        help="measure this loader against torch's DataLoader and the other peers installed",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small sizes and fewer configurations: under 2 minutes on 2 cores "
        "(default: the full run, under 15)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("."), help="folder for the results (default: .)"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[w.name for w in suite.WORKLOADS],
        metavar="WORKLOAD",
        help=f"run only these workloads: {', '.join(w.name for w in suite.WORKLOADS)}",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="show the traceback of a failure too"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the workloads; returns the exit status: 0, or 1 if a row's check failed.

    Raises:
        KeyboardInterrupt, Terminated: Ctrl-C or SIGTERM, after the running workload has been
            stopped (its servers and temporary files cleaned up).
        OSError: ``--out`` cannot be written.
    """
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    return run_until_signal(_bench(args.only, quick=args.quick, out=out))


async def _bench(only: list[str] | None, *, quick: bool, out: Path) -> int:
    started = datetime.datetime.now(datetime.UTC)
    began = time.perf_counter()
    header = versions(*PEERS)
    where = machine()
    print(f"{header}\n{where}", flush=True)
    log = out / LOG_NAME
    log.write_text(f"{header}\n{where}\n")
    rows: list[Row] = []

    def show(row: Row) -> None:
        rate = "-" if row.samples_per_s is None else f"{row.samples_per_s:,.0f}/s"
        print(f"  {row.table:<14} {row.config:<20} {rate:>12}  {row.status}", flush=True)

    with tempfile.TemporaryDirectory(prefix="aioloader-bench-") as workdir:
        for workload in suite.selected(only):
            print(f"{workload.name} ({'quick' if quick else 'full'}) ...", flush=True)
            ran = await suite.run_workload(
                workload, quick=quick, workdir=Path(workdir), log=log, on_row=show
            )
            rows += ran.rows
            print(f"  ({ran.wall_s:.0f} s)", flush=True)
    wall_s = time.perf_counter() - began
    summaries = summarize(rows)
    document = {
        "format": "aioloader.bench/1",
        "started": started.isoformat(timespec="seconds"),
        "wall_s": round(wall_s, 1),
        "quick": quick,
        "versions": header,
        "machine": where,
        "python": sys.version.split()[0],
        "tables": {
            t: text for t, text in suite.titles().items() if any(r.table == t for r in rows)
        },
        "rows": [r.to_json() for r in rows],
        "summary": [
            {"table": s.table, "aioloader": s.ours and s.ours.config, "ratios": s.ratios}
            for s in summaries
        ],
    }
    # Written first: whatever fails below, the figures are kept.
    (out / JSON_NAME).write_text(json.dumps(document, indent=1, allow_nan=False) + "\n")
    written = [str(out / JSON_NAME)]
    print()
    print(format_rows(rows, suite.titles()))
    print("\naioloader's best configuration per table, against each other loader's best:")
    print(format_summary(summaries))
    if not chart.available():
        print(f"\nno chart: matplotlib {suite.NOT_INSTALLED}")
    elif any(r.measured for r in rows):
        title = f"aioloader bench{' --quick' if quick else ''}: {where}"
        try:
            chart.draw(rows, out / CHART_NAME, title)
        except Exception as exc:  # the figures are written: say why there is no chart
            print(f"\nno chart: {type(exc).__name__}: {exc}")
        else:
            written.append(str(out / CHART_NAME))
    failed = failures(rows)
    print(f"\nwrote {', '.join(written)} and {log} in {wall_s:.0f} s")
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
