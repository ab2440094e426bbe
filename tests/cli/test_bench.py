"""``aioloader bench``: its rows, ratios, JSON and chart; a real workload run end to end
(servers on 127.0.0.1, each configuration in a child of its own); a peer or module that is not
installed is a row that says so; a workload past its time, or the command stopped by SIGTERM,
leaves no process behind."""

from __future__ import annotations

import asyncio
import functools
import json
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aioloader._bench import chart, harness, harness_child, harness_processes, suite
from aioloader._bench.results import Row, failures, family, format_rows, summarize

# The runner's tests run on uvloop only: ``aioloader bench`` runs it there (``_cli/signals.py``),
# and its work is starting, signalling and reaping processes, where uvloop's code is its own.
ON_UVLOOP = pytest.mark.asyncio(loop_factories=["uvloop"])
ROOT = Path(__file__).parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def row(config: str, per_s: float | None, status: str = "ok", table: str = "t") -> Row:
    return Row(table, config, per_s, cpu_s=1.0, peak_pss_mib=100.0, status=status)


def test_a_configuration_s_name_says_its_loader() -> None:
    assert family("aio-conn64") == "aioloader"
    assert family("batcher@600") == "aioloader"
    assert family("torch-nw2-fork") == "torch DataLoader"
    assert family("wds-s3-nw8") == "webdataset + torch DataLoader"
    assert family("tdnodes-thr16") == "torchdata.nodes"
    assert family("spdl") == "SPDL"  # a peer's "not installed" row
    assert family("asyncio-ceiling") == "plain asyncio"
    assert family("threads32") == "thread pool"
    assert family("torchy") == "torchy"  # a prefix is a whole word
    assert family("something-else") == "something-else"


def test_the_summary_sets_aioloader_s_best_against_each_peer_s_best() -> None:
    rows = [
        row("aio-conn16", 500.0),
        row("aio-conn64", 2000.0),
        row("torch-nw2", 100.0),
        row("torch-nw8", 250.0),
        row("tdnodes-thr64", 1000.0),
        row("spdl", None, "skipped: not installed"),
        row("asyncio-ceiling", 4000.0, "FAIL: 3 samples missing"),
        row("plain-loop", 10.0, table="other"),
    ]
    first, other = summarize(rows)
    assert first.ours is not None and first.ours.config == "aio-conn64"
    assert first.ratios == {
        "torch DataLoader": 8.0,
        "torchdata.nodes": 2.0,
        "SPDL": None,  # not installed
        "plain asyncio": None,  # failed: its figure is not compared
    }
    assert other.table == "other" and other.ours is None and other.ratios == {"plain loop": None}
    assert failures(rows) == ["t/asyncio-ceiling"]


def test_a_placeholder_row_is_no_loader_of_the_summary() -> None:
    rows = [
        row("aio-conn16", 500.0),
        row("torch-nw8", 250.0),
        row("(workload)", None, "FAIL: took over 9 s"),
        row("-", None, "skipped: webdataset not installed", table="shards"),
    ]
    first, shards = summarize(rows)
    assert first.ratios == {"torch DataLoader": 2.0}
    assert shards.ours is None and shards.ratios == {}
    assert failures(rows) == ["t/(workload)"]


def test_a_reported_row_keeps_its_status_and_figures() -> None:
    ok = Row.from_report(
        {
            "table": "t",
            "config": "aio",
            "samples_per_s": 5.0,
            "status": "ok",
            "ok": True,
            "skipped": None,
            "in_flight": 16,
        }
    )
    assert ok.measured and ok.extra == {"in_flight": 16}
    failed = Row.from_report(
        {
            "table": "t",
            "config": "x",
            "samples_per_s": None,
            "status": "TIMED OUT: past 9 s",
            "ok": False,
            "skipped": None,
        }
    )
    assert failed.failed and failed.status == "FAIL: TIMED OUT: past 9 s"
    skipped = Row.from_report(
        {
            "table": "t",
            "config": "spdl",
            "samples_per_s": None,
            "status": "skipped: why",
            "ok": True,
            "skipped": "why",
        }
    )
    assert not skipped.failed and not skipped.measured and skipped.status == "skipped: why"
    text = format_rows([ok, failed, skipped], {"t": "a table"})
    assert "FAIL: TIMED OUT" in text and "t: a table" in text


