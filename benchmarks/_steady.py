"""What the benchmarks that run each configuration in a fresh interpreter, rounds interleaved,
share: a child's steady epochs (rate and the main process's CPU per batch), the rounds of
children, and the table against torch's row.

Imported by sibling scripts run as ``python benchmarks/<script>.py`` (their folder is first on
``sys.path``)."""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any


def self_cpu_s() -> float:
    """This process's CPU time: all its threads, not its children's."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def steady(
    loader: Iterable[Any],
    epochs: int,
    samples_in: Callable[[Any], int],
    step: Callable[[Any], object] | None = None,
) -> dict[str, Any]:
    """``epochs`` epochs of ``loader`` (closed after, if it can be), ``step`` called on each
    batch: the rate and the CPU ms per batch, medians of epochs 2 on."""
    rates, cpu_ms = [], []
    for _ in range(epochs):
        start, cpu, samples, batches = time.perf_counter(), self_cpu_s(), 0, 0
        for batch in loader:
            samples += samples_in(batch)
            batches += 1
            if step is not None:
                step(batch)
        rates.append(samples / (time.perf_counter() - start))
        cpu_ms.append((self_cpu_s() - cpu) / batches * 1e3)
    if hasattr(loader, "close"):
        loader.close()
    return {"rate": statistics.median(rates[1:]), "cpu_ms": statistics.median(cpu_ms[1:])}


def rounds(
    configs: Sequence[str],
    count: int,
    command: Callable[[str], list[str]],
    extra: Callable[[dict[str, Any]], str] = lambda row: "",
) -> dict[str, list[dict[str, Any]]]:
    """``count`` rounds, each running every config's ``command`` (a child that prints one JSON
    row last) in turn; each row printed as it comes (``extra`` adds to its line)."""
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for round_ in range(1, count + 1):
        for config in configs:
            done = subprocess.run(command(config), check=True, capture_output=True, text=True)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            results[config].append(row)
            print(
                f"  round {round_} {config:<15} {row['rate']:>8,.0f} samples/s  main process "
                f"{row['cpu_ms']:6.2f} ms CPU a batch{extra(row)}",
                flush=True,
            )
    return results


def table(
    results: dict[str, list[dict[str, Any]]],
    extra: tuple[str, Callable[[list[dict[str, Any]]], str]] | None = None,
    peer: Callable[[str], str] = lambda config: "torch",
) -> None:
    """Each config's median rate and CPU per batch, and their ratios to its ``peer`` row's
    (default ``torch``); ``extra``: a column's header and what it shows of a config's rows."""
    head = f"{'config':<15} {'samples/s':>10} {'x peer':>8} {'CPU ms/batch':>13} {'x peer':>8}"
    print(f"\n{head}{'' if extra is None else f' {extra[0]:>8}'}")
    for config, rows in results.items():
        base = results.get(peer(config))
        rate = statistics.median(r["rate"] for r in rows)
        cpu = statistics.median(r["cpu_ms"] for r in rows)
        ratios = ("", "")
        if base:
            b_rate = statistics.median(r["rate"] for r in base)
            b_cpu = statistics.median(r["cpu_ms"] for r in base)
            ratios = (f"{rate / b_rate:.2f}x", f"{cpu / b_cpu:.2f}x")
        more = "" if extra is None else f" {extra[1](rows):>8}"
        print(f"{config:<15} {rate:>10,.0f} {ratios[0]:>8} {cpu:>13.2f} {ratios[1]:>8}{more}")
