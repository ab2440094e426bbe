"""Resuming streams mid-epoch: tar shards (several open at once, the shuffle buffer), an
interleave of parts, an object store's listing (moto), a user's stream that defines
``state_dict``/``load_state_dict``; and a stream that cannot resume, named."""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import tarfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import obstore
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import aioloader
from aioloader import DataLoader
from aioloader.sources import tar_shards
from aioloader.sources._tarstream import read_located
from tests.sources.test_objects import bucket
from tests.sources.test_remote_tar import serve_shards
from tests.sources.test_tar import make_shard, make_shards
from tests.support import http_server
from tests.support.helpers import stop_and_resume
from tests.support.http_server import FaultServer

fault_server = http_server.fault_server
__all__ = ["bucket", "fault_server"]  # the fixtures, used here


def keys(batch: list[dict[str, Any]]) -> list[str]:
    return [f"{s['__key__']}@{Path(s['__shard__']).name}" for s in batch]


def tar_loader(paths: list[Path], **kw: Any) -> DataLoader[Any]:
    options = {
        "shuffle_shards": True,
        "shuffle_buffer": 10,
        "shards_in_flight": 3,
        "seed": 5,
        **kw.pop("tar", {}),
    }
    return DataLoader(
        tar_shards([str(p) for p in paths], **options), batch_size=4, collate_fn=keys, **kw
    )


@pytest.mark.parametrize("stop", [0, 1, 6, 17, 22, 23])
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"in_order": False},
        {"num_workers": 2},
        {"tar": {"shuffle_buffer": 0, "shuffle_shards": False}},
        {"tar": {"shards_in_flight": 1}},
    ],
    ids=["buffer", "out-of-order", "workers", "plain", "one-at-a-time"],
)
def test_tar_shards_resume_exactly(tmp_path: Path, stop: int, kw: dict[str, Any]) -> None:
    """7 shards of 13 samples, 3 read at once, through a buffer of 10: whatever the stop, the
    samples after it are the uninterrupted epoch's, in its order."""
    paths = make_shards(tmp_path, n_shards=7, n_samples=13)
    full, first, rest, state = stop_and_resume(lambda: tar_loader(paths, **kw), stop)
    assert len(full) == 23  # 91 samples in batches of 4
    if kw.get("in_order", True):
        assert first + rest == full
    else:
        assert sorted(map(tuple, first + rest)) == sorted(map(tuple, full))
    if stop == 0:  # the epoch's start, naming this rank's split (what merge_states needs)
        assert state["stream"]["position"] == 0 and state["stream"]["dataset"]["cursor"] is None
        assert state["stream"]["dataset"]["split"] == [0, 1]
    else:
        assert state["stream"]["position"] > 0


def test_compressed_shards_resume_too(tmp_path: Path) -> None:
    paths = make_shards(tmp_path, n_shards=4, n_samples=9)
    zipped = []
    for p in paths:
        z = p.with_suffix(".tar.gz")
        z.write_bytes(gzip.compress(p.read_bytes()))
        zipped.append(z)
    full, first, rest, _ = stop_and_resume(lambda: tar_loader(zipped), 4)
    assert first + rest == full


def test_a_tar_state_of_other_shards_or_settings_is_refused(tmp_path: Path) -> None:
    paths = make_shards(tmp_path, n_shards=5, n_samples=6)
    loader = tar_loader(paths)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    it.close()
    fewer = tar_loader(paths[:4])
    with pytest.raises(ValueError, match="dataset of other shards"):
        fewer.load_state_dict(state)
        list(fewer)
    wider = tar_loader(paths, tar={"shards_in_flight": 2})
    wider.load_state_dict(state)
    with pytest.raises(ValueError, match="shards_in_flight must be the same"):
        list(wider)
    smaller = tar_loader(paths, tar={"shuffle_buffer": 3})
    smaller.load_state_dict(state)
    with pytest.raises(ValueError, match=r"another plan of the epoch.*shuffle_buffer"):
        list(smaller)