def test_a_workload_reports_its_rows_only_to_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = harness.Result("aio-x", samples=100, wall_s=2.0, cpu_s=0.5, peak_pss_mib=64.0)
    monkeypatch.delenv(harness.ROWS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    harness.report("t", result)  # by hand: nowhere to write, nothing written
    assert list(tmp_path.iterdir()) == []
    rows_file = tmp_path / "rows.jsonl"
    monkeypatch.setenv(harness.ROWS_ENV, str(rows_file))
    harness.report("t", result, in_flight=8, p99_ms=math.inf)
    harness.report("t", harness.Result("spdl", skipped="not installed"))
    lines = rows_file.read_text().splitlines()
    first, second = (Row.from_report(json.loads(line)) for line in lines)
    assert (first.samples_per_s, first.cpu_s, first.peak_pss_mib) == (50.0, 0.5, 64.0)
    assert first.extra == {"in_flight": 8, "p99_ms": None}  # JSON has no infinity
    assert second.status == "skipped: not installed" and second.samples_per_s is None


def test_the_chart_is_a_png_and_refuses_nothing_measured(tmp_path: Path) -> None:
    rows = [row("aio-conn64", 2000.0, table="objects-http"), row("torch-nw8", 250.0)]
    rows[0].extra["in_flight"] = 64
    chart.draw(rows, tmp_path / "c.png", "title")
    assert (tmp_path / "c.png").read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ValueError, match="no row was measured"):
        chart.draw([row("spdl", None, "skipped: not installed")], tmp_path / "d.png", "title")


@ON_UVLOOP
async def test_a_workload_without_a_module_it_needs_is_one_skipped_row(tmp_path: Path) -> None:
    workload = suite.Workload(
        "w", "serving", (), (), {"t": "a table"}, needs=("no_such_module_for_the_bench",)
    )
    ran = await suite.run_workload(workload, quick=True, workdir=tmp_path, log=tmp_path / "log")
    (only,) = ran.rows
    assert only.status.startswith("skipped: no_such_module_for_the_bench not installed")
    assert ran.error is None and not only.failed


def session_processes(sid: int) -> list[int]:
    """Live processes of session ``sid`` (a workload runs in a session of its own)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] != "Z" and int(fields[3]) == sid:
                found.append(int(entry))
    return found


@ON_UVLOOP
async def test_a_workload_past_its_time_is_stopped_with_its_servers(tmp_path: Path) -> None:
    # The serving workload starts three server processes; 3 s is not enough for it to end.
    workload = suite.Workload("w", "serving", ("--quick",), (), {"serving": ""}, limit_s=(3, 3))
    sessions: list[int] = []
    real = asyncio.create_subprocess_exec

    async def spying(*args: object, **kwargs: object) -> asyncio.subprocess.Process:
        process = await real(*args, **kwargs)  # type: ignore[arg-type]
        sessions.append(process.pid)  # start_new_session: its pid is its session's id
        return process

    began = time.monotonic()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(asyncio, "create_subprocess_exec", spying)
        ran = await suite.run_workload(workload, quick=True, workdir=tmp_path, log=tmp_path / "log")
    # SIGTERM ended it and its servers: no wait for the SIGKILL that follows a deaf workload.
    assert time.monotonic() - began < 3 + suite.STOP_GRACE_S / 2
    assert ran.error is not None and "took over 3 s" in ran.error
    assert [r.status for r in ran.rows if r.failed] == [f"FAIL: {ran.error}"]
    (session,) = sessions
    assert session_processes(session) == []


async def run_stubborn(
    tmp_path: Path, flag: str, monkeypatch: pytest.MonkeyPatch, limit_s: float = 1.0
) -> tuple[suite.Ran, int]:
    """Run tests/support/stubborn_workload.py with ``flag`` (``limit_s`` allowed, 1 s from
    SIGTERM to SIGKILL); return what the runner said and the workload's session id."""
    monkeypatch.setattr(suite, "STOP_GRACE_S", 1.0)
    monkeypatch.chdir(ROOT)  # the workload's module is tests.support.stubborn_workload
    workload = suite.Workload(
        "w", "tests.support.stubborn_workload", (flag,), (), {"t": ""}, limit_s=(limit_s, 1)
    )
    sessions: list[int] = []
    real = asyncio.create_subprocess_exec

    async def spying(*args: object, **kwargs: object) -> asyncio.subprocess.Process:
        process = await real(*args, **kwargs)  # type: ignore[arg-type]
        sessions.append(process.pid)
        return process

    monkeypatch.setattr(asyncio, "create_subprocess_exec", spying)
    ran = await suite.run_workload(workload, quick=True, workdir=tmp_path, log=tmp_path / "log")
    return ran, sessions[0]


