"""``aioloader.sources.files``: real files in a temporary folder, read through a real loader."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

import aioloader
import aioloader._base.inline
import aioloader._workers.offload
from aioloader._base.inline import Recent
from aioloader.sources import FileDataset, files


def content(key: str) -> bytes:
    return f"<{key}>".encode() * 3


def make_tree(root: Path, keys: Sequence[str]) -> None:
    for key in keys:
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content(key))


def notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


def files_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("aioloader-files")]


async def drain(loader: aioloader.DataLoader[Any]) -> list[Any]:
    return [b async for b in loader]


class Recording(FileDataset):
    """Counts single reads and the batched reads, and the threads those ran on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gets = 0
        self.slices: list[int] = []
        self.thread_names: list[str] = []

    async def get(self, index: int) -> bytes:
        self.gets += 1
        return await super().get(index)

    def _read_many(self, items: Sequence[tuple[str, str]]) -> list[bytes]:
        self.slices.append(len(items))
        self.thread_names.append(threading.current_thread().name)
        return super()._read_many(items)


KEYS = [
    "b.bin",
    "a.txt",
    "sub/z.bin",
    "sub/deeper/y.BIN",
    "a-b.bin",
    "a/c.bin",
    "10.bin",
    "9.bin",
    ".hidden.bin",
    ".cache/x.bin",
]


def test_listing_is_sorted_by_path_and_filtered(tmp_path: Path) -> None:
    root = tmp_path / ".data"  # a hidden root is fine: only parts below it count
    make_tree(root, KEYS)
    (root / "empty_dir").mkdir()

    ds = files(root)
    # Folder by folder, in code-point order: folder "a" before "a-b.bin" (whole strings would
    # put "a/c.bin" last, since "/" sorts after "-" and ".").
    assert ds.keys == [
        "10.bin",
        "9.bin",
        "a/c.bin",
        "a-b.bin",
        "a.txt",
        "b.bin",
        "sub/deeper/y.BIN",
        "sub/z.bin",
    ]
    assert len(ds) == 8 and ds.key(2) == "a/c.bin" and ds.key(-1) == "sub/z.bin"
    with pytest.raises(IndexError):
        ds.key(8)
    assert repr(ds) == f"FileDataset(root={str(root)!r}, pattern='**/*', files=8)"

    assert files(root, "*").keys == ["10.bin", "9.bin", "a-b.bin", "a.txt", "b.bin"]
    assert files(root, "sub/**/*.bin").keys == ["sub/z.bin"]  # glob is case-sensitive
    assert files(root, suffix=".bin").keys == [
        "10.bin",
        "9.bin",
        "a/c.bin",
        "a-b.bin",
        "b.bin",
        "sub/deeper/y.BIN",  # the suffix is not
        "sub/z.bin",
    ]
    assert files(root, suffix=["txt", ".BIN"]).keys == files(root).keys
    assert files(root, "**/*", suffix="txt").keys == ["a.txt"]
    hidden = files(root, include_hidden=True).keys
    assert hidden[:2] == [".cache/x.bin", ".hidden.bin"] and len(hidden) == 10
    assert files(root, ".cache/*", include_hidden=True).keys == [".cache/x.bin"]
    assert files(str(root)).keys == files(root).keys  # str or PathLike


