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

import array
import itertools
import operator
import os
import pickle
import time
from collections.abc import Sequence
from typing import Any, SupportsIndex

from ._read import can_hint, read_file, will_need

__all__ = ["FileReader"]

# A read slower than this came from the disk, not the page cache (a warm 64 KiB file reads in
# tens of microseconds): the rest of the batch's files are then hinted to the kernel at once,
# so that the disk has them all queued rather than one read at a time per worker.
COLD_READ_S = 0.5e-3


class FileReader:
    """The listed files, read by whoever holds a copy (a worker process).

    Compact, because each worker is sent a copy as it starts (each epoch's start, without
    persistent workers): the keys are one UTF-8 blob and an array of offsets, and a path is
    derived from the folder's real path and the key unless it differs (a link, a file under a
    linked folder). A listing of 1,281,000 ImageNet-like keys pickles into 46 MiB in 33 ms
    and loads in 27 ms; as two lists of strings it was 106 MiB, 0.95 s of the loader's CPU
    per worker and 0.31 s in each (packing it takes 0.9 s, once, as the loader is built).
    By pickle 5 the keys and offsets go out of band: a start's workers map one copy of them
    (``_workers/startonce.py``), each worker's PSS 137 -> 81 MiB with 1.28 million keys.

    Args:
        root: The folder, as given to the dataset (for the error notes).
        keys: The files' keys (paths relative to ``root``, ``/`` separators), in index order.
        paths: Their real paths, in the same order.
    """

    __slots__ = ("_blob", "_offsets", "_own_paths", "_prefix", "_root")

    def __init__(self, root: str, keys: Sequence[str], paths: Sequence[str]) -> None:
        self._root = root
        encoded = [key.encode("utf-8", "surrogateescape") for key in keys]
        # In a worker: views of the start's mapping (``__reduce_ex__``)
        self._blob: bytes | memoryview = b"".join(encoded)
        self._offsets: array.array[int] | memoryview = array.array(
            "q", itertools.accumulate(map(len, encoded), initial=0)
        )
        prefix = os.path.realpath(root) + os.sep
        self._prefix = prefix
        self._own_paths = {  # the paths that are not the real root joined with the key
            i: path
            for i, (key, path) in enumerate(zip(keys, paths, strict=True))
            if path != prefix + key.replace("/", os.sep)
        }

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        # Pickle 5 (a worker's start): the listing's two buffers out of band, which the start
        # puts in one mapping every worker of a pool shares (``_workers/startonce.py``)
        blob: Any = self._blob
        offsets: Any = self._offsets
        if operator.index(protocol) >= 5:
            blob, offsets = pickle.PickleBuffer(blob), pickle.PickleBuffer(offsets)
        return _rebuilt, (self._root, blob, offsets, self._prefix, self._own_paths)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}(root={self._root!r}, files={len(self)})"

    def key(self, index: int) -> str:
        """The key of file ``index`` (its path relative to the root, ``/`` separators).

        Raises:
            IndexError: ``index`` is out of range.
        """
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"file index {index} out of range for {n} files")
        index %= n
        start, end = self._offsets[index], self._offsets[index + 1]
        return str(self._blob[start:end], "utf-8", "surrogateescape")

    def path(self, index: int) -> str:
        """The real path of file ``index``.

        Raises:
            IndexError: ``index`` is out of range.
        """
        key = self.key(index)
        own = self._own_paths.get(index % len(self))
        return own if own is not None else self._prefix + key.replace("/", os.sep)

    def __getitem__(self, index: int) -> bytes:
        """The bytes of file ``index``.

        Raises:
            IndexError: ``index`` is out of range.
            OSError: Reading failed, with its own type and a note naming the file's key.
        """
        path = self.path(index)
        try:
            return read_file(path)
        except OSError as exc:
            note(exc, self.key(index), self._root)
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
        paths = [self.path(i) for i in indices]
        hinted = not can_hint
        out: list[bytes] = []
        for position, path in enumerate(paths):
            start = time.perf_counter()
            try:
                out.append(read_file(path))
            except OSError as exc:
                note(exc, self.key(indices[position]), self._root)
                raise
            if not hinted and time.perf_counter() - start > COLD_READ_S:
                hinted = True
                for later in paths[position + 1 :]:
                    will_need(later)
        return out


def note(exc: OSError, key: str, root: str | os.PathLike[str]) -> None:
    """Name the file a read failed on, and its folder, on ``exc``."""
    exc.add_note(f"aioloader.sources.files: reading {key!r} under {os.fspath(root)!r}")


def _rebuilt(
    root: str, blob: Any, offsets: Any, prefix: str, own_paths: dict[int, str]
) -> FileReader:
    """A :class:`FileReader` from its pickle: its buffers as they arrive (bytes and an array;
    from pickle 5, out-of-band views, read-only for the keys)."""
    reader = FileReader.__new__(FileReader)
    reader._root, reader._prefix, reader._own_paths = root, prefix, own_paths
    reader._blob = blob if isinstance(blob, bytes) else memoryview(blob).toreadonly()
    reader._offsets = (
        offsets if isinstance(offsets, array.array) else memoryview(offsets).cast("B").cast("q")
    )
    return reader
