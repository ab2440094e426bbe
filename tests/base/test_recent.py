"""The moving average the adaptive decisions read (``_base/recent.py``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aioloader._base.recent import Placement, Recent


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


def test_where_calls_run_from_how_long_they_took_alone() -> None:
    place = Placement(0.001, slow_below=0.01, probe_every=4, slow_probe_every=8)
    assert place.where() == "alone"  # nothing measured: timed alone
    place.recent.add(0.0002)
    assert place.where() == "inline" and place.fast()
    place = Placement(0.001, slow_below=0.01, probe_every=4, slow_probe_every=8)
    place.recent.add(0.003)  # slower than a hop: on the threads, one in four timed alone
    assert [place.where() for _ in range(8)] == ["threads"] * 3 + ["alone"] + ["threads"] * 3 + [
        "alone"
    ]
    place.recent.seconds = 0.5  # slow: timed alone far less often (the others wait for it)
    assert [place.where() for _ in range(8)] == ["threads"] * 7 + ["alone"]


@given(
    times=st.lists(st.floats(1e-7, 1.0), min_size=1, max_size=40),
    every=st.integers(1, 6),
)
def test_the_place_follows_the_times_and_probes_on_schedule(times: list[float], every: int) -> None:
    place = Placement(0.001, slow_below=0.01, probe_every=every, slow_probe_every=3 * every)
    since = 0
    for took in times:
        place.recent.add(took)
        seconds = place.recent.seconds
        assert seconds is not None
        where = place.where()
        if seconds < 0.001:
            assert where == "inline"
            continue
        since += 1
        due = every if seconds < 0.01 else 3 * every
        assert where == ("alone" if since >= due else "threads")
        if where == "alone":
            since = 0


def test_limits_out_of_order_are_refused() -> None:
    with pytest.raises(ValueError, match="limit <= slow_below"):
        Placement(0.01, slow_below=0.001)
