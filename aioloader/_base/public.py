"""Where public objects say they live.

Owns: :func:`report_public_module`, run by the facades (``aioloader``, ``aioloader.sources``).
Never: imports anything of the package.
"""

from __future__ import annotations

import contextlib

__all__ = ["report_public_module"]


def report_public_module(namespace: dict[str, object], names: list[str], module: str) -> None:
    """Public objects say they live where users import them from (as anyio's and trio's do):
    ``aioloader.DataLoader``, not ``aioloader._loader.loader.DataLoader``, in reprs, tracebacks and
    pickles (pickling by reference finds them here)."""
    for name in names:
        obj = namespace[name]
        if getattr(obj, "__module__", "").startswith(f"{module}."):
            # A builtin or slotted object refuses: it is left as it is.
            with contextlib.suppress(AttributeError, TypeError):
                obj.__module__ = module
