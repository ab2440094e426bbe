"""The device stage's host copies (``_device/hostcopy.py``): bit-exact in parts on threads of
their own, what has no byte view through torch's ``copy_``, errors after every part ended."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aioloader._device import hostcopy
from aioloader._device.hostcopy import HostCopy, as_bytes
from tests.device.test_device import bits, random_tensor


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


@given(nbytes=st.integers(0, 1 << 24), threads=st.integers(1, 8))
def test_parts_cover_the_bytes_once_aligned_and_no_smaller_than_the_minimum(
    nbytes: int, threads: int
) -> None:
    parts = hostcopy._parts(nbytes, threads) if nbytes else []
    assert sum(b - a for a, b in parts) == nbytes
    assert all(a % hostcopy._ALIGN == 0 for a, _ in parts)
    assert [a for a, _ in parts[1:]] == [b for _, b in parts[:-1]]  # contiguous, in order
    assert len(parts) <= max(1, threads)
    assert len(parts) == 1 or all(b - a >= hostcopy._MIN_PART // 2 for a, b in parts)


@pytest.mark.parametrize(
    "dtype", [torch.uint8, torch.float32, torch.int64, torch.bool, torch.bfloat16], ids=str
)
def test_a_copy_in_parts_on_three_threads_is_bit_exact(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hostcopy, "_MIN_PART", 4096)
    ran_on: set[str] = set()
    copyto = np.copyto

    def watched(*args: Any, **kwargs: Any) -> None:
        ran_on.add(threading.current_thread().name.rsplit("_", 1)[0])
        copyto(*args, **kwargs)

    monkeypatch.setattr(hostcopy.np, "copyto", watched)
    host = HostCopy(3)
    try:
        src = random_tensor((37, 91, 13), dtype, 1)  # not a multiple of a page
        dst = torch.empty_like(src)
        host.copy(dst, src)
        assert same_bits(dst, src)
        assert ran_on == {"MainThread", "aioloader-copy"}  # the caller and the pool
    finally:
        host.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("aioloader-copy")]


def test_what_has_no_byte_view_goes_through_torch() -> None:
    host = HostCopy(2)
    try:
        permuted = random_tensor((4, 5, 6), torch.float32, 2).permute(2, 0, 1)
        conj = random_tensor((8, 8), torch.complex64, 3).conj()
        for src in (permuted, conj):
            assert as_bytes(src) is None
            dst = torch.empty_like(src)
            host.copy(dst, src)
            assert same_bits(dst.resolve_conj(), src.resolve_conj())
        empty = torch.empty(0, 3)
        host.copy(torch.empty(0, 3), empty)  # nothing to copy: no error
    finally:
        host.close()


def test_a_part_that_fails_raises_after_every_part_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostcopy, "_MIN_PART", 4096)
    copyto, calls, done = np.copyto, [], []

    def failing(dst: np.ndarray, src: np.ndarray, **kwargs: Any) -> None:
        calls.append(threading.current_thread().name)
        if threading.current_thread().name.startswith("aioloader-copy"):
            raise MemoryError("pretend")
        copyto(dst, src, **kwargs)
        done.append(True)

    monkeypatch.setattr(hostcopy.np, "copyto", failing)
    host = HostCopy(2)
    try:
        src = random_tensor((1 << 16,), torch.uint8, 4)
        with pytest.raises(MemoryError, match="pretend"):
            host.copy(torch.empty_like(src), src)
        assert len(calls) == 2 and done == [True]  # the caller's part ran to its end
    finally:
        host.close()


def test_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        HostCopy(0)
