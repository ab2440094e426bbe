"""torch's DataPipes in the loader, as torch's ``DataLoader`` runs them: ``shuffle`` switches a
pipe's shufflers, each epoch seeds them all alike, and each reader (a worker, or the main process
without workers) keeps its share of a ``sharding_filter``.

Owns: :func:`is_datapipe`, :func:`set_shuffle`, the epochs' seeds (:func:`draw_pipe_seed`,
:func:`epoch_pipe_seed`), :func:`seed_pipe`, :func:`shard_here` and :func:`shard_in_worker`.
Never: iterates a pipe.

torch's ``DataLoader`` sets a pipe's shufflers on or off as it is built (``shuffle``, left as
the pipe says when None), draws a shared seed at each epoch from ``generator`` (or torch's
default generator; rank 0's on every rank), and seeds every random pipe in the graph with it,
in every reader alike: the same shuffled stream everywhere, which each reader's
``sharding_filter`` then divides. Ours does the same, with one addition: with ``seed=`` (ours)
an epoch's seed is derived from it and the epoch, not drawn, so that the epoch resumes.
Without workers the main process is the instance ``rank`` of ``world_size``; worker ``i`` is
instance ``i * world_size + rank`` of ``num_workers * world_size`` (torch.distributed's rank
and world size where it is initialised, else 0 and 1). Without this, every worker read the
whole pipe: each sample came ``num_workers`` times.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.data
import torch.utils.data.graph_settings as graph_settings
from torch.utils.data.graph import traverse_dps

from .seeds import derive_seed, draw_seed
from .sharding import resolve_rank

__all__ = [
    "draw_pipe_seed",
    "draws_seeds",
    "epoch_pipe_seed",
    "has_random_pipes",
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
    """Turn an iterable pipe's shufflers on or off (None: as the pipe has them), as torch's
    ``DataLoader`` does as it is built; any other dataset is left alone."""
    if shuffle is not None and isinstance(dataset, _ITERABLE):
        graph_settings.apply_shuffle_settings(dataset, shuffle=shuffle)  # type: ignore[arg-type]


def draws_seeds(dataset: object, seed: int | None) -> bool:
    """Whether each epoch of ``dataset`` draws its pipe seed from a generator: an iterable
    pipe, read by a loader without ``seed=``."""
    return seed is None and isinstance(dataset, _ITERABLE)


def has_random_pipes(dataset: object) -> bool:
    """Whether an iterable pipe's graph has a pipe that draws from its seed: one with
    ``set_seed`` (torch's test for the pipes it seeds), unless it is a shuffler switched off
    (``shuffle=False``)."""
    if not isinstance(dataset, _ITERABLE):
        return False
    pipes = graph_settings.get_all_graph_pipes(traverse_dps(dataset))  # type: ignore[arg-type]
    return any(_draws(pipe) for pipe in pipes)


def _draws(pipe: object) -> bool:
    if not inspect.ismethod(getattr(pipe, "set_seed", None)):
        return False
    shuffler = inspect.ismethod(getattr(pipe, "set_shuffle", None))
    return not shuffler or getattr(pipe, "_enabled", True) is not False


def draw_pipe_seed(
    dataset: object, seed: int | None, generator: torch.Generator | None
) -> int | None:
    """At an epoch's ``iter()``: its pipe seed drawn as torch's iterator draws it
    (:func:`~aioloader._data.seeds.draw_seed`: from ``generator``, else torch's default
    generator, so ``torch.manual_seed`` before an epoch repeats it), and where torch.distributed
    runs, rank 0's, as torch broadcasts it: every rank's sharding filter divides the same
    shuffled stream. None where nothing is drawn (:func:`draws_seeds`)."""
    if not draws_seeds(dataset, seed):
        return None
    drawn = draw_seed(generator)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        shared = torch.tensor(drawn, dtype=torch.int64)
        dist.broadcast(shared, src=0, group=_gloo())
        drawn = int(shared.item())
    return drawn


def epoch_pipe_seed(
    dataset: object,
    seed: int | None,
    generator: torch.Generator | None,
    epoch: int,
    drawn: int | None,
) -> int | None:
    """The seed of epoch ``epoch``'s random pipes, at its ``iter()`` (None for any other
    dataset than an iterable pipe): derived from the loader's ``seed=`` and the epoch (the same
    on every rank, and again on resuming), else ``drawn`` where it was drawn already (a plain
    ``for`` draws it before its scope draws the workers' base seed, torch's order), else drawn
    now (:func:`draw_pipe_seed`)."""
    if not isinstance(dataset, _ITERABLE):
        return None
    if seed is not None:
        return derive_seed(seed, epoch)
    return drawn if drawn is not None else draw_pipe_seed(dataset, seed, generator)


_gloo_group: tuple[object, Any] | None = None  # (the world it was made in, its gloo group)


def _gloo() -> Any:
    """A gloo group of the whole world, made once per world (torch makes one per iterator):
    the seed is a CPU tensor whatever the default backend."""
    global _gloo_group
    world = dist.group.WORLD
    if _gloo_group is None or _gloo_group[0] is not world:
        _gloo_group = (world, dist.new_group(backend="gloo"))
    return _gloo_group[1]


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
