"""The exceptions aioloader raises, and the notes it attaches to the ones it passes on.

Owns: the exception hierarchy and the helper that annotates a failure with the stage, epoch,
batch and sample it came from. Never: wraps a user's exception in another type. A failure in a
dataset, transform or collate function propagates with its original type and traceback; the
loader only adds notes (PEP 678), so ``except KeyError`` in user code keeps working.

Hierarchy::

    Exception
     ├── TransientError               raised (or subclassed) by user code: "retry me"
     └── AioLoaderError               everything aioloader raises on its own account
          ├── LoaderStateError        (also RuntimeError) the loader is used outside its scope
          ├── LoaderTimeout           (also TimeoutError, RuntimeError) no batch within `timeout`
          ├── WorkerCrashed           (also RuntimeError) a worker process died mid-job
          ├── RemoteError             (also RuntimeError) a worker's exception that could not be
          │    │                      pickled (torch raises RuntimeError for one it cannot rebuild)
          │    └── StopInWorker       a worker's StopIteration (a plain ``for`` ends there)
          ├── Overloaded              (also RuntimeError) a batcher's queue is full: request refused
          └── StrayCancellation       (also RuntimeError) user code raised CancelledError while
                                      nothing cancelled the loader or batcher

The one wrapper: a ``CancelledError`` that user code raises of its own (it awaited a task or
future that something else cancelled; a function on a thread raised
``concurrent.futures.CancelledError``, which asyncio turns into its own) is not an exception
the loader can pass on as the sample's: in a task group it reads as the group's cancellation,
ends every stage and reaches the caller as a bare ``BrokenResourceError``, or cancels the task
that hosts a batcher. It becomes :class:`StrayCancellation`, raised from it, and fails that
sample, batch or request alone (see :func:`stray_cancellation`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal as _signal
from types import FrameType
from typing import Any, TypeVar

__all__ = [
    "AioLoaderError",
    "LoaderStateError",
    "LoaderTimeout",
    "Overloaded",
    "RemoteError",
    "StrayCancellation",
    "TransientError",
    "WorkerCrashed",
]


class TransientError(Exception):
    """An error worth retrying: raise it (or a subclass) from a dataset to mark a failure transient.

    The default :class:`~aioloader.RetryPolicy` retries ``TransientError``, ``TimeoutError`` and
    ``ConnectionError``; any other type can be marked transient through ``RetryPolicy.retry_on``.
    """


class AioLoaderError(Exception):
    """Base class of the errors aioloader raises on its own account."""


class LoaderStateError(AioLoaderError, RuntimeError):
    """The loader was used in a way its lifetime does not allow (e.g. ``async for`` outside
    ``async with loader:``, or a blocking ``for`` on the loader's own event loop thread)."""


class LoaderTimeout(AioLoaderError, TimeoutError, RuntimeError):
    """No batch arrived within the loader's ``timeout`` (torch's ``timeout`` argument).

    It is a ``RuntimeError`` as torch's DataLoader raises, and a ``TimeoutError`` as Python code
    expects.
    """


class WorkerCrashed(AioLoaderError, RuntimeError):
    """A worker died while running a job (killed by a signal, segfault, OOM kill, exit; with
    Ray workers, its actor died or its node was lost).

    The message starts as torch's does (``DataLoader worker (pid N) is killed by signal: ...``)
    and names the worker and the signal (with Ray workers: the actor and its node).

    Attributes:
        worker_id: The worker's id (-1 when rebuilt from a message alone).
        pid: Its process id.
        exitcode: Its exit code (negative: killed by that signal), or None if unknown.
        signal: The signal's name (``"SIGKILL"``), or None when it exited on its own.
        actor: The Ray actor's id (hex), or None for a worker process.
        node: The Ray node it ran on (its address and id), or None for a worker process.
    """

    def __init__(
        self,
        worker_id: int | str,
        pid: int | None = None,
        *,
        exitcode: int | None = None,
        signal: str | None = None,
        actor: str | None = None,
        node: str | None = None,
    ) -> None:
        self.actor, self.node = actor, node
        if isinstance(worker_id, str):  # rebuilt from its message, as `type(exc)(str(exc))`
            super().__init__(worker_id)
            self.worker_id, self.pid, self.exitcode, self.signal = -1, pid, exitcode, signal
            return
        # torch's words first (code and tests match them), then ours.
        if actor is not None:
            how = f"is gone: Ray actor {actor} on node {node} died. (aioloader worker {worker_id}"
        elif signal:
            description = _describe_signal(signal)
            how = f"is killed by signal: {description}. (aioloader worker {worker_id}, {signal}"
        else:
            how = f"exited unexpectedly with exit code {exitcode}. (aioloader worker {worker_id}"
        hint = "; SIGKILL is often the kernel's out-of-memory killer" if signal == "SIGKILL" else ""
        super().__init__(f"DataLoader worker (pid {pid}) {how}{hint})")
        self.worker_id = worker_id
        self.pid = pid
        self.exitcode = exitcode
        self.signal = signal

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_crashed,
            (self.worker_id, self.pid, self.exitcode, self.signal, self.actor, self.node),
        )


