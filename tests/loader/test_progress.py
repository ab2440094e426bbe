"""``progress=True`` draws a line per epoch (stderr, not a terminal here), ``loader.progress()``
says the same for a loop of one's own, and without them the library prints nothing."""

from __future__ import annotations

import re
import sys
from collections.abc import AsyncIterator

import pytest

from aioloader import DataLoader


@pytest.fixture(autouse=True)
def plain_bar(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain bar, whether tqdm is installed or not (it is, in CI: Lightning brings it);
    a test marked ``with_tqdm`` gets tqdm's."""
    if "with_tqdm" not in request.keywords:
        monkeypatch.setitem(sys.modules, "tqdm", None)  # `from tqdm import ...` raises


@pytest.mark.with_tqdm
def test_tqdm_draws_the_bar_when_installed(capsys: pytest.CaptureFixture[str]) -> None:
    import tqdm  # noqa: F401  # a dev dependency: the bar below must be tqdm's

    loader = DataLoader(list(range(200)), batch_size=20, progress=True)
    for _ in loader:
        pass
    out, err = capsys.readouterr()
    assert out == ""
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    assert re.fullmatch(r"epoch 0: 100%\|█+\| 200/200 \[.*, waited \d+%\]", last), last


def test_a_line_per_epoch_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    loader = DataLoader(list(range(200)), batch_size=20, progress=True)
    for _epoch in range(2):
        for _ in loader:
            pass
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 2
    for epoch, line in enumerate(lines):
        assert re.fullmatch(rf"epoch {epoch} \[#{{30}}\] 200/200 [\d,]+/s waited \d+%", line), line


def test_progress_gives_the_running_epochs_line() -> None:
    loader = DataLoader(list(range(200)), batch_size=20, drop_last=True)
    assert loader.progress() == "no epoch started"
    it = iter(loader)
    next(it), next(it)
    assert re.fullmatch(
        r"epoch 0: 40/200 samples, [\d,]+ samples/s, consumer waited \d+%", loader.progress()
    )
    it.close()


async def numbers() -> AsyncIterator[int]:
    for i in range(50):
        yield i


async def test_a_stream_counts_without_a_total(capsys: pytest.CaptureFixture[str]) -> None:
    loader = DataLoader(numbers, batch_size=10, progress=True)
    async with loader:
        assert len([b async for b in loader]) == 5
    assert re.fullmatch(r"epoch 0 50 [\d,]+/s waited \d+%\n", capsys.readouterr().err)


def test_without_progress_nothing_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    for _ in DataLoader(list(range(100)), batch_size=10, shuffle=True):
        pass
    assert capsys.readouterr() == ("", "")


def test_progress_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="progress must be a bool"):
        DataLoader([1], progress="yes")  # type: ignore[arg-type]


def test_an_epoch_left_by_a_break_ends_its_line(capsys: pytest.CaptureFixture[str]) -> None:
    loader = DataLoader(list(range(100)), batch_size=10, progress=True)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    for _ in loader:  # the next epoch ends the one left
        pass
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("epoch 0 [#########") and " 30/100 " in lines[0], lines
    assert lines[1].startswith("epoch 1 [") and " 100/100 " in lines[1], lines


def test_a_resumed_epoch_counts_what_was_taken_but_not_in_its_rate(
    capsys: pytest.CaptureFixture[str],
) -> None:
    saved = DataLoader(list(range(100)), batch_size=10, seed=1)
    it = iter(saved)
    next(it)
    state = saved.state_dict()
    it.close()
    resumed = DataLoader(list(range(100)), batch_size=10, seed=1, progress=True)
    resumed.load_state_dict(state)
    for _ in resumed:
        pass
    line = capsys.readouterr().err.strip()
    assert " 100/100 " in line, line
