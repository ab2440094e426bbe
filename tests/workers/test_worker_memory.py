"""A worker's memory: glibc's malloc keeps giving large blocks a mapping of their own (returned
when freed) in a worker process, where by default a freed large block raises the threshold and
later batch-sized buffers come from the heap, which keeps its high-water mark."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest
import torch
import torch.utils.data

import aioloader

MIB = 1 << 20


_MALLINFO2 = ("arena", "ordblks", "smblks", "hblks", "hblkhd")
_MALLINFO2 += ("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2]


def mapped_bytes_of_a_block_after_a_larger_one_was_freed() -> int:
    """Free a 16 MiB block, then hold an 8 MiB one: how many bytes more malloc has mapped
    (``hblkhd``) while it is held; 8 MiB when the threshold stayed put, 0 when it rose."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    large = bytearray(16 * MIB)
    del large
    before = libc.mallinfo2().hblkhd
    block = bytearray(8 * MIB)
    grown = int(libc.mallinfo2().hblkhd - before)
    del block
    return grown


class Probe(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> int:
        return mapped_bytes_of_a_block_after_a_larger_one_was_freed()


def glibc_with_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not glibc_with_mallinfo2(),
    reason="glibc's malloc (2.33 or later, for mallinfo2) is what this is about",
)
def test_a_worker_keeps_large_blocks_mapped_after_a_larger_one_was_freed() -> None:
    # The premise, in a fresh interpreter with glibc's defaults: the block comes from the heap.
    control = subprocess.run(
        [sys.executable, "-c", "from tests.workers.test_worker_memory import *; "
         "print(mapped_bytes_of_a_block_after_a_larger_one_was_freed())"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    assert int(control.stdout) == 0, control
    loader = aioloader.DataLoader(Probe(), batch_size=None, num_workers=1)
    with loader:
        grown = list(loader)
    assert grown == [8 * MIB + 4096] * 2 or all(g >= 8 * MIB for g in grown), grown