@ON_UVLOOP
async def test_a_workload_deaf_to_sigterm_is_killed_with_its_children(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran, session = await run_stubborn(tmp_path, "--ignore-sigterm", monkeypatch)
    assert ran.error is not None and "took over 1 s" in ran.error
    assert session_processes(session) == []


@ON_UVLOOP
async def test_a_workload_that_leaves_a_process_fails_and_the_process_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran, session = await run_stubborn(tmp_path, "--leave-child", monkeypatch, limit_s=60)
    assert [(r.config, r.status) for r in ran.rows] == [
        ("aio-x", "ok"),
        ("(workload)", "FAIL: 1 of its processes were still running when it exited; killed"),
    ]
    assert session_processes(session) == []


@ON_UVLOOP
async def test_a_cancelled_run_stops_its_workload_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = _children_of(os.getpid())
    stubborn = run_stubborn(tmp_path, "--ignore-sigterm", monkeypatch, limit_s=60)
    task = asyncio.ensure_future(stubborn)
    log = tmp_path / "log"
    for _ in range(600):  # 30 s at most
        if "===== w" in (log.read_text() if log.exists() else ""):
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # its child started
    (workload,) = _children_of(os.getpid()) - before  # its pid is its session's id
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert session_processes(workload) == []


def _children_of(pid: int) -> set[int]:
    return {
        child for child in map(int, filter(str.isdigit, os.listdir("/proc")))
        if _parent(child) == pid
    }  # fmt: skip


def bench(*args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "aioloader", "bench", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
    )


@pytest.mark.timeout(120)
def test_bench_quick_measures_a_workload_and_writes_json_chart_and_log(tmp_path: Path) -> None:
    done = bench("--quick", "--only", "objects", "--out", "results", cwd=tmp_path)
    out, err = done.communicate(timeout=110)
    assert done.returncode == 0, out + err
    results = tmp_path / "results"
    document = json.loads((results / "aioloader-bench.json").read_text())
    assert document["format"] == "aioloader.bench/1" and document["quick"] is True
    rows = [Row(**{k: v for k, v in r.items() if k != "loader"}) for r in document["rows"]]
    by_config = {r.config: r for r in rows}
    for config in ("aio-conn16", "aio-conn64", "aio-conn256", "torch-nw8", "asyncio-ceiling"):
        measured = by_config[config]
        assert measured.status == "ok" and measured.samples_per_s, measured
        assert measured.cpu_s is not None and measured.cpu_s > 0
        assert measured.peak_pss_mib is not None and measured.peak_pss_mib > 50
    assert by_config["aio-conn64"].extra == {"in_flight": 64}
    # The optional peers: measured where installed, a row that says so where not.
    peers = {"torchdata": ("tdnodes-thr64",), "spdl": ("spdl-conc64",)}
    for peer, configs in peers.items():
        if peer in by_config:
            assert by_config[peer].status.startswith("skipped: not installed")
        else:
            assert all(by_config[c].status == "ok" for c in configs)
    (summary,) = document["summary"]
    assert summary["table"] == "objects-http" and summary["aioloader"].startswith("aio-conn")
    assert summary["ratios"]["torch DataLoader"] > 0
    assert (results / "aioloader-bench.png").read_bytes()[:8] == PNG_MAGIC
    assert "===== objects" in (results / "aioloader-bench.log").read_text()
    assert err == "" and "Traceback" not in out


@pytest.mark.timeout(60)
def test_sigterm_stops_the_bench_and_its_workload(tmp_path: Path) -> None:
    running = bench("--quick", "--only", "serving", "--out", ".", cwd=tmp_path)
    log = tmp_path / "aioloader-bench.log"
    deadline = time.monotonic() + 30
    while "===== serving" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline and running.poll() is None
        time.sleep(0.1)
    time.sleep(1.0)  # the workload's servers are starting
    workload_sessions = [
        pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
        if pid != running.pid and _parent(pid) == running.pid
    ]  # fmt: skip
    assert workload_sessions  # the workload's process, in a session of its own
    running.send_signal(signal.SIGTERM)
    out, err = running.communicate(timeout=40)
    assert running.returncode == 143, out + err
    assert err.strip().endswith("aioloader bench: terminated") and "Traceback" not in err
    for sid in workload_sessions:
        assert session_processes(sid) == []


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat[stat.rindex(")") + 2 :].split()[1])


