"""``aioloader bench``'s workloads and how they are run: each in a process of its own (the
module's ``main``, as its script runs it), its rows read back from the file it reports them to
(``harness.report``), its output kept in a log.

A workload's module runs each configuration in a child of its own (``harness_child.run_in_child``)
or, for the CPU workloads, one after another in its own process; either way no configuration
shares a heap with the command. Cancelled (Ctrl-C, SIGTERM), or past its time: the workload's
process group is sent SIGTERM (on which ``streams`` and ``overhead`` clean up as on Ctrl-C; the
others are ended by it, their ``with`` blocks and temporary folders with them only where Python
runs them), then SIGKILL after ``STOP_GRACE_S``; the cancellation goes on once it has exited.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import select
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .harness import ROWS_ENV
from .harness_processes import process_group, wait_until_gone
from .results import Row

STOP_GRACE_S = 10.0  # from SIGTERM to SIGKILL
LEFT_WAIT_S = 2.0  # for the rest of a workload's session to exit after its leader
NOT_INSTALLED = "not installed (pip install -e '.[bench]')"


@dataclass(frozen=True)
class Workload:
    """``module`` (``aioloader._bench.<module>``) run with ``quick`` or ``full`` arguments;
    ``tables``: the tables its rows come in, and what each measures; ``needs``: modules it cannot
    run without (a missing one makes the workload one skipped row); ``limit_s``: how long it may
    take, quick and full."""

    name: str
    module: str
    quick: tuple[str, ...]
    full: tuple[str, ...]
    tables: dict[str, str]
    needs: tuple[str, ...] = ()
    limit_s: tuple[float, float] = (120.0, 600.0)


_REMOTE_QUICK = (
    "aio-conn16", "aio-conn64", "aio-conn256", "torch-nw8", "aio-swapped-nw8", "tdnodes-thr64",
    "spdl-conc64", "asyncio-ceiling",
)  # fmt: skip
_S3_QUICK = ("aio-conn16", "aio-conn64", "torch-nw8", "tdnodes-thr64", "asyncio-ceiling")
_FILES = ("plain-loop", "torch-nw0", "torch-nw2", "torch-nw8", "aio-files", "aio-torchds-for")
_FILES_QUICK = ("plain-loop", "torch-nw0", "torch-nw8", "aio-files", "aio-torchds-for")
_CPU = ("--only", "gil", "dropin-jpeg")
# torch's default start method here (fork) and aioloader's; the full run adds aio-nw1 and
# torch-nw2-spawn (seconds of start-up each).
_CPU_QUICK = ("--configs", "aio-nw0", "aio-nw2", "torch-nw0", "torch-nw2-fork", "aio-ray-nw2")

WORKLOADS: tuple[Workload, ...] = (
    Workload(
        "objects",
        "remote",
        ("--quick", "--only", *_REMOTE_QUICK),
        (),
        {"objects-http": "64 KiB objects over HTTP, 20 ms to the first byte, batch 32"},
    ),
    Workload(
        "objects-s3",
        "remote",
        ("--store", "s3", "--items", "200", "--only", *_S3_QUICK),
        ("--store", "s3"),
        {"objects-s3": "the same objects from moto's S3 server, 20 ms before each GET's answer"},
        needs=("moto", "boto3", "flask"),  # flask: moto's server extra
    ),
    Workload(
        "shards",
        "streams",
        ("--quick", "--decode", "light"),
        ("--decode", "both"),
        {
            "shards-light": "WebDataset tar shards (JPEG samples, written by webdataset) over "
            "HTTP (20 ms to first byte, 50 MB/s a connection) and moto's S3, light decode",
            "shards-heavy": "the same with a Pillow decode per sample",
        },
        needs=("webdataset", "PIL"),  # without moto, its S3 rows say so themselves
    ),
    Workload(
        "files",
        "overhead",
        ("--quick", "--workloads", "files", "--cold", "--repeats", "1", "--only", *_FILES_QUICK),
        ("--workloads", "files", "--cold", "--only", *_FILES),
        {
            "files": "many 16 KiB local files, page cache warm, batch 32",
            "files-cold": "the same, page cache dropped before each timed epoch",
        },
    ),
    Workload(
        "cpu",
        "cpu",
        ("--quick", "--gil-items", "320", "--dropin-jpeg-items", "320", *_CPU, *_CPU_QUICK),
        ("--only", "gil", "decode", "dropin-jpeg"),
        {
            "gil": "a CPU-heavy transform (2 ms of pure Python a sample), batch 32",
            "decode": "PNG decode + crop + flip a sample in the transform, batch 32",
            "dropin-jpeg": "the import swapped: one torch Dataset (Pillow JPEG decode, random "
            "resized crop, flip), torch's DataLoader vs aioloader's, plain for",
        },
        needs=("PIL",),
    ),
    Workload(
        "gpu",
        "gpu",
        ("--quick",),
        (),
        {
            "gpu-data": "the ImageFolder pipeline (JPEGs ~56 KiB, RandomResizedCrop(224), flip, "
            "uint8; batch 256, 12 workers, pin_memory) on a CUDA device, each config a fresh "
            "interpreter that put its model on the GPU first; steady samples/s (epochs 2-3)",
            "gpu-train": "the same with a resnet18 step (bf16, channels_last, normalised on "
            "the GPU)",
            "gpu-fresh": "the same, data only, persistent_workers=False: samples/s over 2 epochs",
        },
        needs=("PIL",),
        limit_s=(240.0, 480.0),
    ),
    Workload(
        "serving",
        "serving",
        ("--quick",),
        (),
        {
            "serving": "dynamic batching under load: HTTP requests at rising rates, a model "
            "call of 4 ms + 0.1 ms a row; config@rate, samples/s = requests served/s, CPU and "
            "PSS the server process's"
        },
    ),
    Workload(
        "serving-cost",
        "serving_cost",
        ("--quick",),
        (),
        {
            "serving-cost": "dynamic batching by cost: requests of long-tailed lengths (90% "
            "short, 10% up to 50x longer), a model whose time is its padded cost; by count, "
            "by cost, by cost within length buckets; config@rate, samples/s = requests served/s"
        },
    ),
)


def titles() -> dict[str, str]:
    """Every table's description, by name."""
    return {table: text for w in WORKLOADS for table, text in w.tables.items()}


