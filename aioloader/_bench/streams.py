"""Streaming benchmark: WebDataset-style tar shards read from remote storage by webdataset's own
pipeline, by a plain asyncio loop and by ``aioloader.sources.tar_shards``, each configuration in
a fresh process of its own.

The data and its decodes (``streams_data.py``), the servers (``streams_servers.py``) and the
configurations (``streams_runs.py``) are described where they are defined.

How a configuration runs: each row of each decode runs in a child process of its own, forked
from a server that has only imported this module (``harness_child.run_in_child``), one after
another, the servers staying up. No row
inherits the heap an earlier one grew. Every child has the same baseline: it imports this
script's modules (torch, NumPy, Pillow, aiohttp, webdataset, aioloader and its sources) and
obstore where installed, sets torch to one intra-op thread (as both loaders' workers run), and
collects garbage; then it tells this process it is ready and waits. This process reads the
child's PSS (``base PSS``), starts sampling the memory of the child's process tree, and tells it
to go: the child's clock starts, it builds the loader, runs the epochs, stops the loader, and
sends back its timings and its check. It then waits up to 15 s for every process it started to
exit (aioloader's fork server aside: it lives as long as the child), kills those left, reports
them, and exits. This process only writes the shards, runs the servers, starts the children,
enforces the timeout and prints the tables.

Measured per configuration:

* ``samples/s``: the samples of all epochs / the wall time from building the loader to its end
  (start-up and shutdown of workers, fork server, sessions and connections included);
* ``first batch s``: from building the loader to the first batch;
* ``steady samples/s``: the samples after the first batch / the time from the first batch to the
  end (the loader's shutdown included);
* ``base PSS MiB``: the child's PSS after its imports, before its clock starts;
* ``peak RSS MiB``, ``peak PSS MiB``: the highest summed RSS and summed PSS of the child and all
  its descendants: the loader's workers, the curl processes under webdataset's workers,
  aioloader's fork server (forked from the child when its first loader with workers starts, as
  in a training script, so in ``aio-nw2``'s time and memory). Sampled by this process from
  outside (``harness_child.run_in_child``: its ``MemorySampler`` rooted at the child, RSS every
  50 ms, PSS every 0.2 s), so that the child runs no thread of the benchmark's: one would
  compete for its GIL, and aioloader forks its fork server only from a process with a single
  thread. The servers and multiprocessing's resource tracker (this process's, which the child
  is handed) are not in a child's tree; the share of the fork server's pages the child holds is
  (``MemorySampler``'s ``lent``).

Ratios, to the same decode's row: ``vs asyncio-ref`` and ``vs wds-nw8`` of ``samples/s``,
``steady vs wds-nw8`` of ``steady samples/s``, ``PSS vs wds-nw8`` of ``peak PSS``.

Checks, for each epoch: every key arrives exactly once with its own label, the payload is the
right size (light) or shape (heavy), no batch is larger than the batch size, and the number of
batches is as expected; and no process a child started is left 15 s after its epochs ended.
Each configuration gets ``--timeout`` (default 120 s) per epoch from its go; past that this
process has the child dump its threads' stacks (``faulthandler`` on SIGUSR1), kills its whole
tree (SIGSTOP to every process in it, then SIGKILL), reports it as timed out and goes on. The
script exits non-zero when a configuration fails or times out.

``--profile NAME`` runs configuration NAME once more per decode, after the tables, in a fresh
child with cProfile enabled on the child's main thread around its epochs, and prints the 25
functions with the most own time. For an async configuration that is the whole
``asyncio.run`` (aioloader's event loop), not aioloader's transform thread or any worker
process; for webdataset, only the consuming loop.

Run it from the repository root::

    python benchmarks/bench_streams.py                   # the full run
    python benchmarks/bench_streams.py --quick           # 4 shards x 100 samples, light decode
    python benchmarks/bench_streams.py --epochs 3 --in-flight 4 --in-flight 8
    python benchmarks/bench_streams.py --quick --profile aio-nw0
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import importlib
import importlib.util
import io
import pstats
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.utils.data

from aioloader._bench.harness import error_text, report
from aioloader._bench.harness_child import run_in_child
from aioloader._bench.harness_script import (
    add_batch_size,
    add_only,
    add_quick,
    add_timeout,
    exit_status,
    machine,
    quick_defaults,
    versions,
)
from aioloader._bench.harness_server import ServerProcess
from aioloader._bench.streams_data import (
    BANDWIDTH_MB_S,
    BATCH_SIZE,
    DECODERS,
    LATENCY_S,
    PROFILE_TOP,
    QUICK_SAMPLES_PER_SHARD,
    QUICK_SHARDS,
    SAMPLE_KIB,
    SAMPLES_PER_SHARD,
    SHARDS,
    TIMEOUT_S,
    Decoder,
    decode_costs,
    write_shards,
)
from aioloader._bench.streams_report import (
    format_results,
)
from aioloader._bench.streams_runs import (
    Config,
    Outcome,
    Recorder,
    Settings,
    StreamResult,
    build_configs,
    in_flight_support,
)
from aioloader._bench.streams_servers import (
    serve_moto,
    serve_shards,
)

# -- the child: one configuration in a process of its own ---------------------------------------


@dataclass(frozen=True)
class Job:
    """One configuration for one decode, as this process hands it to a child (by name: the
    child builds the configuration itself)."""

    config: str
    decode: str
    settings: Settings
    epochs: int
    in_flight: tuple[int, ...]
    profile: bool = False


def _format_profile(profiler: cProfile.Profile) -> str:
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats(pstats.SortKey.TIME).print_stats(PROFILE_TOP)
    return out.getvalue()


def run_epochs(job: Job, config: Config, decoder: Decoder, rec: Recorder) -> Outcome:
    """Run ``config``'s epochs (under cProfile when ``job.profile``), timed from building the
    loader to its end, then check them."""
    profiler = cProfile.Profile()
    error = None
    start = time.perf_counter()
    try:
        with profiler if job.profile else contextlib.nullcontext():
            config.run(job.settings, decoder, job.epochs, rec)
    except Exception as exc:  # report it: this process sends it to the parent
        error = error_text(exc)
    end = time.perf_counter()
    first = rec.first
    return Outcome(
        samples=rec.samples,
        wall_s=end - start,
        first_s=None if first is None else first - start,
        steady_samples=rec.samples - rec.first_samples,
        steady_s=0.0 if first is None else end - first,
        error=error or rec.finish(job.epochs),
        profile=_format_profile(profiler) if job.profile else None,
    )


def prepare_child(job: Job) -> Callable[[], dict[str, Any]]:
    """A child's set-up, the same for every row (its fork server has imported this module's
    imports by now), before ``harness_child.run_in_child`` has it say ready; returns its work: run
    the epochs, and the outcome as a dict."""
    with contextlib.suppress(ImportError):
        importlib.import_module("obstore")  # aio-s3-nw0's; imported by every row alike
    torch.set_num_threads(1)
    # torch warns that 8 workers exceed this machine's cores: measuring that is the point.
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    config = next(c for c in build_configs(job.in_flight) if c.name == job.config)
    decoder = DECODERS[job.decode]
    settings = job.settings
    rec = Recorder(
        settings.data,
        decoder,
        settings.batch_size,
        config.expected_batches(settings.data, settings.batch_size),
    )
    return lambda: dataclasses.asdict(run_epochs(job, config, decoder, rec))


# -- measuring (this process) -------------------------------------------------------------------


def measure(job: Job, timeout: float) -> StreamResult:
    """Run ``job`` in a fresh child (``harness_child.run_in_child``); sample its tree's memory
    from here between go and the child's last message; past ``timeout`` per epoch, dump its
    stacks and kill its tree."""
    run = run_in_child(prepare_child, job, timeout * job.epochs, name=f"bench-{job.config}")
    result = StreamResult(job.config, error=run.error, timed_out=run.timed_out)
    if run.payload is not None:
        result.outcome = outcome = Outcome(**run.payload)
        result.samples, result.wall_s = outcome.samples, outcome.wall_s
    result.record_memory(run.memory)
    return result


@dataclass(frozen=True)
class Bench:
    settings: Settings
    timeout: float
    epochs: int
    in_flight: tuple[int, ...]

    def job(self, config: Config, decode: str, *, profile: bool = False) -> Job:
        return Job(config.name, decode, self.settings, self.epochs, self.in_flight, profile)


def profile(config: Config, decode: str, bench: Bench) -> None:
    """Run ``config`` once more in a child, under cProfile there (its main thread only), and
    print the top functions it sends back."""
    result = measure(bench.job(config, decode, profile=True), bench.timeout)
    status = "check ok" if result.ok else result.status
    print(f"\nprofile of {config.name}, {decode} decode ({status}):")
    text = result.outcome.profile if result.outcome is not None else None
    print(text or "(no profile: the child sent none)", flush=True)


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="webdataset vs asyncio vs aioloader, streaming tar shards from HTTP and S3, "
        "each configuration in a fresh process."
    )
    parser.add_argument("--shards", type=int, default=None, help=f"shards (default {SHARDS})")
    parser.add_argument(
        "--samples-per-shard",
        type=int,
        default=None,
        help=f"samples in each shard (default {SAMPLES_PER_SHARD})",
    )
    parser.add_argument(
        "--sample-kib", type=float, default=SAMPLE_KIB, help="JPEG size to aim for, in KiB"
    )
    add_batch_size(parser, BATCH_SIZE)
    parser.add_argument(
        "--epochs", type=int, default=1, help="epochs per configuration, one loader (default 1)"
    )
    parser.add_argument(
        "--latency", type=float, default=LATENCY_S, help="HTTP server's seconds to first byte"
    )
    parser.add_argument(
        "--bandwidth",
        type=float,
        default=BANDWIDTH_MB_S,
        help="HTTP server's cap per response, MB/s (0: none)",
    )
    parser.add_argument(
        "--decode", choices=("light", "heavy", "both"), default=None, help="default: both"
    )
    add_timeout(
        parser, f"seconds one configuration may take per epoch (default {TIMEOUT_S:g})", TIMEOUT_S
    )
    parser.add_argument(
        "--in-flight",
        type=int,
        action="append",
        default=[],
        metavar="K",
        help="add a row aio-nw0-kK with tar_shards(..., shards_in_flight=K) (repeatable)",
    )
    add_only(parser)
    parser.add_argument(
        "--profile", metavar="NAME", help="run NAME once more under cProfile, print the top 25"
    )
    add_quick(
        parser,
        f"smoke test: {QUICK_SHARDS} shards x {QUICK_SAMPLES_PER_SHARD} samples, light decode "
        "(unless given)",
    )
    args = parser.parse_args(argv)
    quick_defaults(
        args,
        shards=(QUICK_SHARDS, SHARDS),
        samples_per_shard=(QUICK_SAMPLES_PER_SHARD, SAMPLES_PER_SHARD),
        decode=("light", "both"),
    )
    if not 0 < args.shards < 10_000 or min(args.samples_per_shard, args.batch_size) <= 0:
        parser.error("--shards must be 1..9999, --samples-per-shard and --batch-size positive")
    if args.sample_kib <= 0 or args.latency < 0 or args.bandwidth < 0 or args.timeout <= 0:
        parser.error("--sample-kib and --timeout must be positive, --latency, --bandwidth >= 0")
    if args.epochs <= 0 or any(k <= 0 for k in args.in_flight):
        parser.error("--epochs and --in-flight must be positive")
    names = [c.name for c in build_configs(args.in_flight)]
    for name in [*(args.only or []), *([args.profile] if args.profile else [])]:
        if name not in names:
            parser.error(f"unknown configuration {name!r}; choose from {', '.join(names)}")
    return args


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _progress(r: StreamResult) -> str:
    if r.outcome is None:
        return f"  done {r.name:<14} {r.status}"
    return (
        f"  done {r.name:<14} {r.samples_per_s:>8,.0f} samples/s {r.outcome.wall_s:>7.2f} s "
        f"{r.peak_rss_mib:>6,.0f} MiB RSS {r.peak_pss_mib:>6,.0f} MiB PSS "
        f"(base {r.start_pss_mib:,.0f})  {r.status}"
    )


def run_all(args: argparse.Namespace, bench: Bench, configs: list[Config]) -> list[str]:
    """Every configuration for every decode, each in a child; print each decode's table; return
    what failed."""
    settings = bench.settings
    failed: list[str] = []
    decoders = ["light", "heavy"] if args.decode == "both" else [args.decode]
    tables: list[tuple[str, list[StreamResult]]] = []
    for decode in decoders:
        print(f"\n== {decode} decode ==", flush=True)
        results: list[StreamResult] = []
        for config in configs:
            if config.skip is not None or (config.moto and settings.moto_port is None):
                skipped = config.skip or "no moto server"
                results.append(StreamResult(config.name, skipped=skipped))
            else:
                results.append(measure(bench.job(config, decode), bench.timeout))
            r = results[-1]
            print(_progress(r), flush=True)
            report(f"shards-{decode}", r)
            if not r.ok and not r.skipped:
                failed.append(f"{decode}/{r.name}")
        tables.append((decode, results))
    data = settings.data
    for decode, results in tables:
        print(
            f"\n{decode} decode ({data.total:,} samples in {data.shards} shards, batch "
            f"{settings.batch_size}, {bench.epochs} epoch{'s' if bench.epochs > 1 else ''}):"
        )
        print(format_results(results))
    if args.profile:
        config = next(c for c in configs if c.name == args.profile)
        for decode in decoders:
            profile(config, decode, bench)
    return failed


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.perf_counter()
    signal.signal(signal.SIGTERM, _interrupt)  # clean up as for Ctrl-C
    torch.set_num_threads(1)  # for the decode costs measured here
    configs = build_configs(args.in_flight)
    if args.only:
        configs = [c for c in configs if c.name in args.only]
    supported, default = in_flight_support()
    names = ("torch", "webdataset", "aiohttp", "obstore", "moto", "pillow")
    print(versions(*names), flush=True)
    print(f"machine: {machine()}", flush=True)
    print(
        "TarShards(shards_in_flight=...): "
        + (
            f"supported, default {default!r}"
            if supported
            else "not supported (one shard at a time)"
        ),
        flush=True,
    )
    with contextlib.ExitStack() as stack:
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-streams-")))
        start = time.perf_counter()
        data = write_shards(directory, args.shards, args.samples_per_shard, args.sample_kib)
        shard_mib = sum(p.stat().st_size for p in directory.iterdir()) / 2**20 / data.shards
        print(
            f"data: {data.shards} shards x {data.per_shard} samples, {data.side}x{data.side} JPEG "
            f"quality {data.quality} (mean {sum(data.sizes) / len(data.sizes) / 1024:.1f} KiB), "
            f"{shard_mib:.2f} MiB per shard, written in {time.perf_counter() - start:.1f} s",
            flush=True,
        )
        decoders = ["light", "heavy"] if args.decode == "both" else [args.decode]
        print(decode_costs(data, [DECODERS[d] for d in decoders]), flush=True)
        http = stack.enter_context(
            ServerProcess(
                "bench-streams-http",
                serve_shards,
                str(directory),
                args.latency,
                args.bandwidth * 1e6,
            )
        )
        moto_port = None
        if any(c.moto and c.skip is None for c in configs):
            start = time.perf_counter()
            moto = stack.enter_context(
                ServerProcess("bench-streams-moto", serve_moto, str(directory))
            )
            moto_port = moto.port
            print(
                f"moto S3 on 127.0.0.1:{moto.port}, shards uploaded in "
                f"{time.perf_counter() - start:.1f} s",
                flush=True,
            )
        cap = f"{args.bandwidth:g} MB/s per response" if args.bandwidth else "no bandwidth cap"
        print(
            f"HTTP on 127.0.0.1:{http.port}: {args.latency * 1e3:g} ms to first byte, {cap}; "
            f"{args.epochs} epoch(s), each configuration in a fresh child process, timeout "
            f"{args.timeout:g} s per epoch",
            flush=True,
        )
        settings = Settings(data, args.batch_size, http.port, moto_port)
        bench = Bench(settings, args.timeout, args.epochs, tuple(args.in_flight))
        failed = run_all(args, bench, configs)
    print(f"\ntotal {time.perf_counter() - began:.0f} s")
    return exit_status(failed)


if __name__ == "__main__":
    sys.exit(main())
