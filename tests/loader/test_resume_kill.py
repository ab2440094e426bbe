"""Resuming for real: a job training on tar shards served over HTTP (``num_workers=2``) is killed
with SIGKILL mid-epoch, and a new process goes on from the last state it saved; two ranks under
``torchrun`` stop, save, and three go on from their merged state."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.sources.test_remote_tar import serve_shards
from tests.sources.test_tar import make_shards
from tests.support import http_server
from tests.support.http_server import FaultServer
from tests.support.torchrun import torchrun

fault_server = http_server.fault_server

ROOT = Path(__file__).parents[2]
JOB = ROOT / "tests" / "support" / "resume_job.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def in_session(sid: int) -> list[int]:
    """The processes of session ``sid`` still alive (read from /proc)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            alive.append(int(entry.name))
    return alive


async def run_job(tmp: Path, log: Path, state: Path, *args: str) -> tuple[int, int]:
    """Run the job to its end (or its death): ``(returncode, pid)``; fails after 120 s."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(JOB),
        str(tmp / "urls.json"),
        str(log),
        str(state),
        *args,
        cwd=ROOT,
        env={**ENV, "TMPDIR": str(tmp)},  # a SIGKILLed process leaves its pymp-* folder
        start_new_session=True,  # the job and its workers: one session, checked after
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), 120)
    except TimeoutError:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    if proc.returncode not in (0, -signal.SIGKILL):
        pytest.fail(f"the job failed ({proc.returncode}):\n{output.decode()}")
    # The output holds what the job's workers wrote too, until the last of them exited.
    assert "Traceback" not in output.decode(), output.decode()
    return proc.returncode, proc.pid


def batches(log: Path) -> Iterator[dict[str, Any]]:
    for line in log.read_text().splitlines():
        yield json.loads(line)


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("every", "die_at", "repeated"), [(5, 13, 3), (4, 12, 0)])
# The job runs in a child process on its own loop; this test's loop only serves its shards.
@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_a_killed_job_resumes_from_its_last_saved_state(
    tmp_path: Path, fault_server: FaultServer, every: int, die_at: int, repeated: int
) -> None:
    paths = make_shards(tmp_path, n_shards=6, n_samples=15)  # 90 samples: 23 batches of 4
    (tmp_path / "urls.json").write_text(json.dumps(serve_shards(fault_server, paths)))
    state, log = tmp_path / "state.json", tmp_path / "log.jsonl"
    code, pid = await run_job(tmp_path, log, state, "--every", str(every), "--die-at", str(die_at))
    assert code == -signal.SIGKILL
    # Its workers, left with no one to serve, go too.
    for _ in range(100):
        if not in_session(pid):
            break
        await asyncio.sleep(0.1)
    assert not in_session(pid), "a process of the killed job outlived it"
    code, _ = await run_job(tmp_path, log, state, "--every", str(every))
    assert code == 0
    whole = tmp_path / "whole.jsonl"
    await run_job(tmp_path, whole, tmp_path / "none.json", "--every", "1000")
    epoch = [b["keys"] for b in batches(whole)]
    logged = list(batches(log))
    killed = [b["keys"] for b in logged[:die_at]]
    resumed = [b["keys"] for b in logged[die_at:]]
    saved_at = die_at - repeated
    assert len(epoch) == 23 and len({k for b in epoch for k in b}) == 90
    # The new process went on from the last save: what followed it was yielded again, the
    # same batches, and together the two runs yielded the epoch.
    assert killed[saved_at:] == resumed[:repeated]
    assert killed[:saved_at] + resumed == epoch
    assert [b["batch"] for b in logged[die_at:]] == list(range(saved_at + 1, 24))


@pytest.mark.timeout(200)
def test_two_ranks_stop_and_three_go_on_with_the_remainder(tmp_path: Path) -> None:
    """torchrun with 2 ranks takes 7 steps of a 104-sample epoch and saves the merged state;
    torchrun with 3 ranks loads it: every step all-reduced on every rank (none hangs), no
    sample on two ranks, and together the 5 ranks yield the epoch once."""
    job = ROOT / "tests" / "support" / "ddp_resume_job.py"
    torchrun(2, job, "stop", str(tmp_path), cwd=tmp_path)
    torchrun(3, job, "resume", str(tmp_path), cwd=tmp_path)
    before = json.loads((tmp_path / "stop.json").read_text())
    after = json.loads((tmp_path / "resume.json").read_text())
    assert [len(r) for r in before] == [7, 7]
    assert [len(r) for r in after] == [4, 4, 4]  # 104 - 56 = 48 left: 16 samples per rank
    ranks = [[i for b in r for i in b] for r in before + after]
    flat = [i for r in ranks for i in r]
    assert sorted(flat) == list(range(104))  # each sample once, on one rank


@pytest.mark.timeout(200)
def test_the_resume_example_runs(tmp_path: Path) -> None:
    """``examples/resume.py``: killed at step 12, resumed from step 10's checkpoint."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "resume.py")],
        capture_output=True,
        text=True,
        env={**ENV, "TMPDIR": str(tmp_path)},  # the killed run leaves its pymp-* folder
        timeout=150,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "resumed at step 10" in output and "epoch done at step 18" in output
    assert "144 of 144 samples trained on; 16 twice" in output
    assert "Traceback" not in output
