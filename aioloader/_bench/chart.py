"""``aioloader bench``'s chart: throughput per table and loader, and throughput against the
requests in flight for the object-store table. Drawn with matplotlib (the ``bench`` extra),
off-screen (the Agg backend), into a PNG.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

from .results import OURS, Row

# The tables whose rows say how many requests they keep in flight: the object store's first.
IN_FLIGHT_TABLES = ("objects-s3", "objects-http")


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
    curve: list[Row] = []
    for table in IN_FLIGHT_TABLES:
        curve = curve or [r for r in measured if r.table == table and "in_flight" in r.extra]
    figure, axes = plt.subplots(
        1,
        2 if curve else 1,
        figsize=(15 if curve else 10, max(4.0, 0.24 * len(measured) + 1.5)),
        squeeze=False,
        gridspec_kw={"width_ratios": [2, 1]} if curve else None,
    )
    bars = axes[0][0]
    labels = [f"{r.table}: {r.config}" for r in measured]
    values = [r.samples_per_s or 0.0 for r in measured]
    positions = list(range(len(measured)))[::-1]
    bars.barh(positions, values, color=[colors[r.loader] for r in measured])
    bars.set_yticks(positions, labels, fontsize=7)
    bars.set_xscale("log")
    bars.set_xlabel("samples/s (log scale; each table's rows measured in the same run)")
    bars.set_title("Throughput per table and configuration")
    patches = [Patch(color=colors[loader], label=loader) for loader in loaders]
    bars.legend(handles=patches, fontsize=7, loc="lower right")
    if curve:
        line = axes[0][1]
        for loader in dict.fromkeys(r.loader for r in curve):
            points = sorted((r.extra["in_flight"], r.samples_per_s or 0.0)
                            for r in curve if r.loader == loader)  # fmt: skip
            xs, ys = zip(*points, strict=True)
            style = "o-" if loader == OURS else "s--"
            line.plot(xs, ys, style, color=colors[loader], label=loader)
        line.set_xscale("log", base=2)
        line.set_xlabel("requests in flight at most")
        line.set_ylabel("samples/s")
        line.set_title(f"{curve[0].table}: throughput against requests in flight")
        line.legend(fontsize=7)
        line.grid(alpha=0.3)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
