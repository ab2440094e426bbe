"""Many tensors of a worker's result moved into one shared-memory block, so the result crosses
to the main process as one file descriptor instead of one per tensor.

torch's reductions share each tensor's storage on its own: a new shared-memory file, a copy,
and a descriptor handed over through torch's resource sharer (a socket connection per
descriptor on the receiving side). A batch that is a list of 32 tensors paid that 32 times.
Packing copies the tensors once into a single shared block and replaces them with views of it:
one descriptor for the whole result.

Owns: deciding which tensors may be packed and laying them out. Never: sends anything (the
worker pickles the packed result as before), or changes a value, a dtype, a shape or a stride.
"""

from __future__ import annotations

from typing import Any

import torch

from .._base.tree import map_tensors, plain_cpu_tensor, tensors_in

__all__ = ["alone_in_storage", "pack_tensors", "plain_values"]

_ALIGN = 64  # bytes: every view starts on a cache line, aligned for any dtype


_MAX_PACKED = 1 << 20  # bytes: a larger tensor is shared on its own, as torch does


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides = []
    step = 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def plain_values(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes are its values and may be copied elsewhere: a plain CPU tensor
    (``plain_cpu_tensor``), no autograd, not a conjugate or negative view."""
    return plain_cpu_tensor(t) and not t.requires_grad and not t.is_conj() and not t.is_neg()


def alone_in_storage(found: list[torch.Tensor]) -> list[torch.Tensor]:
    """The strided tensors of ``found`` (distinct objects) whose storage no other of them
    shares: moving one elsewhere keeps every aliasing (the others are left to torch's own
    sharing, which keeps it). Sparse tensors, which have no storage, are left out."""
    strided = [t for t in found if t.layout == torch.strided]
    owners: dict[int, int] = {}
    for t in strided:
        key = t.untyped_storage().data_ptr()
        owners[key] = owners.get(key, 0) + 1
    return [t for t in strided if owners[t.untyped_storage().data_ptr()] == 1]


def _packable(t: torch.Tensor) -> bool:
    return (
        plain_values(t)
        and t.nbytes <= _MAX_PACKED
        and t.stride() == _contiguous_strides(t.shape)  # exactly, size-1 dimensions too
    )


def pack_tensors(data: Any) -> Any:
    """``data`` with its small contiguous CPU tensors (up to 1 MiB each) moved into one
    shared-memory block, when there are at least two of them; other tensors, and tensors that
    share a storage with another tensor of ``data`` (their aliasing is kept by torch's own
    sharing), are left as they are.

    The packed tensors are views of the block, as the rows of a stacked batch are views of its
    storage: the block lives while any of them does, and ``torch.save`` of one writes the block
    (``.clone()`` gives a tensor of its own). A container that appears twice in ``data`` and
    holds a packed tensor arrives as two containers.

    Raises:
        RuntimeError: Shared memory could not be allocated.
    """
    found = tensors_in(data)
    if len(found) < 2:
        return data
    chosen = {
        id(t): t
        for t in alone_in_storage(found)
        if _packable(t) and not t.untyped_storage().is_shared()
    }
    if len(chosen) < 2:
        return data
    offsets: dict[int, int] = {}
    size = 0
    for key, t in chosen.items():
        offsets[key] = size
        size += -(-t.nbytes // _ALIGN) * _ALIGN
    block = torch.empty(size, dtype=torch.uint8)
    block.untyped_storage().share_memory_()

    def place(t: torch.Tensor) -> torch.Tensor:
        start = offsets.get(id(t))
        if start is None or chosen.get(id(t)) is not t:
            return t
        view: torch.Tensor = block[start : start + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        return view

    return map_tensors(place, data)
