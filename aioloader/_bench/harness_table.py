"""A workload's table: a line a configuration, its figures in columns, and ratios against peers
measured in the same run (:func:`format_table`, :class:`Column`, :func:`ratio_to`).

Never: prints (a script prints what this formats); imports torch, aioloader or another module of
the package when it runs (``benchmarks/bench_startup.py`` loads this file by its path).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Literal, Protocol, TypeVar

if TYPE_CHECKING:
    from aioloader._bench.harness import Result


class Named(Protocol):
    """A table's row: its first column is ``name``."""

    @property
    def name(self) -> str: ...


Row = TypeVar("Row", bound=Named)
R = TypeVar("R", bound="Result")


@dataclass(frozen=True)
class Column(Generic[Row]):
    """A column of :func:`format_table`: ``cell(row)`` in ``width`` characters, right-aligned
    (``align=">"``) or left-aligned (``"<"``), under ``header``."""

    header: str
    width: int
    cell: Callable[[Row], str]
    align: Literal["<", ">"] = ">"


def format_table(
    rows: Iterable[Row],
    name_width: int,
    columns: Sequence[Column[Row]],
    check: Callable[[Row], str],
    *,
    blank: Callable[[Row], bool] | None = None,
    check_header: str = "check",
    note: str | None = None,
) -> str:
    """A header, a rule, then a line a row: its name under ``config`` in ``name_width``
    characters, its ``columns`` ("-" in each for a ``blank`` row), two spaces and
    ``check(row)`` under ``check_header``; then ``note``."""
    header = (
        f"{'config':<{name_width}}"
        + "".join(f"{c.header:{c.align}{c.width}}" for c in columns)
        + f"  {check_header}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        empty = blank is not None and blank(row)
        cells = "".join(f"{'-' if empty else c.cell(row):{c.align}{c.width}}" for c in columns)
        lines.append(f"{row.name:<{name_width}}{cells}  {check(row)}")
    if note is not None:
        lines.append(note)
    return "\n".join(lines)


def ratio_to(rows: Iterable[R], peer: str, *values: Callable[[R], float]) -> Callable[[R], str]:
    """A cell: each of ``values`` of the row over the same of the row named ``peer``, as
    ``1.23x`` (several: ``1.23x/0.98x``); "-" where either row was not :attr:`Result.measured`,
    the peer did not run, or a value of the peer's is 0."""
    by_name = {r.name: r for r in rows}

    def cell(row: R) -> str:
        base = by_name.get(peer)
        if base is None or not base.measured or not row.measured:
            return "-"
        if any(value(base) == 0 for value in values):
            return "-"
        return "/".join(f"{value(row) / value(base):.2f}x" for value in values)

    return cell
