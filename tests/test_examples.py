"""Every example runs as its docstring says (``examples/resume.py`` is run, and checked in
detail, by ``tests/loader/test_resume_kill.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[1] / "examples"

RUNS = {
    "drop_in.py": ([], "read by workers [0, 1]"),
    "remote_training.py": ([], "LoaderStatistics"),
    "serve_http.py": (["--selftest"], "every answer its own: True"),
    "stateful_slots.py": ([], "batches of 4 streams"),
    "image_folder.py": ([], "epoch 2: accuracy"),
    # A local cluster of its own ("local"), whatever else runs on this machine.
    "ray_workers.py": (["--address", "local"], "made by Ray actors with pids"),
}


def test_every_example_is_run_here() -> None:
    assert {p.name for p in EXAMPLES.glob("*.py")} == {*RUNS, "resume.py"}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_example_runs(name: str) -> None:
    args, says = RUNS[name]
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=EXAMPLES.parent,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert says in output, output
    assert "Traceback" not in output and "Warning" not in output, output