def test_a_tar_state_of_another_seed_or_rank_is_refused(tmp_path: Path) -> None:
    paths = make_shards(tmp_path, n_shards=4, n_samples=6)
    loader = tar_loader(paths, tar={"rank": 0, "world_size": 2})
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    it.close()
    for other, said in (
        ({"rank": 0, "world_size": 2, "seed": 6}, "of another tar_shards"),
        ({"rank": 1, "world_size": 2}, "rank 0's of 2; this tar_shards is rank 1 of 2"),
    ):
        resumed = tar_loader(paths, tar=other)
        resumed.load_state_dict(state)
        with pytest.raises(ValueError, match=said):
            list(resumed)
    # A state saved before issue 26 names no split: its plan's digest still tells ranks apart,
    # and it still resumes the rank it was saved by.
    old = json.loads(json.dumps(state))
    for key in ("dataset", "seed", "shuffle_shards", "split", "pieces"):
        del old["stream"]["dataset"][key]
    resumed = tar_loader(paths, tar={"rank": 1, "world_size": 2})
    resumed.load_state_dict(old)
    with pytest.raises(ValueError, match="saved for another plan of the epoch"):
        list(resumed)
    full = list(tar_loader(paths, tar={"rank": 0, "world_size": 2}))
    again = tar_loader(paths, tar={"rank": 0, "world_size": 2})
    again.load_state_dict(old)
    assert list(again) == full[1:]


def test_an_interleave_resumes_its_parts(tmp_path: Path) -> None:
    async def part(start: int) -> AsyncIterator[int]:
        for i in range(start, start + 7):
            yield i

    parts = [lambda s=s: part(100 * s) for s in range(5)]

    def make() -> DataLoader[Any]:
        ds = aioloader.interleave(parts, in_flight=2, shuffle=True, seed=3)
        return DataLoader(ds, batch_size=3, collate_fn=list)

    full, first, rest, state = stop_and_resume(make, 4)
    assert first + rest == full and len(full) == 12
    assert state["stream"]["dataset"]["parts"] == 5


async def test_an_object_stream_resumes_at_its_listing_position(bucket: dict[str, Any]) -> None:
    def make() -> DataLoader[Any]:
        ds = aioloader.sources.object_stream(bucket["url"], store=bucket["store"], suffix=".bin")
        return DataLoader(ds, batch_size=6, collate_fn=lambda b: [k for k, _ in b])

    loader = make()
    async with loader:
        batches = aiter(loader)
        first = [await anext(batches) for _ in range(2)]
        state = loader.state_dict()
    assert state["stream"]["dataset"] == {"after": "0011.bin"}
    obstore.put(bucket["store"], "0005b.bin", b"added before the stop's position: not read")
    obstore.put(bucket["store"], "0099.bin", b"added after it: read")
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(state)))
    async with resumed:
        rest = [k async for batch in resumed for k in batch]
    assert [k for b in first for k in b] == [f"{i:04d}.bin" for i in range(12)]
    assert rest == [f"{i:04d}.bin" for i in range(12, 40)] + ["0099.bin"]


