"""The moving average the adaptive decisions read (``_base/recent.py``)."""

from __future__ import annotations

from aioloader._base.recent import Recent


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
