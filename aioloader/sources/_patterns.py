"""The ``pattern`` and ``suffix`` arguments of :func:`aioloader.sources.files`, and the
``suffix`` and ``glob`` of :func:`aioloader.sources.objects` and ``object_stream``, checked
and normalised before anything is listed.

Owns: :func:`check_pattern` (a glob relative to the folder: not empty, not absolute, no
``..``), :func:`check_suffix` (one suffix or several, each with its dot, lower-cased) and
:func:`check_key_filters` (an object store's: as given, matched case-sensitively).
Never: touches the file system or a store.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import PurePosixPath

__all__ = ["check_key_filters", "check_pattern", "check_suffix"]


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
    out: list[str] = []
    for s in _suffixes(suffix):
        if not s or s == ".":
            raise ValueError(f"suffix must not be empty, got {suffix!r}")
        out.append((s if s.startswith(".") else "." + s).lower())
    return tuple(out)


def check_key_filters(
    suffix: str | Sequence[str] | None, glob: str | None
) -> tuple[tuple[str, ...], str | None]:
    """An object store's ``suffix`` (the suffixes a key may end with, as given: ``()`` keeps
    every key) and ``glob``, checked.

    Raises:
        TypeError: ``suffix`` is not a str or a sequence of str, or ``glob`` not a str.
        ValueError: A suffix is empty, or the sequence is; ``glob`` is empty.
    """
    if glob is not None and not isinstance(glob, str):
        raise TypeError(f"glob must be a str (a shell pattern) or None, got {glob!r}")
    if glob == "":
        raise ValueError("glob must not be empty (None keeps every key)")
    if suffix is None:
        return (), glob
    suffixes = _suffixes(suffix)
    if "" in suffixes:
        raise ValueError(f"suffix must not be empty, got {suffix!r}")
    return suffixes, glob


def _suffixes(suffix: str | Iterable[str]) -> tuple[str, ...]:
    """``suffix`` as a non-empty tuple of str (a set's in its iteration order: any matches).

    Raises:
        TypeError: It is not a str or an iterable of str (bytes are not).
        ValueError: The iterable is empty.
    """
    if isinstance(suffix, str):
        return (suffix,)
    given: object = suffix
    if not isinstance(given, Iterable) or isinstance(given, bytes | bytearray):
        raise TypeError(f"suffix must be a str or a sequence of str, got {suffix!r}")
    items = tuple(given)
    if not all(isinstance(s, str) for s in items):
        raise TypeError(f"suffix must be a str or a sequence of str, got {suffix!r}")
    if not items:
        raise ValueError("suffix must name at least one suffix (None keeps every name)")
    return items