class Counter(aioloader.AsyncIterableDataset[int]):
    """A user's stream that takes part: its state is where its iterator is."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.at = 0
        self.start = 0

    def __aiter__(self) -> AsyncIterator[int]:
        return self._items()

    async def _items(self) -> AsyncIterator[int]:
        self.at = self.start
        self.start = 0
        while self.at < self.n:
            self.at += 1
            yield self.at - 1

    def state_dict(self) -> dict[str, Any]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.start = state["at"]


class TorchCounter(torch.utils.data.IterableDataset[int]):
    """The same for a torch ``IterableDataset`` (read on the loader's thread)."""

    def __init__(self, n: int) -> None:
        self.n, self.at, self.start = n, 0, 0

    def __iter__(self) -> Iterator[int]:
        self.at, self.start = self.start, 0
        while self.at < self.n:
            self.at += 1
            yield self.at - 1

    def state_dict(self) -> dict[str, Any]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.start = state["at"]


@pytest.mark.parametrize("kind", [Counter, TorchCounter])
@pytest.mark.parametrize("in_order", [True, False])
def test_a_users_stream_that_defines_state_dict_resumes(kind: type, in_order: bool) -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(kind(50), batch_size=8, collate_fn=list, in_order=in_order)

    full, first, rest, state = stop_and_resume(make, 3)
    assert sorted(map(tuple, first + rest)) == sorted(map(tuple, full))
    if in_order:
        assert first + rest == full
        assert state["stream"] == {"batch": 3, "position": 24, "dataset": {"at": 24}}


async def generator() -> AsyncIterator[int]:
    for i in range(10):
        yield i


class NotJSON(Counter):
    def state_dict(self) -> dict[str, Any]:
        return {"at": {self.at}}  # a set


class Plain(torch.utils.data.IterableDataset[int]):
    """Neither it nor its iterator keeps a state."""

    def __iter__(self) -> Iterator[int]:
        return iter(range(10))


@pytest.mark.parametrize(
    ("dataset", "words"),
    [
        (generator, "its dataset function is a stream without state_dict"),
        (Plain(), "neither it nor the iterator its __iter__\\(\\) gives defines state_dict"),
    ],
)
def test_a_stream_that_cannot_resume_is_named_once_batches_are_taken(
    dataset: Any, words: str
) -> None:
    loader = DataLoader(dataset, batch_size=2)
    start = loader.state_dict()  # an epoch's start needs no place in the stream
    assert (start["epoch"], start["taken"], start["stream"]) == (
        0,
        {"through": 0, "beyond": []},
        None,
    )
    it = iter(loader)
    assert next(it).tolist() == [0, 1]
    with pytest.raises(TypeError, match=words):
        loader.state_dict()
    assert next(it).tolist() == [2, 3]  # the refusal lost nothing
    it.close()
    assert DataLoader(dataset, batch_size=2, seed=0).state_dict()["epoch"] == 0


def test_a_stream_that_cannot_resume_is_named() -> None:
    with pytest.raises(TypeError, match="split across ranks by distributed=True"):
        DataLoader(Counter(9), batch_size=2, distributed=True, rank=0, world_size=2).state_dict()
    loader = DataLoader(NotJSON(9), batch_size=2, collate_fn=list)
    it = iter(loader)
    next(it)
    with pytest.raises(TypeError, match=r"NotJSON\.state_dict\(\) is not JSON-serialisable"):
        loader.state_dict()
    it.close()


def test_a_stream_state_is_not_loaded_into_a_map_style_loader(tmp_path: Path) -> None:
    loader = DataLoader(Counter(9), batch_size=2, collate_fn=list)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="state is of a stream dataset"):
        DataLoader(list(range(9)), batch_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="is of a stream"):
        aioloader.merge_states([state])


class Live(Counter):
    """Its state_dict gives the same dict each time, changed in place as it reads on."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.live = {"at": 0}

    async def _items(self) -> AsyncIterator[int]:
        async for item in super()._items():
            self.live["at"] = self.at
            yield item

    def state_dict(self) -> dict[str, Any]:
        return self.live


def test_a_state_kept_by_reference_is_copied_at_each_batch() -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(Live(100), batch_size=4, collate_fn=list, prefetch=8)

    full, first, rest, state = stop_and_resume(make, 3)
    assert state["stream"]["dataset"] == {"at": 12}  # not where the read-ahead was
    assert first + rest == full


class FailsAt10(Counter):
    async def _items(self) -> AsyncIterator[int]:
        async for item in super()._items():
            if item == 10:
                raise OSError("bad record 10")
            yield item


def test_a_stream_that_failed_is_read_again_from_before_its_failure() -> None:
    """A stream source's failure ends its epoch and is not taken: a resumed epoch reads the
    stream again from the last batch before it (and fails there again, as itself)."""
    loader = DataLoader(FailsAt10(20), batch_size=4, collate_fn=list)
    it = iter(loader)
    head = [next(it), next(it)]
    with pytest.raises(OSError, match="bad record 10"):
        next(it)
    state = loader.state_dict()
    it.close()
    assert state["taken"]["through"] == 2 and state["stream"]["position"] == 8
    again = DataLoader(FailsAt10(20), batch_size=4, collate_fn=list)
    again.load_state_dict(state)
    with pytest.raises(OSError, match="bad record 10"):
        list(again)
    fixed = DataLoader(Counter(20), batch_size=4, collate_fn=list)
    fixed.load_state_dict(state)
    assert head + list(fixed) == [list(range(i, i + 4)) for i in range(0, 20, 4)]


@pytest.mark.parametrize(
    "change",
    [{"order": [7, 9]}, {"slots": [True, 0]}, {"pos": 1, "closed": 3}, {"rng": None}],
)
def test_a_malformed_interleave_state_is_refused(tmp_path: Path, change: dict[str, Any]) -> None:
    from aioloader._fanin.interleave import Interleave

    order = Interleave(3, random.Random(1))
    order.turn()
    order.drew()
    state = {**order.to_json(), **change}
    with pytest.raises(ValueError, match="interleave's state"):
        Interleave.from_json(state, random.Random(1))


async def test_a_resumed_shard_is_read_from_its_offset_not_its_start(
    tmp_path: Path, fault_server: FaultServer
) -> None:
    """Over HTTP: the open shards are asked for from the byte after their last sample taken
    (a range request), and the shuffle buffer's samples from their own offsets."""
    paths = make_shards(tmp_path, n_shards=4, n_samples=30)
    urls = serve_shards(fault_server, paths)

    def make() -> DataLoader[Any]:
        ds = tar_shards(urls, shards_in_flight=2, shuffle_buffer=5, seed=1, chunk_size=512)
        return DataLoader(ds, batch_size=4, collate_fn=keys)

    async with make() as loader:
        full = [b async for b in loader]
    async with make() as loader:
        batches = aiter(loader)
        head = [await anext(batches) for _ in range(9)]
        state = json.loads(json.dumps(loader.state_dict()))
    ends = state["stream"]["dataset"]["ends"]
    assert ends and all(end > 0 for end in ends.values())
    fault_server.ranges.clear()
    resumed = make()
    resumed.load_state_dict(state)
    async with resumed:
        rest = [b async for b in resumed]
    assert head + rest == full
    starts = {int(r[6:-1]) for r in fault_server.ranges if r.startswith("bytes=")}
    assert set(ends.values()) <= starts  # each open shard from its offset


