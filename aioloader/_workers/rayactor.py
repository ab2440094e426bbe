"""The Ray actor a Ray worker is, and what crosses between it and the loader.

Owns: :class:`RayWorkerActor`, which does in a Ray actor what ``worker.worker_main`` does in a
worker process (becomes worker ``id`` of ``num_workers``, keeps its copy of the dataset, runs
``worker_init_fn``, runs one job at a time, seeded per batch), and the wire form of a result's
tensors: each plain CPU tensor goes as a NumPy array of its bytes, which Ray stores out of band
in its object store and hands back without a pickle copy; :func:`from_wire` turns them into
ordinary (writable, resizable) torch tensors with one copy each, on the loader's side. Never:
imports Ray at module level (the actor side reads its own node from Ray's runtime context),
touches an event loop, or decides what to do with a failure.
"""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .._base.tree import map_instances, map_tensors, plain_cpu_tensor
from .rayshm import sees, to_shm
from .worker import become_worker, call_job, with_worker_note

__all__ = ["RayWorkerActor", "WireTensor", "dumps_job", "from_wire", "to_wire", "wire_bytes"]


class WireTensor:
    """A tensor on its way back from an actor: its bytes as a flat ``uint8`` NumPy array (Ray
    keeps it in the object store and reads it back as a view), its dtype, and its shape in
    memory order with the permutation back to its own (so a ``channels_last`` or transposed
    tensor keeps its strides, as worker processes keep them).

    A tensor whose elements overlap or leave gaps (a slice, an expanded view) arrives as a
    contiguous tensor of its own; tensors that shared a storage arrive as tensors of their own.
    """

    __slots__ = ("array", "dtype", "order", "shape")

    def __init__(self, tensor: torch.Tensor) -> None:
        t = tensor.detach().resolve_conj().resolve_neg()
        # Its dimensions from the outermost in memory to the innermost.
        strides = t.stride()
        order = sorted(range(t.dim()), key=lambda d: -strides[d])
        dense = t.permute(order)
        if not dense.is_contiguous():  # not a permutation of a dense block: copied
            order, dense = list(range(t.dim())), t.contiguous()
        self.array: np.ndarray[Any, np.dtype[np.uint8]] = (
            dense.reshape(-1).view(torch.uint8).numpy()
        )
        self.dtype = t.dtype
        self.shape = tuple(dense.shape)
        self.order = tuple(order)

    def __getstate__(self) -> tuple[Any, ...]:
        return self.array, self.dtype, self.shape, self.order

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.array, self.dtype, self.shape, self.order = state

    def tensor(self) -> torch.Tensor:
        """A torch tensor of its own with these bytes (one copy out of the object store), in
        the sent tensor's shape and strides.

        Raises:
            RuntimeError: Memory for it could not be allocated.
        """
        out = torch.empty(self.array.nbytes, dtype=torch.uint8)
        np.copyto(out.numpy(), self.array, casting="no")  # releases the GIL for large copies
        back = sorted(range(len(self.order)), key=self.order.__getitem__)
        return out.view(self.dtype).view(self.shape).permute(back)


def _on_wire(tensor: torch.Tensor) -> Any:
    if plain_cpu_tensor(tensor) and not tensor.requires_grad:
        return WireTensor(tensor)
    return tensor  # pickled by torch's own reduction (a copy), as Ray sends any object


def to_wire(result: Any) -> Any:
    """``result`` with its plain CPU tensors as :class:`WireTensor` s (in the actor)."""
    return map_tensors(_on_wire, result)


def dumps_job(job: tuple[Any, ...]) -> bytes:
    """A job, ``(fn, args, batch_seed)``, as the loader sends it: Ray's cloudpickle, which
    sends the script's own functions by value (an actor's ``__main__`` is Ray's)."""
    from ray import cloudpickle

    data: bytes = cloudpickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
    return data


def wire_bytes(result: Any) -> int:
    """The bytes of ``result``'s tensors on the wire (what came through the object store)."""
    total = 0

    def count(wire: WireTensor) -> WireTensor:
        nonlocal total
        total += wire.array.nbytes
        return wire

    map_instances(count, result, WireTensor)
    return total


def from_wire(result: Any) -> Any:
    """``result`` with its :class:`WireTensor` s as torch tensors again (in the loader).

    Raises:
        RuntimeError: Memory for a tensor could not be allocated.
    """
    return map_instances(WireTensor.tensor, result, WireTensor)


class RayWorkerActor:
    """Worker ``worker_id`` of ``num_workers``, as a Ray actor (made by ``raypool.py`` with
    ``ray.remote(...)``; one job at a time).

    Args:
        worker_id: Its index.
        num_workers: Workers in the pool.
        seed: Its seed (``random``, NumPy and torch are seeded with it now).
        worker_init_fn: Run once, now, with ``worker_id``; what it raises is kept and reported
            by :meth:`ready` (an exception raised here would only say that the actor died).
        dataset: Its own copy of a blocking dataset, or None.
        threads: torch's intra-op threads in it (the CPUs it reserved, at least 1).
        shm: ``(prefix, the pool's probe file)``: where the probe is visible (the loader's
            machine), results' tensors go through shared memory in blocks named with the prefix
            (``rayshm.py``); elsewhere (or None), through the object store.
    """

    def __init__(
        self,
        worker_id: int,
        num_workers: int,
        seed: int,
        worker_init_fn: Callable[[int], object] | None,
        dataset: Any,
        threads: int = 1,
        shm: tuple[str, str | None] | None = None,
    ) -> None:
        import ray  # in the actor's process, which Ray started: Ray is there

        context = ray.get_runtime_context()
        self._node = context.get_node_id()
        self._shm = shm[0] if shm is not None and sees(shm[1]) else None
        self._ip = ray.util.get_node_ip_address()
        self._failed: BaseException | None = None
        where = f"Ray worker {worker_id} (pid {os.getpid()}, node {self._ip})"
        try:
            become_worker(worker_id, num_workers, seed, dataset, where, threads)
            if worker_init_fn is not None:
                worker_init_fn(worker_id)
        except BaseException as exc:
            self._failed = with_worker_note(exc)

    def ready(self) -> tuple[bool, Any]:
        """``(True, (pid, node id, node address))``, or ``(False, what worker_init_fn
        raised)``."""
        if self._failed is not None:
            return False, self._failed
        return True, (os.getpid(), self._node, self._ip)

    def run(self, job: bytes) -> tuple[bool, Any]:
        """One job, ``(fn, args, batch_seed)`` pickled: ``(ok, value)`` as a worker process
        replies, the value's tensors on the wire; a job that does not unpickle here (a module
        this node cannot import) fails as its function would, with this worker's note."""
        try:
            fn, args, seed = pickle.loads(job)
        except Exception as exc:
            return False, with_worker_note(exc)
        del job
        return call_job(fn, args, seed, self._finish)

    def _finish(self, result: Any) -> Any:
        """The result's tensors in shared memory on the loader's node, else on the wire (and
        on the wire when ``/dev/shm`` has no room)."""
        if self._shm is not None:
            try:
                return to_shm(result, self._shm)
            except OSError:  # no room in /dev/shm (nothing left there): this one goes the other way
                pass
        return to_wire(result)

    def park(self) -> None:
        """Never returns: the call the loader awaits after killing this actor, which only its
        death ends (one job at a time: it waits behind a job still running)."""
        threading.Event().wait()
