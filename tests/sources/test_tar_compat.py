"""Shards as people have them: written by ``webdataset`` itself (plain and compressed), by GNU
``tar`` and by ``tarfile``; read by ``tar_shards`` as webdataset's own reader reads them."""

from __future__ import annotations

import gc
import io
import os
import shutil
import subprocess
import tarfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import webdataset as wds
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from aioloader.sources import CorruptShardError, tar_shards
from aioloader.sources._braces import expand_braces
from tests.sources.test_tar import collect


def webdataset_reads(path: Path) -> list[dict[str, Any]]:
    """What webdataset's own pipeline gives for ``path``, one shard, in order. (It leaves the
    shard's file to the collector: its ResourceWarning is not ours.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        dataset = wds.WebDataset(str(path), shardshuffle=False, empty_check=False)
        samples = [dict(sample) for sample in dataset]
        del dataset
        gc.collect()
    return samples


def ours(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in s.items() if k != "__shard__"} for s in samples]


def write_with_webdataset(path: Path, *, compress: bool = False) -> None:
    with wds.TarWriter(str(path), compress=compress) as sink:
        for i in range(20):
            sink.write(
                {
                    "__key__": f"sample{i:04d}",
                    "JPG": os.urandom(100 + i),  # upper case: both read it as "jpg"
                    "cls": str(i).encode(),
                    "seg.PNG": b"png" * i,
                }
            )


@pytest.mark.parametrize("compress", [False, True], ids=["tar", "tar.gz"])
async def test_shards_written_by_webdataset_read_as_webdataset_reads_them(
    tmp_path: Path, compress: bool
) -> None:
    path = tmp_path / ("shard.tar.gz" if compress else "shard.tar")
    write_with_webdataset(path, compress=compress)
    want = webdataset_reads(path)
    assert len(want) == 20 and "jpg" in want[0] and "seg.png" in want[0]
    assert ours(await collect(tar_shards([path]))) == want


async def test_metadata_folders_are_skipped_as_webdataset_skips_them(tmp_path: Path) -> None:
    path = tmp_path / "meta.tar"
    with tarfile.open(path, "w") as tar:
        for name, data in [
            ("__info__/stats.json", b"{}"),
            ("__index__", b"..."),
            ("a/0001.txt", b"one"),
            ("a/0002.txt", b"two"),
        ]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    want = webdataset_reads(path)
    got = ours(await collect(tar_shards([path])))
    assert got == want and [s["__key__"] for s in got] == ["a/0001", "a/0002"]


async def test_contiguous_file_members_are_regular_files(tmp_path: Path) -> None:
    path = tmp_path / "cont.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in [("x.bin", b"contiguous"), ("x.txt", b"t")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.type = tarfile.CONTTYPE if name.endswith(".bin") else tarfile.REGTYPE
            tar.addfile(info, io.BytesIO(data))
    got = await collect(tar_shards([path]))
    assert [(s["__key__"], s["bin"], s["txt"]) for s in got] == [("x", b"contiguous", b"t")]
    assert ours(got) == webdataset_reads(path)


def write_sparse_shard(tmp_path: Path, fmt: str) -> Path:
    """A shard holding a sparse file, written by GNU tar in ``fmt``."""
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "0001.txt").write_bytes(b"before")
    with open(folder / "0002.bin", "wb") as f:  # a hole, then data: a sparse file
        f.seek(1 << 20)
        f.write(b"end")
    path = tmp_path / f"sparse-{fmt}.tar"
    subprocess.run(
        ["tar", f"--format={fmt}", "--sparse", "-cf", str(path), "-C", str(folder), "."],
        check=True,
    )
    return path


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs GNU tar on PATH")
@pytest.mark.parametrize("fmt", ["gnu", "pax"])
async def test_gnu_sparse_members_are_an_error_naming_the_member(tmp_path: Path, fmt: str) -> None:
    path = write_sparse_shard(tmp_path, fmt)
    with pytest.raises(CorruptShardError, match=r"0002\.bin' is a GNU sparse file"):
        await collect(tar_shards([path]))


async def test_a_corrupt_compressed_shard_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.tar.gz"
    write_with_webdataset(path, compress=True)
    data = bytearray(path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match=r"bad\.tar\.gz"):
        await collect(tar_shards([path]))


# -- shard lists, as webdataset expands them (braceexpand, and "::" between patterns) ---------

_words = st.text(alphabet="abc09", min_size=1, max_size=3)


@st.composite
def _ranges(draw: st.DrawFn) -> str:
    first, last = draw(st.integers(0, 30)), draw(st.integers(0, 30))
    width = draw(st.sampled_from([0, 2, 3]))
    step = draw(st.one_of(st.none(), st.integers(1, 4)))
    text = f"{first:0{width}d}..{last:0{width}d}" + ("" if step is None else f"..{step}")
    return "{" + text + "}"


_pieces = st.one_of(
    st.text(alphabet="ab/_-.", max_size=4),
    st.sampled_from(["\\{", "\\}"]),  # literal braces
    _ranges(),
    st.lists(_words, min_size=2, max_size=3).map(lambda ws: "{" + ",".join(ws) + "}"),
)


@settings(max_examples=300, deadline=None)
@given(
    patterns=st.lists(
        st.lists(_pieces, min_size=1, max_size=4).map("".join), min_size=1, max_size=3
    )
)
def test_a_shard_pattern_names_what_webdataset_expands_it_to(patterns: list[str]) -> None:
    # "a-{0..1}.tar::b-{0..1}.tar" (OpenCLIP's lists) was one name, a step range an error,
    # and an escaped brace expanded
    pattern = "::".join(patterns)
    assume(all(patterns) and "::" not in "".join(patterns))
    assert expand_braces(pattern) == wds.shardlists.expand_urls(pattern)


def test_an_ipv6_host_is_not_a_list_of_patterns() -> None:
    # webdataset splits "http://[::1]/x.tar" in three: its "::" is the host's
    assert expand_braces("http://[::1]:8000/a-{0..1}.tar::http://[fe80::2]/b.tar") == [
        "http://[::1]:8000/a-0.tar",
        "http://[::1]:8000/a-1.tar",
        "http://[fe80::2]/b.tar",
    ]
