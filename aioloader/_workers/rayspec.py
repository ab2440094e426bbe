"""Where Ray workers run, as a user says it: :class:`RayWorkers`.

Owns: the public description of a pool of Ray actors (the cluster's address, each actor's
resources, anything else Ray's ``.options()`` takes) and reading ``worker_mode``'s Ray forms.
Never: imports Ray (``raypool.py`` does, when a loader starts its workers): a loader that does
not use Ray never loads it, and one that does without Ray installed is told which extra to
install.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RayWorkers", "ray_spec_of"]

_OURS = ("num_cpus", "num_gpus", "resources", "max_restarts", "max_concurrency", "lifetime")


@dataclass(frozen=True, slots=True)
class RayWorkers:
    """``num_workers`` Ray actors as the loader's workers: ``worker_mode=RayWorkers(...)``
    (``worker_mode="ray"`` is ``RayWorkers()``).

    Each actor does what a worker process does: it keeps its own copy of a torch dataset
    (``get_worker_info()`` answers inside it), runs ``worker_init_fn`` once, reads a batch's
    indices or its iterator's next batch, transforms and collates. Results come back through
    Ray's object store; the batch the consumer gets is an ordinary torch batch.

    Attributes:
        address: The cluster to join when Ray is not initialised yet: ``ray.init(address)``
            (``"auto"``, ``"ray://head:10001"``, ``"10.0.0.1:6379"``); None: Ray's default
            (``RAY_ADDRESS``, else a local cluster started for this process). When the
            program called ``ray.init()`` itself, that connection is used and this is ignored.
        num_cpus: CPUs each actor reserves (Ray's ``num_cpus``): the scheduler places actors
            where the cluster has them.
        num_gpus: GPUs each actor reserves (for GPU decoding, say; 0 by default).
        resources: Custom resources each actor reserves, e.g. ``{"decode": 1}`` to place the
            actors on the nodes started with ``--resources='{"decode": 8}'``.
        options: Anything else Ray's ``ActorClass.options()`` takes (``memory``,
            ``runtime_env``, ``scheduling_strategy``, ``label_selector``). Not the ones above,
            nor ``max_restarts``, ``max_concurrency`` or ``lifetime``: the loader replaces a
            dead actor itself, runs one job at a time in each, and its actors die with it.
        start_timeout: Seconds to wait for an actor to be placed and to finish
            ``worker_init_fn`` (a cluster without room for it never places it): past it, the
            start fails with :class:`~aioloader.LoaderTimeout` naming the resources asked for.
        shared_memory: Whether an actor on the loader's machine hands its batches over in
            ``/dev/shm`` (no copy; the default) rather than through Ray's object store (where a
            container's ``/dev/shm`` is small, say). Actors elsewhere use the object store.

    Raises:
        TypeError, ValueError: An attribute of the wrong type or out of range (named).
    """

    address: str | None = None
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: Mapping[str, float] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)
    start_timeout: float = 120.0
    shared_memory: bool = True

    def __post_init__(self) -> None:
        if self.address is not None and not isinstance(self.address, str):
            raise TypeError(f"RayWorkers address must be a str or None, got {self.address!r}")
        for name in ("num_cpus", "num_gpus"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"RayWorkers {name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"RayWorkers {name} must be >= 0, got {value!r}")
        if not isinstance(self.resources, Mapping) or not all(
            isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) and v > 0
            for k, v in self.resources.items()
        ):
            raise TypeError(
                "RayWorkers resources must map resource names to positive amounts, got "
                f"{self.resources!r}"
            )
        if not isinstance(self.options, Mapping):
            raise TypeError(f"RayWorkers options must be a mapping, got {self.options!r}")
        taken = sorted(set(self.options) & set(_OURS))
        if taken:
            raise ValueError(
                f"RayWorkers options may not set {', '.join(taken)}: num_cpus, num_gpus and "
                "resources are RayWorkers' own arguments; the loader sets max_restarts, "
                "max_concurrency and lifetime itself"
            )
        timeout = self.start_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"RayWorkers start_timeout must be > 0 seconds, got {timeout!r}")
        if not isinstance(self.shared_memory, bool):
            raise TypeError(f"RayWorkers shared_memory must be a bool, got {self.shared_memory!r}")
        # A frozen dataclass: keep private copies, so a caller's later change cannot reach us.
        object.__setattr__(self, "resources", dict(self.resources))
        object.__setattr__(self, "options", dict(self.options))

    def actor_options(self) -> dict[str, Any]:
        """What ``ActorClass.options()`` is given for each actor."""
        return {
            **self.options,
            "num_cpus": self.num_cpus,
            "num_gpus": self.num_gpus,
            "resources": dict(self.resources),
            "max_restarts": 0,  # the loader replaces a dead actor, and runs worker_init_fn again
            "max_concurrency": 1,  # one job at a time, as a worker process runs them
        }

    def asked(self) -> str:
        """The resources each actor asks for, in words (for errors)."""
        parts = [f"num_cpus={self.num_cpus:g}"]
        if self.num_gpus:
            parts.append(f"num_gpus={self.num_gpus:g}")
        if self.resources:
            parts.append(f"resources={dict(self.resources)!r}")
        return ", ".join(parts)


def ray_spec_of(worker_mode: object) -> RayWorkers | None:
    """The :class:`RayWorkers` that ``worker_mode`` names (``"ray"`` or an instance), or None
    for ``"process"`` and ``"thread"``.

    Raises:
        ValueError: ``worker_mode`` is none of these.
        ImportError: It names Ray and Ray is not installed (the message names the extra).
    """
    if isinstance(worker_mode, RayWorkers):
        spec = worker_mode
    elif worker_mode == "ray":
        spec = RayWorkers()
    elif worker_mode in ("process", "thread"):
        return None
    else:
        raise ValueError(
            "worker_mode must be 'process', 'thread', 'ray' or an aioloader.RayWorkers, got "
            f"{worker_mode!r}"
        )
    if importlib.util.find_spec("ray") is None:
        raise ImportError(
            f"worker_mode={worker_mode!r} needs Ray, which is not installed: "
            "pip install 'aioloader[ray]'"
        )
    return spec
