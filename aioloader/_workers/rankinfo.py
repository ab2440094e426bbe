"""The training process's rank, in its workers: ``torch.distributed`` answers there as the
worker's code asks it (``is_initialized()``, ``get_rank()``, ``get_world_size()``, and the
``RANK`` and ``WORLD_SIZE`` variables), where the main process has a default process group.

Owns: :func:`main_rank` (read in the main process as its workers start) and :func:`stand_in`
(applied in a worker before ``worker_init_fn``). Never: makes a process group or takes part
in a collective (a worker cannot: the group is the main process's).

Why: torch's fork workers are copies of the training process made after
``init_process_group``, and see its group; ours are forks of a server made earlier (as
aioloader is imported, or by the first loader), which has none. An ``IterableDataset`` that
shards by ``dist.get_rank()`` in ``__iter__`` (webdataset's ``split_by_node`` under
Lightning's launcher, which sets no ``RANK``) read the whole data on every rank, and a
``worker_init_fn`` that seeds by rank failed (found by review, under torchrun).
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

__all__ = ["main_rank", "stand_in"]


def main_rank() -> tuple[int, int] | None:
    """``(rank, world_size)`` of this process's default process group, or None without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def stand_in(rank: int, world_size: int) -> None:
    """In a worker without a process group: ``torch.distributed`` answers with the main
    process's rank and world size (any group asked about: the worker has only the default
    one's view), and ``RANK``/``WORLD_SIZE`` are set where they are not."""
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world_size))
    if not dist.is_available() or dist.is_initialized():
        return

    def is_initialized() -> bool:
        return True

    def get_rank(group: Any = None) -> int:
        return rank

    def get_world_size(group: Any = None) -> int:
        return world_size

    dist.is_initialized = is_initialized
    dist.get_rank = get_rank
    dist.get_world_size = get_world_size
