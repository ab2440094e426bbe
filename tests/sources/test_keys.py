"""Sources carry their names: ``with_keys=True`` gives ``(key, bytes)``: a file's path under the
folder, an object's key under the prefix, a URL without its secrets; read as the plain source
is read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aioloader
from aioloader import DataLoader
from aioloader.sources import Keyed, files, objects, urls
from tests.sources.test_objects import bucket
from tests.support import http_server
from tests.support.http_server import FaultServer, body

fault_server = http_server.fault_server
__all__ = ["bucket", "fault_server"]


def folder(root: Path) -> None:
    for label in ("cat", "dog"):
        (root / label).mkdir()
        for i in range(5):
            (root / label / f"{i:03d}.jpg").write_bytes(f"{label}{i}".encode())


async def test_files_with_keys_name_each_file_and_read_a_slice_per_call(tmp_path: Path) -> None:
    folder(tmp_path)
    ds = files(tmp_path, suffix=".jpg", with_keys=True)
    assert isinstance(ds, Keyed) and len(ds) == 10
    assert type(ds).get_many is not aioloader.AsyncDataset.get_many  # still batched
    loader = DataLoader(ds, batch_size=4, collate_fn=list)
    async with loader:
        got = [item async for batch in loader for item in batch]
    assert got[0] == ("cat/000.jpg", b"cat0") and got[-1] == ("dog/004.jpg", b"dog4")
    labels = {key.split("/")[0] for key, _ in got}
    assert labels == {"cat", "dog"}


async def test_default_collate_gives_the_keys_beside_the_bytes(tmp_path: Path) -> None:
    folder(tmp_path)
    loader = DataLoader(files(tmp_path, with_keys=True), batch_size=3)
    async with loader:
        keys, blobs = await anext(aiter(loader))
    assert list(keys) == ["cat/000.jpg", "cat/001.jpg", "cat/002.jpg"]  # as torch's collate
    assert list(blobs) == [b"cat0", b"cat1", b"cat2"]


async def test_urls_with_keys_leave_the_query_out(fault_server: FaultServer) -> None:
    signed = [fault_server.url(i) + "?X-Amz-Signature=SECRET" for i in range(3)]
    ds = urls(signed, with_keys=True)
    loader = DataLoader(ds, batch_size=3, collate_fn=list)
    async with loader:
        (batch,) = [b async for b in loader]
    assert [key for key, _ in batch] == [fault_server.url(i) for i in range(3)]
    assert [data for _, data in batch] == [body(i) for i in range(3)]
    assert "SECRET" not in repr(batch)


async def test_objects_with_keys_name_the_key_under_the_prefix(bucket: dict[str, Any]) -> None:
    ds = objects(bucket["url"], store=bucket["store"], suffix=".bin", with_keys=True)
    key, data = await ds.get(3)
    assert key == "0003.bin" and data == (3).to_bytes(2, "little") * 512
