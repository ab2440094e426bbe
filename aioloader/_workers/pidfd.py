"""Waiting for any process's end, child or not, through a pidfd (Linux 5.3+): no polling, no
signal, no reaping.

Owns: :func:`exited_within`. Never: reaps a process, or signals one.
"""

from __future__ import annotations

import os
import select

__all__ = ["exited_within"]


def exited_within(pid: int, seconds: float) -> bool | None:
    """Whether process ``pid`` has exited (a zombie counts) or does within ``seconds``; None
    where no pidfd can be had (a kernel without them, a Python without ``os.pidfd_open``).
    A pid no process has (gone and reaped) has exited."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except (OSError, AttributeError):
        return None
    try:
        poller = select.poll()  # not select(): a descriptor past 1023 is out of its range
        poller.register(pidfd, select.POLLIN)  # readable once it has exited
        return bool(poller.poll(seconds * 1000))
    finally:
        os.close(pidfd)
