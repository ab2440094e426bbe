"""Remote-read benchmark: aioloader vs torch's DataLoader vs torchdata.nodes vs SPDL vs a thread
pool vs plain asyncio, fetching small objects over HTTP or S3 from a local server with
first-byte latency.

Workload: ``--items`` (default 2,000) objects of 64 KiB, each served after ``--latency``
(default 20 ms), by a server on ``127.0.0.1`` (port 0, in a subprocess, stopped at the
end of the run):

* ``--store http`` (default): an aiohttp server, ``GET /obj/{i}``, the latency an
  ``await asyncio.sleep`` before the response.
* ``--store s3``: moto's S3 server (threaded werkzeug), the objects ``obj/{i}`` in one bucket,
  the latency a sleep before each GET in the request's thread. The blocking peers read with
  boto3's ``get_object`` (a client a process), the async ones with obstore's ``get_async``,
  aioloader with ``aioloader.sources.objects("s3://bucket/obj/")`` (one listing, then a GET an
  object).

Every configuration reads each object once, in batches of ``--batch-size`` (default 32,
``collate_fn=list``), and is measured in the same run, one after another, so the ratios between
them are what matter:

* ``aio-conn{16,64,256}``: ``aioloader.DataLoader`` over
  ``aioloader.sources.urls(urls, connections=N)`` (or ``objects(...)``), ``max_inflight=N``,
  ``async for``.
* ``torch-nw{2,8}``: ``torch.utils.data.DataLoader`` over a map-style dataset whose
  ``__getitem__`` is a blocking ``urllib.request.urlopen(url).read()`` (or boto3 get),
  ``num_workers`` 2 and 8.
* ``aio-swapped-nw8``: the same code as ``torch-nw8`` with the import swapped
  (``aioloader.DataLoader``), nothing else changed.
* ``tdnodes-thr{16,64}``: a ``torchdata.nodes`` graph, ``IterableWrapper(urls)`` ->
  ``ParallelMapper(map_fn=<the same blocking fetch>, num_workers=N, method="thread",
  in_order=True)`` (at most ``2 * N`` items in flight, its default) -> ``Batcher(batch_size,
  drop_last=False)``, iterated through a ``Loader``; wall time includes joining its threads.
* ``spdl-conc64``: an SPDL pipeline, ``PipelineBuilder().add_source(urls)`` ->
  ``.pipe(<async fetch>, concurrency=64)`` -> ``.aggregate(batch_size)`` -> ``.add_sink()`` ->
  ``.build(num_threads=1)`` (no stage is synchronous), iterated under ``auto_stop()``. SPDL runs
  async stages on its own event loop in a background thread, so the fetch stage's one
  ``aiohttp.ClientSession`` (connector limit 64) is opened and closed on that loop by a
  ``TaskHook.stage_hook`` (passed through ``build(task_hook_factory=...)`` beside SPDL's default
  ``TaskStatsHook``), when the stage starts and ends. SPDL drops a failed fetch (its default
  ``max_failures=-1``) and logs it; the exactly-once check then fails the configuration.
* ``threads32``: ``concurrent.futures.ThreadPoolExecutor(32).map`` of the same blocking fetch.
* ``asyncio-ceiling``: one ``aiohttp.ClientSession`` (connector limit 64) or one obstore store,
  ``asyncio.Semaphore(64)``, ``asyncio.gather`` of every fetch, then grouped in batches.

torchdata and SPDL are the optional extra ``.[bench]``: where one is not installed, its row says so
and the rest still run.

Each configuration runs in a child of its own (``harness_child.run_in_child``), which imports the
peers before its clock starts (so none pays its import inside its wall time, and every row's
memory holds them all). Wall time covers one full epoch end to end, including starting and
stopping the loader (worker processes, threads, sessions). Peak PSS and CPU time are the
child's process tree's, sampled from ``/proc`` every 50 ms from this process. Every
configuration checks that each object arrives exactly once with the right bytes, in the right
number of batches; the script exits non-zero when one does not (or when one raises or times
out); a peer that is not installed is reported, not failed.

Run it from the repository root::

    .venv/bin/python benchmarks/bench_remote.py                # the full run
    .venv/bin/python benchmarks/bench_remote.py --quick        # a smoke test (400 items)
    .venv/bin/python benchmarks/bench_remote.py --store s3     # the same from moto's S3
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from aioloader._bench.harness import Result, report, timed
from aioloader._bench.harness_child import run_in_child
from aioloader._bench.harness_script import (
    add_batch_size,
    add_only,
    add_quick,
    add_timeout,
    exit_status,
    quick_defaults,
    versions,
)
from aioloader._bench.harness_server import ServerProcess
from aioloader._bench.harness_table import Column, format_table, ratio_to
from aioloader._bench.remote_data import (
    Settings,
    check,
)
from aioloader._bench.remote_runs import (
    BASELINES,
    CONFIGS,
    PEER_OF,
    in_flight,
)
from aioloader._bench.remote_server import (
    NOT_INSTALLED,
    OBJECT_SIZE,
    PEERS,
    QUICK_ITEMS,
    SERVER_START_S,
    serve,
    serve_s3,
)


@dataclass(frozen=True)
class Job:
    """One configuration, as handed to its child (which finds it by name)."""

    config: str
    settings: Settings


def prepare_child(job: Job) -> Callable[[], dict[str, Any]]:
    """A child's set-up, before its clock starts: the peers imported (so none pays its import in
    its wall time, and every row's memory holds them all), torch's worker warning silenced (8
    workers on 2 cores: measuring that is the point). Returns the work: the epoch, timed, then
    checked."""
    for module, _ in PEERS.values():
        with contextlib.suppress(ImportError):  # one that fails to import fails its rows
            importlib.import_module(module)
    if job.settings.store == "s3":
        import boto3
        import obstore

        del boto3, obstore  # imported for every row alike
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)

    def work() -> dict[str, Any]:
        outcome = timed(functools.partial(CONFIGS[job.config], job.settings), job.settings.timeout)
        if outcome.value is None:
            return {"samples": 0, "wall_s": outcome.wall_s, "error": outcome.error}
        samples, error = check(outcome.value, job.settings)
        return {"samples": samples, "wall_s": outcome.wall_s, "error": error}

    return work


def measure(name: str, settings: Settings) -> Result:
    """Run one configuration in a child of its own (``harness_child.run_in_child``), its process
    tree's memory and CPU sampled from here; past ``settings.timeout``, its stacks are dumped
    and its tree killed."""
    run = run_in_child(prepare_child, Job(name, settings), settings.timeout, f"bench-{name}")
    result = Result(name, error=run.error)
    if run.payload is not None:
        result.samples, result.wall_s = run.payload["samples"], run.payload["wall_s"]
    result.record_memory(run.memory)
    return result


def format_results(results: Iterable[Result]) -> str:
    results = list(results)
    columns: list[Column[Result]] = [
        Column("samples/s", 11, lambda r: f"{r.samples_per_s:,.0f}"),
        Column("wall s", 9, lambda r: f"{r.wall_s:.2f}"),
        Column("peak RSS MiB", 14, lambda r: f"{r.peak_rss_mib:,.0f}"),
        Column("peak PSS MiB", 14, lambda r: f"{r.peak_pss_mib:,.0f}"),
        Column("CPU s", 7, lambda r: f"{r.cpu_s or 0:.2f}"),
    ]
    for label, peer, width in zip(("ceiling", "nw8"), BASELINES, (12, 9), strict=True):
        per_s = ratio_to(results, peer, lambda r: r.samples_per_s)
        columns.append(Column(f"vs {label}", width, per_s))
    # A peer that is not installed: "-" in every column, and why in the check column.
    return format_table(
        results, 18, columns, lambda r: r.skipped or r.status, blank=lambda r: r.skipped is not None
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="aioloader vs torch DataLoader vs threads vs asyncio, reading over HTTP."
    )
    parser.add_argument("--items", type=int, default=None, help="objects (default 2000)")
    add_batch_size(parser)
    parser.add_argument(
        "--latency", type=float, default=0.02, help="server's seconds before each response"
    )
    parser.add_argument(
        "--store",
        choices=("http", "s3"),
        default="http",
        help="serve the objects from an aiohttp server or from moto's S3 server (default http)",
    )
    add_quick(parser, f"smoke test: {QUICK_ITEMS} items (unless --items)")
    add_only(parser, list(CONFIGS))
    add_timeout(
        parser, "seconds one configuration may take (default: max(120, 3 * items * latency))"
    )
    args = parser.parse_args(argv)
    quick_defaults(args, items=(QUICK_ITEMS, 2000))
    if args.items <= 0 or args.batch_size <= 0 or args.latency < 0:
        parser.error("--items and --batch-size must be positive, --latency non-negative")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # torch warns that 8 workers exceed this machine's cores: measuring that is the point.
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    timeout = args.timeout or max(120.0, 3 * args.items * args.latency)
    installed = {peer: importlib.util.find_spec(peer) is not None for peer in PEERS}
    peers: list[tuple[str, str]] = []
    for peer, (module, distribution) in PEERS.items():
        if installed[peer]:
            # Imported here, not inside a timed configuration. One that fails to import fails
            # its configurations.
            with contextlib.suppress(ImportError):
                importlib.import_module(module)
            peers.append((peer, distribution))
    print(
        f"{versions('torch', *peers, 'aiohttp')}: {args.items} objects x "
        f"{OBJECT_SIZE // 1024} KiB, {args.latency * 1e3:g} ms first-byte latency, "
        f"batch {args.batch_size}",
        flush=True,
    )
    results: list[Result] = []
    table = f"objects-{args.store}"
    server = ServerProcess(
        f"bench-remote-{args.store}",
        serve_s3 if args.store == "s3" else serve,
        args.items,
        args.latency,
        start_timeout=SERVER_START_S,
    )
    with server:
        settings = Settings(
            args.items, args.batch_size, args.latency, timeout, server.port, args.store
        )
        print(f"{args.store} server on 127.0.0.1:{server.port}", flush=True)
        names: list[str] = args.only or list(CONFIGS)
        for name in names:
            needs = PEER_OF.get(name)
            if needs is not None and not installed[needs]:
                if all(r.name != needs for r in results):  # one row for the peer
                    results.append(Result(needs, skipped=NOT_INSTALLED))
                    report(table, results[-1])
                    print(f"  skip {needs:<18} {NOT_INSTALLED}", flush=True)
                continue
            result = measure(name, settings)
            results.append(result)
            report(table, result, **in_flight(name))
            print(
                f"  done {name:<18} {result.samples_per_s:>10,.0f} samples/s "
                f"{result.wall_s:>7.2f} s  {result.peak_pss_mib:>6,.0f} MiB PSS  {result.status}",
                flush=True,
            )
    print()
    print(format_results(results))
    return exit_status([r.name for r in results if not r.ok])


if __name__ == "__main__":
    sys.exit(main())
