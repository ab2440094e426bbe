"""Overhead benchmark: the loader's own cost per sample, where reading a sample costs next to
nothing, against torch's ``DataLoader`` and a hand-written loop, each configuration in a fresh
process of its own.

The workload lives in ``aioloader/_bench/overhead.py`` (its docstring says what is measured
and how); ``aioloader bench`` runs it beside the others. This script runs it alone, with all of
its flags::

    .venv/bin/python benchmarks/bench_overhead.py --help
"""

import sys

from aioloader._bench.overhead import main

if __name__ == "__main__":
    sys.exit(main())
