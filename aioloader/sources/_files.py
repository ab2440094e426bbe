"""A dataset of the files under a local folder: item ``i`` is the bytes of file ``i``.

Owns: listing a folder once (at construction, in a deterministic order) and reading its files.
Never: blocks the event loop while reading (a single file is read with aiofiles, a slice of a
batch in one call on threads the dataset owns), lists the folder again, or follows a symbolic
link out of the folder.

What is listed:

* regular files (symbolic links to regular files included) under ``root`` whose path relative
  to ``root`` matches the glob ``pattern`` (``pathlib`` semantics: ``**`` is any number of
  folders, and does not descend into linked folders; a pattern naming one does);
* whose name ends with one of ``suffix`` (compared without regard to case), when given;
* hidden ones (any part of the relative path starting with ``.``) only with
  ``include_hidden=True``;
* not a symbolic link, nor a file under a linked folder, that resolves to a place outside
  ``root``: such entries are **skipped** (one warning on the ``aioloader`` logger says how many
  and names a few), so a stray link cannot make a dataset unusable nor leak a file from
  elsewhere. A link that stays inside ``root`` is followed, and its target appears under the
  link's own key as well as its real one.

Order: sorted by relative path, compared folder by folder in code-point order, so the same
folder gives the same indices on every run and machine (``os.scandir`` order is not stable).

Threads: inside ``async with dataset:`` (the loader enters it when its scope opens) the dataset
owns a pool of threads named ``aioloader-files_<n>``: :meth:`FileDataset.get_many` reads a
whole slice in one call there (one hop per slice, not per file), and aiofiles runs its calls
there too. Slices that have been taking under a millisecond (cached files) are read on the
calling thread instead, where a hop and the threads' contention for the GIL cost more than the
reads (``_workers/placed.py``). Leaving the context joins the threads. Outside
it, :meth:`FileDataset.get_many` reads item by item with aiofiles on the loop's executor.

Worker processes: a loader with local worker processes (``threads`` not given, and no
``max_inflight``, ``max_inflight_bytes`` or ``sample_timeout`` other than its default) does not
read here at all. Each worker gets
a :class:`~._filereader.FileReader` (the listing, no threads) and reads its own batches' files,
as torch's workers read an ``ImageFolder``; only indices go to the workers (see
:meth:`FileDataset.for_workers`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Literal, overload

import aiofiles

from .._base.checks import check_int
from .._base.inline import FILES_SLOW_BELOW_S, INLINE_BELOW_S, Placement
from .._data.dataset import AsyncDataset
from .._workers.placed import PlacedCalls
from ._filereader import FileReader, note
from ._keyed import Keyed, keyed
from ._listing import list_folder
from ._patterns import check_pattern, check_suffix
from ._read import ReadAhead, can_hint, read_file

__all__ = ["FileDataset", "files"]

_THREAD_NAME = "aioloader-files"
# Reading threads by default. Where the kernel takes read-ahead hints it reads the files of the
# slices scheduled ahead (see FileDataset.will_need), and threads beyond two only wait for the
# GIL at each other's system calls: 20,000 cold 16 KiB files, batch 32, 2 cores, one run each:
# 23.6k/s with 1 thread, 28.2k with 2, 25.1k with 4, 22.7k with 8 (torch's DataLoader with 8
# workers: 24-29k). Without hints, threads are what keeps several reads in flight.
_THREADS_HINTED = 2
_THREADS = 8


@overload
def files(
    root: str | os.PathLike[str],
    pattern: str = "**/*",
    *,
    suffix: str | Sequence[str] | None = None,
    include_hidden: bool = False,
    threads: int | None = None,
    with_keys: Literal[False] = False,
) -> FileDataset: ...
@overload
def files(
    root: str | os.PathLike[str],
    pattern: str = "**/*",
    *,
    suffix: str | Sequence[str] | None = None,
    include_hidden: bool = False,
    threads: int | None = None,
    with_keys: Literal[True],
) -> Keyed[bytes]: ...
def files(
    root: str | os.PathLike[str],
    pattern: str = "**/*",
    *,
    suffix: str | Sequence[str] | None = None,
    include_hidden: bool = False,
    threads: int | None = None,
    with_keys: bool = False,
) -> FileDataset | Keyed[bytes]:
    """List the files under ``root`` once and return them as a dataset of their bytes.

    Example::

        loader = aioloader.DataLoader(
            aioloader.sources.files("data/train", suffix=".jpg"), batch_size=64, transform=decode
        )

    Args:
        root: The folder.
        pattern: A glob relative to ``root`` (``pathlib`` semantics); the default lists every
            file in every sub-folder.
        suffix: Keep only names ending with this suffix (or one of these), case-insensitively;
            a missing leading dot is added (``"jpg"`` means ``".jpg"``).
        include_hidden: Also list hidden files and files in hidden folders (a relative path
            part starting with ``.``).
        threads: Threads for reading, while the dataset's context is open. None (the
            default): 2 where the kernel takes read-ahead hints (``posix_fadvise``: it reads
            the files of the slices scheduled ahead, so more threads only contend for the
            GIL), else 8; and a loader's worker processes read the files themselves (see
            :meth:`FileDataset.for_workers`). Given, the files are always read in the loader's
            process, on that many threads (a slow or networked file system, where many reads
            in flight and the read-ahead of a window of batches pay).
        with_keys: Items are ``(key, bytes)``, the key being the file's path relative to
            ``root`` with ``/`` separators (``"cat/0001.jpg"``: an ImageFolder label is its
            first part).

    Returns:
        A :class:`FileDataset` (with ``with_keys``, one whose items carry their keys).

    Raises:
        FileNotFoundError: ``root`` does not exist.
        NotADirectoryError: ``root`` is not a folder.
        ValueError: Nothing matched (the message names ``root`` and ``pattern``), the pattern
            is absolute, empty or contains ``..``, a suffix is empty, or ``threads < 1``.
        TypeError: ``suffix`` is not a string or a sequence of strings.

    Cancellation: not applicable; listing is synchronous (see :class:`FileDataset`).
    """
    dataset = FileDataset(
        root, pattern, suffix=suffix, include_hidden=include_hidden, threads=threads
    )
    return keyed(dataset, dataset.key) if with_keys else dataset


class FileDataset(AsyncDataset[bytes]):
    """The files under a folder, listed once at construction; item ``i`` is the bytes of file
    ``i`` (``keys[i]`` is its path relative to the folder). See the module's documentation for
    what is listed, in what order, and how escaping symbolic links are skipped.

    Listing walks the folder synchronously, like a torch dataset's constructor: in async code,
    build a dataset of a very large tree with ``await anyio.to_thread.run_sync(files, root)``.

    It is an async context manager: the loader enters it when its scope opens and exits it when
    the scope closes; on its own, ``async with dataset:`` starts and joins its reading threads.
    Entering it again while open (two loaders sharing it) is allowed; the threads live until the
    last exit.

    Args:
        root: The folder.
        pattern: A glob relative to ``root``.
        suffix: Keep only names ending with this suffix, or one of these (case-insensitive).
        include_hidden: Also list hidden files and files in hidden folders.
        threads: Threads for reading, while the context is open (None: 2 where the kernel
            takes read-ahead hints, else 8, and worker processes read for themselves; given:
            always read in this process; see :func:`files`).

    Raises:
        FileNotFoundError: ``root`` does not exist.
        NotADirectoryError: ``root`` is not a folder.
        ValueError: Nothing matched (naming ``root`` and ``pattern``), the pattern is absolute,
            empty or contains ``..``, a suffix is empty, or ``threads < 1``.
        TypeError: ``suffix`` is not a string or a sequence of strings.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        pattern: str = "**/*",
        *,
        suffix: str | Sequence[str] | None = None,
        include_hidden: bool = False,
        threads: int | None = None,
    ) -> None:
        self._threads_given = threads is not None
        if threads is None:
            threads = _THREADS_HINTED if can_hint else _THREADS
        check_int("threads", threads, minimum=1)
        self._root = Path(root)
        self._pattern = check_pattern(pattern)
        self._suffixes = check_suffix(suffix)
        self._include_hidden = include_hidden
        self._threads = threads
        self._keys, self._paths = list_folder(
            self._root, self._pattern, self._suffixes, self._include_hidden
        )
        self._pool: ThreadPoolExecutor | None = None
        self._reader: FileReader | None = None  # for worker processes (see for_workers)
        self._entered = 0
        # Inline while slices read fast, else on the threads (see PlacedCalls).
        self._placed = PlacedCalls(Placement(INLINE_BELOW_S, slow_below=FILES_SLOW_BELOW_S))
        self._ahead = ReadAhead()  # files of scheduled slices, read ahead while reads are slow

    # -- listing ---------------------------------------------------------------------------------

    # -- the dataset -------------------------------------------------------------------------------

    @property
    def root(self) -> Path:
        """The folder, as given."""
        return self._root

    @property
    def keys(self) -> list[str]:
        """The files' paths relative to :attr:`root`, with ``/`` separators, in index order (a
        copy)."""
        return list(self._keys)

    def key(self, index: int) -> str:
        """The relative path of item ``index``.

        Raises:
            IndexError: ``index`` is out of range.
        """
        return self._keys[index]

    def __len__(self) -> int:
        """The number of files listed."""
        return len(self._keys)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(root={os.fspath(self._root)!r}, "
            f"pattern={self._pattern!r}, files={len(self._keys)})"
        )

    async def get(self, index: int) -> bytes:
        """Read file ``index`` with aiofiles (on the dataset's threads while its context is
        open, else on the event loop's default executor).

        Raises:
            IndexError: ``index`` is out of range.
            OSError: Reading failed, with its own type (``FileNotFoundError`` for a file removed
                after listing) and a note naming the file's key.

        Cancellation: a read already running in a thread finishes there; its result is dropped.
        """
        key, path = self._keys[index], self._paths[index]
        try:
            async with aiofiles.open(path, "rb", executor=self._pool) as f:
                return await f.read()
        except OSError as exc:
            note(exc, key, self._root)
            raise

    async def get_many(self, indices: Sequence[int]) -> list[bytes]:
        """Read several files, in the order of ``indices``: in one call on the dataset's threads
        while its context is open (one thread hop for the whole slice), else one by one with
        :meth:`get`.

        Raises:
            IndexError: An index is out of range.
            OSError: Reading a file failed (the first one in ``indices`` order), with its own
                type and a note naming its key.

        Cancellation: a call not yet started is withdrawn; one already running finishes (the
        caller waits for it, shielded: no read outlives the context); its result is dropped.
        """
        pool = self._pool
        if pool is None:
            return [await self.get(i) for i in indices]
        items = [(self._keys[i], self._paths[i]) for i in indices]  # a bad index fails here
        return await self._placed.run(pool, self._read_many, items)

    def will_need(self, indices: Sequence[int]) -> None:
        """A loader schedules a slice of ``indices``: while reads are slow (the files are not
        in the page cache), the next slice read on the threads first asks the kernel to start
        reading these (:func:`~._read.will_need`), so that the disk has the files of a
        loader's whole window of batches queued, as many reader processes would have, where
        the threads alone would keep one read each in flight. Warm (reads inline) it does
        nothing. Returns at once; an index out of range is left to its read."""
        if self._pool is None or not can_hint or self._placed.placement.fast():
            return
        paths, n = self._paths, len(self._paths)
        self._ahead.announce([paths[i] for i in indices if 0 <= i < n])

    def _read_many(self, items: Sequence[tuple[str, str]]) -> list[bytes]:
        """Blocking: read each ``(key, path)`` in turn (runs inline, or on one of the dataset's
        threads). While reads are slow, the reads of the slices scheduled so far (or of this
        one, if none were announced) are started first (see :meth:`will_need`)."""
        if can_hint and not self._placed.placement.fast():
            self._ahead.start([path for _, path in items])
        out: list[bytes] = []
        for key, path in items:
            try:
                out.append(read_file(path))
            except OSError as exc:
                note(exc, key, self._root)
                raise
        return out

    def for_workers(self) -> FileReader | None:
        """The listing as a blocking dataset that worker processes read themselves (picklable:
        the keys and paths, no threads): a loader with local worker processes sends each
        worker a copy and then only indices, so no file's bytes pass through this process.
        None (read here, on the dataset's threads) where ``threads`` was given (reads in this
        process asked for), or for a subclass that overrides :meth:`get`, :meth:`get_many` or
        :meth:`key` (its reads and keys are its own).

        Raises: nothing.
        """
        cls = type(self)
        if self._threads_given or any(
            getattr(cls, name) is not getattr(FileDataset, name)
            for name in ("get", "get_many", "key")
        ):
            return None
        if self._reader is None:  # packed once: a loader asks again as its settings change
            self._reader = FileReader(os.fspath(self._root), self._keys, self._paths)
        return self._reader

    # -- the context -----------------------------------------------------------------------------

    async def __aenter__(self) -> FileDataset:
        """Start the reading threads (lazily: each starts on first use), or count one more user
        of those already running.

        Cancellation: nothing to cancel; it does not wait.
        """
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=self._threads, thread_name_prefix=_THREAD_NAME
            )
        self._entered += 1
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """On the last exit, join the reading threads. Reads not yet started are cancelled; a
        read still running (only a cancelled :meth:`get` leaves one) is waited for, which takes
        at most one file's read.

        Cancellation: not a waiting point; the threads are joined before it returns.
        """
        self._entered = max(0, self._entered - 1)
        if self._entered == 0 and self._pool is not None:
            pool, self._pool = self._pool, None
            pool.shutdown(wait=True, cancel_futures=True)
