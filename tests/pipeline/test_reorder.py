"""Tests for aioloader._pipeline.reorder: ReorderBuffer and BatchAssembler."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aioloader._pipeline.reorder import BatchAssembler, ReorderBuffer

FAST = settings(max_examples=200, deadline=None)


@st.composite
def completions(draw: st.DrawFn) -> tuple[int, list[int], set[int]]:
    """A start, a completion order of start..start+n-1 and the skipped subset."""
    start = draw(st.integers(min_value=0, max_value=5))
    n = draw(st.integers(min_value=0, max_value=60))
    order = draw(st.permutations(range(start, start + n)))
    skipped = draw(st.sets(st.sampled_from(order))) if order else set()
    return start, list(order), skipped


@FAST
@given(completions())
def test_reorder_delivers_in_order(case: tuple[int, list[int], set[int]]) -> None:
    start, order, skipped = case
    buffer: ReorderBuffer[str] = ReorderBuffer(start)
    out: list[str] = []
    done: set[int] = set()
    max_held = 0
    for seq in order:
        if seq in skipped:
            out += buffer.skip(seq)
        else:
            out += buffer.push(seq, f"item{seq}")
        done.add(seq)
        # Model: everything below the first missing seq is released.
        next_seq = start
        while next_seq in done:
            next_seq += 1
        held = sum(1 for s in done if s > next_seq and s not in skipped)
        max_held = max(max_held, held)
        assert buffer.next_seq == next_seq
        assert len(buffer) == held
        assert out == [f"item{s}" for s in range(start, next_seq) if s not in skipped]
    assert out == [f"item{s}" for s in sorted(order) if s not in skipped]
    assert len(buffer) == 0
    assert buffer.next_seq == start + len(order)
    assert buffer.max_held == max_held


@settings(max_examples=100, deadline=None)
@given(completions(), st.data())
def test_reorder_rejects_duplicates_and_stale(
    case: tuple[int, list[int], set[int]], data: st.DataObject
) -> None:
    start, order, _ = case
    if not order:
        return
    buffer: ReorderBuffer[int] = ReorderBuffer(start)
    k = data.draw(st.integers(min_value=1, max_value=len(order)))
    for seq in order[:k]:
        buffer.push(seq, seq)
    before = (buffer.next_seq, len(buffer))
    seq = data.draw(st.sampled_from(order[:k]))
    with pytest.raises(ValueError, match=f"seq {seq}"):
        buffer.push(seq, -1)
    with pytest.raises(ValueError, match=f"seq {seq}"):
        buffer.skip(seq)
    assert (buffer.next_seq, len(buffer)) == before
    if start > 0:
        with pytest.raises(ValueError, match=f"seq {start - 1}"):
            buffer.push(start - 1, -1)


def test_reorder_examples() -> None:
    buffer: ReorderBuffer[str] = ReorderBuffer()
    assert buffer.push(2, "c") == []
    assert buffer.push(1, "b") == []
    assert len(buffer) == 2
    assert buffer.max_held == 2
    assert buffer.skip(3) == []
    assert buffer.push(0, "a") == ["a", "b", "c"]
    assert buffer.next_seq == 4
    assert len(buffer) == 0
    assert buffer.push(4, "e") == ["e"]
    assert buffer.max_held == 2
    with pytest.raises(ValueError, match="seq 4 was already delivered"):
        buffer.push(4, "again")


def test_reorder_validation() -> None:
    with pytest.raises(ValueError, match="start"):
        ReorderBuffer(-1)
    with pytest.raises(TypeError, match="start"):
        ReorderBuffer(1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seq"):
        ReorderBuffer[int]().push(True, 1)


@FAST
@given(st.lists(st.integers()), st.integers(min_value=1, max_value=12), st.booleans())
def test_batch_assembler(stream: list[int], batch_size: int, drop_last: bool) -> None:
    assembler: BatchAssembler[int] = BatchAssembler(batch_size)
    batches: list[list[int]] = []
    for i, item in enumerate(stream):
        batch = assembler.add(item)
        if batch is not None:
            batches.append(batch)
            assert (i + 1) % batch_size == 0
        assert len(assembler) == (i + 1) % batch_size
    assert all(len(b) == batch_size for b in batches)
    tail = assembler.flush(drop_last)
    assert len(assembler) == 0
    assert assembler.flush(drop_last) is None
    full = len(stream) - len(stream) % batch_size
    if tail is not None:
        assert not drop_last
        assert 0 < len(tail) < batch_size
        batches.append(tail)
    else:
        assert drop_last or full == len(stream)
    flat = [x for b in batches for x in b]
    assert flat == (stream[:full] if drop_last else stream)


def test_batch_assembler_validation() -> None:
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        BatchAssembler(0)
    with pytest.raises(TypeError, match="batch_size"):
        BatchAssembler(False)
    with pytest.raises(TypeError, match="drop_last"):
        BatchAssembler[int](2).flush(1)  # type: ignore[arg-type]
