"""What the pipeline asks of a pool of workers, threads or processes alike.

Owns: the :class:`WorkerPool` protocol. Never: runs anything (``_offload.ThreadOffload`` and
``_processes.ProcessWorkers`` are the two pools).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

__all__ = ["WorkerPool"]

R = TypeVar("R")


class WorkerPool(Protocol):
    """A pool that runs functions for the pipeline.

    Attributes:
        concurrency: Calls it runs at once.
        per_worker: Whether its workers are distinct processes, each with its own copy of a
            dataset (so a batch can go to the worker of its choice, as torch deals them).
        inlines: Whether its calls run one at a time, the fast ones inline on the caller's
            thread (a pool of one thread with ``inline_below``): any task may call it directly,
            without a stage of tasks queueing work for it.
        depth: Calls a worker takes at once through ``reserved``'s ``run_on`` (its lane of a
            dataset read in the workers), run one after the other in it: 1 for threads; 2
            where a call's round trip would idle the worker between jobs (a process: the next
            job waits in its pipe; a Ray actor: behind its call). ``run`` gives one call to an
            idle worker, whatever the depth.
    """

    concurrency: int
    per_worker: bool
    inlines: bool
    depth: int

    async def start(self) -> None:
        """Start the workers (processes: spawned, ``worker_init_fn`` run)."""

    async def aclose(self) -> None:
        """Stop the workers and wait until they are gone."""

    async def run(self, fn: Callable[..., R], *args: Any, seed: int | None = None) -> R:
        """``fn(*args)`` on a free worker (reseeded with ``seed`` first)."""

    def reserved(self) -> contextlib.AbstractAsyncContextManager[Callable[..., Any]]:
        """Every worker for one owner: ``run_on(worker_id, fn, *args, seed=None,
        replace=True)`` runs on the worker named (a thread pool runs it on any thread)."""
