"""``sources.files`` with worker processes: the workers read the files themselves (sending
indices, not bytes), with the same items, order, errors and skips as reads in the loader's
process. What a process read is told by Linux's ``/proc/self/io`` (``rchar``: bytes its read
calls returned), so the tests check where the bytes went, not which code path was taken."""

from __future__ import annotations

import os
import pickle
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import aioloader
import aioloader.sources._filereader as filereader
from aioloader.sources import files
from aioloader.sources._filereader import FileReader
from aioloader.sources._keyed import Keyed, KeyedReader
from tests.support import worker_datasets as wd

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc/self/io (Linux)"
)

FILES, SIZE = 64, 64 * 1024  # 4 MiB in all


def payload(i: int) -> bytes:
    return bytes([i % 251]) * SIZE


@pytest.fixture
def root(tmp_path: Path) -> Path:
    for i in range(FILES):
        folder = tmp_path / f"c{i % 4}"
        folder.mkdir(exist_ok=True)
        (folder / f"{i:03d}.bin").write_bytes(payload(i))
    return tmp_path


def bytes_read() -> int:
    """What this process's read calls have returned so far (files, pipes and sockets)."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["rchar"])


def summary(item: bytes) -> tuple[int, int]:
    """A transform that sends back little: the file's size and first byte."""
    return len(item), item[0]


def keyed_summary(item: tuple[str, bytes]) -> tuple[str, int, int]:
    key, data = item
    return key, len(data), data[0]


def slow_on_worker_0(item: bytes) -> int:
    """The worker's id; worker 0 takes 50 ms a sample, worker 1 none."""
    info = aioloader.get_worker_info()
    assert info is not None
    if info.id == 0:
        time.sleep(0.05)
    return info.id


def listed(loader: aioloader.DataLoader[Any], epochs: int = 1) -> Iterator[Any]:
    for _ in range(epochs):
        for batch in loader:
            yield from batch


def number(key: str) -> int:
    """The file's number (``c1/005.bin``: 5): its payload's."""
    return int(key.split("/")[1][:3])


def expected(root: Path) -> list[tuple[int, int]]:
    ds = files(root)
    return [(SIZE, number(ds.key(i)) % 251) for i in range(len(ds))]


def test_worker_processes_read_the_files_and_only_results_come_back(root: Path) -> None:
    loader = aioloader.DataLoader(
        files(root), batch_size=8, num_workers=2, transform=summary, collate_fn=list
    )
    before = bytes_read()
    got = list(listed(loader, epochs=2))
    here = bytes_read() - before
    assert got == expected(root) * 2  # every file once an epoch, in order, whole
    # 8 MiB were read over the two epochs, in the workers: this process read their results
    # (and the workers' start-up messages), far less than one epoch's files.
    assert here < FILES * SIZE // 4, here


def test_read_in_this_process_where_a_fetch_option_asks_for_it(root: Path) -> None:
    # The control for the test above (the measure sees reads here), and the documented rule:
    # a fetch option keeps the reads in this process, where it has its meaning.
    for options in ({"sample_timeout": 30.0}, {"max_inflight": 3}, {"max_inflight_bytes": 1 << 30}):
        loader = aioloader.DataLoader(
            files(root), batch_size=8, num_workers=2, transform=summary, collate_fn=list,
            **options,
        )  # fmt: skip
        before = bytes_read()
        assert list(listed(loader)) == expected(root)
        assert bytes_read() - before >= FILES * SIZE, options


def test_thread_workers_and_no_workers_read_here(root: Path) -> None:
    for options in ({"num_workers": 2, "worker_mode": "thread"}, {"num_workers": 0}):
        loader = aioloader.DataLoader(
            files(root), batch_size=8, transform=summary, collate_fn=list, **options
        )
        before = bytes_read()
        assert list(listed(loader)) == expected(root)
        assert bytes_read() - before >= FILES * SIZE, options