@pytest.mark.timeout(120)
def test_the_s3_workload_reads_every_object_once_through_each_client(tmp_path: Path) -> None:
    """moto's S3 server with its first-byte latency: aioloader's objects(), torch's workers with
    boto3 and the obstore ceiling each deliver every object once, with the right bytes."""
    rows_file = tmp_path / "rows.jsonl"
    configs = ("aio-conn16", "torch-nw2", "threads32", "asyncio-ceiling")
    done = subprocess.run(
        [sys.executable, "-m", "aioloader._bench.remote", "--store", "s3", "--items", "96",
         "--latency", "0.005", "--only", *configs],
        capture_output=True, text=True, timeout=110, check=False,
        env={**os.environ, harness.ROWS_ENV: str(rows_file)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [Row.from_report(json.loads(line)) for line in rows_file.read_text().splitlines()]
    assert [(r.table, r.config, r.status) for r in rows] == [
        ("objects-s3", config, "ok") for config in configs
    ]
    assert all(r.samples_per_s and r.cpu_s and r.peak_pss_mib for r in rows)


@pytest.mark.timeout(90)
def test_a_forked_row_s_memory_is_what_a_process_of_its_own_holds() -> None:
    """A row's child is forked from a server that has imported the workload's modules; with the
    share of the server's pages it holds, its PSS is close to that of a spawned process doing
    the same work, and the memory the work holds shows in full."""
    from tests.support import pss_probe

    forked = harness_child.run_in_child(pss_probe.prepare, pss_probe.MIB, 60, "pss-probe")
    assert forked.error is None, forked.error
    context = multiprocessing.get_context("spawn")
    conn, child = context.Pipe()
    process = context.Process(target=pss_probe.spawned, args=(pss_probe.MIB, child))
    process.start()
    try:
        assert conn.poll(60) and conn.recv() == "ready"
        alone = harness_processes.MemorySampler(
            functools.partial(harness_processes.process_tree, process.pid)
        )
        with alone:
            conn.send("go")
            assert conn.poll(30) and conn.recv() == {"held": pss_probe.MIB * 2**20}
        conn.send("stop")
    finally:
        process.join(10)
        process.kill()
    held = forked.memory.peak_pss_mib - forked.memory.start_pss_mib
    assert pss_probe.MIB * 0.9 < held < pss_probe.MIB * 1.2
    # Within a fifth (the spawned one also holds what its start-up left: not collected yet).
    assert abs(forked.memory.peak_pss_mib - alone.peak_pss_mib) < 0.2 * alone.peak_pss_mib


def test_waiting_for_a_group_to_exit_wakes_as_it_exits_and_gives_up_at_the_deadline() -> None:
    """``wait_until_gone`` waits on the processes' pidfds: it returns once the group's processes
    have exited, one started meanwhile (by the group's leader) included, and returns what is
    left when the deadline passes first."""
    script = "import subprocess, time; subprocess.Popen(['sleep', '0.6']); time.sleep(0.2)"
    leader = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        left = harness_processes.wait_until_gone(
            lambda: harness_processes.process_group(leader.pid), 30
        )
        assert list(left) == []  # the leader, then the sleep it started, both gone
        assert leader.wait(timeout=5) == 0
    finally:
        harness_processes.kill_group(leader.pid)
    stays = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        begun = time.monotonic()
        left = harness_processes.wait_until_gone(
            lambda: harness_processes.process_group(stays.pid), 0.3
        )
        assert list(left) == [stays.pid]
        assert time.monotonic() - begun < 10  # the deadline ended the wait, not the process
    finally:
        harness_processes.kill_group(stays.pid)
        stays.wait()
