"""The cyclic garbage collector paused while a start's tensors are pickled or rebuilt as their
table (``startcopy.py``): our own code, making our own objects, none of them garbage until it
is done. A dataset's own ``__reduce__`` or ``__setstate__`` runs outside the pause.

Why: pickling the table of a dataset of 15,000 tensors makes some 60,000 objects, and each few
hundred set off a collection; the older generations' collections walked every tensor the
dataset holds, again and again. On a 2-core box the whole start pickled in 0.12-0.24 s, in
0.11-0.13 s with the table's part paused, and unpickled in 0.06-0.16 s, 0.055-0.063 s.

Owns: :func:`collections_paused`. Never: runs a collection itself, or pauses one that was
paused already (it is left as it was).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collections_paused"]


@contextlib.contextmanager
def collections_paused() -> Iterator[None]:
    """No cyclic collection (in any thread of this process) while the block runs; the
    collector is enabled again after it, if it was before, whatever the block raises.

    A thread that turns the collector off while the block runs finds it on again after:
    this process's own code never does."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
