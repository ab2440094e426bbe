"""Serving benchmark: aioloader's DynamicBatcher behind an HTTP server, against one model call per
request and a naive batcher, under open-loop load.

The workload lives in ``aioloader/_bench/serving.py`` (its docstring says what is measured and how);
``aioloader bench`` runs it beside the others. This script runs it alone, with all of its flags::

    .venv/bin/python benchmarks/bench_serving.py --help
"""

import sys

from aioloader._bench.serving import main

if __name__ == "__main__":
    sys.exit(main())
