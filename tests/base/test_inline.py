"""The inline policy (``_base/inline.py``): the moving average the adaptive decisions read, and
where the next call goes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aioloader._base.inline import Placement, Recent


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
    place.alone_took(0.0002)
    assert place.where() == "inline" and place.fast()
    place.alone_took(0.003)  # slower than a hop: on the threads, timed alone after 1, 2, 4, 4
    got = [place.where() for _ in range(15)]
    alone = [i for i, where in enumerate(got) if where == "alone"]
    assert alone == [0, 2, 6, 10, 14] and set(got) == {"alone", "threads"}
    place.alone_took(0.5)  # slow: timed alone far less often (the others wait for it)
    got = [place.where() for _ in range(16)]
    assert [i for i, where in enumerate(got) if where == "alone"] == [3, 11]
    place.alone_took(0.0001)  # found fast: inline, and a later slow spell is probed soon
    assert place.where() == "inline"
    place.recent.add(0.5)
    assert place.where() == "alone"


@given(
    times=st.lists(st.floats(1e-7, 1.0), min_size=1, max_size=60),
    every=st.integers(1, 6),
)
def test_calls_are_timed_alone_ever_more_rarely_up_to_the_period(
    times: list[float], every: int
) -> None:
    """On the threads, the gaps between calls timed alone double from one up to the period
    (``every``, or ``3 * every`` for slow calls); a fast average resets them."""
    place = Placement(0.001, slow_below=0.01, probe_every=every, slow_probe_every=3 * every)
    interval, since = 1, 0
    for took in times:
        place.recent.add(took)
        seconds = place.recent.seconds
        assert seconds is not None
        where = place.where()
        if seconds < 0.001:
            assert where == "inline"
            interval = 1
            continue
        since += 1
        assert where == ("alone" if since >= interval else "threads")
        if where == "alone":
            since, interval = 0, min(2 * interval, every if seconds < 0.01 else 3 * every)


def test_limits_out_of_order_are_refused() -> None:
    with pytest.raises(ValueError, match="limit <= slow_below"):
        Placement(0.01, slow_below=0.001)
