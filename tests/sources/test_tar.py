"""``aioloader.sources._tar``: WebDataset tar shards written with ``tarfile``, streamed back."""

from __future__ import annotations

import asyncio
import gc
import io
import logging
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aioloader
from aioloader.sources._tar import CorruptShardError, TarShards, tar_shards
from aioloader.sources._tarfmt import TarParser
from tests.support import worker_fns

EXTS = ("jpg", "cls", "seg.png")


def local(path: Path) -> dict[str, str]:
    """The fields naming a local shard, as webdataset names them (and ``__shard__``, ours)."""
    return {"__url__": str(path), "__local_path__": str(path), "__shard__": str(path)}


def payload(shard: int, sample: int, ext: str) -> bytes:
    return f"<{shard}/{sample}.{ext}>".encode() * (1 + sample % 3)


def add(tar: tarfile.TarFile, name: str, data: bytes, kind: bytes = tarfile.REGTYPE) -> None:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def make_shard(
    path: Path,
    members: Sequence[tuple[str, bytes]],
    fmt: int = tarfile.USTAR_FORMAT,
) -> Path:
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data in members:
            add(tar, name, data)
    return path


def make_shards(root: Path, n_shards: int = 3, n_samples: int = 10) -> list[Path]:
    paths = []
    for s in range(n_shards):
        members = [
            (f"s{s}/{j:04d}.{ext}", payload(s, j, ext)) for j in range(n_samples) for ext in EXTS
        ]
        paths.append(make_shard(root / f"shard-{s}.tar", members))
    return paths


async def collect(ds: TarShards) -> list[dict[str, Any]]:
    return [sample async for sample in ds]


def keys(samples: Sequence[dict[str, Any]]) -> list[str]:
    return [s["__key__"] for s in samples]


ALL_KEYS = sorted(f"s{s}/{j:04d}" for s in range(3) for j in range(10))


async def test_grouping_keys_extensions_and_bytes(tmp_path: Path) -> None:
    paths = make_shards(tmp_path)
    got = await collect(tar_shards(paths, shards_in_flight=1))
    assert len(got) == 30
    for i, sample in enumerate(got):
        s, j = divmod(i, 10)
        assert sample == {
            "__key__": f"s{s}/{j:04d}",
            "__url__": str(paths[s]),
            "__local_path__": str(paths[s]),
            "__shard__": str(paths[s]),
            **{ext: payload(s, j, ext) for ext in EXTS},
        }


async def test_directories_and_links_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "mixed.tar"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        add(tar, "d", b"", tarfile.DIRTYPE)
        add(tar, "d/1.txt", b"one")
        info = tarfile.TarInfo("d/1.lnk")
        info.type = tarfile.SYMTYPE
        info.linkname = "1.txt"
        tar.addfile(info)
        add(tar, "./d/2.txt", b"two")
    got = await collect(tar_shards([path]))
    assert got == [
        {"__key__": "d/1", **local(path), "txt": b"one"},
        {"__key__": "d/2", **local(path), "txt": b"two"},
    ]


async def test_loader_reads_every_sample_once_per_epoch(tmp_path: Path) -> None:
    ds = tar_shards(make_shards(tmp_path), shuffle_shards=True, shuffle_buffer=7, seed=5)
    loader: aioloader.DataLoader[list[dict[str, Any]]] = aioloader.DataLoader(
        ds, batch_size=4, collate_fn=list
    )
    epochs = []
    async with loader:
        for _ in range(2):
            batches = [b async for b in loader]
            assert all(len(b) == 4 for b in batches[:-1])
            epochs.append(keys([x for b in batches for x in b]))
    for order in epochs:
        assert sorted(order) == ALL_KEYS
    assert epochs[0] != epochs[1]