class RemoteError(AioLoaderError, RuntimeError):
    """Stands for an exception raised in a worker process that could not be pickled back: its
    message is the original type's qualified name and message, and its notes carry the
    original's notes and the worker's traceback."""


_E = TypeVar("_E", bound=BaseException)


class StopInWorker(RemoteError):
    """A dataset's ``__getitem__``, a ``transform`` or a ``collate_fn`` raised
    ``StopIteration`` where the loader calls it (a worker process, a thread, or inline):
    raised on as it is, a coroutine would make it PEP 479's bare RuntimeError, naming neither
    the stage nor the sample. A plain ``for`` ends there, as torch's loop does (its worker
    passes the StopIteration back and its iterator raises it); ``async for`` raises this
    (``__cause__``: the original)."""


def worker_error(value: _E, what: str = "the dataset") -> _E | StopInWorker:
    """What to raise for a failure of user code named by ``what``: ``value`` itself, but a
    ``StopIteration`` as a :class:`StopInWorker` raised from it (found by review: "coroutine
    raised StopIteration"). Its notes, and where they say it failed, go with it."""
    if not isinstance(value, StopIteration):
        return value
    error = StopInWorker(f"{what} raised StopIteration: {value}")
    error.__dict__.update({k: v for k, v in vars(value).items() if k in (_WHERE, "__notes__")})
    error.__cause__ = value
    return error


def not_an_end(error: BaseException) -> BaseException:
    """``error``, a batch's failure, as the consumer raises it: a ``StopAsyncIteration`` that
    user code raised (an async ``get`` that called ``anext()`` on a spent iterator) becomes a
    ``RuntimeError`` raised from it, as PEP 525 turns one an async generator raises: raised as
    it is, it would end the consumer's ``async for`` there, the rest of the epoch silently lost
    (found by review). Its notes go with it."""
    if not isinstance(error, StopAsyncIteration):
        return error
    turned = RuntimeError(
        f"user code raised StopAsyncIteration, which is no batch's failure but an iterator's "
        f"end (the note names the stage and the sample): {error}"
    )
    turned.__dict__.update(vars(error))
    turned.__cause__ = error
    return turned


class Overloaded(AioLoaderError, RuntimeError):
    """A :class:`~aioloader.DynamicBatcher` refused a request at once because ``max_queue``
    requests were already waiting (admission control: a fast, clear refusal rather than
    unbounded latency). A server typically answers it with HTTP 503 and a ``Retry-After``.
    """


class StrayCancellation(AioLoaderError, RuntimeError):
    """User code (a dataset's read, a stream, a transform, collate, a batcher's model) raised
    ``CancelledError`` while nothing had cancelled the task that called it: a task or future it
    awaited was cancelled by something else, or a function run on a thread raised
    ``concurrent.futures.CancelledError``. It fails that sample (within ``max_failures``),
    batch or request as any error of the user's does; the ``CancelledError`` is its
    ``__cause__``."""


def stray_cancellation(exc: BaseException, what: str) -> StrayCancellation | None:
    """``exc``, caught around a call of user code named by ``what``, as the error to pass on
    instead: a :class:`StrayCancellation` when ``exc`` is a ``CancelledError`` and this task is
    not being cancelled (``Task.cancelling()``: anyio's cancel scopes, a timeout and a
    cancelled host task all cancel through it); None when ``exc`` is this task's cancellation
    (or no ``CancelledError``), which goes on as it is."""
    if not isinstance(exc, asyncio.CancelledError):
        return None
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no loop here: a plain call's own
        task = None
    if task is not None and task.cancelling():
        return None
    return raised_of_its_own(exc, what)


def as_failure(exc: BaseException, what: str) -> Exception | None:
    """What ``exc``, caught (as ``BaseException``) around awaited user code named by ``what``,
    fails: itself when an ``Exception``; a :class:`StrayCancellation` for a ``CancelledError``
    of its own (:func:`stray_cancellation`). None: this task's cancellation, or another
    ``BaseException`` (``KeyboardInterrupt``), which the caller lets go on."""
    return exc if isinstance(exc, Exception) else stray_cancellation(exc, what)


def raised_of_its_own(exc: asyncio.CancelledError, what: str) -> StrayCancellation:
    """The :class:`StrayCancellation` for a ``CancelledError`` that a plain (not async) call
    of user code raised: never a cancellation, which reaches a task only where it awaits
    (found by review: a ``collate_fn`` run inline that raised it cut the epoch short)."""
    error = StrayCancellation(
        f"{what} raised CancelledError of its own, nothing having cancelled the task that "
        "called it: a task or future it waited on was cancelled by something else (or, on a "
        "thread, it raised concurrent.futures.CancelledError, which asyncio turns into its "
        "own); taken as its failure, not as a cancellation"
    )
    error.__cause__ = exc
    return error