def test_keys_shuffle_and_fresh_workers_give_the_loaders_own_order(root: Path) -> None:
    def run(**options: Any) -> list[Any]:
        loader = aioloader.DataLoader(
            files(root, with_keys=True), batch_size=5, shuffle=True, seed=7,
            transform=keyed_summary, collate_fn=list, **options,
        )  # fmt: skip
        return list(listed(loader, epochs=2))

    here = run(num_workers=0)
    before = bytes_read()
    in_workers = run(num_workers=2, persistent_workers=False)
    assert bytes_read() - before < FILES * SIZE // 4
    assert in_workers == here
    keys = [key for key, _, _ in here]
    assert sorted(keys[:FILES]) == sorted(keys[FILES:]) == files(root).keys
    assert keys[:FILES] != keys[FILES:]  # each epoch shuffled anew
    assert all(first == number(key) % 251 for key, _, first in here)


def test_a_file_gone_after_listing_is_named_and_skipped_within_the_budget(root: Path) -> None:
    ds = files(root)
    everything = expected(root)
    gone = ds.key(10)
    (root / gone).unlink()
    loader = aioloader.DataLoader(
        ds, batch_size=8, num_workers=2, transform=summary, collate_fn=list
    )
    with pytest.raises(FileNotFoundError) as info:
        list(listed(loader))
    said = "\n".join(getattr(info.value, "__notes__", []))
    assert repr(gone) in said and str(root) in said and "fetch" in said, said

    skipping = aioloader.DataLoader(
        ds, batch_size=8, num_workers=2, transform=summary, collate_fn=list, max_failures=1
    )
    got = list(listed(skipping))
    assert got == everything[:10] + everything[11:]
    assert skipping.statistics().skipped_samples == (10,)


def test_batches_go_to_whichever_worker_is_free(root: Path) -> None:
    # No state lives in a worker's reader: nothing ties batch k to worker k % n (as it does a
    # torch dataset's, where each worker would take half the batches, the slow one included).
    loader = aioloader.DataLoader(
        files(root), batch_size=4, num_workers=2, transform=slow_on_worker_0, collate_fn=list
    )
    batches = [batch[0] for batch in loader]  # 16 batches: worker 0 takes 0.2 s for each
    assert len(batches) == FILES // 4
    assert batches.count(1) > len(batches) * 3 // 4, batches


class Upper(aioloader.sources.FileDataset):
    async def get(self, index: int) -> bytes:
        return (await super().get(index)).upper()


class Labelled(aioloader.sources.FileDataset):
    def key(self, index: int) -> str:
        return "class-" + super().key(index)[:2]


def test_own_reads_own_keys_or_threads_given_are_read_here(root: Path) -> None:
    assert isinstance(files(root).for_workers(), FileReader)
    assert isinstance(files(root, with_keys=True).for_workers(), KeyedReader)
    assert Upper(root).for_workers() is None
    assert files(root, threads=4).for_workers() is None
    assert files(root, threads=4, with_keys=True).for_workers() is None
    labelled = Labelled(root)
    assert labelled.for_workers() is None
    assert Keyed(labelled, labelled.key).for_workers() is None

    # Other keys than the files' own: the loader gives them whatever num_workers is.
    def by_number(i: int) -> str:
        return f"item-{i}"

    plain = files(root)
    assert Keyed(plain, by_number).for_workers() is None
    for workers in (0, 2):
        loader = aioloader.DataLoader(
            Keyed(plain, by_number), batch_size=8, num_workers=workers,
            transform=keyed_summary, collate_fn=list,
        )  # fmt: skip
        assert [key for key, _, _ in listed(loader)] == [f"item-{i}" for i in range(FILES)]