async def test_shuffle_is_a_seeded_permutation(tmp_path: Path) -> None:
    paths = make_shards(tmp_path)

    async def order(seed: int, epoch: int) -> list[str]:
        ds = tar_shards(paths, shuffle_shards=True, shuffle_buffer=8, seed=seed)
        ds.set_epoch(epoch)
        return keys(await collect(ds))

    first = await order(1, 0)
    assert sorted(first) == ALL_KEYS
    assert first != ALL_KEYS
    assert await order(1, 0) == first
    assert await order(1, 1) != first
    assert await order(2, 0) != first
    # Each __aiter__ starts the next epoch.
    ds = tar_shards(paths, shuffle_shards=True, shuffle_buffer=8, seed=1)
    assert keys(await collect(ds)) == first
    assert keys(await collect(ds)) == await order(1, 1)


async def test_no_shuffle_keeps_the_stream_order(tmp_path: Path) -> None:
    paths = make_shards(tmp_path)
    one_by_one = tar_shards(paths, shards_in_flight=1)
    assert keys(await collect(one_by_one)) == ALL_KEYS
    assert keys(await collect(one_by_one)) == ALL_KEYS
    # Several shards at once: a round-robin over them, whatever the timing.
    round_robin = [f"s{s}/{j:04d}" for j in range(10) for s in range(3)]
    ds = tar_shards(paths)
    assert ds.shards_in_flight(3) == 3
    assert keys(await collect(ds)) == round_robin
    assert keys(await collect(tar_shards(paths, shards_in_flight=8))) == round_robin


async def test_shards_in_flight_interleave_and_the_next_shard_takes_the_place(
    tmp_path: Path,
) -> None:
    paths = make_shards(tmp_path, n_shards=3, n_samples=10)
    short = make_shard(tmp_path / "short.tar", [("t/0000.cls", b"0"), ("t/0001.cls", b"1")])
    ds = tar_shards([paths[0], short, paths[1], paths[2]], shards_in_flight=2)
    got = keys(await collect(ds))
    assert got[:6] == ["s0/0000", "t/0000", "s0/0001", "t/0001", "s0/0002", "s1/0000"]
    assert sorted(got) == sorted([*ALL_KEYS, "t/0000", "t/0001"])


async def test_the_seeded_interleave_is_the_same_for_the_same_seed(tmp_path: Path) -> None:
    paths = make_shards(tmp_path, n_shards=3, n_samples=10)

    async def run(seed: int) -> list[str]:
        return keys(await collect(tar_shards(paths, shuffle_shards=True, seed=seed)))

    first = await run(4)
    assert first == await run(4)
    assert sorted(first) == ALL_KEYS
    assert first != await run(5)


async def test_rank_split_is_disjoint_and_even(tmp_path: Path) -> None:
    paths = make_shards(tmp_path, n_shards=4, n_samples=5)
    everything = sorted(keys(await collect(tar_shards(paths))))
    for epoch in range(2):
        per_rank = []
        for rank in range(2):
            ds = tar_shards(paths, shuffle_shards=True, seed=9, rank=rank, world_size=2)
            ds.set_epoch(epoch)
            assert len(ds.epoch_shards(epoch)) == 2
            per_rank.append(keys(await collect(ds)))
        assert len(per_rank[0]) == len(per_rank[1]) == 10
        assert not set(per_rank[0]) & set(per_rank[1])
        assert sorted(per_rank[0] + per_rank[1]) == everything


async def test_uneven_shards_drop_the_tail(tmp_path: Path) -> None:
    paths = make_shards(tmp_path, n_shards=5, n_samples=2)
    names = {str(p) for p in paths}
    for epoch in range(3):
        chosen = []
        for rank in range(2):
            ds = tar_shards(paths, shuffle_shards=True, seed=4, rank=rank, world_size=2)
            ds.set_epoch(epoch)
            shards = ds.epoch_shards(epoch)
            assert len(shards) == 2
            got = await collect(ds)
            assert len(got) == 4
            assert {s["__shard__"] for s in got} == set(shards)
            chosen += shards
        assert len(set(chosen)) == 4 and set(chosen) < names


