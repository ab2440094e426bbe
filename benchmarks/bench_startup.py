"""Start-up benchmark: a whole short training script, in a fresh interpreter, with torch's
DataLoader and with aioloader's (the import swapped, nothing else changed).

The script (``SCRIPT`` below, written to a temporary directory and run as ``python script.py``)
imports torch and ``DataLoader`` (``from torch.utils.data import DataLoader`` or ``from
aioloader import DataLoader``), defines a torch ``Dataset`` of 2,000 cheap samples
(``__getitem__(i)`` returns ``tensor([i, i * i % 1009])``), builds ``DataLoader(dataset,
batch_size=32, num_workers=2)`` (``persistent_workers=True`` in the ``-persistent`` rows), runs
3 epochs of a plain ``for batch in loader:`` at module level, checks that every epoch delivered
each index exactly once (else it exits non-zero), prints its timestamps as one JSON line, and
ends. torch uses its default context (fork
on Linux), aioloader its own (forkserver). ``--metrics-thread`` starts a daemon thread in the
script before its loader, as a metrics or logging thread does: the process is then no longer
safe to fork, and aioloader's workers come from its standby fork server (or, without one, the
stdlib's fresh interpreter). ``--holding paths`` (ImageNet's 1.28 million (path, class) pairs,
as ``ImageFolder`` holds them) or ``--holding array`` (a 256 MiB NumPy array) gives the dataset
something to carry to the workers: torch's forked workers inherit it, aioloader's are sent it.

Configurations: ``torch-nw2``, ``torch-nw2-persistent``, ``aio-nw2``, ``aio-nw2-persistent``;
each is run ``--runs`` times (default 3), the configurations interleaved, every run in a fresh
subprocess (its own session, so the script and every worker it starts form one process group).
For each configuration the table shows:

* ``wall s``: the median, over its runs, of the seconds from starting the subprocess to its exit
  (interpreter start, imports, worker start, 3 epochs, worker shutdown, interpreter exit), and
  the runs themselves;
* ``start s`` / ``epoch 1-3 s`` / ``exit s`` (of the median run): to the end of the imports,
  each epoch (epoch 1 includes building the loader and starting its workers), and from the last
  batch to the process's exit;
* ``peak PSS MiB``: the highest sum of PSS (``Pss`` of ``/proc/<pid>/smaps_rollup``, what
  psutil's ``memory_full_info().pss`` reports) over the process group, sampled every 0.1 s
  (highest over the runs);
* ``left``: processes of the group still alive 5 s after the script exited (then killed);
* ``check``: ``ok``, or why a run failed (non-zero exit, a timeout, a failed epoch check).

Then the ratio aio/torch of the median wall times, without and with ``persistent_workers``,
beside the goal (<= 1.5x).

Last, the exit check: the same script up to ``it = iter(loader); next(it)`` (one batch taken,
the iterator left open, ``loader`` and ``it`` module globals) and then nothing: the script just
ends. ``--exit-runs`` runs (default 5; interleaved) per loader, with and without
``persistent_workers`` (how a script ends can differ from run to run); the row shows every exit
code, the runs whose stderr was empty, the median wall time, leftover processes and peak PSS,
beside the goal (every run: exit code 0, stderr empty); the distinct first lines of stderr and
the last lines of the first non-empty one follow the table.

Every subprocess is killed (its whole process group) after ``--timeout`` seconds (default 120;
the exit check: 60). The script exits non-zero when a timed run fails; a missed goal (the ratio,
the exit check) is reported, not a failure.

Run it from the repository root::

    python benchmarks/bench_startup.py                           # ~1.5-4 min on 2 cores
    python benchmarks/bench_startup.py --runs 1 --exit-runs 1    # a smoke test
    python benchmarks/bench_startup.py --only torch
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple


# The harness's light modules, loaded from their files: importing them as
# ``aioloader._bench.harness_*`` would import aioloader and torch into this process, whose pages
# its measured children would then share (and their PSS would count only half of them). None of
# the three imports another module of the package.
def _load_harness(name: str) -> None:
    spec = importlib.util.spec_from_file_location(
        f"_{name}", Path(__file__).parents[1] / "aioloader" / "_bench" / f"{name}.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"_{name}"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)


for _name in ("harness_processes", "harness_table", "harness_script"):
    _load_harness(_name)
from _harness_processes import (  # noqa: E402
    MemorySampler,
    kill_group,
    process_group,
    wait_until_gone,
)
from _harness_script import (  # noqa: E402
    add_only,
    add_timeout,
    cpus_and_load,
    exit_status,
    load_average,
)
from _harness_table import Column, format_table  # noqa: E402

ITEMS = 2000
BATCH_SIZE = 32
EPOCHS = 3
POLL_S = 0.1
LEFTOVER_WAIT_S = 5.0
STDERR_LINES = 25  # of an exit check's stderr, printed under its table
GOAL_RATIO = 1.5
REPO_ROOT = Path(__file__).resolve().parent.parent

LOADER_IMPORTS = {
    "torch": "from torch.utils.data import DataLoader",
    "aio": "from aioloader import DataLoader",
}

# The user's script; the import line and ", persistent_workers=True" are the only differences
# between rows (the body: 3 epochs, or the exit check).
SCRIPT = """\
import json
import sys
import time

