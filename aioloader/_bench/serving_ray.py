"""Ray Serve's ``@serve.batch`` as a server of the serving workload (``(d) ray batch``), where
Ray is installed. Ray is never a dependency of aioloader: install ``ray[serve]`` in a virtual
environment of its own with aioloader on its path to get this row.

Owns: the model wrapped as a Ray Serve deployment wraps it: ``@serve.batch`` on an async method
(``max_batch_size``, ``batch_wait_timeout_s`` = the batcher's ``max_delay``), the model run on
one thread as the batcher runs it. Never: starts a Ray cluster or Ray's HTTP proxy: the
decorator runs inside the workload's own aiohttp server, so the HTTP stack, the load and the
model are the other servers'; only the batching differs.
"""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["available", "ray_batched"]


def available() -> bool:
    """Whether Ray Serve imports here. Ray installed without its ``serve`` extra lacks Serve's
    HTTP dependencies (starlette): the Ray workers' tests install it so, and the serving
    workload then failed whole as that server started. Tried in a child interpreter, where Ray
    is installed (the import would weigh on the process that asks, a measured one)."""
    if importlib.util.find_spec("ray") is None:
        return False
    try:
        tried = subprocess.run(
            [sys.executable, "-c", "import ray.serve"], capture_output=True, timeout=180
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return tried.returncode == 0


def ray_batched(
    model: Callable[[torch.Tensor], torch.Tensor],
    thread: ThreadPoolExecutor,
    *,
    max_batch_size: int,
    max_delay: float,
    sizes: Counter[int],
) -> Callable[[torch.Tensor], Awaitable[torch.Tensor]]:
    """``submit(x)`` through ``@serve.batch``; each batch's size is counted in ``sizes``.

    Raises:
        ImportError: Ray Serve is not installed.
    """
    from ray.serve import batch, batching

    # Outside a deployment, the queue asks for the replica's context only to warn when
    # max_batch_size exceeds max_ongoing_requests; it has no other use for it.
    queue_class = batching._BatchQueue
    queue_class._warn_if_max_batch_size_exceeds_max_ongoing_requests = lambda self: None

    async def run(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        sizes[len(xs)] += 1
        loop = asyncio.get_running_loop()
        out = await loop.run_in_executor(thread, model, torch.stack(xs))
        return list(out.unbind(0))

    submit: Callable[[torch.Tensor], Awaitable[torch.Tensor]]
    submit = batch(max_batch_size=max_batch_size, batch_wait_timeout_s=max_delay)(run)
    return submit