async def test_fewer_shards_than_ranks_is_an_error_not_an_empty_epoch(tmp_path: Path) -> None:
    # Every rank's epoch was empty, without a word: a DDP job training on nothing.
    paths = make_shards(tmp_path, n_shards=3, n_samples=2)
    for rank in range(4):
        with pytest.raises(ValueError, match=r"3 parts .* among 4 ranks"):
            await collect(tar_shards(paths, rank=rank, world_size=4))


def test_a_loader_given_distributed_refuses_shards_already_split_by_rank(tmp_path: Path) -> None:
    # Under torchrun the loader kept half of each rank's shards, without a word.
    paths = make_shards(tmp_path, n_shards=4, n_samples=2)
    with pytest.raises(ValueError, match="would split TarShards a second time"):
        aioloader.DataLoader(tar_shards(paths), distributed=True)
    with pytest.raises(ValueError, match="would split TarShards a second time"):
        aioloader.DataLoader(tar_shards(paths, rank=0, world_size=2), distributed=True)
    # Every rank reading every shard: the loader's split is the only one.
    aioloader.DataLoader(tar_shards(paths, world_size=1), distributed=True)


@pytest.mark.parametrize("name", ["../evil.txt", "/abs.txt", "a/../../b.txt"])
async def test_escaping_names_are_rejected(tmp_path: Path, name: str) -> None:
    path = make_shard(tmp_path / "evil.tar", [("ok.txt", b"fine"), (name, b"bad")])
    with pytest.raises(ValueError, match=r"evil\.tar") as info:
        await collect(tar_shards([path]))
    message = str(info.value)
    assert repr(name) in message
    assert "offset 1024" in message  # the second header: 512 header + 512 data block


async def test_truncated_member_names_shard_and_offset(tmp_path: Path) -> None:
    path = make_shard(tmp_path / "cut.tar", [("a.bin", b"x" * 3000), ("b.bin", b"y" * 3000)])
    data = path.read_bytes()
    path.write_bytes(data[: 512 * 8 + 100])  # inside b.bin's data (its header is at 3584)
    ds = tar_shards([path], chunk_size=700)
    got = []
    with pytest.raises(CorruptShardError, match=r"cut\.tar.*truncated") as info:
        async for sample in ds:
            got.append(sample)
    assert got == []  # "a" is complete only once the next member's key is known
    assert "offset 4096" in str(info.value)
    assert "b.bin" in str(info.value)


async def test_missing_end_of_archive_is_truncation(tmp_path: Path) -> None:
    path = make_shard(tmp_path / "cut.tar", [("a.bin", b"x" * 512)])
    path.write_bytes(path.read_bytes()[:1024])
    with pytest.raises(CorruptShardError, match="offset 1024"):
        await collect(tar_shards([path]))


async def test_flipped_header_byte_fails_the_checksum(tmp_path: Path) -> None:
    path = make_shard(tmp_path / "flip.tar", [("a.bin", b"x" * 10), ("b.bin", b"y" * 10)])
    data = bytearray(path.read_bytes())
    data[1024 + 1] ^= 0x01  # the second header's name
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match=r"flip\.tar.*offset 1024.*checksum"):
        await collect(tar_shards([path]))


async def test_non_octal_size_is_corrupt(tmp_path: Path) -> None:
    path = make_shard(tmp_path / "size.tar", [("a.bin", b"x" * 10)])
    data = bytearray(path.read_bytes())
    data[124:136] = b"00000000z12\0"
    rechecksum(data, 0)
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match=r"size\.tar.*offset 0.*not octal"):
        await collect(tar_shards([path]))


