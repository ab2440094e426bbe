"""A start's template: one process that unpickles the start arguments (``worker_init_fn`` and
the dataset) once, and from which every worker of that start is forked, sharing what it
unpickled copy-on-write, as torch's fork workers share the main process's dataset.

Why: a worker not forked from this process unpickles its own copy of the dataset. A dataset
holding ImageNet's 1.28 million (path, class) pairs (as ``ImageFolder`` holds them) is 230 MiB
of Python objects in each worker, unpickled by each (0.4 s of CPU on a 2-core box): with 12
workers, 2.7 GB and 5 s of CPU that torch's forked workers do not spend.

How: the template is a process of the start's own context (a fork of the fork server); it
unpickles the start arguments, then serves the stdlib's fork-server protocol on a socket of
its own. Each worker of the start is started through it (:class:`TemplateWorker`: the stdlib's
forkserver ``Popen``, pointed at the template), and finds its start arguments in what it
inherited (:func:`_held_start`). The template lives as long as its workers: this process
holds its alive pipe until the last of them has been joined (its exit statuses reach this
process through the template, as they do through a fork server).

Where it is not used (the caller then starts each worker as before, each unpickling its own
copy): a start of one worker (a replacement) or one whose pickle is small
(``startonce.IN_FILE_FROM``); a start method other than forkserver; ``AIOLOADER_TEMPLATE=0``;
and where unpickling the start arguments left the template unsafe to fork (:func:`_unsafe`): a
descriptor it opened (an HDF5 or LMDB file a ``__setstate__`` opens, which must not be shared
by forked processes), a thread it started, or an error (each worker's start then raises it,
named, as before). :attr:`Template.why_not` says why.

Never: forks a process with other threads or a CUDA context; keeps a template past its last
worker; shares what a worker writes (a page written becomes that worker's own).
"""

from __future__ import annotations

import contextlib
import gc
import io
import multiprocessing.context
import multiprocessing.forkserver as stdlib_forkserver
import os
import secrets
import signal
from collections.abc import Iterator
from contextvars import ContextVar
from multiprocessing import popen_forkserver, reduction, spawn, util
from multiprocessing.connection import Connection
from typing import Any

import anyio
import torch.multiprocessing

from .children import blocking, exits
from .environ import ParentEnviron
from .forkserver import ServerClient, listening, server_protocol_known, unsafe_to_fork
from .startonce import IN_FILE_FROM, Descriptor, OnceStart, Unreceived
from .worker import name_this_process

__all__ = ["ENV", "Template", "TemplateWorker", "template_why_not"]

ENV = "AIOLOADER_TEMPLATE"  # "0": no templates, each worker unpickles its own copy
_STOP_GRACE = 5.0  # seconds the template may take to exit once its workers have


def template_why_not(ctx: multiprocessing.context.BaseContext, once: object, workers: int) -> str:
    """Why the workers starting now with start arguments ``once`` are not forked from a
    template; ``""`` where they may be."""
    if workers < 2:
        return "one worker starting"
    if ctx.get_start_method() != "forkserver":
        return f"start method {ctx.get_start_method()}"
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    if not isinstance(once, OnceStart) or once.size < IN_FILE_FROM:
        return f"they pickle to under {IN_FILE_FROM >> 20} MiB"  # unpickled in no time
    if not server_protocol_known():
        return "this Python's fork-server protocol is not one aioloader speaks"
    return ""


class Template:
    """A running template holding one start's arguments, for that start's workers.

    Made by :meth:`start`; each worker started under :meth:`routing` is forked from it and
    counted (:meth:`adopt`); :meth:`release` as each is joined, :meth:`seal` once the start's
    workers have all been started; the last of those stops the template.
    """

    def __init__(self, process: multiprocessing.process.BaseProcess, address: str, alive: int):
        self._process = process
        self._server = ServerClient(address, alive)
        self._alive: int | None = alive
        self._token = ""
        self._users = 0
        self._sealed = False
        self.pid = process.pid

    @classmethod
    async def start(
        cls,
        ctx: multiprocessing.context.BaseContext,
        once: OnceStart,
        environ: ParentEnviron | None,
    ) -> Template | str:
        """A template holding ``once`` unpickled, or why there is none (the caller starts its
        workers without one).

        Raises:
            OSError: The template process could not be started (no room for a process).

        Cancellation: the template is killed and reaped (shielded) before the cancellation
        propagates.
        """
        token = secrets.token_hex(8)
        reply, their_reply = ctx.Pipe(duplex=False)
        alive_r, alive_w = os.pipe()
        process = ctx.Process(  # type: ignore[attr-defined]  # every context has one
            target=serve,
            args=(
                their_reply,
                Descriptor(alive_r),
                environ,
                once.unreceived(),
                token,
                torch.multiprocessing.get_sharing_strategy(),  # type: ignore[no-untyped-call]
            ),
            name="aioloader-template",
            daemon=True,  # a last resort only: the pool stops it once its workers are gone
        )
        try:
            process.start()
        except BaseException:
            reply.close()
            os.close(alive_w)
            raise
        finally:
            their_reply.close()
            os.close(alive_r)
        template = cls(process, "", alive_w)
        try:
            await anyio.wait_readable(reply.fileno())
            blocking(reply)
            try:
                ok, said = reply.recv()
            except (EOFError, OSError):
                ok, said = False, "the template process died unpickling them"
        except BaseException:
            with anyio.CancelScope(shield=True):
                process.kill()
                await template._stop()
            raise
        finally:
            reply.close()
        if not ok:
            await template._stop()
            return str(said)
        template._server = ServerClient(said, alive_w)
        template._token = token
        return template

    @property
    def start_args(self) -> object:
        """What each worker's start holds in place of the start arguments: a reference to the
        template's (:func:`_held_start`)."""
        return _Held(self._token)

    @contextlib.contextmanager
    def routing(self) -> Iterator[None]:
        """:class:`TemplateWorker` processes started in the block are forked from this
        template, and counted."""
        routed = _route.set(self._server)
        try:
            yield
        finally:
            _route.reset(routed)

    def adopt(self) -> None:
        """A worker was forked from it."""
        self._users += 1

    async def seal(self) -> None:
        """The start's workers have all started: the template stops once they have exited
        (now, where none did)."""
        self._sealed = True
        if self._users == 0:
            await self._stop()

    async def release(self) -> None:
        """One of its workers was joined."""
        self._users -= 1
        if self._sealed and self._users == 0:
            await self._stop()

    async def _stop(self) -> None:
        """Close its alive pipe (its EOF, once every worker forked from it has exited, ends
        its serving), and reap it: terminated if it lingers."""
        with anyio.CancelScope(shield=True):
            if self._alive is not None:
                os.close(self._alive)
                self._alive = None
            process = self._process
            if not await exits(process, within=_STOP_GRACE):
                process.kill()
                await exits(process, within=_STOP_GRACE)
            process.join()
            with contextlib.suppress(ValueError):
                process.close()