def test_bad_roots_and_arguments_say_what(tmp_path: Path) -> None:
    make_tree(tmp_path, ["a.bin"])
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError) as info:
        files(missing)
    assert info.value.filename == str(missing) and str(missing) in str(info.value)
    with pytest.raises(NotADirectoryError, match=r"a\.bin"):
        files(tmp_path / "a.bin")
    with pytest.raises(ValueError, match=r"no file under .*matches pattern '\*\.png'") as empty:
        files(tmp_path, "*.png")
    assert str(tmp_path) in str(empty.value)
    with pytest.raises(ValueError, match="suffix"):
        files(tmp_path, suffix=".png")
    with pytest.raises(ValueError, match="no file"):
        files(tmp_path, "**/*", include_hidden=False, suffix=".b")
    for pattern in ("../*", "/etc/*", "a/../../*", ""):
        with pytest.raises(ValueError, match="pattern"):
            files(tmp_path, pattern)
    with pytest.raises(ValueError, match="suffix"):
        files(tmp_path, suffix="")
    with pytest.raises(TypeError, match="suffix"):
        files(tmp_path, suffix=[b".bin"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="threads"):
        files(tmp_path, threads=0)


def test_symlinks_leading_out_of_root_are_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aioloader")
    root, outside = tmp_path / "root", tmp_path / "outside"
    make_tree(root, ["real.bin", "sub/inner.bin"])
    make_tree(outside, ["secret.bin", "more/secret2.bin"])
    (root / "to_secret.bin").symlink_to(outside / "secret.bin")
    (root / "to_outside_dir").symlink_to(outside, target_is_directory=True)
    (root / "relative_escape.bin").symlink_to("../outside/secret.bin")
    (root / "inner_link.bin").symlink_to("sub/inner.bin")  # stays inside: followed
    (root / "sub_link").symlink_to(root / "sub", target_is_directory=True)
    (root / "dangling.bin").symlink_to(root / "gone.bin")

    ds = files(root)
    assert ds.keys == ["inner_link.bin", "real.bin", "sub/inner.bin"]
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "skipped 2 symbolic link(s) leading outside" in messages[0]
    assert "'to_secret.bin'" in messages[0] and "'relative_escape.bin'" in messages[0]

    # A pattern that names a linked folder goes through it; one outside root is still skipped.
    assert files(root, "sub_link/*").keys == ["sub_link/inner.bin"]
    with pytest.raises(ValueError, match="no file"):
        files(root, "to_outside_dir/**/*")
    assert "skipped 2 symbolic link(s)" in caplog.records[-1].getMessage()

    # A root that is itself a link is resolved first: its files are inside it.
    link_root = tmp_path / "link_root"
    link_root.symlink_to(root, target_is_directory=True)
    assert files(link_root).keys == ds.keys


@pytest.mark.parametrize("shuffle", [False, True])
async def test_loader_reads_every_file_once_per_epoch(
    tmp_path: Path, shuffle: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = [f"d{i % 3}/f{i:03d}.bin" for i in range(45)]
    make_tree(tmp_path, keys)
    # A slice counts as fast under 10 ms here (its slow mark), not 1 ms: this checks the move
    # to the loop's thread, not the machine's load (beside another busy test process in CI,
    # slices of 8 cached files took over 1 ms on a thread, and none moved).
    monkeypatch.setattr(aioloader.sources._files, "INLINE_BELOW_S", 0.01)
    ds = Recording(tmp_path)
    expected = [content(k) for k in ds.keys]
    loader: aioloader.DataLoader[list[bytes]] = aioloader.DataLoader(
        ds, batch_size=8, collate_fn=list, shuffle=shuffle, seed=3
    )
    epochs = []
    async with loader:
        for _ in range(2):
            batches = await drain(loader)
            assert [len(b) for b in batches] == [8] * 5 + [5]
            epochs.append([x for b in batches for x in b])
    assert files_threads() == []
    for got in epochs:
        assert sorted(got) == sorted(expected)  # every file exactly once
    # One call per batch, never a read per file: on the loop's thread once the slices are
    # known to read fast (cached files), else on the dataset's own threads: the first, not
    # timed yet, and a few after it while a slow first one weighs on the average.
    assert ds.gets == 0
    assert sorted(ds.slices) == [5, 5] + [8] * 10
    here = threading.current_thread().name
    assert ds.thread_names[0] != here and here in ds.thread_names, ds.thread_names
    assert all(n.startswith("aioloader-files_") or n == here for n in ds.thread_names)
    if shuffle:
        assert epochs[0] != expected and epochs[0] != epochs[1]
        again: aioloader.DataLoader[list[bytes]] = aioloader.DataLoader(
            ds, batch_size=8, collate_fn=list, shuffle=True, seed=3
        )
        async with again:
            assert [x for b in await drain(again) for x in b] == epochs[0]
    else:
        assert epochs == [expected, expected]


def test_plain_for_loop(tmp_path: Path) -> None:
    make_tree(tmp_path, [f"{i}.bin" for i in range(10)])
    ds = files(tmp_path)
    loader: aioloader.DataLoader[list[bytes]] = aioloader.DataLoader(
        ds, batch_size=4, collate_fn=list
    )
    got = [x for b in loader for x in b]
    assert got == [content(k) for k in ds.keys]
    assert files_threads() == []


async def test_a_file_removed_after_listing_names_its_key(tmp_path: Path) -> None:
    keys = [f"part/{i:02d}.bin" for i in range(20)]
    make_tree(tmp_path, keys)
    ds = Recording(tmp_path)
    gone = ds.keys.index("part/13.bin")
    (tmp_path / "part" / "13.bin").unlink()

    dl: aioloader.DataLoader[list[bytes]] = aioloader.DataLoader(ds, batch_size=8, collate_fn=list)
    async with dl:
        got: list[bytes] = []
        with pytest.raises(FileNotFoundError) as info:
            async for batch in dl:
                got.extend(batch)
    assert got == [content(k) for k in keys[:8]]  # the batch before it was delivered
    assert "'part/13.bin'" in notes(info.value) and "stage 'fetch'" in notes(info.value)

    # With a budget, only that file is skipped (the slice is re-read file by file).
    dl = aioloader.DataLoader(ds, batch_size=8, collate_fn=list, max_failures=1)
    async with dl:
        got = [x for b in await drain(dl) for x in b]
    assert got == [content(k) for k in keys if k != "part/13.bin"]
    assert dl.statistics().skipped_samples == (gone,)

    # Read on its own, outside any loader: the same type, the same note.
    with pytest.raises(FileNotFoundError) as single:
        await ds.get(gone)
    assert "'part/13.bin'" in notes(single.value)
    async with ds:
        with pytest.raises(FileNotFoundError) as many:
            await ds.get_many([0, gone, 1])
    assert "'part/13.bin'" in notes(many.value)


async def test_standalone_context(tmp_path: Path) -> None:
    make_tree(tmp_path, ["x/1.bin", "x/2.bin", "y.bin"])
    ds = Recording(tmp_path, threads=2)
    # Outside the context: aiofiles on the loop's executor, get_many one file at a time.
    assert await ds.get(2) == content("y.bin")
    assert await ds.get_many([2, 0]) == [content("y.bin"), content("x/1.bin")]
    assert ds.slices == [] and ds.gets == 3
    async with ds:
        assert await ds.get(0) == content("x/1.bin")
        async with ds:  # entered twice (two loaders sharing it): threads live until the last exit
            want = [content(k) for k in ("x/2.bin", "y.bin", "x/2.bin")]
            assert await ds.get_many([1, 2, 1]) == want
        assert files_threads()
        assert await ds.get_many([0]) == [content("x/1.bin")]
        with pytest.raises(IndexError):
            await ds.get_many([0, 3])
    assert files_threads() == []
    assert ds.slices == [3, 1]
    assert await ds.get(1) == content("x/2.bin")  # usable again after the context


async def test_cancelled_get_many_leaves_no_thread(tmp_path: Path) -> None:
    make_tree(tmp_path, [f"{i}.bin" for i in range(4)])
    loop = asyncio.get_running_loop()
    started, release = anyio.Event(), threading.Event()

    calls = [0]

    class Slow(FileDataset):
        def _read_many(self, items: Sequence[tuple[str, str]]) -> list[bytes]:
            calls[0] += 1
            if calls[0] == 1:  # the first read is timed inline: slow, so the next go to a thread
                time.sleep(0.01)
            else:
                loop.call_soon_threadsafe(started.set)
                release.wait(5)
            return super()._read_many(items)

    ds = Slow(tmp_path, threads=1)
    scope = anyio.CancelScope()
    finished: list[bool] = []

    async def read() -> None:
        with scope:
            await ds.get_many([0, 1, 2, 3])
            raise AssertionError("the read was not cancelled")
        finished.append(scope.cancelled_caught)

    async with ds:
        assert await ds.get_many([0]) == [content("0.bin")]
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await started.wait()
            scope.cancel()
            await anyio.sleep(0.02)
            assert finished == [], "a cancelled caller waits for the read running in a thread"
            release.set()
        assert finished == [True]
        assert await ds.get_many([3]) == [content("3.bin")]  # the pool still serves
    assert files_threads() == []


def test_listing_and_reading_is_deterministic_across_instances(tmp_path: Path) -> None:
    names = [f"{c}{i}.bin" for c in "qazwsx" for i in (3, 1, 2)]
    make_tree(tmp_path, names)
    a, b = files(tmp_path), files(os.fspath(tmp_path) + os.sep)
    assert a.keys == b.keys == sorted(names)


async def test_cached_slices_are_read_here_and_slow_ones_on_the_threads(tmp_path: Path) -> None:
    """A slice known to read fast (files in the page cache) is read on the calling thread: a
    hop to a thread would cost more than the reads. The first is not timed yet: on a thread.
    One that took over a millisecond sends the next to the dataset's threads."""
    make_tree(tmp_path, [f"{i}.bin" for i in range(8)])
    loop, where, pause = threading.get_ident(), [], [0.0]

    class Spy(FileDataset):
        def _read_many(self, items: Sequence[tuple[str, str]]) -> list[bytes]:
            where.append(threading.get_ident())
            time.sleep(pause[0])
            return super()._read_many(items)

    ds = Spy(tmp_path, threads=2)
    async with ds:
        for _ in range(50):  # a loaded machine may need a few slices to show they are fast
            assert await ds.get_many(range(8)) == [content(f"{i}.bin") for i in range(8)]
            if where[-1] == loop:
                break
        assert where[0] != loop and where[-1] == loop  # the first: on a thread, timed alone
        # Known fast (the test says so: on a loaded machine the last slice here may have been
        # timed over the millisecond), then 20 ms: slow, whatever the machine's load.
        ds._placed.placement.recent.seconds = 1e-5
        pause[0] = 0.02
        await ds.get_many([0])  # known fast, so here; now known slow
        await ds.get_many([0])
        assert where[-2:] == [loop, where[-1]] and where[-1] != loop


async def test_fast_slices_are_timed_alone_and_come_back_inline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the overhead benchmark: cached files read on several threads at once took up to
    ten times as long as inline (each thread waiting for the GIL at the others' system calls),
    so the slices, timed there, stayed there for good (37 us a file where a plain loop read 9).
    Slices that may be fast are read one at a time on the threads: timed alone, they come back
    here. Here a read takes 0.1 ms, or 4 ms while another read runs on a thread, on a clock of
    the test's (a loaded machine's would stretch any read past the millisecond called slow)."""
    make_tree(tmp_path, [f"{i}.bin" for i in range(8)])
    clock = VirtualClock(monkeypatch)
    loop, here, running, crowded = threading.get_ident(), [], [0], [0]
    lock = threading.Lock()

    class Contended(FileDataset):
        def _read_many(self, items: Sequence[tuple[str, str]]) -> list[bytes]:
            here.append(threading.get_ident() == loop)
            with lock:
                running[0] += 1
            try:
                time.sleep(0.0005)  # long enough, in real time, for reads beside it to overlap
                with lock:
                    slowed = running[0] > 1
                crowded[0] += slowed
                clock.spend(0.004 if slowed else 0.0001)
                return super()._read_many(items)
            finally:
                with lock:
                    running[0] -= 1

    ds = Contended(tmp_path, threads=4)
    async with ds:
        for _ in range(6):  # four readers at once, as a loader's fetch workers read
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(ds.get_many, [i, i + 4])
        assert not here[0]  # the first: on a thread, alone, and found fast
        assert all(here[1:]), here  # read here since
        assert crowded == [0]
    assert files_threads() == []


class VirtualClock:
    """The placement's clock (``time.perf_counter`` where its calls are timed), a thread's own
    and moved only by :meth:`spend`: a call takes what the test says it takes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._local = threading.local()
        timing = types.SimpleNamespace(perf_counter=self.perf_counter)
        monkeypatch.setattr(aioloader._base.inline, "time", timing)
        monkeypatch.setattr(aioloader._workers.offload, "time", timing)

    def perf_counter(self) -> float:
        return float(getattr(self._local, "now", 0.0))

    def spend(self, seconds: float) -> None:
        self._local.now = self.perf_counter() + seconds


class Pinned(Recent):
    """An estimate no measurement moves: what the placement knows is the test's to say."""

    __slots__ = ("_pinned",)

    def __init__(self, seconds: float) -> None:
        self._pinned = seconds

    @property  # type: ignore[override]
    def seconds(self) -> float:
        return self._pinned

    @seconds.setter
    def seconds(self, value: float | None) -> None:
        pass


def real_path(path: str) -> str:
    return os.path.realpath(path)


def hinted_paths(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files each read-ahead hint named, in order (``posix_fadvise`` still runs)."""
    hinted: list[str] = []
    real = os.posix_fadvise

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            hinted.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    return hinted


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no read-ahead hints here")
async def test_slow_reads_start_the_reads_of_the_batches_scheduled_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cold files (reads slow) are hinted to the kernel a window of batches ahead of their
    reads, each once; warm ones (reads inline) are not hinted at all."""
    make_tree(tmp_path, [f"{i:02d}.bin" for i in range(64)])
    hinted = hinted_paths(monkeypatch)
    order: list[str] = []

    ahead: list[int] = []  # at each read: files hinted and not yet read

    class Cold(FileDataset):
        def _read_many(self, items: Sequence[tuple[str, str]]) -> list[bytes]:
            self._placed.placement.recent.seconds = 0.005  # slow: the files are not cached
            time.sleep(0.0015)  # and the slice too: the stages take over from the calls
            read = super()._read_many(items)
            ahead.append(len(hinted) - len(order))
            order.extend(path for _, path in items)
            return read

    ds = Cold(tmp_path)
    assert ds._threads == 2  # threads beyond two only wait for the GIL when hints work
    ds._placed.placement.recent.seconds = 0.005
    loader = aioloader.DataLoader(ds, batch_size=4, collate_fn=list)
    async with loader:
        got = [b async for b in loader]
    assert [x for b in got for x in b] == [content(f"{i:02d}.bin") for i in range(64)]
    assert sorted(hinted) == sorted(map(real_path, order))  # each file once
    # Hinted ahead: once the stages read (the first slices were read in the consumer's calls,
    # each hinting its own files), the files of later batches were hinted before their reads.
    assert max(ahead) > 8

    hinted.clear()
    warm = FileDataset(tmp_path, threads=3)
    # Fast, and kept so: a loaded machine may time a read of cached files over a millisecond.
    warm._placed.placement.recent = Pinned(1e-5)
    loader = aioloader.DataLoader(warm, batch_size=4, collate_fn=list)
    async with loader:
        assert len([b async for b in loader]) == 16
    assert hinted == []


def test_a_hint_for_a_file_that_cannot_be_opened_is_dropped(tmp_path: Path) -> None:
    from aioloader.sources._read import will_need

    will_need(os.fspath(tmp_path / "missing.bin"))  # its read will say why
    will_need(os.fspath(tmp_path))  # a folder opens, and takes the hint or ignores it


async def test_the_loader_hints_each_scheduled_batch_to_a_dataset_that_takes_hints() -> None:
    hints: list[list[int]] = []
    gets: list[int] = []

    class Hinted(aioloader.AsyncDataset[int]):
        def __len__(self) -> int:
            return 20

        async def get(self, index: int) -> int:
            gets.append(index)
            await anyio.sleep(0.001)  # a read that waits: the stages run ahead of it
            return index

        def will_need(self, indices: Sequence[int]) -> None:
            hints.append(list(indices))

    loader = aioloader.DataLoader(Hinted(), batch_size=4, shuffle=True, seed=1, collate_fn=list)
    async with loader:
        got = [b async for b in loader]
    assert hints == got  # every batch, in its order, once
    assert len(hints) == 5 and sorted(gets) == list(range(20))


def test_files_with_keys_read_ahead_as_files_do(tmp_path: Path) -> None:
    """Found by review: the keyed wrapper did not pass the loader's hints on, so cold files
    read with their keys lost the read-ahead (and kept the two threads chosen for it)."""
    make_tree(tmp_path, ["a.bin", "b.bin"])
    keyed_files = files(tmp_path, with_keys=True)
    assert type(keyed_files).will_need is not aioloader.AsyncDataset.will_need
    seen: list[list[int]] = []
    keyed_files.source.will_need = seen.append  # type: ignore[attr-defined,method-assign]
    keyed_files.will_need([1, 0])
    assert seen == [[1, 0]]