async def test_big_member_streams_in_small_chunks(tmp_path: Path) -> None:
    big = bytes(range(256)) * (3 * 1024 * 4)  # 3 MiB
    path = make_shard(
        tmp_path / "big.tar", [("x/1.bin", big), ("x/1.txt", b"t"), ("x/2.bin", b"z" * 7)]
    )
    got = await collect(tar_shards([path], chunk_size=64 * 1024))
    assert keys(got) == ["x/1", "x/2"]
    assert got[0]["bin"] == big and got[0]["txt"] == b"t"
    assert got[1]["bin"] == b"z" * 7


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
async def test_long_names(tmp_path: Path, fmt: int) -> None:
    folder = "/".join(["d" * 60] * 4)
    members = [(f"{folder}/0001.jpg", b"j"), (f"{folder}/0001.cls", b"c")]
    path = make_shard(tmp_path / "long.tar", members, fmt=fmt)
    got = await collect(tar_shards([path], chunk_size=100))
    assert got == [
        {
            "__key__": f"{folder}/0001",
            **local(path),
            "jpg": b"j",
            "cls": b"c",
        }
    ]


async def test_long_escaping_name_is_rejected(tmp_path: Path) -> None:
    name = "a" * 120 + "/../../x.txt"
    path = make_shard(tmp_path / "longevil.tar", [(name, b"x")], fmt=tarfile.GNU_FORMAT)
    with pytest.raises(ValueError, match=r"longevil\.tar.*'\.\.'"):
        await collect(tar_shards([path]))


async def test_early_stop_closes_the_shard(tmp_path: Path) -> None:
    paths = make_shards(tmp_path)
    # Small buffers, so the readers still hold their shards open when the first sample comes.
    ds = tar_shards(paths, shuffle_buffer=3, chunk_size=512, buffer_bytes=1024)
    it = ds.__aiter__()
    first = await it.__anext__()
    assert first["__key__"] in ALL_KEYS
    assert open_shards(paths) > 0
    await it.aclose()  # type: ignore[attr-defined]
    assert open_shards(paths) == 0
    # A fresh epoch after an early stop starts from the beginning.
    assert sorted(keys(await collect(ds))) == ALL_KEYS


