"""Serving benchmark: aioloader's DynamicBatcher behind an HTTP server, against one model call per
request and a naive batcher, under open-loop load.

The server (an aiohttp app on 127.0.0.1, port 0, uvloop, in a subprocess so the load generator
does not share its event loop or GIL) answers ``POST /predict``: a body of 512 float32 values
(2 KiB) in, the model's 512 float32 outputs for it out. Three servers, one after another:

* ``(a) batcher``: ``DynamicBatcher(model, max_batch_size=32, max_delay=0.005, max_queue=1024)``;
  the model runs in the batcher's thread, one batch at a time.
* ``(b) per-request``: one model call per request on a batch of one, serialized on one thread
  (what a naive server with one model instance does).
* ``(c) naive batch``: a loop that sleeps ``max_delay`` (5 ms), then runs the model once on
  everything that arrived meanwhile (no size bound, no deadline), on one thread.
* ``(d) ray batch``, where Ray is installed: Ray Serve's ``@serve.batch`` with the same
  ``max_batch_size`` and ``max_delay`` as its ``batch_wait_timeout_s``, the model on one
  thread (``_bench/serving_ray.py``). ``--modes`` picks servers.

The model (``--model``):

* ``gpu`` (default) simulates an accelerator: a call sleeps 4 ms + 0.1 ms per row in the model's
  thread — a GPU's fixed launch/transfer/sync cost plus a small per-row cost, during which the
  host CPU is free — and returns ``tanh(batch)`` (a few microseconds on the host, standing for
  what the device computes). Batch time: about 4.1 ms for 1 row, 7.2 ms for 32. (Running even
  a small torch MLP on the host here costs sporadic multi-millisecond CPU spikes on this VM
  that swamp every server's tail latency alike.)
* ``cpu``: a real torch MLP 512→2048→2048→512 on the CPU (one intra-op thread). Its weights are
  read on every call, so batch time is sub-linear (here about 3 ms for 1 row, 12 ms for 32), but
  it burns a core that the HTTP stack needs on a 2-core machine, so the comparison then mostly
  measures CPU contention.

The server measures its model's batch time for 1, 8 and 32 rows at start-up. All three servers
set ``sys.setswitchinterval(0.0005)``: the model's thread needs the GIL back after each call
while the loop thread is busy with HTTP, and at the default 5 ms every hand-off may cost 5 ms.

Load: for each offered rate (requests/s), a seeded Poisson arrival process issues
``rate x window`` requests (open loop: each is sent at its arrival time whether or not earlier
ones are answered) over up to 512 keep-alive connections; a request gives up after
``--request-timeout`` seconds (closing its connection, which cancels its server handler).
The client is a minimal HTTP/1.1 client on asyncio protocols: aiohttp's client costs about
0.6 ms of CPU per request on this VM, CPU the server under test would lose. Latency runs from
the scheduled arrival to the answer, so client-side queueing counts. Between rates the client
waits until the server has no handler running.

Columns: ``done/s`` (successful answers per second, from the first arrival to the last request's
end), ``x(b)`` (that over the per-request server's at the same rate), ``p50``/``p99`` ms (over
every request; a failed one counts as infinitely slow, shown ``>timeout``), ``srv p99`` (p99 of
the time inside the server's handler, for the answered requests: the part HTTP, the client and
the machine's scheduling don't add), ``fail`` (timed out,
or 503 from the batcher's admission control), ``batch`` (mean model batch size), ``other CPU``
(share of the machine's CPU used meanwhile by processes outside this benchmark: rows with a high
figure were slowed by them).

The goal checked at the end: at each rate where (b) saturates (answers < 90% of offered), (a)
serves what is offered (>= 95%: several times (b) once the rate is) with p99 <= max_delay +
the model's 32-row batch time + 5 ms.

The servers are ``serving_server.py``'s, the load generator and each rate's figures
``serving_load.py``'s; this module measures, prints the tables and checks the goal.

Run:
    python benchmarks/bench_serving.py            # 4 rates x 3 s each, about a minute
    python benchmarks/bench_serving.py --quick    # a smoke test: 2 rates, short windows
    python benchmarks/bench_serving.py --model cpu --rates 100 400 800
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import uvloop

from aioloader._bench.harness import Result, report
from aioloader._bench.harness_script import add_quick, quick_defaults
from aioloader._bench.serving_load import SIZE_BINS, Level, measure
from aioloader._bench.serving_ray import available
from aioloader._bench.serving_server import MAX_BATCH, MAX_DELAY, MODES, serve


def ms(seconds: float, timeout: float) -> str:
    return f">{timeout * 1e3:.0f}" if math.isinf(seconds) else f"{seconds * 1e3:.1f}"


def summarize(results: dict[str, list[Level]], times: dict[int, float], args: Any) -> bool:
    t = args.request_timeout
    print(
        f"\nmodel {args.model}: batch time 1 row {times[1] * 1e3:.2f} ms, 8 rows "
        f"{times[8] * 1e3:.2f} ms, 32 rows {times[32] * 1e3:.2f} ms; max_delay "
        f"{MAX_DELAY * 1e3:.0f} ms, max_batch_size {MAX_BATCH}\n"
    )
    head = f"{'offered/s':>9}  {'server':<16}{'done/s':>8}{'x(b)':>7}{'p50 ms':>9}{'p99 ms':>9}"
    print(head + f"{'srv p99':>9}{'fail':>6}{'batch':>7}{'other CPU':>11}")
    for i, rate in enumerate(args.rates):
        base = results["serial"][i].done_per_s if "serial" in results else 0.0
        for mode in results:
            lv = results[mode][i]
            relative = f"{lv.done_per_s / base:.2f}" if base else "-"
            print(
                f"{rate:>9.0f}  {MODES[mode]:<16}{lv.done_per_s:>8.0f}{relative:>7}"
                f"{ms(lv.percentile(0.5), t):>9}{ms(lv.percentile(0.99), t):>9}"
                f"{ms(lv.server_p99, t):>9}{lv.failed:>6}{lv.mean_batch:>7.1f}{lv.other_cpu:>11.0%}"
            )
    bins = "".join(f"{f'{lo}-{hi}' if lo < hi else lo:>7}" for lo, hi in SIZE_BINS)
    print(
        f"\nbatch sizes (share of model calls):\n{'offered/s':>9}  {'server':<16}{'calls':>7}{bins}"
    )
    for i, rate in enumerate(args.rates):
        for mode in results:
            lv = results[mode][i]
            shares = "".join(f"{share:>7.0%}" for share in lv.size_shares())
            print(f"{rate:>9.0f}  {MODES[mode]:<16}{lv.batches:>7}{shares}")
    bound = MAX_DELAY + times[32] + 0.005
    verdicts = []
    for i, rate in enumerate(args.rates if {"serial", "batcher"} <= results.keys() else ()):
        b, a = results["serial"][i], results["batcher"][i]
        if b.done_per_s >= 0.9 * rate:
            continue
        ratio = a.done_per_s / b.done_per_s if b.done_per_s else math.inf
        p99 = a.percentile(0.99)
        sustained = a.ok >= 0.95 * a.sent
        good = sustained and p99 <= bound
        verdicts.append(good)
        print(
            f"goal at {rate:.0f}/s ((b) saturated at {b.done_per_s:.0f}/s): (a) served"
            f" {a.ok / a.sent:.0%} of it, {ratio:.1f}x (b); p99 {ms(p99, t)} ms (want <="
            f" {bound * 1e3:.1f} = max_delay + 32-row batch + 5 ms): "
            + ("holds" if good else "DOES NOT HOLD")
        )
    if not verdicts:
        print("goal: (b) saturated at no offered rate; raise --rates")
    return all(verdicts)


async def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    print("starting the three servers", flush=True)
    results, times = await measure(args)
    summarize(results, times, args)
    for mode, levels in results.items():
        for level in levels:
            error = f"{level.failed} of {level.sent} requests failed" if level.failed else None
            row = Result(f"{mode}@{level.rate:g}", level.ok, level.span_s, error=error)
            row.cpu_s, row.peak_pss_mib = level.server_cpu_s, level.server_pss_mib or 0.0
            # (b) and (c) are baselines: at a rate past what they serve, they fail requests.
            if mode != "batcher":
                row.error = None
            report("serving", row, offered=level.rate, p99_ms=level.percentile(0.99) * 1e3)
    print(f"\n(total {time.perf_counter() - started:.0f} s)")
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_quick(parser, "smoke test: 2 rates, 0.5 s each")
    parser.add_argument("--model", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--rates", type=float, nargs="+", help="offered loads, requests/s")
    parser.add_argument("--window", type=float, help="seconds of arrivals per rate")
    parser.add_argument("--request-timeout", type=float, default=3.0)
    parser.add_argument("--serve", choices=tuple(MODES), help=argparse.SUPPRESS)
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=tuple(MODES),
        help="servers to run (default: all; Ray Serve's where it imports)",
    )
    args = parser.parse_args(argv)
    if args.modes is None and not args.serve:
        args.modes = [mode for mode in MODES if mode != "ray"]
        if available():
            args.modes.append("ray")
        else:
            print(f"{MODES['ray']}: not run: Ray Serve does not import here (ray[serve])")
    quick_defaults(args, rates=([150, 600], [100, 300, 600, 900]), window=(0.5, 3.0))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    if options.serve:
        uvloop.run(serve(options.serve, options.model))
        return 0
    return uvloop.run(run(options))


if __name__ == "__main__":
    sys.exit(main())