@given(n=st.integers(1, 12), cut=st.integers(0, 12), long=st.booleans())
@settings(max_examples=40, deadline=None)
def test_a_shard_read_from_a_samples_end_goes_on_with_the_next(
    tmp_path_factory: pytest.TempPathFactory, n: int, cut: int, long: bool
) -> None:
    """Spans, on files tarfile writes (long names as pax headers too): reading from the end
    of sample ``k`` gives samples ``k + 1..``; from its start, sample ``k`` and on."""
    folder = tmp_path_factory.mktemp("spans")
    stem = "d/" + "x" * 120 if long else "d/s"
    members = [
        (f"{stem}{j:03d}.{ext}", f"{j}{ext}".encode() * (j + 1))
        for j in range(n)
        for ext in ("a", "b")
    ]
    path = make_shard(folder / "s.tar", members, fmt=tarfile.PAX_FORMAT)
    data = path.read_bytes()

    async def read(start: int) -> list[tuple[dict[str, Any], int | None, int | None]]:
        async def chunks() -> AsyncIterator[bytes]:
            for i in range(start, len(data), 700):
                yield data[i : i + 700]

        return [s async for s in read_located("s", chunks(), start=start)]

    whole = asyncio.run(read(0))
    k = cut % n
    _, begin, end = whole[k]
    assert [s for s, _, _ in asyncio.run(read(end))] == [s for s, _, _ in whole[k + 1 :]]
    assert [s for s, _, _ in asyncio.run(read(begin))] == [s for s, _, _ in whole[k:]]


@pytest.mark.parametrize(("width", "stop"), [(3, 1), (16, 1), (16, 2), (5, 1)])
def test_a_state_saved_before_every_shard_was_open_resumes(
    tmp_path: Path, width: int, stop: int
) -> None:
    """Saved with a slot still empty: the resumed interleave's first turn takes the next
    shard while its plan reopens the others (found by review: a KeyError)."""
    paths = make_shards(tmp_path, n_shards=20, n_samples=5)

    def make() -> DataLoader[Any]:
        ds = tar_shards([str(p) for p in paths], shards_in_flight=width, seed=2)
        return DataLoader(ds, batch_size=2, collate_fn=keys)

    full, first, rest, _ = stop_and_resume(make, stop)
    assert first + rest == full


def test_an_interleave_saved_early_resumes(tmp_path: Path) -> None:
    async def part(start: int) -> AsyncIterator[int]:
        for i in range(start, start + 4):
            yield i

    parts = [lambda s=s: part(100 * s) for s in range(6)]

    def make() -> DataLoader[Any]:
        return DataLoader(aioloader.interleave(parts, in_flight=3), batch_size=2, collate_fn=list)

    full, first, rest, _ = stop_and_resume(make, 1)
    assert first + rest == full
