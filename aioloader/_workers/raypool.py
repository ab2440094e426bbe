"""A pool of Ray actors as the loader's workers, driven from the event loop.

Owns: making ``num_workers`` actors (``rayactor.RayWorkerActor``) with the resources asked for,
handing a job to an idle actor (or, through ``reserved``, to the actor of a worker's lane: two
calls at once, ``depth``), awaiting each reply as an object ref on the event loop (no thread
per job, no polling), telling a dead actor as :class:`WorkerCrashed` naming it and its node,
replacing it, and killing every actor on close.

Jobs go as bytes pickled here with Ray's cloudpickle (the script's own functions by value: an
actor's ``__main__`` is Ray's), counted in ``jobs`` and ``bytes_sent``. An actor on the loader's
machine writes a result's tensors into one block of shared memory, mapped here without a copy
(``rayshm.py``); from another machine they come through the object store (``rayactor.py``),
copied once into tensors of their own on the loop's thread, counted in ``bytes_received``.

Losing the head node (Ray's control store) is not survived: Ray ends a driver that cannot reach
it after ``gcs_rpc_server_reconnect_timeout_s`` (60 s), and ``ray.kill`` can block until then.
Losing other nodes is: their actors' batches fail with ``WorkerCrashed`` and new actors take
their places where a node can hold them (else ``LoaderTimeout``).

Cancellation (as for worker processes): a call waiting behind another in its actor is
withdrawn; a running one is awaited, shielded, for up to ``CANCEL_GRACE`` seconds and its reply
dropped, then its actor killed if still busy and replaced on next use. Never: leaves an actor
alive once :meth:`RayPool.aclose` returns, or shuts down a Ray connection (``ray.shutdown()``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import anyio

from .._base.exceptions import LoaderTimeout, WorkerCrashed, first_leaf
from .._base.recorders import WorkerRecorder
from .processes import CANCEL_GRACE
from .rayactor import RayWorkerActor, dumps_job, from_wire, wire_bytes
from .raycluster import lost_errors
from .rayshm import discard, from_shm, probe, sweep, sweep_orphans
from .rayslot import Actor
from .rayspec import RayWorkers
from .slots import Slots

__all__ = ["RayPool"]

R = TypeVar("R")

_STOP_GRACE = 5.0  # seconds to wait for a killed actor to be reported dead
DEPTH = 2  # calls in flight per actor


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
        # Two calls at once per actor from its lane (``reserved``), run one after the other in
        # it: the next job is there when one ends, so a call's round trip (about a millisecond)
        # does not idle it. ``run`` hands out an idle actor, one call each.
        self.depth = DEPTH
        self._spec = spec
        self._seed = seed
        self._derive = derive
        self._init_fn = worker_init_fn
        self._stats = stats
        self._dataset = dataset
        self._dataset_ref: Any = None
        self._actor_class: Any = None
        self._probe: str | None = None  # its file in /dev/shm, made as the pool starts
        # Blocks of shared memory the actors on this node write results into (rayshm.py).
        self._shm_prefix = f"aioloader-ray-{os.getpid()}-{secrets.token_hex(4)}"
        self._slots: Slots[Actor] = Slots(workers)  # the actor in each slot, the idle ones
        self._replacing = [anyio.Lock() for _ in range(workers)]  # a slot's replacement

    # -- life ------------------------------------------------------------------------------------

    def _make(self, worker_id: int) -> Actor:
        handle = self._actor_class.remote(
            worker_id,
            self.concurrency,
            self._derive(self._seed, worker_id),
            self._init_fn,
            self._dataset_ref,
            max(1, int(self._spec.num_cpus)),
            (self._shm_prefix, self._probe),
        )
        # The id as `ray list actors` and `ray logs` take it (Ray's handle has no public getter).
        name = getattr(getattr(handle, "_actor_id", None), "hex", lambda: "?")()
        return Actor(worker_id, handle, name=name)

    async def _ready(self, actor: Actor) -> None:
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
        if self._spec.shared_memory:
            sweep_orphans()  # what pools of a killed loader left in /dev/shm
            self._probe = probe(self._shm_prefix)
        self._actor_class = ray.remote(RayWorkerActor).options(**self._spec.actor_options())
        if self._dataset is not None:
            self._dataset_ref = await anyio.to_thread.run_sync(self._put_dataset)
        try:
            for i in range(self.concurrency):  # one at a time: a failure kills those made
                self._slots.now.append(self._make(i))
            async with anyio.create_task_group() as tg:
                for actor in self._slots.now:
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
        self._slots.all_idle()
        self._stats.startup_s = time.perf_counter() - started
        self._stats.processes = self.concurrency
        self._stats.server = "ray"
        nodes = sorted({a.node for a in self._slots.now})
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

    async def _replace(self, actor: Actor) -> Actor:
        """A fresh actor for a dead (or abandoned) one's slot; the slot's actor as it is when
        another call replaced it meanwhile (two calls at once per actor).

        Cancellation: a half-started replacement is killed; the slot keeps the old one, to be
        replaced on next use.
        """
        async with self._replacing[actor.id]:
            if self._slots.now[actor.id] is not actor:
                return self._slots.now[actor.id]  # replaced by the other call
            return await self._replace_now(actor)

    async def _replace_now(self, actor: Actor) -> Actor:
        await self._kill(actor)
        fresh = self._make(actor.id)
        try:
            await self._ready(fresh)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._kill(fresh)
            raise
        self._slots.now[actor.id] = fresh
        self._stats.restarts += 1
        return fresh

    async def _kill(self, actor: Actor) -> None:
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
            for actor in self._slots.now:
                tg.start_soon(self._kill, actor)

    async def aclose(self) -> None:
        """Kill every actor and wait until Ray reports each dead.

        Cancellation: shielded; a cancelled caller still leaves no actor behind.
        """
        with anyio.CancelScope(shield=True):
            await self._kill_all()
        sweep(self._shm_prefix)  # what actors killed mid-job left
        self._slots.close()

    # -- jobs ------------------------------------------------------------------------------------

    async def _reply(self, actor: Actor, ref: Any, *, count: bool = True) -> Any:
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
            crashed = actor.dead()
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
        return await self._slots.run(self._exchange, fn, args, seed)

    @contextlib.asynccontextmanager
    async def reserved(self) -> AsyncIterator[Callable[..., Any]]:
        """Every actor for one owner, as ``ProcessWorkers.reserved``: yields ``run_on(
        worker_id, fn, *args, seed=None, replace=True)``.

        Cancellation: waiting for the actors can be cancelled; the ones taken go back.
        """
        async with self._slots.reserved(self._exchange) as run_on:
            yield run_on

    async def _exchange(
        self,
        actor: Actor,
        fn: Callable[..., R],
        args: tuple[Any, ...],
        seed: int | None,
        *,
        replace: bool = True,
    ) -> R:
        if not actor.alive:
            if not replace:
                raise actor.dead()
            await actor.settle(CANCEL_GRACE)
            actor = await self._replace(actor)
        payload = dumps_job((fn, args, seed))
        self._stats.bytes_sent += len(payload)
        self._stats.jobs += 1
        ref = actor.handle.run.remote(payload)
        del payload
        ticket = object()
        actor.calls.append(ticket)
        try:
            ok, value = await self._reply(actor, ref, count=False)
        except WorkerCrashed:
            # The actor died: the call it ran fails, as a worker process's job does; a call
            # still waiting behind it never started, and goes to its replacement.
            ran = actor.died(self._stats)
            actor.let_go(ticket)
            if ran is not ticket and replace:
                return await self._exchange(self._slots.now[actor.id], fn, args, seed)
            raise
        except anyio.get_cancelled_exc_class():
            await self._drain_cancelled(actor, ref, ticket)
            raise
        except BaseException:
            actor.let_go(ticket)
            raise
        actor.let_go(ticket)
        if not ok:
            try:
                raise value
            finally:  # no reference cycle through this frame
                del value
        self._stats.bytes_received += wire_bytes(value)
        return from_wire(from_shm(value))  # type: ignore[no-any-return]

    async def _drain_cancelled(self, actor: Actor, ref: Any, ticket: object) -> None:
        """A cancelled call: one waiting behind another in the actor is withdrawn; a running
        one is awaited (shielded, up to ``CANCEL_GRACE``) and its reply dropped, then its actor
        killed if it is still busy."""
        import ray

        try:
            if not actor.alive:
                return
            if actor.calls[0] is not ticket:  # waiting behind another: it never started
                with contextlib.suppress(Exception):
                    ray.cancel(ref)
            with anyio.CancelScope(shield=True):
                with anyio.move_on_after(CANCEL_GRACE):
                    try:
                        ok, value = await self._reply(actor, ref, count=False)
                    except WorkerCrashed:
                        actor.died(self._stats)
                    except Exception:  # withdrawn (Ray's TaskCancelledError), or lost with it
                        pass
                    else:
                        if ok:
                            discard(value)  # its blocks of shared memory, which nobody maps
                    return
                await self._kill(actor)  # still busy: don't let it run on unseen
        finally:
            actor.let_go(ticket)
