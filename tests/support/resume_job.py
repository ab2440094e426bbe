"""Run by ``tests/loader/test_resume_kill.py`` in a process of its own: one epoch over tar shards
served over HTTP (``num_workers=2``), each batch's keys logged as it is taken, the loader's
state saved every ``--every`` batches (written whole, then renamed), and, with ``--die-at``,
a SIGKILL to itself after that many batches: the process dies with its iterator, workers and
connections open, as a preempted job does. A state file present at the start is resumed.

Usage: resume_job.py URLS_JSON LOG STATE --every K [--die-at N]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import aioloader
from aioloader.sources import tar_shards
from tests.support.worker_fns import sample_key


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("urls", type=Path)
    parser.add_argument("log", type=Path)
    parser.add_argument("state", type=Path)
    parser.add_argument("--every", type=int, required=True)
    parser.add_argument("--die-at", type=int, default=None)
    args = parser.parse_args()
    urls = json.loads(args.urls.read_text())
    dataset = tar_shards(urls, shuffle_shards=True, shuffle_buffer=8, shards_in_flight=3, seed=7)
    loader: aioloader.DataLoader[list[str]] = aioloader.DataLoader(
        dataset, batch_size=4, num_workers=2, transform=sample_key, collate_fn=list
    )
    taken = 0
    if args.state.exists():
        saved = json.loads(args.state.read_text())
        loader.load_state_dict(saved["loader"])
        taken = saved["batches"]
    with args.log.open("a") as log:
        for batch in loader:
            taken += 1
            log.write(json.dumps({"run": os.getpid(), "batch": taken, "keys": batch}) + "\n")
            log.flush()
            if taken % args.every == 0:
                partial = args.state.with_suffix(".partial")
                partial.write_text(json.dumps({"loader": loader.state_dict(), "batches": taken}))
                os.replace(partial, args.state)  # a kill leaves the old state or the new one
            if taken == args.die_at:
                os.kill(os.getpid(), signal.SIGKILL)
    print(f"epoch done: {taken} batches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
