"""What an object store's listing holds besides samples, against moto's S3 server: folder
markers (zero-byte keys ending with ``/``, which obstore lists without the ``/``), a key obstore
cannot take as a path; and the ``suffix`` and ``glob`` arguments, checked before anything is
listed. Found by a review that trained from a bucket as a user would."""

from __future__ import annotations

import uuid
from typing import Any

import boto3
import obstore
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aioloader
from aioloader._cli.errors import explain
from aioloader.sources._markers import folder_markers
from tests.sources.test_objects import CREDS, _boto_creds


@pytest.fixture
def markers_bucket(s3_endpoint: str) -> dict[str, Any]:
    """``train/`` as the S3 console's "Create folder" leaves it: the folder's own marker, a
    marker beside the keys under it (``sub/``), one with none (``empty/``), and a real empty
    object (``zero.bin``) among the samples."""
    name = f"aioloader-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=s3_endpoint, **_boto_creds())
    client.create_bucket(Bucket=name)
    for key in ("train/", "train/sub/", "train/empty/"):
        client.put_object(Bucket=name, Key=key, Body=b"")
    for i in range(6):
        client.put_object(Bucket=name, Key=f"train/{i}.bin", Body=bytes([i]) * 3)
    client.put_object(Bucket=name, Key="train/sub/a.bin", Body=b"abc")
    client.put_object(Bucket=name, Key="train/zero.bin", Body=b"")
    options = {"config": {"endpoint": s3_endpoint, **CREDS}, "client_options": {"allow_http": True}}
    return {"url": f"s3://{name}/train/", "client": client, "bucket": name, **options}


SAMPLES = [f"{i}.bin" for i in range(6)] + ["sub/a.bin", "zero.bin"]


def options(bucket: dict[str, Any]) -> dict[str, Any]:
    return {"config": bucket["config"], "client_options": bucket["client_options"]}


async def test_objects_leave_folder_markers_out_and_keep_an_empty_object(
    markers_bucket: dict[str, Any],
) -> None:
    ds = aioloader.sources.objects(markers_bucket["url"], with_keys=True, **options(markers_bucket))
    assert sorted(ds.source.keys) == sorted(SAMPLES)
    # with a filter, a zero-byte key it keeps is a file, not asked for (a marker's name rarely
    # ends with a file's suffix; empty label files are common)
    filtered = aioloader.sources.objects(
        markers_bucket["url"], suffix=".bin", **options(markers_bucket)
    )
    assert sorted(filtered.keys) == sorted(SAMPLES)
    async with aioloader.DataLoader(ds, batch_size=3, collate_fn=list) as loader:
        got = dict([item async for batch in loader for item in batch])
    assert sorted(got) == sorted(SAMPLES) and got["zero.bin"] == b"" and got["sub/a.bin"] == b"abc"


async def test_object_stream_reads_past_folder_markers(markers_bucket: dict[str, Any]) -> None:
    stream = aioloader.sources.object_stream(markers_bucket["url"], **options(markers_bucket))
    async with aioloader.DataLoader(stream, batch_size=3, collate_fn=list) as loader:
        got = dict([item async for batch in loader for item in batch])
    assert sorted(got) == sorted(SAMPLES) and got["zero.bin"] == b""


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.lists(st.sampled_from(["a", "b", "a-b", "a.b"]), max_size=3).map("/".join),
        st.sampled_from([0, 0, 5]),
        max_size=12,
    )
)
def test_folder_markers_are_the_zero_byte_entries_with_keys_under_them(
    listing: dict[str, int],
) -> None:
    listed = sorted(listing.items())
    markers, unsure = folder_markers(listed)
    for path, size in listed:
        parent = any(other.startswith(path + "/") for other in listing)
        assert (path in markers) == (size == 0 and (path == "" or parent)), (path, listed)
        assert (path in unsure) == (size == 0 and path != "" and not parent)


def test_a_key_obstore_cannot_take_names_the_prefix_and_why(
    markers_bucket: dict[str, Any],
) -> None:
    bucket = markers_bucket
    bucket["client"].put_object(Bucket=bucket["bucket"], Key="train/logs//run.txt", Body=b"x")
    with pytest.raises(Exception) as info:  # obstore's InvalidPathError, its own type
        aioloader.sources.objects(bucket["url"], suffix=".bin", **options(bucket))
    assert type(info.value).__name__ == "InvalidPathError"
    (note,) = info.value.__notes__
    assert f"while listing {bucket['url']}" in note and "narrower prefix" in note


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"suffix": 5}, TypeError, "suffix must be a str or a sequence of str"),
        ({"suffix": b".jpg"}, TypeError, "suffix must be a str or a sequence of str"),
        ({"suffix": [".jpg", 3]}, TypeError, "suffix must be a str or a sequence of str"),
        ({"suffix": ""}, ValueError, "suffix must not be empty"),
        ({"suffix": ()}, ValueError, "suffix must name at least one"),
        ({"glob": 5}, TypeError, "glob must be a str"),
        ({"glob": ""}, ValueError, "glob must not be empty"),
    ],
)
def test_suffix_and_glob_are_checked_before_anything_is_listed(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        aioloader.sources.objects("memory:///", **kwargs)
    with pytest.raises(error, match=match):
        aioloader.sources.object_stream("memory:///", **kwargs)


def test_files_suffix_of_the_wrong_type_is_named(tmp_path: Any) -> None:
    with pytest.raises(TypeError, match="suffix must be a str or a sequence of str, got 5"):
        aioloader.sources.files(tmp_path, suffix=5)  # type: ignore[arg-type]


def test_a_set_of_suffixes_is_taken_as_before(tmp_path: Any) -> None:
    # the first check took a Sequence only, and refused the set that worked before
    for name in ("a.jpg", "b.png", "c.txt"):
        (tmp_path / name).write_bytes(b"x")
    assert len(aioloader.sources.files(tmp_path, suffix={".jpg", ".png"})) == 2
    assert len(aioloader.sources.objects(f"file://{tmp_path}/", suffix=frozenset({".txt"}))) == 1


async def test_a_missing_object_is_not_said_to_be_a_missing_bucket(
    markers_bucket: dict[str, Any],
) -> None:
    # S3's NoSuchKey says "The specified key does not exist.": the command line took it for
    # a missing bucket
    store = obstore.store.from_url(markers_bucket["url"], **options(markers_bucket))
    ds = aioloader.sources.ObjectDataset(store, markers_bucket["url"], ["gone.bin"])
    with pytest.raises(FileNotFoundError) as info:
        await ds.get(0)
    said = explain(info.value) or ""
    assert "bucket" not in said and "gone.bin" in said
