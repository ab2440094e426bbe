"""A worker's failure as the main process receives it: the exception itself where it pickles
(else a :class:`~aioloader._base.exceptions.RemoteError` standing for it), with a note naming
the worker and carrying its traceback, as the main process cannot see the worker's frames.

Owns: the note and the stand-ins. Never: decides what a failure means (the caller does).
"""

from __future__ import annotations

import traceback
from typing import Any

from .._base.exceptions import RemoteError
from . import fdpass
from .byvalue import dumps_reply
from .result import JobResult

__all__ = ["noted", "prepare_failures"]


def _picklable(exc: Exception) -> Exception:
    try:
        message, passing = dumps_reply(exc)
        fdpass.loads(message, passing.handed())
    except Exception:
        stand_in = RemoteError(f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}")
        for note in getattr(exc, "__notes__", ()):
            stand_in.add_note(note)
        return stand_in
    return exc


def noted(exc: BaseException, where: str) -> Exception:
    """``exc`` (or a stand-in, for a non-Exception or one that does not pickle) with a note
    naming the worker (``where``) and carrying its traceback."""
    if not isinstance(exc, Exception):
        # SystemExit, KeyboardInterrupt, GeneratorExit from user code: in the main process they
        # would read as its own exit or cancellation. The job failed; say so as an Exception.
        stand_in = RemoteError(
            f"{type(exc).__qualname__} raised in a worker{': ' + str(exc) if str(exc) else ''}"
        )
        stand_in.__cause__ = None
        exc = _attach_traceback(stand_in, exc)
    exc.add_note(f"aioloader: raised in {where}; the worker's traceback:\n{_stack(exc)}")
    return _picklable(exc)


_CHAIN_CONNECTORS = (  # the lines traceback puts between the exceptions of a chain
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
)


def _stack(exc: BaseException) -> str:
    """``exc``'s traceback (its chain too) without its closing line and notes: the main
    process prints those with the exception itself, and they would read twice."""
    formatted = traceback.TracebackException.from_exception(exc)
    lines = list(formatted.format())
    tail = list(formatted.format_exception_only())
    if lines[-len(tail) :] == tail:
        lines = lines[: -len(tail)]
    text = "".join(lines).rstrip()
    # A failure reported rather than raised (a sample's, raised from its StopIteration) has
    # no traceback of its own: its chain's connecting line would end the note, leading nowhere.
    for connector in _CHAIN_CONNECTORS:
        text = text.removesuffix(connector).rstrip()
    return text


def _attach_traceback(stand_in: Exception, original: BaseException) -> Exception:
    tb = "".join(traceback.format_exception(type(original), original, original.__traceback__))
    stand_in.add_note(f"aioloader: the original, in the worker:\n{tb.rstrip()}")
    return stand_in


def prepare_failures(result: Any, where: str) -> Any:
    """Exceptions inside a job's result (per-sample failures, a failed batch's error) must
    survive pickling. Any other result (a user's batch, say) is left as it is."""
    if not isinstance(result, JobResult):
        return result
    if result.failures:
        result.failures = [(pos, stage, noted(exc, where)) for pos, stage, exc in result.failures]
    if result.error is not None:
        result.error = noted(result.error, where)
    return result
