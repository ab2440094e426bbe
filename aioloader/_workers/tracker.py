"""multiprocessing's resource tracker, started as a process group of its own.

Owns: :func:`ensure_resource_tracker`. Never: stops the tracker, or changes one that runs.
"""

from __future__ import annotations

import threading
from multiprocessing import resource_tracker, util
from typing import Any

__all__ = ["ensure_resource_tracker"]

_TRACKER_MAIN = "from multiprocessing.resource_tracker import main"
_tracker_start = threading.Lock()


def ensure_resource_tracker() -> None:
    """Start multiprocessing's resource tracker where it does not run, as a process group of
    its own: its command, as the stdlib spawns it, is prefixed with leaving this process's
    group. A Jupyter kernel, shutting down, signals the processes of its group and waits until
    they are gone; the tracker ignores SIGTERM, so it was killed at last and, unreaped, held
    the shutdown 2.5 s, until the kernel itself was killed, its exit hooks unrun (found by
    review: every notebook whose loader had workers). A tracker already running is left as
    it is. The spawn function is wrapped only for this call; another thread's spawn meanwhile
    goes through it unchanged."""
    spawning: Any = util  # (typeshed's signature for it is narrower than the stdlib's calls)
    with _tracker_start:
        real = spawning.spawnv_passfds

        def own_group(path: str, args: list[str], passfds: Any) -> int:
            if args and args[-1].startswith(_TRACKER_MAIN):
                args = [*args[:-1], f"import os; os.setpgid(0, 0); {args[-1]}"]
            pid: int = real(path, args, passfds)
            return pid

        spawning.spawnv_passfds = own_group
        try:
            resource_tracker.ensure_running()
        finally:
            spawning.spawnv_passfds = real
