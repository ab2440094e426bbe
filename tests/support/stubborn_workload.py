"""A workload for ``aioloader bench``'s runner that misbehaves on purpose, in one of two ways:

* ``--ignore-sigterm``: ignores SIGTERM (so does the child it starts), from its first line,
  and never ends;
* ``--leave-child``: reports one row, then exits 0 leaving a child process running in its
  session.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]

if "--ignore-sigterm" in sys.argv:  # before the imports below, which take seconds
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the child
    subprocess.Popen(SLEEPER)
    time.sleep(120)

from aioloader._bench.harness import Result, report  # noqa: E402


def main() -> int:
    report("t", Result("aio-x", samples=10, wall_s=1.0))
    subprocess.Popen(SLEEPER)
    return 0
