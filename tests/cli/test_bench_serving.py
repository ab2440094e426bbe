"""The serving workloads' own reporting: the batch-size distribution of ``serving.py`` (from
rows made by hand), and ``serving_cost.py`` run briefly end to end (every request served, its
rows reported to the command). No figure is asserted: they are the machine's."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest

from aioloader._bench import harness, serving, serving_cost, serving_load


def level(mode: str, rate: float, sizes: dict[int, int]) -> serving_load.Level:
    return serving_load.Level(mode, rate, 10, 10, 0, 1.0, [0.01] * 10, sizes, 0.0, 0.01)


def test_the_serving_table_shows_each_server_s_batch_sizes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    lv = level("batcher", 200, {1: 2, 3: 1, 8: 1, 32: 1})
    assert lv.batches == 5 and lv.mean_batch == pytest.approx(45 / 5)
    assert lv.size_shares() == [0.4, 0.2, 0.0, 0.2, 0.0, 0.2]
    results = {"batcher": [lv], "naive": [level("naive", 200, {4: 2})]}
    args = Namespace(request_timeout=3.0, rates=[200], model="gpu")
    assert serving.summarize(results, {1: 0.004, 8: 0.005, 32: 0.007}, args)  # no goal: no (b)
    out = capsys.readouterr().out
    assert "batch sizes (share of model calls)" in out
    assert "(a) batcher           5    40%    20%     0%    20%     0%    20%" in out


def test_the_cost_workload_serves_every_request_and_reports_its_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = tmp_path / "rows.jsonl"
    monkeypatch.setenv(harness.ROWS_ENV, str(rows))
    assert serving_cost.main(["--rates", "300", "--window", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "goal at 300/s" in out
    reported = [json.loads(line) for line in rows.read_text().splitlines()]
    assert [r["config"] for r in reported] == [
        "batcher-count@300", "batcher-cost@300", "batcher-bucket@300"
    ]  # fmt: skip
    assert all(r["table"] == "serving-cost" and r["ok"] for r in reported)
    assert all(r["padded_per_request"] > 0 for r in reported)
