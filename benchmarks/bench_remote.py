"""Remote-read benchmark: aioloader vs torch's DataLoader vs torchdata.nodes vs SPDL vs a thread
pool vs plain asyncio, fetching objects over HTTP from a local server with first-byte latency.

The workload lives in ``aioloader/_bench/remote.py`` (its docstring says what is measured and how);
``aioloader bench`` runs it beside the others. This script runs it alone, with all of its flags::

    .venv/bin/python benchmarks/bench_remote.py --help
"""

import sys

from aioloader._bench.remote import main

if __name__ == "__main__":
    sys.exit(main())