_route: ContextVar[ServerClient | None] = ContextVar("aioloader_template", default=None)


class TemplateWorker(multiprocessing.context.ForkServerProcess):
    """A worker process forked from the template whose :meth:`Template.routing` block starts
    it."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:  # multiprocessing's name
        server = _route.get()
        if server is None:
            raise RuntimeError("a TemplateWorker starts inside its Template's routing() block")
        return _TemplatePopen(process_obj, server)


class _TemplatePopen(popen_forkserver.Popen):
    """The stdlib's forkserver ``Popen``, asking the template for the process instead of the
    fork server."""

    _fds: list[int]  # the descriptors its process's pickle hands it (the stdlib's name)

    def __init__(self, process_obj: Any, server: ServerClient) -> None:
        self._server = server
        super().__init__(process_obj)

    def _launch(self, process_obj: Any) -> None:
        # The stdlib's protocol: the process's preparation data and itself, pickled (their
        # descriptors collected in self._fds), then the request, then the pickle down the
        # data pipe, then the pid read back from the status pipe (its sentinel)
        data = io.BytesIO()
        multiprocessing.context.set_spawning_popen(self)
        try:
            reduction.dump(spawn.get_preparation_data(process_obj._name), data)
            reduction.dump(process_obj, data)
        finally:
            multiprocessing.context.set_spawning_popen(None)
        self.sentinel, data_w = self._server.connect_to_new_process(self._fds)
        parent_w = os.dup(data_w)  # the worker's parent_process() waits on its other end
        self.finalizer = util.Finalize(self, _close, (parent_w, self.sentinel))
        with open(data_w, "wb", closefd=True) as pipe:
            pipe.write(data.getbuffer())
        self.pid = stdlib_forkserver.read_signed(self.sentinel)


def _close(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


# -- in the template and its workers ------------------------------------------------------------

_held: dict[str, object] = {}  # token: the start arguments, unpickled in the template


class _Held:
    """A worker's start arguments, as its template holds them: a name, pickled in its start."""

    __slots__ = ("token",)

    def __init__(self, token: str) -> None:
        self.token = token

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return _held_start, (self.token,)


def _held_start(token: str) -> object:
    """In a worker forked from a template: the start arguments it inherited."""
    try:
        return _held[token]
    except KeyError:
        raise RuntimeError(
            "aioloader: this worker was not forked from the template that holds its start arguments"
        ) from None


def serve(
    reply: Connection,
    alive: Any,
    environ: ParentEnviron | None,
    start: Unreceived,
    token: str,
    sharing_strategy: str,
) -> None:
    """The template process: unpickle the start arguments, then, where that left it safe to
    fork, tell the main process where it listens and serve its workers' starts until its alive
    pipe's EOF (the main process's end closed, and every worker forked from it gone).
    ``environ`` is in place by now (applied as it was unpickled)."""
    del environ
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process's Ctrl-C is its own
    name_this_process("aioloader-tpl")
    torch.multiprocessing.set_sharing_strategy(sharing_strategy)  # type: ignore[no-untyped-call]
    alive_r = alive.detach()
    before = _descriptors()
    try:
        held = start.receive()
    except BaseException as exc:  # each worker's own start raises it, named
        reply.send((False, f"unpickling them raised {type(exc).__name__}"))
        return
    del start
    why = _unsafe(before)
    if why:
        reply.send((False, why))
        return
    _held[token] = held
    del held
    # What it holds goes to the collector's permanent generation: a collection in a worker
    # would otherwise write to each object's header and copy every page of it
    gc.freeze()
    address, listener = listening()
    reply.send((True, address))
    reply.close()
    stdlib_forkserver.main(listener.detach(), alive_r, [])


def _descriptors() -> dict[int, str]:
    """This process's open descriptors and what each is."""
    found = {}
    for entry in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own, gone by now
            found[int(entry)] = os.readlink(f"/proc/self/fd/{entry}")
    return found


def _unsafe(before: dict[int, str]) -> str:
    """Why forking workers from this template could share what each worker must have its own
    of: a descriptor opened since ``before`` (but the start's own files in memory) or a
    thread; ``""`` where nothing was."""
    opened = sorted(
        path
        for fd, path in _descriptors().items()
        if before.get(fd) != path and not path.startswith("/memfd:aioloader-start")
    )
    if opened:
        return f"unpickling them opened {', '.join(opened[:3])}"
    why = unsafe_to_fork()
    return f"after unpickling them, {why}" if why else ""
