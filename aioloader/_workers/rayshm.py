"""A Ray worker on the loader's own node hands its result's tensors over in shared memory.

Ray's object store costs a batch of a few MB about 4 ms of round trip and 2 ms of the loader's
CPU here (a put in the actor, a get and our copy in the loader, measured on the 2-core machine:
``benchmarks`` in the CHANGELOG). An actor on the same node as the loader writes every tensor
of a result once into one file in ``/dev/shm`` (as a worker process packs its tensors into one
shared block) and replies with where each lies; the loader maps the file, unlinks it at once
(the mapping lives as long as the tensors that view it) and gets views of it, without a copy.
An actor on another node sends its tensors through the object store (``rayactor.py``).

Owns: writing a result's tensors into a block (:func:`to_shm`), taking them back
(:func:`from_shm`), letting go of a block nobody will read (:func:`discard`), and the block
names' prefix per pool, so a pool can remove what its killed actors left (:func:`sweep`), and
what pools of a loader process that was killed left (:func:`sweep_orphans`).
Never: touches Ray or an event loop.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from pathlib import Path
from typing import Any

import torch

from .._base.tree import map_instances, map_tensors, plain_cpu_tensor

__all__ = [
    "SHM_DIR",
    "ShmTensor",
    "discard",
    "from_shm",
    "probe",
    "sees",
    "sweep",
    "sweep_orphans",
    "to_shm",
]

SHM_DIR = Path("/dev/shm")
_ALIGN = 64  # bytes: every tensor starts on a cache line
_serial = itertools.count()


class ShmTensor:
    """Where one tensor of a result lies in a block file: the file, its size, the tensor's
    offset, dtype, shape in memory order and the permutation back to its own order."""

    __slots__ = ("block", "dtype", "nbytes", "offset", "order", "shape", "size")

    def __init__(
        self,
        block: str,
        size: int,
        offset: int,
        tensor: torch.Tensor,
        order: tuple[int, ...],
        shape: tuple[int, ...],
    ) -> None:
        self.block, self.size, self.offset = block, size, offset
        self.dtype, self.nbytes = tensor.dtype, tensor.nbytes
        self.order, self.shape = order, shape

    def __getstate__(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        for name, value in zip(self.__slots__, state, strict=True):
            setattr(self, name, value)


def _dense(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``t`` permuted to memory order when that is a dense block (else a contiguous copy in its
    own order), and the order."""
    strides = t.stride()
    order = sorted(range(t.dim()), key=lambda d: -strides[d])
    dense = t.permute(order)
    if not dense.is_contiguous():
        return t.contiguous(), tuple(range(t.dim()))
    return dense, tuple(order)


def to_shm(result: Any, prefix: str) -> Any:
    """``result`` with its plain CPU tensors written into one new block file named
    ``<prefix>-<pid>-<n>`` in :data:`SHM_DIR` and replaced by :class:`ShmTensor` s (none: the
    result as it is). In the actor.

    Raises:
        OSError: The block could not be made (``/dev/shm`` full or missing): nothing is left
            behind, and the caller sends the result another way.
    """
    found: list[torch.Tensor] = []

    def pick(t: torch.Tensor) -> torch.Tensor:
        if plain_cpu_tensor(t) and not t.requires_grad:
            found.append(t)
        return t

    map_tensors(pick, result)
    if not found:
        return result
    laid: dict[int, tuple[torch.Tensor, tuple[int, ...], int]] = {}
    size = 0
    for t in found:
        if id(t) in laid:
            continue
        dense, order = _dense(t.detach().resolve_conj().resolve_neg())
        laid[id(t)] = (dense, order, size)
        size += -(-dense.nbytes // _ALIGN) * _ALIGN
    size = max(size, 1)
    name = f"{prefix}-{os.getpid()}-{next(_serial)}"
    path = SHM_DIR / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        # Its pages reserved now: a tmpfs without room says so here (ENOSPC), not with a
        # SIGBUS as the copy touches a page it cannot have.
        os.posix_fallocate(fd, 0, size)
        block = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        for dense, _, offset in laid.values():
            part = block[offset : offset + dense.nbytes]
            part.view(dense.dtype).view(dense.shape).copy_(dense)
        del block

        def place(t: torch.Tensor) -> Any:
            if id(t) not in laid:
                return t
            dense, order, offset = laid[id(t)]
            return ShmTensor(name, size, offset, t, order, tuple(dense.shape))

        return map_tensors(place, result)
    except RuntimeError as exc:  # torch's own errors mapping it
        path.unlink(missing_ok=True)
        raise OSError(f"could not map {path}: {exc}") from exc
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def from_shm(result: Any) -> Any:
    """``result`` with its :class:`ShmTensor` s as tensors that view their block, each block
    unlinked as it is mapped (its memory goes with the last tensor viewing it). In the loader.

    Raises:
        OSError: A block is gone (its actor's pool swept it, or another process removed it).
    """
    blocks: dict[str, torch.Tensor] = {}

    def take(placed: ShmTensor) -> torch.Tensor:
        block = blocks.get(placed.block)
        if block is None:
            path = SHM_DIR / placed.block
            if not path.exists():
                raise FileNotFoundError(f"a Ray worker's result block is gone: {path}")
            block = torch.from_file(str(path), shared=True, size=placed.size, dtype=torch.uint8)
            path.unlink(missing_ok=True)
            blocks[placed.block] = block
        part = block[placed.offset : placed.offset + placed.nbytes]
        back = sorted(range(len(placed.order)), key=placed.order.__getitem__)
        return part.view(placed.dtype).view(placed.shape).permute(back)

    try:
        return map_instances(take, result, ShmTensor)
    except BaseException:
        discard(result)
        raise


def discard(result: Any) -> None:
    """Unlink the blocks of a result nobody will read (a cancelled job's reply)."""

    def drop(placed: ShmTensor) -> ShmTensor:
        with contextlib.suppress(OSError):
            (SHM_DIR / placed.block).unlink(missing_ok=True)
        return placed

    map_instances(drop, result, ShmTensor)


def probe(prefix: str) -> str | None:
    """Make an empty file named for the pool in :data:`SHM_DIR` and return its name (None
    without a ``/dev/shm``): an actor that sees it shares this machine's shared memory (a node
    id alone does not say so: a Ray Client's loader runs elsewhere)."""
    name = f"{prefix}-probe"
    try:
        (SHM_DIR / name).touch(mode=0o600, exist_ok=False)
    except OSError:
        return None
    return name


def sees(name: str | None) -> bool:
    """Whether the pool's probe file is visible here (in the actor)."""
    return name is not None and (SHM_DIR / name).exists()


def sweep_orphans() -> int:
    """Unlink the blocks and probes of pools whose loader process is gone (killed before it
    could close them: they would hold their memory until the machine restarts); how many.
    A pool's names carry its loader's pid (``aioloader-ray-<pid>-...``)."""
    gone = 0
    for path in SHM_DIR.glob("aioloader-ray-*-*"):
        pid = path.name.split("-")[2]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        with contextlib.suppress(OSError):
            path.unlink()
            gone += 1
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def sweep(prefix: str) -> int:
    """Unlink every block named with ``prefix`` (what killed actors of a pool left behind);
    how many there were."""
    gone = 0
    for path in SHM_DIR.glob(f"{prefix}-*"):
        with contextlib.suppress(OSError):
            path.unlink()
            gone += 1
    return gone