def missing(workload: Workload) -> list[str]:
    """The modules ``workload`` needs that are not installed."""
    return [name for name in workload.needs if importlib.util.find_spec(name) is None]


@dataclass
class Ran:
    """A workload's outcome: its rows, how long it took, and its error (None: exited 0)."""

    rows: list[Row]
    wall_s: float
    error: str | None


async def run_workload(
    workload: Workload,
    *,
    quick: bool,
    workdir: Path,
    log: Path,
    on_row: Callable[[Row], None] = lambda row: None,
) -> Ran:
    """Run ``workload``'s module in a process of its own, in a session of its own; return its
    rows once it has exited (``on_row`` is called for each). A workload that fails as a whole
    (a non-zero exit, past its time, no row reported, processes left once it exited) adds a
    ``(workload)`` row that says so.

    Raises:
        asyncio.CancelledError: Cancelled; the workload's processes are stopped first (SIGTERM
            to its session's process group, SIGKILL after ``STOP_GRACE_S``).
    """
    started = time.perf_counter()
    rows: list[Row] = []
    if gone := missing(workload):
        for table in workload.tables:
            rows.append(Row(table, "-", None, status=f"skipped: {', '.join(gone)} {NOT_INSTALLED}"))
            on_row(rows[-1])
        return Ran(rows, 0.0, None)
    rows_file = workdir / f"rows-{workload.name}.jsonl"
    rows_file.unlink(missing_ok=True)
    rows_file.touch()
    args = workload.quick if quick else workload.full
    module = workload.module if "." in workload.module else f"aioloader._bench.{workload.module}"
    code = f"import sys; from {module} import main; sys.exit(main())"
    # A temporary folder of its own, removed after it: what a killed workload's processes
    # leave there (multiprocessing's pymp-* folders, say) goes too.
    temp = Path(tempfile.mkdtemp(prefix=f"aioloader-bench-{workload.name}-"))
    env = {**os.environ, ROWS_ENV: str(rows_file), "PYTHONUNBUFFERED": "1", "TMPDIR": str(temp)}
    limit = workload.limit_s[0 if quick else 1]
    error: str | None = None
    with log.open("ab") as out, contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, temp, ignore_errors=True)
        out.write(f"\n===== {workload.name}: {' '.join(args)}\n".encode())
        out.flush()
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, *args,
            stdout=out, stderr=asyncio.subprocess.STDOUT, env=env,
            start_new_session=True,  # Ctrl-C reaches it through this process: cleanly, once
        )  # fmt: skip
        try:
            async with asyncio.timeout(limit):
                status = await process.wait()
            if status != 0:
                error = f"exited with status {status} (see {log})"
        except TimeoutError:
            error = f"took over {limit:g} s; stopped (see {log})"
        finally:
            # Whatever happened (cancelled too): no process of the workload's outlives it.
            left = await _stop(process)
    if left and error is None:
        error = f"{left} of its processes were still running when it exited; killed"
    _read_rows(rows_file, rows, on_row)
    if error is None and not rows:
        error = f"it reported no row (see {log})"
    if error is not None:
        rows.append(Row(next(iter(workload.tables)), "(workload)", None, status=f"FAIL: {error}"))
        on_row(rows[-1])
    return Ran(rows, time.perf_counter() - started, error)


