"""``aioloader bench``'s chart: throughput per table and loader, and throughput against the
requests in flight for the object tables (HTTP and S3). Drawn with matplotlib (the ``bench`` extra),
off-screen (the Agg backend), into a PNG.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

from .results import OURS, Row

# The tables whose rows say how many requests they keep in flight, each its own plot.
IN_FLIGHT_TABLES = ("objects-http", "objects-s3")


def available() -> bool:
    """Whether matplotlib is installed."""
    return importlib.util.find_spec("matplotlib") is not None


def draw(rows: Sequence[Row], path: Path, title: str) -> None:
    """Write the chart of the measured ``rows`` to ``path`` (a PNG).

    Raises:
        ImportError: matplotlib is not installed (see :func:`available`).
        ValueError: No row was measured.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    measured = [r for r in rows if r.measured]
    if not measured:
        raise ValueError("no row was measured: nothing to draw")
    loaders = list(dict.fromkeys(r.loader for r in measured))
    colors = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(loaders)}
    curves = [
        [r for r in measured if r.table == table and "in_flight" in r.extra]
        for table in IN_FLIGHT_TABLES
    ]
    curves = [curve for curve in curves if curve]
    figure = plt.figure(figsize=(15 if curves else 10, max(5.0, 0.2 * len(measured) + 2.0)))
    grid = figure.add_gridspec(max(1, len(curves)), 2 if curves else 1, width_ratios=(
        [2, 1] if curves else [1]))  # fmt: skip
    bars = figure.add_subplot(grid[:, 0])
    labels = [f"{r.table}: {r.config}" for r in measured]
    values = [r.samples_per_s or 0.0 for r in measured]
    positions = list(range(len(measured)))[::-1]
    bars.barh(positions, values, color=[colors[r.loader] for r in measured])
    bars.set_yticks(positions, labels, fontsize=7)
    bars.set_ylim(-0.7, len(measured) - 0.3)
    bars.set_xscale("log")
    bars.set_xlabel("samples/s (log scale; each table's rows measured in the same run)")
    bars.set_title("Throughput per table and configuration")
    patches = [Patch(color=colors[loader], label=loader) for loader in loaders]
    bars.legend(handles=patches, fontsize=7, loc="lower right")
    for place, curve in enumerate(curves):
        line = figure.add_subplot(grid[place, 1])
        for loader in dict.fromkeys(r.loader for r in curve):
            points = sorted((r.extra["in_flight"], r.samples_per_s or 0.0)
                            for r in curve if r.loader == loader)  # fmt: skip
            xs, ys = zip(*points, strict=True)
            style = "o-" if loader == OURS else "s--"
            line.plot(xs, ys, style, color=colors[loader], label=loader)
        line.set_xscale("log", base=2)
        line.set_ylim(bottom=0)
        line.set_xlabel("requests in flight at most")
        line.set_ylabel("samples/s")
        line.set_title(f"{curve[0].table}: throughput against requests in flight", fontsize=9)
        line.legend(fontsize=7)
        line.grid(alpha=0.3)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout(rect=(0, 0, 1, 0.98))  # below the suptitle
    figure.savefig(path, dpi=110)
    plt.close(figure)
