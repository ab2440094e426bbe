"""CPU-bound benchmark: aioloader's worker processes vs torch's DataLoader on compute-heavy work.

The workload lives in ``aioloader/_bench/cpu.py`` (its docstring says what is measured and how);
``aioloader bench`` runs it beside the others. This script runs it alone, with all of its flags::

    .venv/bin/python benchmarks/bench_cpu.py --help
"""

import sys

from aioloader._bench.cpu import main

if __name__ == "__main__":
    sys.exit(main())
