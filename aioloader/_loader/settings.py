"""The loader's attributes as views of its plan: ``loader.batch_size`` reads the plan, and
``loader.num_workers = 4`` re-plans.

Owns: :class:`Setting`, the descriptor ``DataLoader`` declares each of its arguments' attributes
with (in ``loader.py``, one line each, after the signature). Never: checks a value or builds a
plan itself (``plan.py`` does, through the loader's ``_replan``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar, overload

from .plan import LoaderPlan

__all__ = ["Planned", "Setting"]

T = TypeVar("T")


class Planned(Protocol):
    """What a setting needs of its loader (``loader.DataLoader`` is one): its plan, and a way
    to replace it with one where an argument has another value."""

    _plan: LoaderPlan

    def _replan(self, name: str, value: object) -> None: ...


class Setting(Generic[T]):
    """A loader attribute that is a view of its plan: the argument as given, or (``resolved``)
    as the plan resolved it; where that is None, what ``shown(loader)`` gives, if given (the
    sampler torch's loader would have). Setting it re-plans (see :meth:`LoaderPlan.replaced`)."""

    __slots__ = ("name", "resolved", "shown")

    def __init__(
        self, *, resolved: bool = False, shown: Callable[[Any], object] | None = None
    ) -> None:
        self.resolved = resolved
        self.shown = shown
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, loader: None, owner: type) -> Setting[T]: ...
    @overload
    def __get__(self, loader: Planned, owner: type) -> T: ...
    def __get__(self, loader: Planned | None, owner: type) -> T | Setting[T]:
        if loader is None:
            return self
        plan = loader._plan
        value = getattr(plan if self.resolved else plan.arguments, self.name)
        if value is None and self.shown is not None:
            value = self.shown(loader)
        return value  # type: ignore[no-any-return]

    def __set__(self, loader: Planned, value: T) -> None:
        loader._replan(self.name, value)