def test_the_reader_pickles_names_failures_and_hints_a_cold_batch(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = files(root)
    assert ds.for_workers() is ds.for_workers()  # packed once per dataset
    reader = pickle.loads(pickle.dumps(ds.for_workers()))
    assert len(reader) == FILES and reader.key(3) == ds.key(3)

    def content(i: int) -> bytes:
        return payload(number(ds.key(i)))

    assert reader[3] == content(3) and reader.__getitems__([5, 1]) == [content(5), content(1)]
    with pytest.raises(IndexError):
        reader.__getitems__([1, FILES])

    hinted: list[str] = []
    monkeypatch.setattr(filereader, "will_need", hinted.append)
    monkeypatch.setattr(filereader, "COLD_READ_S", 3600.0)  # every read counts as warm
    reader.__getitems__([0, 1, 2])
    assert hinted == []  # warm reads: no hint
    monkeypatch.setattr(filereader, "COLD_READ_S", -1.0)  # every read counts as from the disk
    reader.__getitems__([0, 1, 2])
    assert hinted == [os.path.realpath(root / ds.key(k)) for k in (1, 2)]  # once, the rest

    (root / ds.key(2)).unlink()
    for call in (lambda: reader[2], lambda: reader.__getitems__([0, 2])):
        with pytest.raises(FileNotFoundError) as info:
            call()
        assert repr(ds.key(2)) in "\n".join(info.value.__notes__)


def test_the_reader_keeps_links_odd_names_and_negative_indices(root: Path) -> None:
    (root / "link.bin").symlink_to(root / "c1" / "005.bin")  # inside the root: listed
    (root / "alias").symlink_to(root / "c2", target_is_directory=True)
    odd = os.fsdecode(b"c3/\xff-caf\xc3\xa9.bin")  # not UTF-8, then UTF-8
    (root / odd).write_bytes(b"odd")
    ds = files(root, "**/*")
    reader = pickle.loads(pickle.dumps(ds.for_workers()))
    keys = ds.keys
    assert "link.bin" in keys and "alias/002.bin" not in keys  # ** does not enter linked folders
    assert [reader.key(i) for i in range(len(reader))] == keys
    assert reader.key(-1) == keys[-1] and reader[-1] == reader[len(keys) - 1]
    for i in range(len(keys)):
        assert reader[i] == (root / keys[i]).read_bytes(), keys[i]
    assert reader[keys.index("link.bin")] == payload(5)
    assert reader[keys.index(odd)] == b"odd"
    with pytest.raises(IndexError):
        reader.key(len(keys))
    with pytest.raises(IndexError):
        reader[-len(keys) - 1]

    linked = files(root, "alias/*")  # a pattern naming the linked folder lists it
    via = pickle.loads(pickle.dumps(linked.for_workers()))
    assert [via.key(i) for i in range(len(via))] == linked.keys
    assert via[0] == (root / linked.keys[0]).read_bytes()
    assert via.path(0) == os.path.realpath(root / "c2" / linked.keys[0].split("/")[1])


def big_listing(n: int = 40_000) -> FileReader:
    keys = [f"train/n{i % 1000:08d}/img_{i:08d}.JPEG" for i in range(n)]
    keys[5] = "caf\udce9/\u00e9t\u00e9.bin"  # not UTF-8 (surrogateescape), and not ASCII
    return FileReader("/data", keys, ["/data/" + key for key in keys])


def test_the_listing_pickles_whole_by_every_protocol_and_copies() -> None:
    reader = big_listing()
    wanted = [reader.key(i) for i in (0, 5, 39_999, -1)]
    buffers: list[pickle.PickleBuffer] = []
    out_of_band = pickle.dumps(reader, protocol=5, buffer_callback=buffers.append)
    assert len(out_of_band) < 10_000 and len(buffers) == 2  # the keys and their offsets
    copies = [
        pickle.loads(out_of_band, buffers=buffers),
        *(pickle.loads(pickle.dumps(reader, protocol=p)) for p in range(2, 6)),
        __import__("copy").deepcopy(reader),
    ]
    for copy in copies:
        assert len(copy) == 40_000
        assert [copy.key(i) for i in (0, 5, 39_999, -1)] == wanted
        assert copy.path(5) == "/data/" + wanted[1]


def test_a_start_s_workers_share_one_mapping_of_the_listing() -> None:
    """The keys and their offsets go out of band: every worker of a start maps them from one
    file in memory, where each unpickled a copy of its own."""
    reader = big_listing()
    dl = aioloader.DataLoader(wd.ListingKeys(reader, 24), batch_size=4, num_workers=2)
    got = [(key, files, mapped) for b in dl for key, files, mapped in zip(*b.values(), strict=True)]
    assert [key for key, _, _ in got] == [reader.key(i * 7) for i in range(24)]
    assert {int(files) for _, files, _ in got} == {40_000}
    assert {bool(mapped) for _, _, mapped in got} == {True}
