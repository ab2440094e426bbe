"""The ``pattern`` and ``suffix`` arguments of :func:`aioloader.sources.files`, checked and
normalised before a folder is listed.

Owns: :func:`check_pattern` (a glob relative to the folder: not empty, not absolute, no
``..``) and :func:`check_suffix` (one suffix or several, each with its dot, lower-cased).
Never: touches the file system.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import PurePosixPath

__all__ = ["check_pattern", "check_suffix"]


def check_pattern(pattern: str) -> str:
    """``pattern``, checked.

    Raises:
        TypeError: It is not a str.
        ValueError: It is empty, absolute or contains ``..``.
    """
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a str, got {type(pattern).__name__}")
    if not pattern:
        raise ValueError("pattern must not be empty (the default, '**/*', lists every file)")
    pure = PurePosixPath(pattern.replace(os.sep, "/"))
    if pure.is_absolute() or ".." in pure.parts:
        raise ValueError(f"pattern must be relative to root and without '..', got {pattern!r}")
    return pattern


def check_suffix(suffix: str | Sequence[str] | None) -> tuple[str, ...]:
    """The suffixes to keep (none: every name), each with its dot and lower-cased.

    Raises:
        TypeError: ``suffix`` is not a str or a sequence of str.
        ValueError: A suffix is empty, or the sequence is.
    """
    if suffix is None:
        return ()
    items = [suffix] if isinstance(suffix, str) else suffix
    out: list[str] = []
    for s in items:
        if not isinstance(s, str):
            raise TypeError(f"suffix must be a str or a sequence of str, got {suffix!r}")
        if not s or s == ".":
            raise ValueError(f"suffix must not be empty, got {suffix!r}")
        out.append((s if s.startswith(".") else "." + s).lower())
    if not out:
        raise ValueError("suffix must name at least one suffix (None keeps every name)")
    return tuple(out)
