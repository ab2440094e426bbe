"""The files of a :class:`~aioloader.sources.FileDataset` as worker processes read them.

Owns: :class:`FileReader`, what ``FileDataset.for_workers()`` returns: a picklable blocking
map-style dataset (item ``i`` is the bytes of file ``i``, ``key(i)`` its key) that each worker
process keeps a copy of, so that a loader with worker processes sends them indices and no file's
bytes pass through the training process (issue 25: reading and sending a batch's JPEGs cost
that process's event loop about 11 ms of CPU per batch of 256, beside the training step).
Never: lists the folder (the dataset did, once; its order is kept), holds threads or files
open between calls, or retries (the loader's ``retry`` runs around each read in the worker).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from ._read import can_hint, read_file, will_need

__all__ = ["FileReader"]

# A read slower than this came from the disk, not the page cache (a warm 64 KiB file reads in
# tens of microseconds): the rest of the batch's files are then hinted to the kernel at once,
# so that the disk has them all queued rather than one read at a time per worker.
COLD_READ_S = 0.5e-3


class FileReader:
    """The listed files, read by whoever holds a copy (a worker process).

    Args:
        root: The folder, as given to the dataset (for the error notes).
        keys: The files' keys (paths relative to ``root``), in index order.
        paths: Their real paths, in the same order.
    """

    __slots__ = ("_keys", "_paths", "_root")

    def __init__(self, root: str, keys: Sequence[str], paths: Sequence[str]) -> None:
        self._root = root
        self._keys = keys
        self._paths = paths

    def __len__(self) -> int:
        return len(self._paths)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(root={self._root!r}, files={len(self._paths)})"

    def key(self, index: int) -> str:
        """The key of file ``index`` (its path relative to the root, ``/`` separators).

        Raises:
            IndexError: ``index`` is out of range.
        """
        return self._keys[index]

    def __getitem__(self, index: int) -> bytes:
        """The bytes of file ``index``.

        Raises:
            IndexError: ``index`` is out of range.
            OSError: Reading failed, with its own type and a note naming the file's key.
        """
        try:
            return read_file(self._paths[index])
        except OSError as exc:
            note(exc, self._keys[index], self._root)
            raise

    def __getitems__(self, indices: Sequence[int]) -> list[bytes]:
        """The bytes of each file of ``indices``, in order (torch's batched protocol: a worker
        reads its batch in one call). After a read that came from the disk, the batch's other
        files are hinted to the kernel before they are read.

        Raises:
            IndexError: An index is out of range (before anything is read).
            OSError: Reading a file failed (the first in ``indices`` order), with a note naming
                its key.
        """
        paths = [self._paths[i] for i in indices]
        hinted = not can_hint
        out: list[bytes] = []
        for position, path in enumerate(paths):
            start = time.perf_counter()
            try:
                out.append(read_file(path))
            except OSError as exc:
                note(exc, self._keys[indices[position]], self._root)
                raise
            if not hinted and time.perf_counter() - start > COLD_READ_S:
                hinted = True
                for later in paths[position + 1 :]:
                    will_need(later)
        return out


def note(exc: OSError, key: str, root: str | os.PathLike[str]) -> None:
    """Name the file a read failed on, and its folder, on ``exc``."""
    exc.add_note(f"aioloader.sources.files: reading {key!r} under {os.fspath(root)!r}")
