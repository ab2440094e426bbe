"""The device side of the device stage: which device ``device=`` means, the CUDA calls (a side
stream, events, the consumer's hand-over), and the pool of page-locked buffers.

Owns: resolving ``device=`` (:func:`resolve_device`), the :class:`Accelerator` seam and its CUDA
implementation, and :class:`PinnedPool`. Never: walks batches or decides when to copy
(``_device/stage.py``).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

__all__ = [
    "Accelerator",
    "CudaAccelerator",
    "Event",
    "PinnedPool",
    "cuda_index",
    "resolve_device",
    "size_class",
]

_MIN_BUFFER = 1 << 16  # the smallest pinned buffer: tiny batches share one size class


def cuda_index(
    requested: int | None, *, local_rank: str | None, count: int, current: Callable[[], int]
) -> int:
    """The CUDA device a ``device=`` argument means: its index when it has one; for a bare
    ``"cuda"``, the local rank's device under torchrun (``LOCAL_RANK``) when it names a visible
    device, else the current device (with one visible device per process, that one).

    Raises:
        ValueError: The index names no visible device, or ``LOCAL_RANK`` is not an int.
    """
    if requested is not None:
        if not 0 <= requested < count:
            raise ValueError(
                f"device: CUDA device {requested} does not exist ({count} visible device(s))"
            )
        return requested
    if local_rank is not None:
        try:
            rank = int(local_rank)
        except ValueError:
            raise ValueError(
                f"device='cuda': the environment's LOCAL_RANK={local_rank!r} is not an int"
            ) from None
        if 0 <= rank < count:
            return rank
    return current()


def resolve_device(device: object) -> torch.device | None:
    """Check ``device=`` and resolve it: None stays None, a CPU device is returned as it is, and
    ``"cuda"`` becomes the CUDA device it means (see :func:`cuda_index`).

    Raises:
        TypeError: ``device`` is not a string, a ``torch.device`` or None.
        ValueError: ``device`` is not a device, is neither CPU nor CUDA, names a missing CUDA
            device, or names CUDA while CUDA is not available.
    """
    if device is None:
        return None
    if not isinstance(device, str | torch.device):
        raise TypeError(
            f"device must be a str, a torch.device or None, got {type(device).__qualname__}"
        )
    try:
        target = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device={device!r} is not a device: {exc}") from None
    if target.type == "cpu":
        return target
    if target.type != "cuda":
        raise ValueError(
            f"device={device!r}: the device stage moves batches to 'cuda' devices (or leaves "
            f"them on 'cpu'), not to {target.type!r}"
        )
    if not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} needs CUDA, but torch.cuda.is_available() is False; pass "
            "device='cpu' or None to keep batches on the host"
        )
    index = cuda_index(
        target.index,
        local_rank=os.environ.get("LOCAL_RANK"),
        count=torch.cuda.device_count(),
        current=torch.cuda.current_device,
    )
    return torch.device("cuda", index)


# -- the accelerator seam ---------------------------------------------------------------------


class Event(Protocol):
    """A point on the side stream: complete once everything issued before it is done."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class Accelerator(Protocol):
    """The device-specific calls of the stage. All but :meth:`hand_over` run on the stage's
    thread; :meth:`hand_over` runs on the consumer's."""

    device: torch.device

    def open(self) -> None:
        """Initialise the device for this thread and create the side stream."""

    def side(self) -> AbstractContextManager[Any]:
        """Make the side stream current (allocations and kernels go to it)."""

    def pinned(self, nbytes: int) -> torch.Tensor:
        """A new page-locked ``uint8`` host buffer of ``nbytes``."""

    def register(self, address: int, nbytes: int) -> Callable[[], object] | None:
        """Page-lock ``nbytes`` of host memory at ``address`` in place, for copies to the
        device at a pinned buffer's speed: the call that undoes it, or None where the device
        refuses (the caller copies through a pinned buffer instead)."""

    def record(self) -> Event:
        """An event at the current end of the side stream."""

    def hand_over(self, event: Event, tensors: Sequence[torch.Tensor]) -> None:
        """Make the calling thread's current stream wait for ``event``, and tell the allocator
        that ``tensors`` are used on that stream."""

    def close(self) -> None:
        """Wait until everything issued on the side stream is done."""


