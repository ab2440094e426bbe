"""A main process killed (SIGKILL: preempted, out of memory) mid-transfer: its workers leave
quietly.

A worker hands each batch's tensors over by descriptor, through multiprocessing's resource
sharer: the main process connects to the worker's socket, answers a handshake and takes the
descriptor. A main process that died in that handshake left every worker printing the stdlib's
traceback of the hang-up (``ConnectionResetError`` in ``deliver_challenge``) into the job's log,
as if something had gone wrong besides the kill. torch's workers print it too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "tests" / "support" / "killed_mid_handshake.py"


def run(method: str, how: str, tmp_path: Path, workers: int = 1) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), method, how, str(workers)],
        capture_output=True,  # the workers write to these pipes too: read to their last close
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)},
        timeout=60,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("method", "workers"), [("forkserver", 1), ("fork", 1), ("spawn", 1), ("fork", 2)]
)
def test_a_main_process_killed_mid_handshake_leaves_no_traceback(
    method: str, workers: int, tmp_path: Path
) -> None:
    """With fork and 2 workers (found by review), the second holds the first's pipe from the
    main process (``parent_process()``'s sentinel), which then never tells of its death."""
    returncode, output = run(method, "killed", tmp_path, workers)
    assert returncode == -signal.SIGKILL, output
    assert "killed mid-handshake" in output
    assert "Traceback" not in output, output


@pytest.mark.timeout(90)
def test_a_hang_up_by_a_live_main_process_is_still_reported(tmp_path: Path) -> None:
    """Only a dead main process's hang-up goes unsaid; the worker serves on after this one."""
    returncode, output = run("forkserver", "hangs-up", tmp_path)
    assert returncode == 0, output
    assert "in deliver_challenge" in output and "ConnectionResetError" in output, output
    assert "item 1" in output, output  # served after the hang-up
