"""Brace expansion of shard names, as WebDataset and shell users write them.

``"s3://b/train-{000000..000127}.tar"`` names 128 shards; ``"{a,b}/x-{0..2}.tar"`` names six.
Pure: no I/O.
"""

from __future__ import annotations

import itertools
import re

__all__ = ["expand_braces"]

_GROUP = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")
_MAX_NAMES = 10_000_000


def expand_braces(pattern: str) -> list[str]:
    """Every name ``pattern`` stands for, in order (the last group varies fastest).

    A group ``{first..last}`` is a range of integers, ascending or descending, both ends
    included; when either end is written with leading zeros, every number is zero-padded to that
    width. A group ``{a,b,c}`` is a list of alternatives. Groups do not nest. A pattern without
    braces names itself.

    Raises:
        ValueError: A brace is unmatched, a group is empty, a group is neither a range nor a
            list, or the pattern names more than ten million shards; the message quotes the
            pattern.
    """
    pieces: list[list[str]] = []
    pos = 0
    for match in _GROUP.finditer(pattern):
        literal = pattern[pos : match.start()]
        _check_literal(literal, pattern)
        pieces.append([literal])
        pieces.append(_group(match[1], pattern))
        pos = match.end()
    tail = pattern[pos:]
    _check_literal(tail, pattern)
    pieces.append([tail])
    count = 1
    for options in pieces:
        count *= len(options)
    if count > _MAX_NAMES:
        raise ValueError(f"shard pattern {pattern!r} names {count} shards, more than {_MAX_NAMES}")
    return ["".join(parts) for parts in itertools.product(*pieces)]


def _check_literal(text: str, pattern: str) -> None:
    if "{" in text or "}" in text:
        raise ValueError(f"shard pattern {pattern!r} has an unmatched or nested brace")


def _group(body: str, pattern: str) -> list[str]:
    ranged = _RANGE.match(body)
    if ranged is not None:
        first_text, last_text = ranged[1], ranged[2]
        first, last = int(first_text), int(last_text)
        padded = any(len(t.lstrip("-")) > 1 and t.lstrip("-")[0] == "0" for t in ranged.groups())
        width = max(len(first_text), len(last_text)) if padded else 0
        step = 1 if last >= first else -1
        return [f"{n:0{width}d}" for n in range(first, last + step, step)]
    if "," in body:
        return body.split(",")
    raise ValueError(
        f"shard pattern {pattern!r}: group {{{body}}} is neither a range {{first..last}} nor a "
        "list {a,b}"
    )
