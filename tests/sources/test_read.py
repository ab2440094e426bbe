"""Reading a local file whole in four system calls (``sources/_read.py``): the same bytes as
``open().read()``, to the end of a file that grows while it is read, errors with their own
types, and no descriptor left open."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from aioloader.sources._read import read_file


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 16384, (1 << 20) + 3])
def test_the_bytes_of_a_file_of_any_size(tmp_path: Path, size: int) -> None:
    path = tmp_path / "f.bin"
    data = os.urandom(size)
    path.write_bytes(data)
    assert read_file(str(path)) == data == path.read_bytes()


def test_a_file_that_grows_while_read_is_read_to_its_end(tmp_path: Path) -> None:
    """A FIFO's size is 0 when it is opened: everything after the first byte comes from the
    reads that follow, until the writer closes it."""
    path = tmp_path / "fifo"
    os.mkfifo(path)
    parts = [b"a" * 10, b"b" * 70_000, b"c"]

    def write() -> None:
        with open(path, "wb", buffering=0) as f:
            for part in parts:
                f.write(part)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert read_file(str(path)) == b"".join(parts)
    finally:
        writer.join(5)


def test_errors_keep_their_types_and_leave_no_descriptor(tmp_path: Path) -> None:
    before = open_fds()
    with pytest.raises(FileNotFoundError):
        read_file(str(tmp_path / "missing"))
    with pytest.raises(IsADirectoryError):
        read_file(str(tmp_path))
    (tmp_path / "ok").write_bytes(b"x")
    for _ in range(50):
        read_file(str(tmp_path / "ok"))
    assert open_fds() == before
