"""The environment variables a process forked from a fork server takes from the main process.

Owns: :class:`ParentEnviron` (sent with a worker's start arguments, the main process's
variables as the worker starts, applied as they are unpickled), :func:`environ_now` and
:func:`adopt_environ`. Never: reads or sets anything but ``os.environ``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ParentEnviron", "adopt_environ", "environ_now"]


@dataclass(frozen=True, slots=True)
class ParentEnviron:
    """The main process's environment variables as it starts a worker, for a worker forked from
    a fork server: unpickled in the worker, they become its own (:func:`adopt_environ`).

    A fork server keeps the environment it started with, and the stdlib hands each process it
    forks the parent's path, working directory and main module but not its environment: a
    variable the script set after the server started (a data root, a credential, for the
    second loader a changed one) was missing in the workers, where torch's forked and spawned
    workers have it. Sent before the worker's dataset, it is in place before the dataset is
    unpickled (a ``__setstate__`` or a module imported on the way that reads it)."""

    variables: dict[str, str]

    def __reduce__(self) -> tuple[Callable[[dict[str, str]], ParentEnviron], tuple[Any, ...]]:
        return _adopted, (self.variables,)


def _adopted(variables: dict[str, str]) -> ParentEnviron:
    adopt_environ(variables)
    return ParentEnviron(variables)


def environ_now() -> dict[str, str]:
    """This process's environment variables, copied: tried again where another thread changed
    them meanwhile (``os.environ`` lists its names, then reads each: one deleted in between
    raised ``KeyError``, found by review)."""
    for _ in range(_ENVIRON_TRIES - 1):
        with contextlib.suppress(KeyError, RuntimeError):
            return dict(os.environ)
    return dict(os.environ)


_ENVIRON_TRIES = 8


def adopt_environ(variables: dict[str, str]) -> None:
    """Make this process's environment variables ``variables``, exactly."""
    for name in [name for name in os.environ if name not in variables]:
        del os.environ[name]
    for name, value in variables.items():
        if os.environ.get(name) != value:
            os.environ[name] = value