class CudaAccelerator:
    """One CUDA device: a dedicated stream for the copies, events on it, pinned buffers."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: torch.cuda.Stream | None = None

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            raise RuntimeError("the device stage is not open")
        return self._stream

    def open(self) -> None:
        # The stage's thread allocates (pinned memory, copies) on this device, never on device 0
        # (a context there per rank would waste memory on every GPU but the first).
        torch.cuda.set_device(self.device)
        # torch's constructor is unannotated
        self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        # A runtime call on this thread: the device's primary context is current here from
        # now on (register() calls the driver, which needs one; a stream from torch's pool may
        # have been made on another thread).
        self._stream.synchronize()

    def side(self) -> AbstractContextManager[Any]:
        return torch.cuda.stream(self._side_stream())

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def register(self, address: int, nbytes: int) -> Callable[[], object] | None:
        # The driver's call, not the runtime's cudaHostRegister (torch.cuda.cudart()): a
        # refusal there stays pending on the thread, and torch's next kernel-launch check
        # reports it as its own error. Called on the stage's thread, which made the side
        # stream: the device's primary context is current there; without one, it refuses.
        driver = _driver()
        if driver is None:
            return None
        context = ctypes.c_void_p()
        if driver.cuCtxGetCurrent(ctypes.byref(context)) != 0 or not context.value:
            return None
        if driver.cuMemHostRegister_v2(address, nbytes, _REGISTER_PORTABLE) != 0:
            return None
        return lambda: driver.cuMemHostUnregister(address)

    def record(self) -> Event:
        # blocking: a host wait on it sleeps rather than spins (torch's constructor is unannotated)
        event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        event.record(self._side_stream())
        return event

    def hand_over(self, event: Event, tensors: Sequence[torch.Tensor]) -> None:
        if not isinstance(event, torch.cuda.Event):
            raise TypeError(f"expected a torch.cuda.Event, got {type(event).__qualname__}")
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(event)
        for tensor in tensors:
            tensor.record_stream(stream)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()


_REGISTER_PORTABLE = 1  # CU_MEMHOSTREGISTER_PORTABLE: page-locked for every context


@functools.cache
def _driver() -> ctypes.CDLL | None:
    """The CUDA driver's library, with the calls :meth:`CudaAccelerator.register` makes typed;
    None where it cannot be loaded."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        register = driver.cuMemHostRegister_v2
        unregister = driver.cuMemHostUnregister
        current = driver.cuCtxGetCurrent
    except (OSError, AttributeError):
        return None
    register.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint)
    unregister.argtypes = (ctypes.c_void_p,)
    current.argtypes = (ctypes.POINTER(ctypes.c_void_p),)
    register.restype = unregister.restype = current.restype = ctypes.c_int
    return driver


# -- pinned buffers ----------------------------------------------------------------------------


def size_class(nbytes: int) -> int:
    """The buffer size serving ``nbytes``: the next power of two, at least 64 KiB (torch's
    pinned allocator rounds to powers of two too, so finer classes would save nothing)."""
    return max(_MIN_BUFFER, 1 << max(0, nbytes - 1).bit_length())


class PinnedPool:
    """Page-locked ``uint8`` host buffers, reused across batches, in power-of-two sizes.

    A buffer given back stays busy until its event completes (the copies out of it are done);
    only then can :meth:`take` hand it out again. At most ``capacity`` buffers exist: when they
    all do and none that is free fits, :meth:`take` waits for the oldest busy one, or replaces
    the smallest free one. Not thread-safe: the device stage uses it from its one thread.

    Args:
        allocate: Makes a new page-locked buffer of the given size.
        capacity: The most buffers that may exist at once (at least 1).
    """

    def __init__(self, allocate: Callable[[int], torch.Tensor], capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.allocations = 0  # buffers ever allocated
        self.waits = 0  # times take() waited for a copy to finish
        self._allocate = allocate
        self._free: list[torch.Tensor] = []
        self._busy: deque[tuple[torch.Tensor, Event]] = deque()
        self._lent = 0

    @property
    def count(self) -> int:
        """Buffers that exist now: free, busy or lent out."""
        return len(self._free) + len(self._busy) + self._lent

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` that no copy is reading. May block (waiting for the
        oldest copy to finish): call it off the event loop."""
        size = size_class(nbytes)
        while True:
            self._reclaim()
            fits = [i for i, b in enumerate(self._free) if b.numel() >= size]
            if fits:
                buffer = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                break
            if self.count < self.capacity or not (self._busy or self._free):
                buffer = self._allocate(size)
                self.allocations += 1
                break
            if self._busy:
                self.waits += 1
                self._busy[0][1].synchronize()  # events on one stream complete in order
            else:  # every buffer is free and too small: replace the smallest
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))
        self._lent += 1
        return buffer

    def give_back(self, buffer: torch.Tensor, event: Event) -> None:
        """Return a buffer from :meth:`take`; it is reused once ``event`` has completed."""
        self._lent -= 1
        self._busy.append((buffer, event))

    def discard(self, buffer: torch.Tensor) -> None:
        """Forget a buffer from :meth:`take` that cannot be known to be idle (never reused)."""
        self._lent -= 1

    def clear(self) -> None:
        """Wait for every copy out of a busy buffer, then drop all buffers."""
        while self._busy:
            self._busy.popleft()[1].synchronize()
        self._free.clear()

    def _reclaim(self) -> None:
        while self._busy and self._busy[0][1].query():
            self._free.append(self._busy.popleft()[0])
