"""Many tensors of a worker's result moved into one shared-memory block, so the result crosses
to the main process as one file descriptor instead of one per tensor; and a job's tensors, so
that it crosses to its worker as one, and the main process's own tensors stay where they are.

torch's reductions share each tensor's storage on its own: a new shared-memory file, a copy,
and a descriptor handed over (beside the message: ``fdpass.py``), mapped on the receiving
side. A batch that is a list of 32 tensors paid that 32 times. Packing copies the tensors
once into a single shared block and replaces them with views of it: one descriptor for the
whole result. Sharing a storage moves it into shared memory where it is: a job's samples,
kept by the main process's dataset (an in-memory cache), each became a segment of its own,
open as a descriptor for as long as the dataset lived (1,280 cached images sent once: 1,280
descriptors), and a transform that changed its sample in place in the worker changed the
dataset's; two rows of a dataset's tensor in one job moved the whole tensor. A job's tensors
are copied into a block of the job's own instead, whatever their size (the copy torch's
sharing would make), views of one storage each on its own and a permuted view with its
strides; a gapped view (a strided slice) still goes torch's way.

Owns: deciding which tensors may be packed and laying them out. Never: sends anything (the
worker pickles the packed result as before), or changes a value, a dtype, a shape or a stride.
"""

from __future__ import annotations

from typing import Any

import torch

from .._base.tree import map_tensors, plain_cpu_tensor, tensors_in

__all__ = ["alone_in_storage", "memory_order", "pack_tensors", "plain_values", "shared_storage"]

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


def shared_storage(size: int) -> torch.UntypedStorage:
    """``size`` bytes made in shared memory, as torch's sharing strategy makes them (not made
    here and copied there: ``share_memory_`` copies, with every intra-op thread, which then
    spin for more work, on the training process's cores)."""
    return torch.UntypedStorage._new_shared(size)  # type: ignore[no-untyped-call,no-any-return]


def memory_order(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The permutation of ``tensor``'s dimensions whose ``permute`` is contiguous (the
    identity for a contiguous tensor); None when it has none (overlapping or gapped)."""
    identity = tuple(range(tensor.dim()))
    if tensor.is_contiguous():
        return identity
    strides = tensor.stride()
    order = tuple(sorted(identity, key=lambda d: (-strides[d], d)))
    return order if tensor.permute(order).is_contiguous() else None


def _packable(t: torch.Tensor, most: int | None, *, dense: bool) -> bool:
    return (
        plain_values(t)
        and (most is None or t.nbytes <= most)
        and (
            memory_order(t) is not None  # any permutation of a contiguous layout
            if dense
            else t.stride() == _contiguous_strides(t.shape)  # exactly, size-1 dimensions too
        )
    )


def pack_tensors(
    data: Any, *, at_least: int = 2, most: int | None = _MAX_PACKED, aliased: bool = False
) -> Any:
    """``data`` with its contiguous CPU tensors of up to ``most`` bytes each (None: any size)
    copied into one shared-memory block, when there are at least ``at_least`` of them; other
    tensors, tensors already in shared memory, and tensors that share a storage with another
    tensor of ``data`` (their aliasing is kept by torch's own sharing), are left as they are.
    With ``aliased`` (a job's tensors, whose storages are the main process's: a row of a
    dataset's tensor, a permuted view of a cached image), tensors that share a storage are
    copied each on its own too (the aliasing between them is not kept), and so are dense
    tensors of any memory order (their strides kept); a gapped view goes torch's way.

    The packed tensors are views of the block, as the rows of a stacked batch are views of its
    storage: the block lives while any of them does, and ``torch.save`` of one writes the block
    (``.clone()`` gives a tensor of its own). A container that appears twice in ``data`` and
    holds a packed tensor arrives as two containers.

    Raises:
        RuntimeError: Shared memory could not be allocated.
    """
    found = tensors_in(data)
    if len(found) < at_least:
        return data
    candidates = found if aliased else alone_in_storage(found)
    chosen = {
        id(t): t
        for t in candidates
        if _packable(t, most, dense=aliased) and not t.untyped_storage().is_shared()
    }
    if not chosen or len(chosen) < at_least:
        return data
    offsets: dict[int, int] = {}
    size = 0
    for key, t in chosen.items():
        offsets[key] = size
        size += -(-t.nbytes // _ALIGN) * _ALIGN
    block = shared_storage(size)

    def place(t: torch.Tensor) -> torch.Tensor:
        start = offsets.get(id(t))
        if start is None or chosen.get(id(t)) is not t:
            return t
        view = t.new_empty(0).set_(block, start // t.element_size(), t.shape, t.stride())
        view.copy_(t)
        return view

    return map_tensors(place, data)
