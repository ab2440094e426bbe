"""torch's ``default_collate_fn_map``, as :func:`~aioloader.default_collate` follows it: the
functions of the user's in it (a type registered, or one of torch's rules replaced), which
torch documents as the way to extend ``default_collate`` and its loader's ``collate_fn=None``
follows (found by review: a registered type could not be collated, a replaced ``str`` rule
was not used). The rest of the map is torch's own rules, which ``collate.py`` has.

Owns: :func:`refresh` and :func:`function_for`. Never: collates (``collate.py`` does, calling
a user's function where torch's ``collate`` would).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils.collate import default_collate_fn_map as collate_fn_map

__all__ = ["collate_fn_map", "function_for", "refresh", "registered"]

_TORCH_COLLATE = "torch.utils.data._utils.collate"
_TORCH_KEYS = frozenset({torch.Tensor, np.ndarray, (np.bool_, np.number, np.object_), float, int})
_TORCH_KEYS |= {str, bytes}
_TORCH_TYPES = (torch.Tensor, np.ndarray, np.bool_, np.number, np.object_, float, int, str, bytes)

registered: dict[Any, Callable[..., Any]] = {}
"""The user's entries of torch's map, as the last :func:`refresh` found them (the same for
every thread: the map is the process's)."""


def refresh() -> None:
    """Read the user's entries of torch's map into :data:`registered` (once per batch)."""
    global registered
    registered = {
        key: fn
        for key, fn in collate_fn_map.items()
        if key not in _TORCH_KEYS or getattr(fn, "__module__", None) != _TORCH_COLLATE
    }


def function_for(elem: Any) -> Callable[..., Any] | None:
    """The user's function for ``elem`` as torch's ``collate`` finds it: its exact type's,
    else the first key it is an instance of (torch's own keys come first in torch's map, so
    a subclass of one of them gets torch's rule, which ours is)."""
    fn = registered.get(type(elem))
    if fn is not None or isinstance(elem, _TORCH_TYPES):
        return fn
    for key, found in registered.items():
        if isinstance(elem, key):
            return found
    return None
