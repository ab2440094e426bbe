"""torch's DataPipes in the loader, as torch's ``DataLoader`` runs them: ``shuffle`` switches a
pipe's shufflers, each epoch seeds them all alike, and each reader (a worker, or the main process
without workers) keeps its share of a ``sharding_filter``.

Owns: :func:`is_datapipe`, :func:`set_shuffle`, :func:`epoch_seed`, :func:`seed_pipe`,
:func:`shard_here` and :func:`shard_in_worker`. Never: iterates a pipe.

torch's ``DataLoader`` sets a pipe's shufflers on or off as it is built (``shuffle``, left as
the pipe says when None), draws a shared seed at each epoch from ``generator`` (or torch's
default generator), and seeds every random pipe in the graph with it, in every reader alike:
the same shuffled stream everywhere, which each reader's ``sharding_filter`` then divides.
Without workers the main process is the instance ``rank`` of ``world_size``; worker ``i`` is
instance ``i * world_size + rank`` of ``num_workers * world_size`` (torch.distributed's rank
and world size where it is initialised, else 0 and 1). Without this, every worker read the
whole pipe: each sample came ``num_workers`` times.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.data
import torch.utils.data.graph_settings as graph_settings

from .sharding import resolve_rank

__all__ = [
    "epoch_seed",
    "is_datapipe",
    "seed_pipe",
    "set_shuffle",
    "shard_here",
    "shard_in_worker",
]

_ITERABLE: tuple[type, ...] = ()
_PIPES: tuple[type, ...] = ()
if isinstance(getattr(torch.utils.data, "IterDataPipe", None), type):  # (DataPipes may go)
    _ITERABLE = (torch.utils.data.IterDataPipe,)
    _PIPES = (torch.utils.data.IterDataPipe, torch.utils.data.MapDataPipe)


def is_datapipe(dataset: object) -> bool:
    """Whether ``dataset`` is one of torch's DataPipes (iterable or map-style)."""
    return isinstance(dataset, _PIPES)


def set_shuffle(dataset: object, shuffle: bool | None) -> None:
    """Turn a pipe's shufflers on or off (None: as the pipe has them), as torch's
    ``DataLoader`` does as it is built; any other dataset is left alone."""
    if shuffle is not None and is_datapipe(dataset):
        graph_settings.apply_shuffle_settings(dataset, shuffle=shuffle)  # type: ignore[arg-type]


def epoch_seed(
    dataset: object, generator: torch.Generator | None, drawn: int | None = None
) -> int | None:
    """An epoch's shared seed for an iterable pipe (None for any other dataset): ``drawn``
    where it was drawn already, else drawn now as torch draws it: from ``generator``, else
    torch's default generator (so ``torch.manual_seed`` before an epoch repeats its order)."""
    if not isinstance(dataset, _ITERABLE):
        return None
    if drawn is not None:
        return drawn
    seed = torch.empty((), dtype=torch.int64).random_(generator=generator)
    return int(seed.item())


def seed_pipe(pipe: Any, seed: int) -> None:
    """Seed every random pipe in the graph from ``seed`` (the same in every reader)."""
    rng = torch.Generator()
    rng.manual_seed(seed)
    graph_settings.apply_random_seed(pipe, rng)


def shard_here(pipe: Any) -> None:
    """Keep this process's share of the pipe's ``sharding_filter``, read without workers: its
    rank's of the world (all of it in a world of one)."""
    rank, world_size = resolve_rank(None, None)
    graph_settings.apply_sharding(pipe, world_size, rank)


def shard_in_worker(
    worker_init_fn: Callable[[int], object] | None, rank: int, world_size: int, worker_id: int
) -> None:
    """In a worker, as its ``worker_init_fn`` (a partial of this): keep the worker's share of
    its copy of the pipe, then call the user's ``worker_init_fn``."""
    info = torch.utils.data.get_worker_info()  # ours tell torch who they are
    pipe: Any = None if info is None else info.dataset
    if info is None or not is_datapipe(pipe):
        raise RuntimeError("shard_in_worker runs in a loader's worker that reads a DataPipe")
    graph_settings.apply_sharding(
        pipe, info.num_workers * world_size, worker_id * world_size + rank
    )
    if worker_init_fn is not None:
        worker_init_fn(worker_id)
