"""What every benchmark script says and takes around its tables: the header line
(:func:`versions`, :func:`machine`, :func:`cpus_and_load`), the common flags (:func:`add_quick`,
:func:`add_only`, :func:`add_timeout`, :func:`add_batch_size`, :func:`quick_defaults`) and the
exit status (:func:`exit_status`).

Never: prints, :func:`exit_status`'s ``FAILED:`` line aside; imports torch, or aioloader but in a
call of :func:`versions`, or another module of the package (``benchmarks/bench_startup.py``
loads this file by its path).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import sys
from collections.abc import Sequence
from pathlib import Path

# -- the header line ------------------------------------------------------------------------------


def versions(*packages: str | tuple[str, str], where: bool = False) -> str:
    """``aioloader 0.1.0, torch 2.5.1, ..., python 3.11.9``: the aioloader this process imports
    (``where``: and its folder), then each installed distribution of ``packages`` (a name, or
    ``(label, distribution)``; one not installed is left out), then Python's version."""
    import aioloader  # here, not at import: the harness imports nothing heavy

    first = f"aioloader {aioloader.__version__}"
    if where:
        first += f" ({Path(aioloader.__file__).parent})"
    found = [first]
    for package in packages:
        label, distribution = package if isinstance(package, tuple) else (package, package)
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found.append(f"{label} {importlib.metadata.version(distribution)}")
    return f"{', '.join(found)}, python {sys.version.split()[0]}"


def load_average(fields: int = 2) -> str:
    """The first ``fields`` load averages (1, 5, 15 minutes), as ``/proc/loadavg`` writes them."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:fields])


def machine() -> str:
    """``2 cores (2 usable), <CPU model>, load average 0.50 0.93 0.99``."""
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    usable = len(os.sched_getaffinity(0))
    return f"{os.cpu_count()} cores ({usable} usable), {model}, load average {load_average(3)}"


def cpus_and_load() -> str:
    return f"{os.cpu_count()} CPUs (load average {load_average()})"


# -- the common flags, the exit status ------------------------------------------------------------


def add_quick(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--quick", action="store_true", help=help)


def add_only(
    parser: argparse.ArgumentParser,
    choices: Sequence[str] | None = None,
    *,
    metavar: str | None = "NAME",
    help: str = "configurations to run",
) -> None:
    parser.add_argument("--only", nargs="+", choices=choices, metavar=metavar, help=help)


def add_timeout(parser: argparse.ArgumentParser, help: str, default: float | None = None) -> None:
    parser.add_argument("--timeout", type=float, default=default, help=help)


def add_batch_size(parser: argparse.ArgumentParser, default: int = 32) -> None:
    parser.add_argument("--batch-size", type=int, default=default, help="samples per batch")


def quick_defaults(args: argparse.Namespace, **defaults: tuple[object, object]) -> None:
    """For each ``name=(quick, full)`` whose flag was not given (None): ``quick`` under
    ``--quick``, else ``full``."""
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)


def exit_status(failed: Sequence[str]) -> int:
    """1 after a ``FAILED:`` line on stderr naming what failed; 0 when nothing did."""
    if failed:
        print(f"\nFAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
