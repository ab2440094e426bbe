"""The dynamic batcher's default collation: torch's ``default_collate``, for requests whose
tensors, arrays and numbers are of one dtype.

Owns: :func:`collate_alike`. Never: decides what happens to a batch it refuses (the runner
splits it, ``_serving/runner.py``), or checks what a user's ``collate_fn`` is given.

Why: ``default_collate`` promotes what it stacks (a float64 request among float32 ones made the
whole batch float64, and every caller got a result computed in float64, or the model's dtype
error), and a plain number's batch takes its dtype from whichever request came first (``[1,
2.5]`` stacks as float32, ``[2.5, 1]`` as float64). A request should get what it would get
alone, and a bad one fail alone (found by review): refused here, the batch is split into
parts whose requests agree, as for shapes that do not stack.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .._data.collate import default_collate

__all__ = ["MixedDtypes", "collate_alike"]

_NUMBERS = (bool, int, float, complex)
_EXACT_NUMBERS = frozenset(_NUMBERS)


class MixedDtypes(TypeError):
    """Requests of a batch differ in dtype: ``groups`` holds the positions of the requests
    that agree, group by group in order of first appearance, for the batch to be split into
    those parts (not in halves, down to single requests: interleaved float32 and float64
    requests ran one model call each; found by review)."""

    def __init__(self, message: str, groups: list[list[int]]) -> None:
        super().__init__(message, groups)
        self.groups = groups

    def __str__(self) -> str:
        return str(self.args[0])


def collate_alike(items: Sequence[Any]) -> Any:
    """``default_collate(items)``, once every item's leaves agree in dtype with the first's.

    Raises:
        MixedDtypes: Two items differ in the dtype of a tensor or array (or the type of a
            plain number) at the same place, named; with the groups of those that agree.
        Exception: What ``default_collate`` raises.
    """
    first: list[object] = []
    _kinds(items[0], first)
    for position in range(1, len(items)):
        kinds: list[object] = []
        _kinds(items[position], kinds)
        if kinds != first:  # named by the slower walk that keeps the path
            why = _differs(items[0], items[position], "")
            if why is not None:
                raise MixedDtypes(
                    f"requests 0 and {position} of the batch differ in dtype at {why} (a "
                    "batch's requests must agree, as the model gets them stacked)",
                    _groups(items),
                )
    return default_collate(items)


def _groups(items: Sequence[Any]) -> list[list[int]]:
    """The positions of ``items`` grouped by their leaves' dtypes, in order of appearance."""
    groups: dict[tuple[object, ...], list[int]] = {}
    for position, item in enumerate(items):
        kinds: list[object] = []
        _kinds(item, kinds)
        groups.setdefault(tuple(kinds), []).append(position)
    return list(groups.values())


def _kinds(x: Any, out: list[object]) -> None:
    """Append the dtype (or number type) of each of ``x``'s leaves to ``out``, in walk order;
    containers walked as :func:`_differs` walks them (what else differs, collation says).
    Exact types first: an ABC's ``isinstance`` costs a microsecond, and this runs per request."""
    kind = type(x)
    if kind is torch.Tensor or kind is np.ndarray:
        out.append(x.dtype)
    elif kind in _EXACT_NUMBERS:
        out.append(kind)
    elif kind is dict:
        for value in x.values():
            _kinds(value, out)
    elif kind is list or kind is tuple:
        for value in x:
            if type(value) in _EXACT_NUMBERS:
                out.append(type(value))
            else:
                _kinds(value, out)
    elif kind is str or kind is bytes:
        return
    elif isinstance(x, torch.Tensor | np.ndarray | np.generic):
        out.append(x.dtype)
    elif isinstance(x, _NUMBERS):
        out.append(type(x))
    elif isinstance(x, Mapping):
        for value in x.values():
            _kinds(value, out)
    elif isinstance(x, Sequence) and not isinstance(x, str | bytes):
        for value in x:
            _kinds(value, out)
    elif dataclasses.is_dataclass(x):
        for f in dataclasses.fields(x):
            _kinds(getattr(x, f.name), out)


def _differs(a: Any, b: Any, at: str) -> str | None:
    """Where ``a`` and ``b`` first differ in a leaf's dtype, as ``at`` names the place: the
    place and the two dtypes, or None."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return None if a.dtype == b.dtype else f"{at or 'the input'} ({a.dtype}, {b.dtype})"
    if isinstance(a, np.ndarray | np.generic) and isinstance(b, np.ndarray | np.generic):
        same = a.dtype == b.dtype
        return None if same else f"{at or 'the input'} (numpy {a.dtype}, {b.dtype})"
    if isinstance(a, _NUMBERS) and isinstance(b, _NUMBERS):
        same = type(a) is type(b)
        return None if same else f"{at or 'the input'} ({type(a).__name__}, {type(b).__name__})"
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in a:
            if key in b and (why := _differs(a[key], b[key], f"{at}[{key!r}]")) is not None:
                return why
        return None
    if dataclasses.is_dataclass(a) and type(a) is type(b):
        for f in dataclasses.fields(a):
            why = _differs(getattr(a, f.name), getattr(b, f.name), f"{at}.{f.name}")
            if why is not None:
                return why
        return None
    if (
        isinstance(a, Sequence)
        and isinstance(b, Sequence)
        and not isinstance(a, str | bytes)
        and len(a) == len(b)
    ):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if (why := _differs(x, y, f"{at}[{i}]")) is not None:
                return why
    return None