async def test_an_iterator_dropped_unclosed_closes_its_shards(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``async for ... break`` with no ``aclose``: the epoch's task is cancelled when the
    iterator goes, from whatever task collects it, and no error is logged."""
    paths = make_shards(tmp_path)
    ds = tar_shards(paths, chunk_size=512, buffer_bytes=1024)
    async for _ in ds:
        break
    assert open_shards(paths) > 0
    gc.collect()
    for _ in range(50):
        if open_shards(paths) == 0:
            break
        await anyio.sleep(0.01)
    assert open_shards(paths) == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_corrupt_shard_closes_the_others_still_open(tmp_path: Path) -> None:
    paths = make_shards(tmp_path, n_shards=4, n_samples=200)
    data = paths[2].read_bytes()
    paths[2].write_bytes(data[:3000])  # cut inside its first members
    ds = tar_shards(paths, shards_in_flight=4, chunk_size=512, buffer_bytes=2048)
    with pytest.raises(CorruptShardError, match=r"shard-2\.tar.*truncated"):
        async for _ in ds:
            assert open_shards(paths) > 0
    assert open_shards(paths) == 0


def open_shards(paths: Sequence[Path]) -> int:
    """How many file descriptors of this process are open on ``paths``."""
    names = {str(p) for p in paths}
    fds = Path("/proc/self/fd")
    return sum(1 for fd in fds.iterdir() if _target(fd) in names)


def _target(fd: Path) -> str:
    try:
        return str(fd.readlink())
    except OSError:
        return ""


def test_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one"):
        tar_shards([])
    with pytest.raises(TypeError):
        tar_shards(b"a.tar")  # type: ignore[arg-type]
    assert tar_shards("a.tar").shards == ["a.tar"]  # a string is a (brace) pattern
    with pytest.raises(ValueError, match="shuffle_buffer"):
        tar_shards(["a.tar"], shuffle_buffer=-1)
    with pytest.raises(ValueError, match="chunk_size"):
        tar_shards(["a.tar"], chunk_size=0)
    with pytest.raises(ValueError, match="shards_in_flight must be a positive int"):
        tar_shards(["a.tar"], shards_in_flight=0)
    with pytest.raises(TypeError, match="shards_in_flight"):
        tar_shards(["a.tar"], shards_in_flight=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="buffer_bytes"):
        tar_shards(["a.tar"], buffer_bytes=0)
    with pytest.raises(ValueError, match=r"shards\[1\] 's3:///shard-1\.tar' names no bucket"):
        tar_shards(["s3://b/shard-0.tar", "s3:///shard-1.tar"])
    with pytest.raises(ValueError, match=r"shards\[0\] 'http:///x\.tar' names no host"):
        tar_shards(["http:///x.tar"])
    assert tar_shards(["file:///data/x.tar"]).shards == ["file:///data/x.tar"]
    with pytest.raises(ValueError, match="rank"):
        tar_shards(["a.tar"], rank=2, world_size=2)


def rechecksum(data: bytearray, at: int) -> None:
    header = data[at : at + 512]
    chk = sum(header[:148]) + 8 * 32 + sum(header[156:])
    data[at + 148 : at + 156] = b"%06o\0 " % chk


async def test_gnu_base256_size(tmp_path: Path) -> None:
    path = make_shard(tmp_path / "b256.tar", [("a.bin", b"x" * 10), ("a.txt", b"t")])
    data = bytearray(path.read_bytes())
    data[124:136] = b"\x80" + (10).to_bytes(11, "big")
    rechecksum(data, 0)
    path.write_bytes(bytes(data))
    got = await collect(tar_shards([path]))
    assert got == [
        {
            "__key__": "a",
            **local(path),
            "bin": b"x" * 10,
            "txt": b"t",
        }
    ]


async def test_repeated_extension_is_rejected(tmp_path: Path) -> None:
    path = make_shard(tmp_path / "dup.tar", [("a.bin", b"1"), ("a.bin", b"2")])
    with pytest.raises(ValueError, match=r"dup\.tar.*'a\.bin'.*offset 1024.*repeats"):
        await collect(tar_shards([path]))


async def test_missing_shard_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        await collect(tar_shards([tmp_path / "nope.tar"]))
    assert "nope.tar" in "\n".join(info.value.__notes__)


# -- the parser, fed any split of bytes tarfile wrote --------------------------------------------

member_names = st.tuples(
    st.text("abcxyz_-", min_size=1, max_size=6).map(lambda d: "d" * 120 + d),  # long: GNU/pax
    st.text("abc0123", min_size=1, max_size=8),
).map(lambda t: "/".join(t)) | st.text("abc0123", min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(
    samples=st.lists(
        st.tuples(member_names, st.lists(st.binary(max_size=1500), min_size=1, max_size=3)),
        min_size=1,
        max_size=6,
        unique_by=lambda s: s[0],
    ),
    fmt=st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT]),
    cuts=st.lists(st.integers(min_value=1, max_value=3000), min_size=1, max_size=40),
)
def test_parser_gives_tarfiles_members_for_any_chunking(
    samples: list[tuple[str, list[bytes]]], fmt: int, cuts: list[int]
) -> None:
    if fmt == tarfile.USTAR_FORMAT:
        samples = [(key[-20:], values) for key, values in samples]  # ustar: short names only
        if len({key for key, _ in samples}) < len(samples):
            return
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt) as tar:
        for key, values in samples:
            for n, value in enumerate(values):
                add(tar, f"{key}.e{n}", value)
    data = buffer.getvalue()
    parser = TarParser("mem.tar")
    got: list[dict[str, Any]] = []
    at = 0
    for cut in cuts * (len(data) // sum(cuts) + 1):
        got += parser.feed(data[at : at + cut])
        at += cut
        if at >= len(data):
            break
    got += parser.finish()
    want = [
        {
            "__key__": key,
            "__url__": "mem.tar",
            "__shard__": "mem.tar",
            **{f"e{n}": v for n, v in enumerate(values)},
        }
        for key, values in samples
    ]
    assert got == want


def test_plain_for_with_worker_processes_and_a_break(tmp_path: Path) -> None:
    paths = make_shards(tmp_path, n_shards=4, n_samples=40)
    ds = tar_shards(paths, chunk_size=512, buffer_bytes=2048)
    loader: aioloader.DataLoader[list[str]] = aioloader.DataLoader(
        ds, batch_size=8, num_workers=2, transform=worker_fns.sample_key, collate_fn=list
    )
    every = [key for batch in loader for key in batch]
    assert sorted(every) == sorted(f"s{s}/{j:04d}" for s in range(4) for j in range(40))
    # The transform in the workers keeps the interleave's order.
    assert every == keys(asyncio.run(collect(tar_shards(paths))))
    for batch in loader:
        assert len(batch) == 8
        break
    loader.close()
    assert open_shards(paths) == 0


def test_samples_before_a_bad_header_in_the_same_chunk_come_first(tmp_path: Path) -> None:
    members = [(f"{j:04d}.txt", b"x" * 10) for j in range(5)]
    data = bytearray(make_shard(tmp_path / "bad.tar", members).read_bytes())
    data[3 * 1024 + 100] ^= 0xFF  # the fourth member's header: its checksum fails
    for chunk in (len(data), 512, 700):
        parser = TarParser("bad.tar")
        got: list[str] = []
        with pytest.raises(CorruptShardError, match="offset 3072: header checksum"):
            for at in range(0, len(data), chunk):
                got += [s["__key__"] for s in parser.feed(bytes(data[at : at + chunk]))]
                parser.check()
            parser.finish()
        assert got == ["0000", "0001"]  # "0002" is complete only once the next key is known


def test_a_shard_cut_in_a_members_padding_names_the_padding(tmp_path: Path) -> None:
    data = make_shard(tmp_path / "pad.tar", [("a.bin", b"x" * 513)]).read_bytes()
    parser = TarParser("pad.tar")
    parser.feed(data[: 512 + 600])
    with pytest.raises(CorruptShardError, match="padding needs 511 bytes at offset 1025"):
        parser.finish()
    parser = TarParser("pad.tar")
    parser.feed(data[: 512 + 100])
    with pytest.raises(CorruptShardError, match=r"member 'a\.bin'.*needs 513 bytes at offset 512"):
        parser.finish()


async def test_the_loaders_epoch_reaches_the_shards(tmp_path: Path) -> None:
    paths = make_shards(tmp_path)

    def shards() -> TarShards:
        return tar_shards(paths, shuffle_shards=True, shuffle_buffer=5, seed=2)

    async def order(epoch: int) -> list[str]:
        ds = shards()
        ds.set_epoch(epoch)
        return keys(await collect(ds))

    loader: aioloader.DataLoader[list[dict[str, Any]]] = aioloader.DataLoader(
        shards(), batch_size=5, collate_fn=list
    )
    loader.set_epoch(3)
    async with loader:
        assert keys([s async for b in loader for s in b]) == await order(3)
        assert keys([s async for b in loader for s in b]) == await order(4)
    loader.set_epoch(7)
    assert keys([s for b in loader for s in b]) == await order(7)  # a plain for too

    per_slot: aioloader.DataLoader[Any] = aioloader.DataLoader(
        shards().per_slot(2), batch_size=2, collate_fn=list
    )
    per_slot.set_epoch(5)
    async with per_slot:
        got = [s.sample["__key__"] async for b in per_slot for s in b]
    direct = shards().per_slot(2)
    direct.set_epoch(5)
    assert got == [s.sample["__key__"] async for s in direct]
    assert got != [s.sample["__key__"] async for s in shards().per_slot(2)]  # epoch 0
