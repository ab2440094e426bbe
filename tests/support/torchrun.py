"""Running a job under ``torchrun --standalone`` on the CPU (gloo), or a script that starts its
ranks itself, for the tests whose ranks must take part in every collective: a rank that hangs
fails the test, it does not hang it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def torchrun(ranks: int, job: Path, *args: str, cwd: Path, timeout: float = 60) -> str:
    """Run ``job`` on ``ranks`` ranks; return its output (every rank's, stdout and stderr).

    Fails the test (after killing torchrun and its ranks together) when they take longer than
    ``timeout`` seconds (a hang), or end with a non-zero status.
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return _run([*command, "--nproc-per-node", str(ranks), str(job), *args], cwd, timeout)


def run_script(script: Path, *args: str, cwd: Path, timeout: float = 60) -> str:
    """Run ``python script args`` as a user runs a training script (one that starts ranks of
    its own, as Lightning's DDP does, among them); fails as :func:`torchrun` does."""
    return _run([sys.executable, str(script), *args], cwd, timeout)


def _run(command: list[str], cwd: Path, timeout: float) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=cwd,
        start_new_session=True,  # the job and its ranks: one group, killed together
    ) as run:
        try:
            output, _ = run.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            output, _ = run.communicate()
            pytest.fail(f"the ranks hung (killed after {timeout} s):\n{output}")
    assert run.returncode == 0, output
    return output
