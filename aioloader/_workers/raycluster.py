"""The Ray cluster as the loader meets it: joining it, and what its exceptions mean.

Owns: :func:`join_cluster` (``ray.init`` once, on the thread that builds the loader) and
:func:`lost_errors`, Ray's exception types that mean a worker is gone (by type, never by
message). Never: makes actors or runs jobs (``raypool.py``).
"""

from __future__ import annotations

import threading

from .rayspec import RayWorkers

__all__ = ["join_cluster", "lost_errors"]

_joined = threading.Lock()


def join_cluster(spec: RayWorkers) -> None:
    """``ray.init(address=spec.address)`` unless Ray is initialised already.

    Called as the loader is built, on the thread that builds it: Ray ties the local cluster
    it may start to the life of the thread that starts it (its processes get the thread's
    parent-death signal), so it must not be a thread of the loader's own, which ends with the
    loader.

    Raises:
        ConnectionError: The cluster at ``spec.address`` could not be reached (Ray's own
            exception, with a note naming the address).
    """
    import ray

    with _joined:
        if ray.is_initialized():
            return
        try:
            ray.init(address=spec.address, ignore_reinit_error=True)
        except Exception as exc:
            exc.add_note(
                f"aioloader: joining the Ray cluster for worker_mode=RayWorkers(address="
                f"{spec.address!r}) failed"
            )
            raise


def lost_errors() -> tuple[type[BaseException], ...]:
    """Ray's exceptions that mean the actor, its node or its result is gone (by type: an actor
    that died or cannot be reached, a lost object or owner, a dead raylet or node, an actor no
    node can place or whose placement group went)."""
    names = (
        "RayActorError",  # ActorDiedError, ActorUnavailableError
        "ObjectLostError",  # OwnerDiedError among others
        "WorkerCrashedError",
        "LocalRayletDiedError",
        "NodeDiedError",
        "ActorUnschedulableError",
        "ActorPlacementGroupRemoved",
    )
    import ray.exceptions as rex

    return tuple(getattr(rex, name) for name in names if hasattr(rex, name))
