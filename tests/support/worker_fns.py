"""Functions that run inside worker processes in the tests: module-level, so spawned workers
can import them by name."""

from __future__ import annotations

import multiprocessing.util
import os
import random
import signal
import time
from typing import Any

import numpy as np
import torch

import aioloader

INIT_CALLS: list[int] = []  # in a worker: the ids worker_init_fn was called with


def init(worker_id: int) -> None:
    INIT_CALLS.append(worker_id)


def failing_init(worker_id: int) -> None:
    raise LookupError(f"no config for worker {worker_id}")


def whoami(x: int) -> dict[str, Any]:
    info = aioloader.get_worker_info()
    assert info is not None
    return {
        "x": x,
        "id": info.id,
        "num_workers": info.num_workers,
        "seed": info.seed,
        "pid": os.getpid(),
        "init_calls": list(INIT_CALLS),
    }


def augment(x: int) -> torch.Tensor:
    """A random augmentation drawing from all three global generators."""
    return torch.tensor(
        [
            x,
            random.randint(0, 2**30),
            int(np.random.randint(0, 2**30)),
            int(torch.randint(0, 2**30, ())),
        ]
    )


def image(x: int) -> torch.Tensor:
    return torch.full((3, 224, 224), x % 256, dtype=torch.uint8)


def bad_value(x: int) -> int:
    if x == 5:
        raise ValueError(f"cannot decode sample {x}")
    return x


class Unpicklable(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = __import__("threading").Lock()  # locks do not pickle


def raise_unpicklable(x: int) -> int:
    if x == 3:
        raise Unpicklable("holds a lock")
    return x


def kill_on_7(x: int) -> int:
    if x == 7 and aioloader.get_worker_info() is not None:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def slow(x: int) -> int:
    time.sleep(0.05)
    return x


def sample_key(sample: dict[str, Any]) -> str:
    """A tar sample's key, with the worker that read it: a transform for stream tests."""
    info = aioloader.get_worker_info()
    assert info is not None, "not in a worker"
    return str(sample["__key__"])


def _refuse_to_load(message: str) -> None:
    raise ValueError(message)


class _LoadsBadly:
    """Pickles in the worker; unpickling it (in the main process) raises ValueError."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_refuse_to_load, ("this value does not load here",))


class Unloadable(torch.utils.data.Dataset[_LoadsBadly]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> _LoadsBadly:
        return _LoadsBadly()


def _write_marker(path: str) -> None:
    with open(path, "w") as f:
        f.write("left on EOF")


def mark_a_clean_exit(folder: str, worker_id: int) -> None:
    """A ``worker_init_fn`` (with ``functools.partial``): the worker writes a file as it leaves
    of itself (multiprocessing's finalizers, which a terminated worker does not run)."""
    multiprocessing.util.Finalize(None, _write_marker, (f"{folder}/w{worker_id}",), exitpriority=10)


def add_one_in_place(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Adds 1 to each of a job's tensors where they are (shared with the main process) and
    sends them back as they are."""
    for t in tensors:
        t.add_(1)
    return tensors


def bumped(tensor: torch.Tensor) -> torch.Tensor:
    """A transform that changes its sample in place (as ``Normalize(inplace=True)`` does)."""
    return tensor.add_(1)


class HeldTensors(torch.utils.data.Dataset[torch.Tensor]):
    """A dataset that holds its samples as ``n`` tensors (preloaded; ``shared``: each moved to
    shared memory, so that each goes to a worker as a descriptor of its own), and ``names``
    strings of 96 characters (20,000 of them pickle to over 1 MiB: a template's start)."""

    def __init__(self, n: int, names: int = 0, *, shared: bool = False) -> None:
        self.items = [torch.full((2,), float(i)) for i in range(n)]
        if shared:
            for item in self.items:
                item.share_memory_()
        self.names = [f"sample-{i:08d}" * 6 for i in range(names)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.items[index]


def killed_between_reply_and_descriptors(n: int) -> torch.Tensor:
    """Returns ``torch.arange(n)``, and the worker is killed once the reply's message is sent,
    before its tensor's descriptor is."""
    from aioloader._workers import fdpass

    def killed(conn: object, passing: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    fdpass.send_descriptors = killed  # type: ignore[assignment]  # in this worker only
    return torch.arange(n)


def sets_a_socket_timeout(worker_id: int) -> None:
    """A ``worker_init_fn``: a default timeout for every socket made in the worker after."""
    import socket

    socket.setdefaulttimeout(30)


def lower_the_open_file_limit(headroom: int) -> int:
    """Lowers this worker's open-file limit to ``headroom`` above what it has open."""
    import resource

    opened = {int(fd) for fd in os.listdir("/proc/self/fd")}
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # The limit bounds a descriptor's number: the one under which `headroom` numbers are free
    limit = [n for n in range(soft) if n not in opened][headroom - 1] + 1
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    return len(opened)


def big_result(*ignored: object) -> Any:
    """A job's result whose batch (1 MiB) goes into one of the worker's blocks."""
    from aioloader._workers.result import JobResult

    return JobResult(batch=torch.ones(1 << 18), size=1)


def blocks_busy(*ignored: object) -> list[bool]:
    """Which of this worker's blocks hold a result the main process has not let go of."""
    from aioloader._workers import worker

    return [block.busy for block in worker._blocks._blocks]


class HeldSparse(torch.utils.data.Dataset[torch.Tensor]):
    """A dataset that holds ``n`` sparse tensors (each two storages: indices and values)."""

    def __init__(self, n: int) -> None:
        self.items = [
            torch.sparse_coo_tensor(
                [[0, 1]], [float(i), 1.0], (4,), check_invariants=True
            ).coalesce()
            for i in range(n)
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.items[index].to_dense()