def _describe_signal(name: str) -> str:
    try:
        return _signal.strsignal(_signal.Signals[name]) or name
    except (KeyError, ValueError):
        return name


def _rebuild_crashed(
    worker_id: int | str,
    pid: int | None,
    exitcode: int | None,
    signal: str | None,
    actor: str | None = None,
    node: str | None = None,
) -> WorkerCrashed:
    return WorkerCrashed(worker_id, pid, exitcode=exitcode, signal=signal, actor=actor, node=node)


_WHERE = "_aioloader_where"  # the fields of the note annotate() wrote, kept on the exception


def annotate(
    exc: BaseException,
    stage: str,
    *,
    epoch: int | None = None,
    batch: int | None = None,
    index: object = None,
    detail: str = "",
) -> BaseException:
    """Attach a note naming where ``exc`` happened, and return ``exc`` itself.

    One note per failure: where an earlier call already wrote one (the read that failed names
    its sample; the stage that received the failure knows the batch and the epoch), that note
    is completed with what it lacked, the earlier fields kept. An exception object raised
    again for another batch or epoch (a model that keeps its load error and raises it at
    every call) is another failure: its note is written anew, not left naming the first
    (found by review). The fields travel with the exception (its ``__dict__``), through a
    worker's pipe too.

    Args:
        exc: The exception to annotate; its type and traceback are left as they are.
        stage: The pipeline stage (``"fetch"``, ``"transform"``, ``"collate"``, ``"source"``).
        epoch: The epoch it happened in, if known.
        batch: The batch's position in the epoch, if known.
        index: The dataset index or key of the sample, if known.
        detail: Extra words appended to the note.

    Returns:
        The same exception object, for ``raise annotate(exc, ...)``.
    """
    fields: dict[str, Any] = {
        "stage": stage, "index": index, "batch": batch, "epoch": epoch, "detail": detail
    }  # fmt: skip
    earlier = getattr(exc, _WHERE, None)
    notes = getattr(exc, "__notes__", None)
    if isinstance(earlier, dict) and notes and earlier.get("note") in notes:
        if not _another_failure(earlier, fields):
            kept = {k: v for k, v in earlier.items() if v not in (None, "")}
            fields = {k: kept.get(k, v) for k, v in fields.items()}
        fields["note"] = _where_note(fields)
        notes[notes.index(earlier["note"])] = fields["note"]
    else:
        fields["note"] = _where_note(fields)
        exc.add_note(fields["note"])
    with contextlib.suppress(AttributeError):  # an exception type without a __dict__
        setattr(exc, _WHERE, fields)
    return exc


def _another_failure(earlier: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether a note's fields and a new call's name two failures: another batch or epoch
    (a stage or sample may be named otherwise by the two calls of one failure)."""
    return any(
        earlier.get(k) is not None and now[k] is not None and earlier[k] != now[k]
        for k in ("batch", "epoch")
    )


def _where_note(fields: dict[str, Any]) -> str:
    where = [f"stage {fields['stage']!r}"]
    if fields["index"] is not None:
        where.append(f"sample {fields['index']!r}")
    if fields["batch"] is not None:
        where.append(f"batch {fields['batch']}")
    if fields["epoch"] is not None:
        where.append(f"epoch {fields['epoch']}")
    note = "aioloader: failed in " + ", ".join(where)
    if fields["detail"]:
        note += f" ({fields['detail']})"
    return note


def first_leaf(exc: BaseException) -> BaseException:
    """The first real failure inside (possibly nested) exception groups; the others, if any,
    are named in a note on it rather than lost."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for inner in e.exceptions:
                walk(inner)
        else:
            leaves.append(e)

    walk(exc)
    first = leaves[0]
    if len(leaves) > 1:
        others = ", ".join(f"{type(e).__name__}: {e}" for e in leaves[1:6])
        first.add_note(f"aioloader: {len(leaves) - 1} more failure(s) in the same epoch: {others}")
    return first


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def forget_locals(exc: BaseException) -> None:
    """Clear the local variables of aioloader's own finished (plain function) frames that
    ``exc``'s traceback keeps, its entries and the callers they keep (a frame keeps its caller).

    Why: a failure stored to be raised later (a batch's error, raised in its turn) keeps, through
    its traceback, the frames it passed; a finished one whose locals hold the failure (the list
    of a batch's failures) is a reference cycle, and every frame above it up to the consumer's
    stays until the garbage collector runs, the consumer's iterator with it (and a plain
    ``for``'s loop thread). The user's frames and those still running are left as they are.
    """
    tb = exc.__traceback__
    seen: set[int] = set()
    while tb is not None:
        frame: FrameType | None = tb.tb_frame
        while frame is not None and id(frame) not in seen:
            seen.add(id(frame))
            code = frame.f_code
            if code.co_filename.startswith(_PACKAGE) and not code.co_flags & _SUSPENDABLE:
                with contextlib.suppress(RuntimeError):  # still running: a caller
                    frame.clear()
            frame = frame.f_back
        tb = tb.tb_next
