"""Datasets and checks shared by the loader tests: real async sources with gates and counters,
no mocks of the loader itself."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import torch

import aioloader
from aioloader._base.recorders import WorkerRecorder
from aioloader._data.seeds import derive_seed
from aioloader._workers.processes import ProcessWorkers


class Counting(aioloader.AsyncDataset[int]):
    """Item ``i`` is ``i``; counts calls and the most ``get`` calls running at once."""

    def __init__(
        self,
        n: int,
        *,
        jitter: float = 0.0,
        fail: Iterable[int] = (),
        exc: type[Exception] = KeyError,
        seed: int = 0,
    ) -> None:
        self.n = n
        self.jitter = jitter
        self.fail = set(fail)
        self.exc = exc
        self.rng = random.Random(seed)
        self.calls = 0
        self.running = 0
        self.max_running = 0
        self.started: list[int] = []

    def __len__(self) -> int:
        return self.n

    async def get(self, index: int) -> int:
        self.calls += 1
        self.started.append(index)
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            if self.jitter:
                await asyncio.sleep(self.rng.random() * self.jitter)
            else:
                await anyio.lowlevel.checkpoint()
            if index in self.fail:
                raise self.exc(f"bad sample {index}")
            return index
        finally:
            self.running -= 1


class Batched(Counting):
    """Like :class:`Counting`, with a batched getter that counts its calls."""

    def __init__(self, n: int, **kwargs: Any) -> None:
        super().__init__(n, **kwargs)
        self.many_calls = 0

    async def get_many(self, indices: Sequence[int]) -> list[int]:
        self.many_calls += 1
        return [await self.get(i) for i in indices]


class Gated(aioloader.AsyncDataset[int]):
    """``get(i)`` waits until the test opens gate ``i`` (or all gates)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.gates = {i: anyio.Event() for i in range(n)}
        self.entered = {i: anyio.Event() for i in range(n)}

    def __len__(self) -> int:
        return self.n

    def open_all(self) -> None:
        for gate in self.gates.values():
            gate.set()

    async def get(self, index: int) -> int:
        self.entered[index].set()
        await self.gates[index].wait()
        return index


class Stream(aioloader.AsyncIterableDataset[int]):
    """Yields 0..n-1; records whether each epoch's iterator was closed."""

    def __init__(self, n: int, *, length: bool = False) -> None:
        self.n = n
        self.closed = 0
        self.opened = 0
        if length:
            self.__len__ = lambda: n  # type: ignore[method-assign]

    async def _gen(self) -> AsyncIterator[int]:
        self.opened += 1
        try:
            for i in range(self.n):
                await anyio.lowlevel.checkpoint()
                yield i
        finally:
            self.closed += 1

    def __aiter__(self) -> AsyncIterator[int]:
        return self._gen()


class TorchMap(torch.utils.data.Dataset[int]):
    def __init__(self, n: int, delay: float = 0.0) -> None:
        self.n = n
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.n:
            raise IndexError(index)
        if self.delay:
            time.sleep(self.delay)
        return index


class TorchStream(torch.utils.data.IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


def flat(batches: Iterable[Any]) -> list[int]:
    """Every sample id in a list of batches (tensors of ids)."""
    out: list[int] = []
    for b in batches:
        out.extend(torch.as_tensor(b).reshape(-1).tolist())
    return out


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def shared_memory_fds() -> int:
    """This process's descriptors of shared-memory segments (``/dev/shm``: torch's)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed since
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/shm/")
    return count


def other_tasks() -> set[asyncio.Task[Any]]:
    current = asyncio.current_task()
    return {t for t in asyncio.all_tasks() if t is not current and not t.done()}


def run_json_script(folder: Path, script: str, *args: str, env: dict[str, str]) -> dict[str, Any]:
    """Write ``script`` (dedented) to ``folder/script.py`` and run it in a fresh interpreter
    with ``args`` and ``env`` added to this one's: it must exit 0, say nothing on stderr and
    print one JSON object, returned."""
    path = folder / "script.py"
    path.write_text(textwrap.dedent(script))
    done = subprocess.run(
        [sys.executable, str(path), *args],
        capture_output=True, text=True, timeout=120, check=False, env={**os.environ, **env},
    )  # fmt: skip
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def stop_and_resume(make: Any, stop: int) -> tuple[list[Any], list[Any], list[Any], dict[str, Any]]:
    """``(full, first, rest, state)``: one loader's whole epoch; another's first ``stop``
    batches (fewer if the epoch has fewer) and its state then, through JSON; the batches a
    third loader gives from that state. ``make`` builds each loader; each is closed after."""
    with make() as whole:
        full = list(whole)
    with make() as loader:
        it = iter(loader)
        first = list(itertools.islice(it, stop))
        state = json.loads(json.dumps(loader.state_dict()))
        it.close()
    with make() as resumed:
        resumed.load_state_dict(state)
        rest = list(resumed)
    return full, first, rest, state


def views_kept(exc: BaseException) -> list[str]:
    """The unreleased memoryviews that the frames of ``exc``'s tracebacks (its context and
    cause too) still hold, named by function and local."""
    kept: list[str] = []
    chain: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while chain:
        link = chain.pop()
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        tb = link.__traceback__
        while tb is not None:
            for name, value in tb.tb_frame.f_locals.items():
                if isinstance(value, memoryview) and not released(value):
                    kept.append(f"{tb.tb_frame.f_code.co_name}: {name}")
            tb = tb.tb_next
        chain += [link.__context__, link.__cause__]
    return kept


def released(view: memoryview) -> bool:
    """Whether ``view`` was released (it holds no buffer any more)."""
    try:
        view.nbytes  # noqa: B018  # raises once released
    except ValueError:
        return True
    return False


def bare_pool(
    workers: int = 1, context: str = "forkserver", stats: WorkerRecorder | None = None
) -> ProcessWorkers:
    """A process pool as the loader makes one, without a loader: seeded 0, no
    ``worker_init_fn`` (not started)."""
    return ProcessWorkers(
        workers,
        context=context,
        seed=0,
        derive=derive_seed,
        worker_init_fn=None,
        stats=stats or WorkerRecorder(),
    )
