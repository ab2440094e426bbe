"""What a loader's (or a batcher's) device stage does, decided once from its arguments.

Owns: :class:`DevicePlan` and the one device decision (:func:`device_plan`, :func:`plan_for`),
shared by the loader and the batcher: where batches go, whether they are pinned, torch's warning
for ``pin_memory=True`` without an accelerator. Never: moves memory, or starts the stage
(``stage.py`` does, in a scope).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from .accelerator import Accelerator, CudaAccelerator

__all__ = ["DevicePlan", "device_plan", "plan_for"]


@dataclass(frozen=True, slots=True)
class DevicePlan:
    """What a loader's device stage does (fixed at construction; a scope builds the stage).

    Attributes:
        accelerator: Makes the device's :class:`Accelerator` (one per scope); None: the stage
            only pins batches on the host (``pin_memory=True`` without ``device``).
        pin: Copy through page-locked memory (the pool with a device; torch's pinning without).
        transform: ``device_transform``, run on the side stream after the copies.
    """

    accelerator: Callable[[], Accelerator] | None
    pin: bool
    transform: Callable[[Any], Any] | None = None


def plan_for(
    device: torch.device | None, *, pin: bool, transform: Callable[[Any], Any] | None
) -> DevicePlan | None:
    """The device stage for ``device`` (already resolved): None when batches stay on the host
    unpinned (then ``device_transform`` runs where collation runs)."""
    if device is not None and device.type == "cuda":
        return DevicePlan(partial(CudaAccelerator, device), pin, transform)
    if pin:
        return DevicePlan(None, True)
    return None


def device_plan(
    device: torch.device | None,
    *,
    pin_memory: bool,
    transform: Callable[[Any], Any] | None,
    stacklevel: int,
) -> DevicePlan | None:
    """The one device decision, for the loader and the batcher alike: :func:`plan_for`, after
    ``pin_memory=True`` without an accelerator is warned about (a ``UserWarning`` in torch's
    words, which scripts filter it by, at ``stacklevel`` above the caller) and dropped."""
    pin = bool(pin_memory)
    if pin and not torch.cuda.is_available():
        warnings.warn(
            "'pin_memory' argument is set as true but no accelerator is found, then device "
            "pinned memory won't be used. (aioloader pins for CUDA devices only)",
            UserWarning,
            stacklevel=stacklevel + 1,
        )
        pin = False
    return plan_for(device, pin=pin, transform=transform)
