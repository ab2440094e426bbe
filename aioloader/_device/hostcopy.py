"""Host copies for the device stage (into pinned memory) on a few threads of its own, never on
torch's OpenMP team.

torch's CPU ``copy_`` splits a large copy over an OpenMP team of one thread per core, and after
each copy libgomp's threads spin, waiting for more work, for milliseconds: beside a loader
that copies a batch every few tens of milliseconds, a core or more of the training process
spent spinning, taken from the workers. torch's own pin thread avoids it with
``torch.set_num_threads(1)``, which also changes the count that threads started later begin
with, and MKL's for the whole process, so the stage does not. NumPy's copy releases the GIL,
and the threads here block when idle. docs/design.md has the measurements (an H100 box, and
``benchmarks/bench_hostcopy.py`` on any machine).

Owns: copying a tensor into one of the same shape, dtype and layout, as bytes, split over
``threads`` threads (the calling one and a pool that waits, blocked, when idle); where the
pinned copies go (:func:`page_locked`, torch's caching host allocator). Never: copies
what has no flat byte view (not contiguous, conjugate or negative views, a dtype torch will not
view as bytes): those go through torch's ``copy_``.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

__all__ = ["HostCopy", "as_bytes", "page_locked"]

_MIN_PART = 1 << 20  # bytes: a copy is split only into parts at least this large
_ALIGN = 4096  # bytes: where parts start (whole pages)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor``'s memory as a flat ``uint8`` view, or None where it has none that holds its
    values: not contiguous, a conjugate or negative view (its bytes are not its values), or a
    dtype torch will not view as bytes."""
    if not tensor.is_contiguous() or tensor.is_conj() or tensor.is_neg():
        return None
    try:
        flat = tensor.detach().view(-1).view(torch.uint8)
    except RuntimeError:
        return None
    return flat if flat.numel() == tensor.numel() * tensor.element_size() else None


def page_locked(shape: torch.Size, strides: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An empty host tensor from torch's caching host allocator: page-locked, and reused only
    once the copies out of it that torch recorded (a ``non_blocking`` copy's event) are done."""
    return torch.empty_strided(shape, strides, dtype=dtype, pin_memory=True)


def _parts(nbytes: int, threads: int) -> list[tuple[int, int]]:
    """``[start, end)`` byte ranges covering ``nbytes``: up to ``threads`` of them, each at
    least ``_MIN_PART`` (one when the copy is small), starting on ``_ALIGN`` boundaries."""
    count = max(1, min(threads, nbytes // _MIN_PART))
    step = -(-nbytes // count // _ALIGN) * _ALIGN
    return [(start, min(start + step, nbytes)) for start in range(0, nbytes, step)]


class HostCopy:
    """Copies between host tensors on ``threads`` threads (see the module).

    Args:
        threads: Threads per copy, the calling one included (``threads - 1`` are started, on
            first use, named ``aioloader-copy_<n>``).

    Raises:
        ValueError: ``threads`` is less than 1.
    """

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self._pool = (
            ThreadPoolExecutor(threads - 1, thread_name_prefix="aioloader-copy")
            if threads > 1
            else None
        )

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` into ``dst`` (same shape and dtype; blocking, host memory both).

        Raises:
            RuntimeError: From torch's ``copy_``, for tensors it copies (shapes that differ).
        """
        target, source = as_bytes(dst), as_bytes(src)
        if target is None or source is None or target.numel() != source.numel():
            dst.copy_(src)
            return
        into, out_of = target.numpy(), source.numpy()
        if not into.size:
            return
        first, *rest = _parts(into.size, self.threads)
        pending: list[Future[None]] = []
        if self._pool is not None:
            pending = [
                self._pool.submit(np.copyto, into[a:b], out_of[a:b], casting="no") for a, b in rest
            ]
        try:
            np.copyto(into[first[0] : first[1]], out_of[first[0] : first[1]], casting="no")
        finally:
            errors = [f.exception() for f in pending]  # waits for every part
        if error := next((e for e in errors if e is not None), None):
            raise error

    def close(self) -> None:
        """Join the threads (after the copies running on them)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
