"""``aioloader bench``'s ``gpu`` workload (issue 25): its smoke run end to end on the CPU (the
code a GPU box runs, each configuration in a fresh interpreter, without torchvision), and one
skipped row where there is no CUDA device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aioloader._bench import gpu, harness, suite
from aioloader._bench.gpu_results import GpuResult
from aioloader._bench.results import Row


def test_the_gpu_workload_is_registered_with_its_three_tables() -> None:
    (workload,) = suite.selected(["gpu"])
    assert workload.module == "gpu" and "PIL" in workload.needs
    assert set(workload.tables) == set(gpu.TABLES)
    assert workload.limit_s[1] <= 600  # fits one device command


def test_a_row_s_rate_is_the_median_steady_epoch_or_every_epoch_without_persistence() -> None:
    payload = {"images": 100, "epoch_s": [4.0, 1.0, 2.0]}
    assert GpuResult("torch", payload=payload).rate == pytest.approx(100 / 1.5)
    fresh = GpuResult("torch", persistent=False, payload={"images": 100, "epoch_s": [3.0, 1.0]})
    assert fresh.rate == pytest.approx(50.0)
    assert GpuResult("torch").rate == 0.0  # no payload: nothing measured


@pytest.mark.skipif(torch.cuda.is_available(), reason="there is a CUDA device here")
def test_without_cuda_the_workload_is_one_skipped_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows_file = tmp_path / "rows.jsonl"
    monkeypatch.setenv(harness.ROWS_ENV, str(rows_file))
    assert gpu.main([]) == 0
    (row,) = [Row.from_report(json.loads(x)) for x in rows_file.read_text().splitlines()]
    assert (row.table, row.config) == ("gpu-data", "-")
    assert row.status.startswith("skipped: needs a CUDA device")


@pytest.mark.timeout(120)
def test_the_smoke_run_measures_every_configuration_on_the_cpu(tmp_path: Path) -> None:
    rows_file = tmp_path / "rows.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "aioloader._bench.gpu", "--smoke"],
        capture_output=True, text=True, timeout=110, check=False,
        env={**os.environ, harness.ROWS_ENV: str(rows_file)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [Row.from_report(json.loads(x)) for x in rows_file.read_text().splitlines()]
    assert [(r.table, r.config) for r in rows] == list(gpu.SMOKE_RUNS)
    for row in rows:
        extra = row.extra
        assert row.status == "ok" and row.samples_per_s and row.samples_per_s > 0, row
        assert row.peak_pss_mib and row.peak_pss_mib > 0
        epochs = 3 if extra["persistent"] else 2
        assert extra["images"] == gpu.SMOKE_IMAGES
        assert extra["samples"] == [gpu.SMOKE_IMAGES] * epochs  # labels counted each epoch
        assert len(extra["epoch_s"]) == epochs and extra["first_epoch_s"] > 0
        assert extra["batch_shape"] == [8, 3, gpu.CROP, gpu.CROP]
        assert (extra["batch_dtype"], extra["batch_device"]) == ("uint8", "cpu")
        assert extra["dataset"].startswith("PillowFolder") and extra["model"] == "TinyNet"
        if extra["mode"] == "train":  # the step's cost alone and beside the loader
            for where in ("alone", "loop"):
                step = extra["step_ms"][where]
                assert step["steps"] > 0 and step["host_ms"] > 0 and step["cpu_ms"] > 0
        else:
            assert extra["step_ms"] is None
        # The steady epochs' CPU per batch, by thread (in clock ticks: the smoke run's other
        # threads may use less than one).
        threads = extra["threads_cpu_ms"]
        assert threads["main"] > 0 and all(ms > 0 for ms in threads.values())
        by_role = extra["pss_by_process"]
        assert by_role["main"]["processes"] == 1 and by_role["main"]["pss_mib"] > 0
        assert by_role["workers"]["processes"] == 2 and by_role["workers"]["pss_mib"] > 0
        if row.config == "torch":
            assert by_role["workers"]["names"] == ["pt_data_worker"]
            assert "fork server" not in by_role  # AIOLOADER_STANDBY=0: a torch user's script
            assert extra["startup_s"] == [] and extra["server"] == ""
        else:
            # The smoke run's thread stands in for CUDA's: the workers come from the standby.
            assert all(n.startswith("aioloader-w") for n in by_role["workers"]["names"])
            assert by_role["fork server"]["names"] == ["aioloader-sb"]
            assert extra["server"] == "standby" and extra["server_s"] > 0
            assert len(extra["startup_s"]) == (1 if extra["persistent"] else epochs)
            assert all(s > 0 for s in extra["startup_s"])
            assert extra["server"] == "standby" and "threads" in extra["server_why"]
    assert extra["mode"] == "data" and rows[1].extra["mode"] == "train"
    assert "| steady, with the training step (samples/s) |" in done.stdout


def test_the_plan_measures_the_import_order_in_the_data_table_only() -> None:
    runs = {(r.table, r.config) for r in gpu.plan(gpu.parse_args([]))}
    assert len(runs) == len(gpu.TABLES) * len(gpu.CONFIGS) - 2
    assert ("gpu-data", "aio-first") in runs
    assert ("gpu-fresh", "aio-first") not in runs and ("gpu-train", "aio-first") not in runs


def test_the_users_script_imports_aioloader_last_or_first(tmp_path: Path) -> None:
    for first in (False, True):
        text = gpu.user_script(tmp_path, aioloader_first=first).read_text()
        lines = [x.strip() for x in text.splitlines() if x.strip().startswith("import ")]
        expected = ["torch", "aioloader", "torchvision"] if first else ["torch", "torchvision"]
        if not first:
            expected.append("aioloader")
        assert [x.removeprefix("import ") for x in lines[1:]] == expected, text
        compile(text, "train.py", "exec")
