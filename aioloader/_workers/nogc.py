"""The cyclic garbage collector paused while a start's arguments are pickled or unpickled.

Why: pickling a dataset of 15,000 tensors made about 100,000 objects (views, buffers, the
reductions' tuples), and each few hundred set off a collection; the older generations'
collections walked every tensor the dataset holds, again and again. ``dumps_once`` took 0.28 s,
0.16 s with the collector paused; unpickling in a worker 0.17 s, 0.055 s (2-core box). Nothing
a pickle makes is garbage until it is done, so a collection then finds nothing to free.

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
