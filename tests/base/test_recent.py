"""The moving average the adaptive decisions read (``_base/recent.py``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aioloader._base.recent import InlineChoice, Recent


def test_nothing_measured_is_under_no_limit() -> None:
    assert not Recent().under(1.0)


def test_one_slow_call_moves_it_at_once_and_fast_ones_bring_it_back() -> None:
    recent = Recent()
    recent.add(0.0001)
    assert recent.under(0.001)
    recent.add(0.01)  # one call 100 times slower: over the limit straight away
    assert not recent.under(0.001)
    calls = 0
    while not recent.under(0.001):
        recent.add(0.0001)
        calls += 1
    assert calls == 4  # the jump shrinks by 3/4 a call: a handful of calls, not hundreds


def test_the_first_call_and_fast_ones_run_inline_slow_ones_on_the_threads() -> None:
    choice = InlineChoice(0.001, probe_below=0.01)
    assert choice.inline()  # nothing measured: timed alone, inline
    choice.recent.add(0.0002)
    assert choice.inline()
    choice.recent.add(0.05)
    assert not any(choice.inline() for _ in range(100)), "too slow to be worth a probe"


def test_a_probe_replaces_the_average_with_its_own_time() -> None:
    choice = InlineChoice(0.001, probe_below=0.01, probe_every=4)
    choice.recent.add(0.003)  # calls on the threads look slow (waiting for the GIL)
    decisions = [choice.inline() for _ in range(4)]
    assert decisions == [False, False, False, True]
    assert choice.recent.seconds is None  # what the probe takes is the estimate
    choice.recent.add(0.0001)  # timed alone it is fast
    assert choice.inline()


@given(
    times=st.lists(st.floats(1e-6, 0.05), min_size=1, max_size=60),
    busy=st.lists(st.integers(0, 3), min_size=60, max_size=60),
    every=st.integers(1, 10),
)
def test_probes_are_rare_alone_and_only_for_calls_that_may_be_fast(
    times: list[float], busy: list[int], every: int
) -> None:
    """Over the limit, a call runs inline only as a probe: with no call on the threads, while
    the average is under ``probe_below``, at most once every ``every`` decisions."""
    choice = InlineChoice(0.001, probe_below=0.01, probe_every=every)
    since = every
    for took, on_threads in zip(times, busy, strict=False):
        seconds = choice.recent.seconds
        choice.on_threads = on_threads
        inline = choice.inline()
        if seconds is None or seconds < 0.001:
            assert inline
        elif inline:
            assert on_threads == 0 and seconds < 0.01 and since >= every
            since = 0
        since += 1
        with choice.away():
            assert choice.on_threads == on_threads + 1
        choice.recent.add(took)


def test_away_counts_a_call_until_it_ends_even_by_an_error() -> None:
    choice = InlineChoice(0.001, probe_below=0.01)
    with pytest.raises(KeyError), choice.away():
        assert choice.on_threads == 1
        raise KeyError("x")
    assert choice.on_threads == 0
