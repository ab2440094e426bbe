"""Checking an argument of ours: one rule for every check, and the helpers that apply it.

The rule: a value of the wrong type raises ``TypeError``, a value of the right type outside its
range raises ``ValueError``; the message names the argument and shows the value. torch's own
``DataLoader`` arguments keep the exception types and words torch gives them (it raises
``ValueError`` for a ``batch_size`` of the wrong type, for one): ``_loader/arguments.py`` checks
those.

Owns: the rule and the checks shared by the loader, the samplers, the interleave and the
sources. Never: checks an argument's combination with others (``_loader/arguments.py``).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable

import torch

__all__ = ["check_bool", "check_int", "check_picklable", "check_seconds", "check_seed"]


def check_int(name: str, value: object, *, minimum: int) -> int:
    """Return ``value`` if it is an int (not a bool) of at least ``minimum``.

    Args:
        name: The argument name used in the error message.
        value: The value to check.
        minimum: The smallest accepted value: 0 or 1.

    Returns:
        ``value``, typed as an int.

    Raises:
        TypeError: If ``value`` is not an int or is a bool.
        ValueError: If ``value`` is smaller than ``minimum``.
    """
    kind = "positive int" if minimum == 1 else "non-negative int"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a {kind}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be a {kind}, got {value!r}")
    return value


def as_int(value: object, *, bools: bool) -> object:
    """``value`` as an int where it is an integer of another type (a NumPy integer, a 0-d
    integer tensor; ``bools``: a bool too), as torch's loader compares and ranges its counts;
    anything else as it is, for the checks to name."""
    if type(value) is int or (isinstance(value, bool) and not bools):
        return value
    if isinstance(value, numbers.Integral):  # bool, NumPy's integers
        return operator.index(value)
    if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.is_floating_point():
        return operator.index(value)
    return value


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` if it is a bool.

    Args:
        name: The argument name used in the error message.
        value: The value to check.

    Returns:
        ``value``, typed as a bool.

    Raises:
        TypeError: If ``value`` is not a bool.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_seed(value: object) -> int:
    """Return ``value`` if it is an int (any size or sign; not a bool): a seed.

    Raises:
        TypeError: If ``value`` is not an int or is a bool.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"seed must be an int, got {value!r}")
    return value


def check_seconds(name: str, value: object) -> float:
    """Return ``value`` as a float if it is a positive, finite number of seconds.

    Raises:
        TypeError: If ``value`` is not an int or a float (or is a bool).
        ValueError: If it is not positive and finite.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a positive, finite number of seconds, got {value!r}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")
    return float(value)


def check_picklable(
    name: str,
    value: object,
    *,
    dumps: Callable[[object], bytes],
    to: str,
    remedy: str = "pass worker_mode='thread'",
) -> None:
    """Fail now, not mid-epoch, when ``value`` cannot be sent to ``to``, pickled by ``dumps``
    (Ray's workers: cloudpickle; the worker processes decide in ``_workers/byvalue.py``).

    Raises:
        TypeError: ``value`` does not pickle; the message names the argument and what to do.
    """
    if value is None:
        return
    try:
        dumps(value)
    except Exception as exc:
        raise TypeError(
            f"{name}={value!r} cannot be sent to {to} ({type(exc).__name__}: {exc}): make "
            f"its object picklable, or {remedy}"
        ) from exc
