"""Streaming benchmark: WebDataset-style tar shards read from remote storage by webdataset's own
pipeline, by a plain asyncio loop and by ``aioloader.sources.tar_shards``, each configuration in
a fresh process of its own.

The workload lives in ``aioloader/_bench/streams.py`` (its docstring says what is measured and how);
``aioloader bench`` runs it beside the others. This script runs it alone, with all of its flags::

    .venv/bin/python benchmarks/bench_streams.py --help
"""

import sys

from aioloader._bench.streams import main

if __name__ == "__main__":
    sys.exit(main())
