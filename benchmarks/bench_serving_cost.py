"""Serving benchmark by cost: requests of long-tailed lengths through aioloader's DynamicBatcher,
a model whose time is its padded cost; batching by count, by cost, and by cost within buckets.

The workload lives in ``aioloader/_bench/serving_cost.py`` (its docstring says what is measured
and how); ``aioloader bench`` runs it beside the others. This script runs it alone, with all of
its flags::

    .venv/bin/python benchmarks/bench_serving_cost.py --help
"""

import sys

from aioloader._bench.serving_cost import main

if __name__ == "__main__":
    sys.exit(main())
