"""One caller's request to the dynamic batcher, and the states of its life.

Owns: :class:`Request` (the item, when it arrived and expires, its cost and bucket, the future
its outcome arrives through and its deadline's timer) and its states. Never: moves a request
from one state to another (the batcher and its runner tasks do, :mod:`aioloader._serving.batcher`
and :mod:`aioloader._serving.dispatch`), or waits.

A request's life: ``WAITING`` in the queue → ``RUNNING`` in a batch → ``DONE`` (outcome set), or
``GONE`` (withdrawn, expired, cancelled or abandoned: counted once, by whoever moved it there).
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Any

__all__ = ["DONE", "GONE", "RUNNING", "WAITING", "Request"]

WAITING, RUNNING, DONE, GONE = "waiting", "running", "done", "gone"


class Request:
    """One caller's request; its outcome arrives through ``future``.

    A bare asyncio future and timer handle rather than an anyio event and cancel scope: they
    are what every request pays for, and cost a few microseconds instead of tens. Each raise of
    a future's exception starts from the traceback it was set with, so when every caller of a
    batch gets the same exception object, one caller's frames don't pile onto another's.
    """

    __slots__ = ("bucket", "cost", "deadline", "enqueued_at", "future", "item", "state", "timer")

    def __init__(
        self,
        item: Any,
        enqueued_at: float,
        deadline: float,
        future: asyncio.Future[Any],
        cost: float,
        bucket: Hashable,
    ) -> None:
        self.item = item
        self.enqueued_at = enqueued_at
        self.deadline = deadline
        self.future = future
        self.cost = cost
        self.bucket = bucket
        self.state = WAITING
        self.timer: asyncio.TimerHandle | None = None

    def resolve(self, value: Any, error: BaseException | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if not self.future.done():
            if error is None:
                self.future.set_result(value)
            else:
                self.future.set_exception(error)