import torch
{import_line}


class CheapDataset(torch.utils.data.Dataset):
    def __init__(self):
{holding}
    def __len__(self):
        return {items}

    def __getitem__(self, index):
        return torch.tensor([index, index * index % 1009])


if __name__ == "__main__":
{thread}    ready = time.time()
    loader = DataLoader(CheapDataset(), batch_size={batch_size}, num_workers=2{persistent})
{body}
"""

RUN_BODY = f"""\
    ends = []
    for epoch in range({EPOCHS}):
        seen = []
        for batch in loader:
            seen.extend(batch[:, 0].tolist())
        ends.append(time.time())
        if sorted(seen) != list(range({ITEMS})):
            sys.exit(f"epoch {{epoch}}: {{len(seen)}} samples, not each of {ITEMS} once")
    print(json.dumps({{"ready": ready, "ends": ends}}), flush=True)"""

EXIT_BODY = """\
    it = iter(loader)
    next(it)"""


# --metrics-thread: what a training script often has before its loader (a metrics or logging
# thread; an earlier loader's loop): the process is no longer safe to fork.
METRICS_THREAD = """\
    import threading
    threading.Thread(target=threading.Event().wait, name="metrics", daemon=True).start()
"""


# --holding: what the dataset holds, built in the main process as a dataset's __init__ builds
# it (torch's forked workers inherit it; workers not forked from the script are sent it)
HOLDING = {
    "nothing": "        pass\n",
    # ImageNet's training list, as ImageFolder holds it: 1.28 million (path, class) pairs
    "paths": (
        '        self.samples = [(f"/data/train/n{i % 1000:08d}/{i:08d}.JPEG", i % 1000)\n'
        "                        for i in range(1_281_167)]\n"
    ),
    # 256 MiB of features (or CIFAR's images) in one NumPy array
    "array": "        import numpy\n        self.features = numpy.ones(32 << 20)\n",
}


def script_text(
    loader: str, persistent: bool, body: str, thread: bool = False, holding: str = "nothing"
) -> str:
    return SCRIPT.format(
        holding=HOLDING[holding],
        thread=METRICS_THREAD if thread else "",
        import_line=LOADER_IMPORTS[loader],
        items=ITEMS,
        batch_size=BATCH_SIZE,
        persistent=", persistent_workers=True" if persistent else "",
        body=body,
    )


# -- one subprocess ------------------------------------------------------------------------------


@dataclass
class Run:
    """One subprocess: its exit code (None: killed at the timeout), output and timings."""

    returncode: int | None
    stdout: str
    stderr: str
    started: float
    ended: float
    peak_pss_mib: float
    leftover: int
    report: dict[str, object] = field(default_factory=dict)

    @property
    def wall_s(self) -> float:
        return self.ended - self.started

    @property
    def stderr_first_line(self) -> str:
        lines = self.stderr.strip().splitlines()
        return lines[0] if lines else ""


def _child_env() -> dict[str, str]:
    """This environment, with the repository root appended to PYTHONPATH (the script lives in a
    temporary directory; an earlier PYTHONPATH entry, e.g. another checkout, still wins)."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(REPO_ROOT)])
    return env


