"""A pool of Ray actors as the loader's workers, driven from the event loop.

Owns: making ``num_workers`` actors (:class:`~aioloader._workers.rayactor.RayWorkerActor`) with the
resources asked for, handing one job at a time to an idle actor (or, for a worker's own
stream, to that actor), awaiting the reply as an object ref on the event loop (Ray's refs are
awaitable: no thread per job, no polling), telling a dead actor as :class:`WorkerCrashed`
naming the actor and its node, replacing it, and killing every actor on close.

Jobs go as bytes the loader pickled itself with Ray's cloudpickle (samples, a batch's indices,
the functions: by reference where their module imports on the node, by value where it does not,
such as the script's own ``__main__``, whose actors run Ray's own main instead), so ``jobs`` and
``bytes_sent`` count what was sent. An actor on the loader's node writes a result's tensors
into one block of shared memory, which the loader maps without a copy (``rayshm.py``, as worker
processes do; blocks a killed actor left are removed on close). From another node they come
through the object store, as NumPy arrays read without a pickle copy (``rayactor.py``), then
copied once into torch tensors of their own, on the event loop's thread (``np.copyto`` releases
the GIL, not the loop: a few milliseconds for a batch of tens of MB); ``bytes_received``
counts those.

Losing the head node (Ray's control store) is not survived: Ray ends a driver that cannot reach
it after ``gcs_rpc_server_reconnect_timeout_s`` (60 s by default), and ``ray.kill`` can block
until then. Losing other nodes is survived: their actors' batches fail with ``WorkerCrashed``
and new actors take their places, where a node can hold them (else ``LoaderTimeout``).

Cancellation policy (as for worker processes): a job already sent is awaited, shielded, for up
to ``CANCEL_GRACE`` seconds and its reply dropped; an actor still busy after that is killed and
replaced on next use. Never: leaves an actor alive once :meth:`RayPool.aclose` returns, or
shuts down a Ray connection (the program's, or the one the first Ray loader made: later loaders
use it too; ``ray.shutdown()`` ends it).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio

from .._base.exceptions import LoaderTimeout, WorkerCrashed, first_leaf
from .._base.recorders import WorkerRecorder
from .processes import CANCEL_GRACE
from .rayactor import RayWorkerActor, from_wire, wire_bytes
from .raycluster import lost_errors
from .rayshm import discard, from_shm, sweep
from .rayspec import RayWorkers

__all__ = ["RayPool"]

R = TypeVar("R")

_STOP_GRACE = 5.0  # seconds to wait for a killed actor to be reported dead
DEPTH = 2  # calls in flight per actor


@dataclass(eq=False, slots=True)
class _Actor:
    id: int
    handle: Any  # ray.actor.ActorHandle
    pid: int = 0
    name: str = "?"  # the actor's id (hex)
    node: str = ""  # "address (node id ...)", once it is ready
    alive: bool = True
    killed: bool = False
    # Its calls not answered yet, oldest first: the oldest runs, the others wait behind it.
    calls: list[object] = field(default_factory=list)
    ran: object = None  # the call it was running when it died


class RayPool:
    """``workers`` Ray actors, each running one job at a time (the ``WorkerPool`` protocol).

    Args:
        spec: Where the actors run and what each reserves.
        workers: Number of actors.
        seed: Base seed; worker ``i`` is seeded with ``derive(seed, i)`` at start.
        derive: Derives a worker's seed from ``(seed, worker_id)``.
        worker_init_fn: Called once in each actor as it starts, with its id.
        stats: Where start-up time, restarts, crashes, jobs and bytes are counted.
        dataset: A blocking dataset each actor keeps its own copy of (put in the object store
            once, read by each actor as it starts), or None.
    """

    def __init__(
        self,
        spec: RayWorkers,
        workers: int,
        *,
        seed: int,
        derive: Callable[..., int],
        worker_init_fn: Callable[[int], object] | None,
        stats: WorkerRecorder,
        dataset: object = None,
    ) -> None:
        self.concurrency = workers
        self.per_worker = True  # each actor a process with its own copy of the dataset
        self.inlines = False
        # Two calls at once per actor, run one after the other in it: the next job is there
        # when one ends, so the round trip of each call (about a millisecond) does not idle it.
        self.depth = DEPTH
        self._spec = spec
        self._seed = seed
        self._derive = derive
        self._init_fn = worker_init_fn
        self._stats = stats
        self._dataset = dataset
        self._dataset_ref: Any = None
        self._actor_class: Any = None
        self._node = ""  # the loader's Ray node (set as the pool starts)
        # Blocks of shared memory the actors on this node write results into (rayshm.py).
        self._shm_prefix = f"aioloader-ray-{os.getpid()}-{secrets.token_hex(4)}"
        self._actors: list[_Actor] = []
        # Each actor's free call slots (``DEPTH`` each); replacing a slot's actor takes its lock.
        slots = workers * DEPTH
        self._idle_send, self._idle_recv = anyio.create_memory_object_stream[_Actor](slots)
        self._replacing = [anyio.Lock() for _ in range(workers)]

    # -- life ------------------------------------------------------------------------------------

    def _make(self, worker_id: int) -> _Actor:
        handle = self._actor_class.remote(
            worker_id,
            self.concurrency,
            self._derive(self._seed, worker_id),
            self._init_fn,
            self._dataset_ref,
            max(1, int(self._spec.num_cpus)),
            (self._shm_prefix, self._node),
        )
        # The id as `ray list actors` and `ray logs` take it (Ray's handle has no public getter).
        name = getattr(getattr(handle, "_actor_id", None), "hex", lambda: "?")()
        return _Actor(worker_id, handle, name=name)

    async def _ready(self, actor: _Actor) -> None:
        """Wait until ``actor`` is placed and has run ``worker_init_fn``.

        Raises:
            LoaderTimeout: Not ready within ``start_timeout`` (no node had room for it).
            WorkerCrashed: It died while starting.
            Exception: ``worker_init_fn`` raised (original type, the actor's traceback in a
                note).
        """
        spec = self._spec
        ref = actor.handle.ready.remote()
        with anyio.move_on_after(spec.start_timeout) as waited:
            ok, value = await self._reply(actor, ref)
        if waited.cancelled_caught:
            raise LoaderTimeout(
                f"Ray worker {actor.id} was not ready within start_timeout="
                f"{spec.start_timeout:g} s: no node of the cluster placed an actor with "
                f"{spec.asked()}, or its worker_init_fn did not return (a cluster without "
                "room for it never places it; `ray status` shows what it has)"
            )
        if not ok:
            raise value  # worker_init_fn failed, with the actor's traceback in a note
        actor.pid, node, address = value
        actor.node = f"{address} (node id {node})"

    async def start(self) -> None:
        """Make every actor and wait until each has run ``worker_init_fn``.

        Raises:
            LoaderTimeout: An actor was not placed within ``start_timeout``.
            WorkerCrashed: An actor died while starting.
            Exception: ``worker_init_fn`` raised (original type, the actor's traceback in a
                note), or the dataset could not be serialised (with a note naming it).

        Cancellation: the actors made so far are killed.
        """
        import ray

        started = time.perf_counter()
        self._node = ray.get_runtime_context().get_node_id()
        self._actor_class = ray.remote(RayWorkerActor).options(**self._spec.actor_options())
        if self._dataset is not None:
            self._dataset_ref = await anyio.to_thread.run_sync(self._put_dataset)
        try:
            for i in range(self.concurrency):  # one at a time: a failure kills those made
                self._actors.append(self._make(i))
            async with anyio.create_task_group() as tg:
                for actor in self._actors:
                    tg.start_soon(self._ready, actor)
        except BaseException as group:
            with anyio.CancelScope(shield=True):
                await self._kill_all()
            if not isinstance(group, Exception):
                raise
            error = first_leaf(group)
            if isinstance(error, WorkerCrashed):
                error.add_note(
                    "aioloader: the Ray worker died while starting: its node must import what "
                    "the dataset, worker_init_fn, transform and collate_fn need (the same torch "
                    "and aioloader; your own modules: RayWorkers(options={'runtime_env': "
                    "{'working_dir': '.'}}) ships this folder)"
                )
            raise error from None
        for _ in range(DEPTH):
            for actor in self._actors:
                self._idle_send.send_nowait(actor)
        self._stats.startup_s = time.perf_counter() - started
        self._stats.processes = self.concurrency
        self._stats.server = "ray"
        nodes = sorted({a.node for a in self._actors})
        self._stats.server_why = f"{len(nodes)} node(s): {', '.join(nodes)}"

    def _put_dataset(self) -> Any:
        import ray

        try:
            return ray.put(self._dataset)
        except Exception as exc:
            exc.add_note(
                f"aioloader: the dataset ({type(self._dataset).__qualname__}) is sent to each "
                "Ray worker and must serialise (Ray uses cloudpickle)"
            )
            raise

    async def _replace(self, actor: _Actor) -> _Actor:
        """A fresh actor for a dead (or abandoned) one's slot; the slot's actor as it is when
        another call replaced it meanwhile (two calls at once per actor).

        Cancellation: a half-started replacement is killed; the slot keeps the old one, to be
        replaced on next use.
        """
        async with self._replacing[actor.id]:
            if self._actors[actor.id] is not actor:
                return self._actors[actor.id]  # replaced by the other call
            return await self._replace_now(actor)

    async def _replace_now(self, actor: _Actor) -> _Actor:
        await self._kill(actor)
        fresh = self._make(actor.id)
        try:
            await self._ready(fresh)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._kill(fresh)
            raise
        self._actors[actor.id] = fresh
        self._stats.restarts += 1
        return fresh

    async def _kill(self, actor: _Actor) -> None:
        """Kill ``actor`` and wait (briefly, shielded) until Ray reports it dead.

        ``ray.kill`` only asks Ray's control store to kill it, and a call made afterwards may
        still be served before the kill lands: the call awaited here is one that never returns
        (``park``, sent first), so only the actor's death ends the wait."""
        if actor.killed:
            return
        import ray

        actor.alive = False
        actor.killed = True
        with contextlib.suppress(Exception):  # already dead, or the cluster is gone
            parked = actor.handle.park.remote()
            ray.kill(actor.handle, no_restart=True)
            with (
                anyio.CancelScope(shield=True),
                anyio.move_on_after(_STOP_GRACE),
                contextlib.suppress(Exception),  # dead: what we waited for
            ):
                await parked

    async def _kill_all(self) -> None:
        async with anyio.create_task_group() as tg:
            for actor in self._actors:
                tg.start_soon(self._kill, actor)

    async def aclose(self) -> None:
        """Kill every actor and wait until Ray reports each dead.

        Cancellation: shielded; a cancelled caller still leaves no actor behind.
        """
        with anyio.CancelScope(shield=True):
            await self._kill_all()
        sweep(self._shm_prefix)  # what actors killed mid-job left
        self._idle_send.close()
        self._idle_recv.close()

    # -- jobs ------------------------------------------------------------------------------------

    async def _reply(self, actor: _Actor, ref: Any, *, count: bool = True) -> Any:
        """Await ``ref``, a call on ``actor``; a dead actor raises :class:`WorkerCrashed`
        (counted as a crash unless ``count`` is False: the caller decides)."""
        import ray.exceptions as rex

        try:
            return await ref
        except rex.RayTaskError as exc:  # our own call failed in the actor (not the job)
            raise exc.as_instanceof_cause() from None
        except lost_errors() as exc:
            actor.alive = False
            self._stats.crashes += count
            crashed = self._dead(actor)
            crashed.add_note(f"aioloader: Ray said ({type(exc).__name__}): {str(exc).strip()}")
            raise crashed from None

    async def run(self, fn: Callable[..., R], *args: Any, seed: int | None = None) -> R:
        """Run ``fn(*args)`` in an idle actor (seeded with ``seed`` first) and return its
        result.

        Raises:
            WorkerCrashed: The actor died during the job (it is replaced on next use).
            LoaderTimeout: Its replacement could not be placed within ``start_timeout``.
            Exception: Whatever ``fn`` raised, with its original type when it pickles (else
                ``RemoteError``), and the actor's traceback in a note.

        Cancellation: see the module's policy; the actor goes back to the pool either way.
        """
        actor = await self._idle_recv.receive()
        try:
            return await self._exchange(actor, fn, args, seed)
        finally:
            self._idle_send.send_nowait(self._actors[actor.id])

    @contextlib.asynccontextmanager
    async def reserved(self) -> AsyncIterator[Callable[..., Any]]:
        """Every actor for one owner, as ``ProcessWorkers.reserved``: yields ``run_on(
        worker_id, fn, *args, seed=None, replace=True)``.

        Cancellation: waiting for the actors can be cancelled; the ones taken go back.
        """
        taken: list[_Actor] = []
        try:
            for _ in range(self.concurrency * DEPTH):
                taken.append(await self._idle_recv.receive())

            async def run_on(
                worker_id: int,
                fn: Callable[..., R],
                *args: Any,
                seed: int | None = None,
                replace: bool = True,
            ) -> R:
                actor = self._actors[worker_id]
                return await self._exchange(actor, fn, args, seed, replace=replace)

            yield run_on
        finally:
            for actor in taken:
                self._idle_send.send_nowait(self._actors[actor.id])

    async def _exchange(
        self,
        actor: _Actor,
        fn: Callable[..., R],
        args: tuple[Any, ...],
        seed: int | None,
        *,
        replace: bool = True,
    ) -> R:
        if not actor.alive:
            if not replace:
                raise self._dead(actor)
            actor = await self._replace(actor)
        payload = _dumps((fn, args, seed))
        self._stats.bytes_sent += len(payload)
        self._stats.jobs += 1
        ref = actor.handle.run.remote(payload)
        del payload
        ticket = object()
        actor.calls.append(ticket)
        try:
            ok, value = await self._reply(actor, ref, count=False)
        except WorkerCrashed:
            # The actor died: the call that ran fails, as a worker process's job does; a call
            # still waiting behind it never started, and goes to its replacement.
            if actor.ran is None:  # the first of its calls to learn of its death
                actor.ran = actor.calls[0]
            waited = actor.ran is not ticket
            if waited and replace:
                return await self._exchange(self._actors[actor.id], fn, args, seed)
            self._stats.crashes += 1
            raise
        except anyio.get_cancelled_exc_class():
            await self._drain_cancelled(actor, ref)
            raise
        finally:
            actor.calls.remove(ticket)
        if not ok:
            try:
                raise value
            finally:  # no reference cycle through this frame
                del value
        self._stats.bytes_received += wire_bytes(value)
        return from_wire(from_shm(value))  # type: ignore[no-any-return]

    def _dead(self, actor: _Actor) -> WorkerCrashed:
        node = actor.node or "not known (it was not ready yet)"
        return WorkerCrashed(actor.id, actor.pid, actor=actor.name, node=node)

    async def _drain_cancelled(self, actor: _Actor, ref: Any) -> None:
        if not actor.alive:
            return
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(CANCEL_GRACE), contextlib.suppress(WorkerCrashed):
                ok, value = await self._reply(actor, ref)
                if ok:
                    discard(value)  # its blocks of shared memory, which nobody will map
                return
            await self._kill(actor)  # still busy: don't let it run on unseen


def _dumps(job: tuple[Any, ...]) -> bytes:
    from ray import cloudpickle

    data: bytes = cloudpickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
    return data
