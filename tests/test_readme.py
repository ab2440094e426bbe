"""The README's code runs: every ``python`` block not marked ``<!-- fragment: ... -->`` is run
as a program of its own, and its commands use the virtual environment they create."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"
BLOCK = re.compile(r"(<!-- fragment:[^>]*-->\n)?```python\n(.*?)```", re.S)


def programs() -> list[str]:
    return [code for fragment, code in BLOCK.findall(README.read_text()) if not fragment]


def test_the_readme_has_programs_to_run() -> None:
    assert len(programs()) >= 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("index", range(len(programs())))
def test_a_readme_program_runs(index: int, tmp_path: Path) -> None:
    script = tmp_path / "readme.py"
    script.write_text(programs()[index])
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr


def test_the_quick_start_is_two_commands_in_the_venv() -> None:
    text = README.read_text()
    quick = text.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    first, second = quick.strip().splitlines()
    assert first.startswith("python3 -m venv .venv && .venv/bin/pip install torch==2.13.0")
    assert "demo" in first and "[dev]" not in first
    assert "'.[dev]'" in second and second.endswith(
        ".venv/bin/python -m pytest -n auto --dist loadgroup"
    )