def _read_rows(rows_file: Path, rows: list[Row], on_row: Callable[[Row], None]) -> None:
    """Append the rows written to ``rows_file`` (whole lines: a killed workload may have left
    half of one; a line that is not a row is a failed row that says so)."""
    for number, line in enumerate(rows_file.read_text(encoding="utf-8").splitlines(True), 1):
        if not line.endswith("\n"):
            continue
        try:
            rows.append(Row.from_report(json.loads(line)))
        except (ValueError, KeyError, TypeError) as exc:
            rows.append(Row("?", "(workload)", None, status=f"FAIL: row {number}: {exc!r}"))
        on_row(rows[-1])


async def _stop(process: asyncio.subprocess.Process) -> int:
    """Stop what is left of the workload's session: SIGTERM to its process group unless its
    leader has exited, then SIGKILL to whatever is left after ``STOP_GRACE_S``; return how many
    processes were left once the leader had exited of itself (0 when it had to be stopped).
    Cancelled meanwhile: SIGKILL at once (and the kills waited for), then the cancellation goes
    on."""
    group = process.pid  # start_new_session: the leader's pid is the group's id
    stopping = process.returncode is None
    try:
        if stopping:
            _signal_group(group, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STOP_GRACE_S):
                    await process.wait()
        left = await asyncio.to_thread(wait_until_gone, lambda: process_group(group), LEFT_WAIT_S)
    except BaseException:
        _kill_and_wait(group)  # cancelled: briefly blocking, so nothing outlives the runner
        raise
    if left:
        await asyncio.to_thread(_kill_and_wait, group)
    if process.returncode is None:
        await process.wait()  # killed: reaped now
    return 0 if stopping else len(left)


def _kill_and_wait(group: int) -> None:
    """SIGKILL ``group`` and wait (up to ``LEFT_WAIT_S``) until each of its processes has
    exited: a killed process is still listed until the kernel has run its exit, so "killed" is
    only true once that has happened. Not our children (the leader's own, reparented when it
    exited), so each is waited for through a pidfd, which turns readable as it exits."""
    _signal_group(group, signal.SIGKILL)
    pidfds = []
    for pid in process_group(group):
        with contextlib.suppress(ProcessLookupError):  # exited since it was listed
            pidfds.append(os.pidfd_open(pid))
    deadline = time.monotonic() + LEFT_WAIT_S
    try:
        while pidfds and (left := deadline - time.monotonic()) > 0:
            exited, _, _ = select.select(pidfds, [], [], left)
            for fd in exited:
                pidfds.remove(fd)
                os.close(fd)
    finally:
        for fd in pidfds:
            os.close(fd)


def _signal_group(group: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signum)


def selected(names: Sequence[str] | None) -> list[Workload]:
    """The workloads named (all of them for None), in the suite's order."""
    return [w for w in WORKLOADS if names is None or w.name in names]