def run_script(path: Path, timeout: float) -> Run:
    """Run ``python path`` in a new session; sample its group's PSS; kill the group at
    ``timeout``; after the script exits, count (and kill) what is left of its group."""
    started = time.time()
    proc = subprocess.Popen(
        [sys.executable, str(path)],
        cwd=path.parent,
        env=_child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    group = functools.partial(process_group, proc.pid)
    with MemorySampler(group, poll_s=POLL_S, pss_every=1) as sampler:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
            returncode: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            stdout, stderr = proc.communicate()
            returncode = None
        ended = time.time()
    left = wait_until_gone(group, LEFTOVER_WAIT_S)
    if left:
        kill_group(proc.pid)
    run = Run(returncode, stdout, stderr, started, ended, sampler.peak_pss_mib, len(left))
    with contextlib.suppress(ValueError, IndexError):
        run.report = json.loads(stdout.strip().splitlines()[-1])
    return run


def run_error(run: Run, timeout: float) -> str | None:
    """Why a timed run failed, or None."""
    if run.returncode is None:
        return f"killed after {timeout:g} s"
    if run.returncode != 0:
        return f"exit code {run.returncode}: {run.stderr_first_line or '(no stderr)'}"
    ends = run.report.get("ends")
    if not isinstance(ends, list) or len(ends) != EPOCHS:
        return f"no report of {EPOCHS} epochs on stdout"
    return None


# -- output ---------------------------------------------------------------------------------------


@dataclass
class Config:
    name: str
    loader: str
    persistent: bool
    runs: list[Run] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors and bool(self.runs)

    def median_wall(self) -> float:
        return statistics.median(r.wall_s for r in self.runs)

    def median_run(self) -> Run:
        ordered = sorted(self.runs, key=lambda r: r.wall_s)
        return ordered[(len(ordered) - 1) // 2]


def _phase(length: Callable[[Run, list[float]], float]) -> Callable[[Config], str]:
    """A phase column: ``length(run, marks)`` of the median run, where ``marks`` is its
    report's ``[ready, end of epoch 1, ..., end of the last]``; "-" without a whole report."""

    def cell(config: Config) -> str:
        run = config.median_run()
        ready, ends = run.report.get("ready"), run.report.get("ends")
        if not isinstance(ready, float) or not isinstance(ends, list) or len(ends) != EPOCHS:
            return "-"
        return f"{length(run, [ready, *ends]):.2f}"

    return cell


def _epoch(k: int) -> Callable[[Run, list[float]], float]:
    return lambda run, marks: marks[k] - marks[k - 1]


def format_results(configs: Sequence[Config]) -> str:
    columns: list[Column[Config]] = [
        Column("wall s", 8, lambda c: f"{c.median_wall():.2f}"),
        Column("  runs", 22, lambda c: "  " + " ".join(f"{r.wall_s:.2f}" for r in c.runs), "<"),
        Column("start s", 8, _phase(lambda run, marks: marks[0] - run.started)),
        *(Column(f"epoch {k} s", 10, _phase(_epoch(k))) for k in range(1, EPOCHS + 1)),
        Column("exit s", 8, _phase(lambda run, marks: run.ended - marks[-1])),
        Column("peak PSS MiB", 14, lambda c: f"{max(r.peak_pss_mib for r in c.runs):,.0f}"),
        Column("left", 6, lambda c: f"{max(r.leftover for r in c.runs)}"),
    ]
    note = (
        "(wall s: median over the runs, subprocess start to exit; start s: to the end of the "
        "imports; epoch 1 includes\n building the loader and starting its workers; exit s: last "
        "batch to process exit; phases of the median run;\n peak PSS: highest over the runs, "
        "summed over the process group; left: processes alive 5 s after exit)"
    )

    def check(c: Config) -> str:
        if not c.runs:
            return "not run"
        return "ok" if c.ok else "FAIL: " + "; ".join(c.errors)

    return format_table(configs, 21, columns, check, blank=lambda c: not c.runs, note=note)


def format_ratios(configs: Sequence[Config]) -> str:
    by_name = {c.name: c for c in configs}
    lines = []
    for suffix in ("", "-persistent"):
        torch_c, aio_c = by_name.get(f"torch-nw2{suffix}"), by_name.get(f"aio-nw2{suffix}")
        label = f"  wall aio-nw2{suffix} / torch-nw2{suffix}"
        if torch_c is None or aio_c is None or not torch_c.ok or not aio_c.ok:
            lines.append(f"{label:<52} n/a (a configuration failed or did not run)")
            continue
        ratio = aio_c.median_wall() / torch_c.median_wall()
        verdict = "met" if ratio <= GOAL_RATIO else "MISSED"
        lines.append(
            f"{label:<52} {ratio:5.2f}x ({aio_c.median_wall():.2f} / "
            f"{torch_c.median_wall():.2f} s)   goal <= {GOAL_RATIO:.1f}x   {verdict}"
        )
    return "\n".join(lines)


def _clean(run: Run) -> bool:
    return run.returncode == 0 and not run.stderr.strip()


class ExitRow(NamedTuple):
    """A configuration's exit checks."""

    name: str
    runs: list[Run]


def format_exit_checks(rows: Sequence[ExitRow], timeout: float) -> str:
    """One row per configuration over its runs: every exit code ("killed": hung until
    ``timeout``), runs with an empty stderr, median wall time, most leftover processes, highest
    peak PSS, and the goal, met when every run exited 0 with an empty stderr. Then each
    configuration's distinct first lines of stderr (with counts) and the tail of the first
    non-empty one."""

    def codes(row: ExitRow) -> str:
        return ",".join("killed" if r.returncode is None else str(r.returncode) for r in row.runs)

    def empty(row: ExitRow) -> str:
        return f"{sum(not r.stderr.strip() for r in row.runs)}/{len(row.runs)}"

    def verdict(row: ExitRow) -> str:
        clean = sum(_clean(r) for r in row.runs)
        return "met" if clean == len(row.runs) else f"MISSED ({clean}/{len(row.runs)} clean)"

    columns: list[Column[ExitRow]] = [
        Column("exit codes", 18, codes, "<"),
        Column("stderr empty", 13, empty),
        Column("wall s", 8, lambda row: f"{statistics.median(r.wall_s for r in row.runs):.2f}"),
        Column("left", 6, lambda row: f"{max(r.leftover for r in row.runs)}"),
        Column("peak PSS MiB", 14, lambda row: f"{max(r.peak_pss_mib for r in row.runs):,.0f}"),
    ]
    note = f'(exit code "killed": hung, killed after {timeout:g} s; wall s: median)'
    goal = "goal (every run: exit code 0, stderr empty)"
    lines = [format_table(rows, 21, columns, verdict, check_header=goal, note=note)]
    for name, runs in rows:
        firsts: dict[str, int] = {}
        for run in runs:
            if run.stderr.strip():
                firsts[run.stderr_first_line] = firsts.get(run.stderr_first_line, 0) + 1
        if not firsts:
            continue
        lines.append(
            f"\n{name}: stderr in {sum(firsts.values())} of {len(runs)} runs; first lines:"
        )
        lines.extend(f"  {count}x {line[:150]!r}" for line, count in firsts.items())
        first = next(r for r in runs if r.stderr.strip())
        tail = first.stderr.strip().splitlines()[-STDERR_LINES:]
        lines.append(
            f"  the first such stderr (exit code {first.returncode}), last {len(tail)} lines:"
        )
        lines.extend(f"  | {line}" for line in tail)
    return "\n".join(lines)


# -- main -----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Wall time of a 3-epoch script with torch's DataLoader vs aioloader's, each "
        "in a fresh interpreter; and whether a script ending with an open iterator exits cleanly."
    )
    parser.add_argument("--runs", type=int, default=3, help="runs per configuration (median)")
    add_timeout(parser, "seconds one timed run may take", 120.0)
    parser.add_argument(
        "--exit-timeout", type=float, default=60.0, help="seconds one exit check may take"
    )
    add_only(parser, ["torch", "aio"], metavar=None, help="loaders to run (default: both)")
    parser.add_argument(
        "--exit-runs",
        type=int,
        default=5,
        help="runs of the exit check per configuration (0: skip it)",
    )
    parser.add_argument(
        "--metrics-thread",
        action="store_true",
        help="start a daemon thread in the script before its loader (as a metrics thread does)",
    )
    parser.add_argument(
        "--holding",
        choices=sorted(HOLDING),
        default="nothing",
        help="what the dataset holds: nothing, ImageNet's 1.28 million (path, class) pairs, or "
        "a 256 MiB NumPy array",
    )
    args = parser.parse_args(argv)
    if args.runs <= 0 or args.timeout <= 0 or args.exit_timeout <= 0 or args.exit_runs < 0:
        parser.error("--runs, --timeout and --exit-timeout must be positive, --exit-runs >= 0")
    return args


def _versions(cwd: Path) -> str:
    """The torch and aioloader a script in ``cwd`` imports: versions and paths."""
    found = []
    for module in ("torch", "aioloader"):
        code = f"import {module}; print({module}.__version__, {module}.__file__)"
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            out = subprocess.run(
                [sys.executable, "-c", code],
                cwd=cwd,
                env=_child_env(),
                capture_output=True,
                text=True,
                timeout=120,
                check=True,
            ).stdout.split()
            found.append(f"{module} {out[0]} ({out[1]})")
    return ", ".join(found)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    loaders: list[str] = args.only or ["torch", "aio"]
    configs = [
        Config(f"{loader}-nw2{'-persistent' if persistent else ''}", loader, persistent)
        for loader in loaders
        for persistent in (False, True)
    ]
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        print(
            f"python {platform.python_version()}, {cpus_and_load()}; {_versions(Path(tmp))}",
            flush=True,
        )
        print(
            f"script: {ITEMS} samples, batch {BATCH_SIZE}, num_workers=2, {EPOCHS} epochs of a "
            f"plain `for`, the dataset holding {args.holding}; {args.runs} runs per "
            "configuration, interleaved",
            flush=True,
        )
        for config in configs:
            path = Path(tmp) / config.name / "script.py"
            path.parent.mkdir()
            path.write_text(
                script_text(
                    config.loader, config.persistent, RUN_BODY, args.metrics_thread, args.holding
                )
            )
        for k in range(args.runs):
            for config in configs:
                run = run_script(Path(tmp) / config.name / "script.py", args.timeout)
                config.runs.append(run)
                error = run_error(run, args.timeout)
                if error is not None:
                    config.errors.append(f"run {k + 1}: {error}")
                print(
                    f"  run {k + 1} {config.name:<21} {run.wall_s:6.2f} s  exit "
                    f"{run.returncode}  peak PSS {run.peak_pss_mib:,.0f} MiB  left "
                    f"{run.leftover}  {error or 'ok'}",
                    flush=True,
                )
        print()
        print(format_results(configs))
        print()
        print(f"ratios (goal: aioloader's script within {GOAL_RATIO:g}x of torch's):")
        print(format_ratios(configs))
        for config in configs:
            stderr = {r.stderr_first_line for r in config.runs if r.stderr.strip()}
            for line in sorted(stderr):
                print(f"  {config.name} stderr: {line[:160]!r}")
        if args.exit_runs:
            rows = [ExitRow(c.name, []) for c in configs]
            for config in configs:
                path = Path(tmp) / config.name / "exit.py"
                path.write_text(
                    script_text(
                        config.loader,
                        config.persistent,
                        EXIT_BODY,
                        args.metrics_thread,
                        args.holding,
                    )
                )
            for k in range(args.exit_runs):
                for config, (_, runs) in zip(configs, rows, strict=True):
                    run = run_script(Path(tmp) / config.name / "exit.py", args.exit_timeout)
                    runs.append(run)
                    print(
                        f"  exit check {k + 1} {config.name:<21} exit {run.returncode}  stderr "
                        f"{'empty' if not run.stderr.strip() else 'NOT empty'}  "
                        f"{run.wall_s:.2f} s",
                        flush=True,
                    )
            print()
            print(
                "exit with an open iterator (`it = iter(loader); next(it)`, then the script ends):"
            )
            print(format_exit_checks(rows, args.exit_timeout))
    print(f"\nload average at the end: {load_average()}")
    return exit_status([c.name for c in configs if not c.ok])


if __name__ == "__main__":
    sys.exit(main())
