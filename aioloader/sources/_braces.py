"""Brace expansion of shard names, as WebDataset and shell users write them.

``"s3://b/train-{000000..000127}.tar"`` names 128 shards; ``"{a,b}/x-{0..2}.tar"`` names six.
Pure: no I/O.
"""

from __future__ import annotations

import itertools
import re

__all__ = ["expand_braces"]

_GROUP = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?$")
# A brace written ``\{`` or ``\}`` is a literal one (braceexpand's rule, which webdataset uses)
_ESCAPED = {"\\{": "\ue000", "\\}": "\ue001"}
_MAX_NAMES = 10_000_000
_LIST = re.compile(r"::(?![^\[]*\])")  # "::" between patterns, not in an IPv6 host: [::1]


def expand_braces(pattern: str) -> list[str]:
    r"""Every name ``pattern`` stands for, in order (the last group varies fastest).

    A group ``{first..last}`` is a range of integers, ascending or descending, both ends
    included (``{first..last..step}``: every ``step``-th); when either end is written with
    leading zeros, every number is zero-padded to that width. A group ``{a,b,c}`` is a list of
    alternatives. Groups do not nest; ``\{`` and ``\}`` are literal braces. A pattern without
    braces names itself. Several patterns joined by ``::`` name their shards one after the
    other (webdataset's and OpenCLIP's lists: ``"a-{0..9}.tar::b-{0..9}.tar"``).

    Raises:
        ValueError: A brace is unmatched, a group is empty, a group is neither a range nor a
            list, or the pattern names more than ten million shards; the message quotes the
            pattern.
    """
    if "::" in pattern and len(parts := _LIST.split(pattern)) > 1:
        return [name for part in parts for name in expand_braces(part)]
    given = pattern
    for escaped, held in _ESCAPED.items():
        pattern = pattern.replace(escaped, held)
    names = _expand(pattern, given)
    if pattern == given:
        return names
    return [n.replace("\ue000", "{").replace("\ue001", "}") for n in names]


def _expand(pattern: str, given: str) -> list[str]:
    pieces: list[list[str]] = []
    pos = 0
    for match in _GROUP.finditer(pattern):
        literal = pattern[pos : match.start()]
        _check_literal(literal, given)
        pieces.append([literal])
        pieces.append(_group(match[1], given))
        pos = match.end()
    tail = pattern[pos:]
    _check_literal(tail, given)
    pieces.append([tail])
    count = 1
    for options in pieces:
        count *= len(options)
    if count > _MAX_NAMES:
        raise ValueError(f"shard pattern {given!r} names {count} shards, more than {_MAX_NAMES}")
    return ["".join(parts) for parts in itertools.product(*pieces)]


def _check_literal(text: str, pattern: str) -> None:
    if "{" in text or "}" in text:
        raise ValueError(f"shard pattern {pattern!r} has an unmatched or nested brace")


def _group(body: str, pattern: str) -> list[str]:
    ranged = _RANGE.match(body)
    if ranged is not None:
        first_text, last_text = ranged[1], ranged[2]
        first, last = int(first_text), int(last_text)
        ends = (first_text, last_text)
        padded = any(len(t.lstrip("-")) > 1 and t.lstrip("-")[0] == "0" for t in ends)
        width = max(len(first_text), len(last_text)) if padded else 0
        stride = abs(int(ranged[3] or 1))
        if stride == 0:
            raise ValueError(f"shard pattern {pattern!r}: group {{{body}}} has a step of 0")
        step = stride if last >= first else -stride
        return [f"{n:0{width}d}" for n in range(first, last + (1 if step > 0 else -1), step)]
    if "," in body:
        return body.split(",")
    raise ValueError(
        f"shard pattern {pattern!r}: group {{{body}}} is neither a range {{first..last}} nor a "
        "list {a,b}"
    )
