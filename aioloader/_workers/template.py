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
inherited (``intemplate.py``). The template lives as long as its workers: this process
holds its alive pipe until the last of them has been joined (its exit statuses reach this
process through the template, as they do through a fork server).

Where it is not used (the caller then starts each worker as before, each unpickling its own
copy): a start of one worker (a replacement) or one whose pickle is small
(``startonce.IN_FILE_FROM``); a start method other than forkserver; ``AIOLOADER_TEMPLATE=0``;
a class in the pickle that runs code of its own as it is unpickled, outside the standard
library, NumPy, torch and a few packages that restore what was pickled (:func:`_own_code`: a
``__setstate__`` that draws a random generator would draw it once, for every worker;
``AIOLOADER_TEMPLATE=always`` lets it); and where unpickling the start arguments left the
template unsafe to fork (:func:`_unsafe`): a descriptor it opened (an HDF5 or LMDB file a
``__setstate__`` opens, which must not be shared by forked processes), a thread it started,
or an error (each worker's start then raises it, named, as before). The pool's statistics
say which (``template_why``); a refusal is remembered for the dataset's later starts.

Never: forks a process with other threads or a CUDA context; keeps a template past its last
worker; shares what a worker writes (a page written becomes that worker's own).
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing.context
import multiprocessing.forkserver as stdlib_forkserver
import os
import secrets
import sys
import weakref
from collections.abc import Iterator
from contextvars import ContextVar
from multiprocessing import popen_forkserver, reduction, spawn, util
from typing import Any

import anyio
import torch.multiprocessing

from .children import blocking, exits
from .environ import ParentEnviron
from .forkserver import ServerClient, let_go_of, server_protocol_known
from .intemplate import Held, serve
from .startonce import IN_FILE_FROM, MOST_HANDED, Descriptor, OnceStart

__all__ = ["ENV", "Template", "TemplateWorker", "remember_refusal", "template_why_not"]

# "0": no templates, each worker unpickles its own copy; "always": a template also where a
# class runs code of its own as it is unpickled (:func:`_own_code`), but for a file or thread
ENV = "AIOLOADER_TEMPLATE"
_STOP_GRACE = 5.0  # seconds the template may take to exit once its workers have


def template_why_not(
    ctx: multiprocessing.context.BaseContext, once: object, workers: int, dataset: object
) -> str:
    """Why the ``workers`` starting now with start arguments ``once`` (``dataset`` among them)
    are not forked from a template; ``""`` where they may be."""
    if workers < 2:
        return "one worker starting"
    if ctx.get_start_method() != "forkserver":
        return f"start method {ctx.get_start_method()}"
    setting = os.environ.get(ENV, "")
    if setting == "0":
        return f"{ENV}=0"
    if not isinstance(once, OnceStart) or once.size < IN_FILE_FROM:
        return f"they pickle to under {IN_FILE_FROM >> 20} MiB"  # unpickled in no time
    if not server_protocol_known():
        return "this Python's fork-server protocol is not one aioloader speaks"
    if once.handed > MOST_HANDED:  # each would be a descriptor in the template's start
        return (
            f"they hold {once.handed} values handed over by descriptor (tensors, sockets): "
            f"more than a fork server's start takes ({MOST_HANDED})"
        )
    with contextlib.suppress(TypeError):  # a dataset that cannot be a weak key
        if refused := _refused.get(dataset):
            return refused
    return "" if setting == "always" else _own_code(once.kinds)


def remember_refusal(dataset: object, why: str) -> None:
    """A template refused ``dataset``'s start (it opened a file, started a thread): the
    later starts of the same dataset (each epoch's, without persistent workers) do without
    one, rather than unpickling it twice in turn."""
    with contextlib.suppress(TypeError):
        _refused[dataset] = why


_refused: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()

# Packages whose own unpickling code restores what was pickled, the same in any process (an
# array, a tensor, a generator's state), and the standard library
_RESTORING = frozenset({"aioloader", "cloudpickle", "numpy", "pandas", "PIL", "pyarrow", "scipy"})
_RESTORING |= frozenset({"torch", "torchaudio", "torchdata", "torchvision"})


def _own_code(kinds: frozenset[type]) -> str:
    """Why unpickling objects of these types runs code of their own that may make what each
    worker must have its own of (a ``__setstate__`` that draws a random generator, makes a
    temporary folder): run in a template, it would run once for every worker of the start.
    ``""`` where none does (their state is restored as it was pickled)."""
    for kind in sorted(kinds, key=lambda kind: kind.__qualname__):
        if "__qualname__" in vars(kind):  # a function's or a class's type: pickled by name
            continue
        for name in ("__setstate__", "__reduce_ex__", "__reduce__"):
            owner = next((c for c in kind.__mro__ if name in vars(c)), object)
            if owner is object:
                continue
            code = vars(owner)[name]
            module = getattr(code, "__module__", None) or owner.__module__
            top = module.partition(".")[0]
            if top not in _RESTORING and top not in sys.stdlib_module_names:
                return f"{kind.__qualname__} runs its own {name} as it is unpickled"
    return ""


class Template:
    """A running template holding one start's arguments, for that start's workers.

    Made by :meth:`start`; each worker started under :meth:`routing` is forked from it and
    counted (:meth:`adopt`); :meth:`release` as each is joined, :meth:`seal` once the start's
    workers have all been started; the last of those stops the template.
    """

    def __init__(
        self, process: multiprocessing.process.BaseProcess, alive: int, address: str, token: str
    ) -> None:
        self._process = process
        self._alive = alive  # the alive pipe's write end
        self._server = ServerClient(address, alive)
        self._token = token
        self._users = 0
        self._sealed = self._stopped = False
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
        _alive_ends.add(alive_w)
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
            _alive_ends.discard(alive_w)
            os.close(alive_w)
            raise
        finally:
            their_reply.close()
            os.close(alive_r)
        try:
            await anyio.wait_readable(reply.fileno())
            blocking(reply)
            try:
                ok, said = reply.recv()
            except (EOFError, OSError):
                ok, said = False, "the template process died unpickling them"
        except BaseException:
            process.kill()
            await _reap(process, alive_w)
            raise
        finally:
            reply.close()
        if not ok:
            await _reap(process, alive_w)
            return str(said)
        return cls(process, alive_w, str(said), token)

    @property
    def start_args(self) -> object:
        """What each worker's start holds in place of the start arguments: a reference to the
        template's (``intemplate.Held``)."""
        return Held(self._token)

    @contextlib.contextmanager
    def routing(self) -> Iterator[None]:
        """:class:`TemplateWorker` processes started in the block are forked from this
        template (the caller counts each: :meth:`adopt`)."""
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
        if not self._stopped:
            self._stopped = True
            await _reap(self._process, self._alive)


async def _reap(process: multiprocessing.process.BaseProcess, alive: int) -> None:
    """Close a template's alive pipe (its EOF, once every worker forked from it has exited,
    ends its serving), and reap it: killed if it lingers. Shielded from cancellation."""
    with anyio.CancelScope(shield=True):
        if alive in _alive_ends:  # not closed already
            _alive_ends.discard(alive)
            os.close(alive)
        if not await exits(process, within=_STOP_GRACE):
            process.kill()
            await exits(process, within=_STOP_GRACE)
        process.join()
        with contextlib.suppress(ValueError):
            process.close()


_route: ContextVar[ServerClient | None] = ContextVar("aioloader_template", default=None)

_alive_ends: set[int] = set()  # the templates' alive pipes' write ends, open here


def _let_go_in_child() -> None:
    """In a process forked from this one (a fork-context process of the application's, torch's
    fork workers): the templates' alive pipes let go of, so that a template does not wait for
    that process to exit before it stops (its pool waited 5 s, then killed it; found by
    review)."""
    for alive in _alive_ends:
        let_go_of(alive)
    _alive_ends.clear()


os.register_at_fork(after_in_child=_let_go_in_child)


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
