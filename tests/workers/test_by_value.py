"""What pickle cannot send by name goes to the worker processes by value (``byvalue.py``):
lambdas, closures and local classes work as they do in torch's forked workers, each is sent to
a worker once, what comes back is of the caller's own classes, and the main script's own
functions and classes go by name where the workers run it again (by value where they do not:
``python -c``)."""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import aioloader
from aioloader import default_collate
from aioloader._base.recorders import WorkerRecorder
from aioloader._workers.byvalue import ByValue, portable, sent_by_name
from aioloader._workers.mainmodule import workers_main
from aioloader._workers.mainscript import names_bound_on_import
from tests.support import worker_fns
from tests.support.helpers import Counting, bare_pool, flat, open_fds, run_json_script

# -- deciding -------------------------------------------------------------------------------------

SPAWNED = workers_main("spawn")  # what a spawned worker has of the main module (pytest's: none)


def test_what_pickle_finds_by_name_is_left_as_it_is() -> None:
    for value in (None, worker_fns.kill_on_7, default_collate, Counting, max):
        assert portable(value, SPAWNED) is value
    assert sent_by_name(Counting(4), SPAWNED)


def test_lambdas_closures_and_local_classes_go_by_value() -> None:
    k = 3

    def add_k(x: int) -> int:
        return x + k

    class Local:
        pass

    for value in (lambda x: x, add_k, functools.partial(add_k), Local, [Local()]):
        assert not sent_by_name(value, SPAWNED)
        wrapped = portable(value, SPAWNED)
        assert isinstance(wrapped, ByValue) and wrapped.value is value
    assert portable(add_k, SPAWNED)(1) == 4  # callable here too: the loader may run it here
    assert pickle.loads(pickle.dumps(portable(add_k, SPAWNED)))(1) == 4  # as a worker gets it


def test_the_scan_copies_no_tensor_into_shared_memory() -> None:
    """Deciding pickles into nothing: torch's reductions (which move a tensor's storage to
    shared memory) do not run, and a NumPy array's bytes are not copied."""
    table = torch.arange(1000.0)
    before = open_fds()
    assert sent_by_name({"table": table, "array": np.ones(1 << 20)}, SPAWNED)
    assert not sent_by_name({"table": table, "fn": lambda: table}, SPAWNED, starting=True)
    assert not table.is_shared() and open_fds() == before


def test_what_does_not_pickle_even_by_value_raises_its_reason() -> None:
    lock = threading.Lock()
    with pytest.raises(TypeError, match=r"_thread\.lock"):
        portable(lambda: lock, SPAWNED)


def test_the_names_a_script_binds_when_a_worker_runs_it_again() -> None:
    source = textwrap.dedent(
        """
        import os, numpy as np
        from typing import Any as A
        try:
            import ujson as json
        except ImportError:
            import json
        X, (Y, Z) = 1, (2, 3)
        with open(__file__) as handle:
            pass
        for i in range(2):
            pass
        def f(): local = 1
        class C:
            attr = 1
        async def g(): pass
        def shadowed(): pass
        if __name__ == "__main__":
            def guarded(): pass
            G = 1
            def shadowed(): pass  # the main module's is this one; a worker's, the one above
        else:
            imported = 1
        """
    )
    names = names_bound_on_import(source)
    expected = {"os", "np", "A", "json", "X", "Y", "Z", "handle", "i", "f", "C", "g", "imported"}
    assert names == frozenset(expected)
    assert "anything" in names_bound_on_import("from os.path import *\n")


# -- in a loader's workers ------------------------------------------------------------------------


def test_lambdas_and_closures_run_in_the_workers_as_torch_s_forked_workers_run_them() -> None:
    offset = 100

    def collate(batch: list[Any]) -> list[Any]:
        return [(offset + v, pid, w) for v, pid, w in batch]

    def init(worker_id: int) -> None:
        os.environ["AIOLOADER_TEST_INIT"] = str(worker_id)

    loader = aioloader.DataLoader(
        Counting(8),
        batch_size=2,
        num_workers=2,
        transform=lambda x: (x * 2, os.getpid(), os.environ.get("AIOLOADER_TEST_INIT")),
        collate_fn=collate,
        worker_init_fn=init,
        # without a CUDA device it runs where collation runs: in the workers
        device_transform=lambda batch: [(*row, os.getpid()) for row in batch],
    )
    rows = [row for batch in loader for row in batch]
    assert [v for v, _, _, _ in rows] == [100 + 2 * x for x in range(8)]
    assert all(pid == finished_in for _, pid, _, finished_in in rows)
    workers = {pid: w for _, pid, w, _ in rows}
    assert os.getpid() not in workers and sorted(workers.values()) in (["0"], ["0", "1"])
    assert "AIOLOADER_TEST_INIT" not in os.environ


def test_a_torch_dataset_with_a_lambda_and_a_local_class_in_it() -> None:
    class Squares(torch.utils.data.Dataset[Any]):
        def __init__(self, transform: Any) -> None:
            self.transform = transform
            self.tag = "main"

        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> Any:
            return self.transform(i), self.tag, os.getpid()

        def set_up(self, worker_id: int) -> None:
            self.tag = f"worker {worker_id}"

    dataset = Squares(lambda i: i * i)
    loader = aioloader.DataLoader(
        dataset, batch_size=2, num_workers=2, worker_init_fn=dataset.set_up, collate_fn=list
    )
    got = list(loader)
    # worker_init_fn set up the worker's own copy: the bound method and the dataset arrived in
    # one pickle, one object (as torch's idiom needs)
    assert [(v, tag) for batch in got for v, tag, _ in batch] == [
        (0, "worker 0"), (1, "worker 0"), (4, "worker 1"), (9, "worker 1"),
    ]  # fmt: skip
    assert os.getpid() not in {pid for batch in got for _, _, pid in batch}
    assert dataset.tag == "main"


class Table(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self, table: torch.Tensor, transform: Any) -> None:
        self.table, self.transform = table, transform

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.transform(self.table[i])


@pytest.mark.parametrize("context", ["forkserver", "spawn"])
def test_a_dataset_pickle_refuses_goes_by_value_epoch_after_epoch_leaving_nothing(
    context: str,
) -> None:
    """Pickle refuses the dataset as it starts a worker (a lambda in it); nothing was started,
    and it goes by value, with its tensor. Each epoch's workers start so, and none leaves a
    descriptor behind."""
    loader = aioloader.DataLoader(
        Table(torch.arange(4.0), lambda row: row * 10),
        batch_size=2,
        num_workers=1,
        multiprocessing_context=context,
    )
    assert [b.tolist() for b in loader] == [[0.0, 10.0], [20.0, 30.0]]
    gc.collect()  # a batch's segment goes with its tensor, whenever that is collected
    before = open_fds()
    for _ in range(2):
        assert [b.tolist() for b in loader] == [[0.0, 10.0], [20.0, 30.0]]
        gc.collect()
        assert open_fds() == before


class SharedTable(torch.utils.data.Dataset[Any]):
    """A tensor in shared memory, a process-shared counter (it pickles only as a process
    starts) and a function (a lambda: the whole goes by value)."""

    def __init__(self, transform: Any) -> None:
        self.table = torch.arange(4.0).share_memory_()
        self.calls = multiprocessing.get_context("spawn").Value("i", 0)
        self.transform = transform

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        self.count()
        return self.transform(self.table[i]).item(), self.table.is_shared()

    def count(self, worker_id: int = 0) -> None:
        with self.calls.get_lock():
            self.calls.value += 1


def test_start_arguments_by_value_share_tensors_and_process_shared_values() -> None:
    """By value, the dataset is pickled inside each worker's start, as pickle by name pickles
    it: its tensor in shared memory is shared with the workers, and a multiprocessing ``Value``
    (which pickles only then) reaches them."""
    dataset = SharedTable(lambda row: row * 10)
    loader = aioloader.DataLoader(
        dataset, batch_size=2, num_workers=2, collate_fn=list, worker_init_fn=dataset.count
    )
    assert [row for batch in loader for row in batch] == [
        (0.0, True), (10.0, True), (20.0, True), (30.0, True),
    ]  # fmt: skip
    assert dataset.calls.value == 4 + 2  # the workers counted in this process's counter


@pytest.mark.parametrize("persistent", [False, True])
def test_a_closure_s_state_reaches_each_epoch_s_workers_as_torch_s_forked_ones(
    persistent: bool,
) -> None:
    """A closure is pickled as each pool first sends it: an epoch's new workers see its state
    then (torch forks them from it); persistent workers keep what they got first (torch's
    too)."""
    config = {"scale": 1}
    loader = aioloader.DataLoader(
        Counting(2),
        batch_size=2,
        num_workers=1,
        persistent_workers=persistent,
        collate_fn=lambda batch: [x * config["scale"] for x in batch],
    )
    seen = []
    for epoch in range(3):
        config["scale"] = 10**epoch
        seen.append(list(loader))
    loader.close()
    scales = [1, 1, 1] if persistent else [1, 10, 100]
    assert seen == [[[0, s]] for s in scales]


def test_each_worker_is_sent_a_value_once_and_a_replacement_again() -> None:
    """A closure holding 1 MiB crosses the pipe once per worker, not once per batch; a worker
    that died is replaced by one that is sent it again."""
    weights = os.urandom(1 << 20)

    def transform(x: int) -> int:
        return worker_fns.kill_on_7(x) + len(weights)

    batches = [[0, 1], [2, 3], [4, 5], [6], [8, 9], [10, 11], [12, 13], [14, 15]]
    loader = aioloader.DataLoader(
        Counting(16), batch_sampler=batches, num_workers=2, transform=transform, collate_fn=list
    )
    with loader:
        assert flat(loader) == [x + (1 << 20) for b in batches for x in b]
        sent = loader.statistics().workers.bytes_sent  # type: ignore[union-attr]
        assert 2 << 20 < sent < 3 << 20  # to each of 2 workers once, and 8 small jobs
        batches.insert(3, [7])
        with pytest.raises(aioloader.WorkerCrashed):
            list(loader)
        batches.remove([7])
        assert flat(loader) == [x + (1 << 20) for b in batches for x in b]
        stats = loader.statistics().workers
        assert stats is not None and stats.restarts == 1


def test_what_comes_back_is_of_the_caller_s_own_classes() -> None:
    """A batch of a local class, and an exception of one, arrive as instances of the classes
    the main process defined (cloudpickle tracks a class it sent by value), not copies."""

    class Batch:
        def __init__(self, items: list[int]) -> None:
            self.items = items

    class Refused(ValueError):
        pass

    def collate(items: list[int]) -> Batch:
        if 3 in items:
            raise Refused(f"no 3 in {items}")
        return Batch(items)

    loader = aioloader.DataLoader(Counting(4), batch_size=2, num_workers=1, collate_fn=collate)
    with loader:
        it = iter(loader)
        first = next(it)
        assert type(first) is Batch and first.items == [0, 1]
        with pytest.raises(Refused, match=r"no 3 in \[2, 3\]") as info:
            next(it)
    assert type(info.value) is Refused
    assert "raised in worker 0" in "\n".join(info.value.__notes__)


async def test_a_dynamic_batcher_s_worker_collates_with_a_lambda() -> None:
    batcher = aioloader.DynamicBatcher(
        lambda batch: batch * 2,
        max_batch_size=4,
        max_delay=60.0,
        num_workers=1,
        collate_fn=lambda items: torch.stack(items) + 1,
    )
    async with batcher:
        got = await asyncio.gather(*(batcher.submit(torch.full((2,), float(i))) for i in range(4)))
    assert sorted(g.tolist()[0] for g in got) == [2.0, 4.0, 6.0, 8.0]


# -- the main script ------------------------------------------------------------------------------

_SCRIPT = """
import json, os, sys
import torch
import aioloader


class Rows(torch.utils.data.Dataset):  # top level: a worker that runs the script again has it
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return i


class Total:
    def __init__(self, value, by_name):
        self.value, self.by_name = value, by_name


def main():
    scale = 10
    loader = aioloader.DataLoader(
        Rows(), batch_size=2, num_workers=2, worker_init_fn=guarded_init,
        multiprocessing_context=sys.argv[-1],
        collate_fn=lambda b: Total(
            sum(b) * scale + int(os.environ["INIT"]),
            # by name, the dataset's class is the one the worker's main module has
            type(aioloader.get_worker_info().dataset)
            is getattr(sys.modules["__main__"], "Rows", None),
        ),
    )
    out = list(loader)
    print(json.dumps({
        "values": [t.value for t in out],
        "own_class": all(type(t) is Total for t in out),
        "by_name": [t.by_name for t in out],
        "server": loader.statistics().workers.server,
    }))


if __name__ == "__main__":
    def guarded_init(worker_id):  # under the guard: a worker running the script has no such name
        os.environ["INIT"] = str(1000 * (worker_id + 1))

    main()
"""


@pytest.mark.parametrize(
    ("how", "context"),
    [
        ("file", "forkserver"),
        ("file", "spawn"),
        ("./file", "forkserver"),
        ("-c", "forkserver"),
        ("-c", "spawn"),
    ],
)
def test_the_main_script_s_own_go_by_name_where_the_workers_run_it_again(
    tmp_path: Path, how: str, context: str
) -> None:
    """The main module's own go by name where the workers have them. Spawned, a worker runs
    the script again (none of ``-c``'s): the top-level dataset class goes by name (the
    worker's is its main module's, not a copy), and a function defined under the ``__main__``
    guard by value. A fork server forked from the script has all it had then (``-c``'s too):
    both go by name."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    args = {"file": [str(script)], "./file": ["./script.py"], "-c": ["-c", script.read_text()]}
    # run as ./script.py, a forked server's workers run it again all the same (multiprocessing
    # compares the path as given with its absolute form)
    done = subprocess.run(
        [sys.executable, *args[how], context], capture_output=True, text=True, timeout=120,
        check=False, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["values"] == [10 + 1000, 50 + 2000]
    assert result["own_class"]
    assert result["by_name"] == [how != "-c" or context == "forkserver"] * 2
    assert result["server"] == ("forked" if context == "forkserver" else "")


def test_a_dynamic_batcher_built_as_a_module_is_imported_starts_no_server_then(
    tmp_path: Path,
) -> None:
    """The serving pattern: a batcher built at the top level of an imported module, above a
    class its requests use. Its construction chooses no fork server (one forked then would
    hold the half-imported module, without the class): the workers start as it opens."""
    (tmp_path / "app_mod.py").write_text(
        textwrap.dedent(
            """
            import torch
            import aioloader

            def collate(items):
                return torch.stack([item.value for item in items])

            batcher = aioloader.DynamicBatcher(
                lambda batch: batch * 2, max_batch_size=4, max_delay=0.01, num_workers=1,
                collate_fn=collate,
            )

            class Item:  # below the batcher: a server forked as it was built would lack it
                def __init__(self, value):
                    self.value = torch.tensor([float(value)])
            """
        )
    )
    (tmp_path / "serve.py").write_text(
        textwrap.dedent(
            """
            import asyncio
            import app_mod

            async def main():
                async with app_mod.batcher:
                    out = await app_mod.batcher.submit(app_mod.Item(1))
                print(out.tolist())

            if __name__ == "__main__":
                asyncio.run(main())
            """
        )
    )
    done = subprocess.run(
        [sys.executable, "serve.py"], capture_output=True, text=True, timeout=120,
        check=False, cwd=tmp_path,
    )  # fmt: skip
    assert (done.returncode, done.stdout.strip()) == (0, "[2.0]"), done.stderr


def test_a_closure_s_connection_and_shared_tensor_are_the_worker_s_own() -> None:
    """What a closure holds is pickled for each worker as multiprocessing and torch pickle it:
    a connection is a descriptor of the worker's own (not a number that means another file
    there), and a shared tensor stays shared."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    counter = torch.zeros(1).share_memory_()

    def collate(batch: list[int]) -> list[int]:
        writer.send(len(batch))
        counter.add_(1)
        return batch

    loader = aioloader.DataLoader(Counting(4), batch_size=2, num_workers=1, collate_fn=collate)
    assert list(loader) == [[0, 1], [2, 3]]
    sent = [reader.recv() for _ in range(2) if reader.poll(10)]
    assert sent == [2, 2] and counter.item() == 2.0
    reader.close()
    writer.close()


def test_a_batcher_s_function_defined_after_the_server_forked_goes_by_value(
    tmp_path: Path,
) -> None:
    """A loader forked the fork server from the script; a function defined after that, at the
    top level, is not in it: the batcher's workers, started from that server, are sent it by
    value (decided as they start, not as the batcher was built)."""
    (tmp_path / "script.py").write_text(
        textwrap.dedent(
            """
            import asyncio
            import torch
            import aioloader

            print(aioloader.DataLoader(list(range(4)), batch_size=2, num_workers=1).__len__())
            list(aioloader.DataLoader(list(range(4)), batch_size=2, num_workers=1))

            def collate(items):  # after the server was forked: not in it
                return torch.stack(items) + 1

            batcher = aioloader.DynamicBatcher(
                lambda batch: batch * 2, max_batch_size=4, max_delay=0.01, num_workers=1,
                collate_fn=collate,
            )

            async def main():
                async with batcher:
                    out = await batcher.submit(torch.tensor([1.0]))
                    server = batcher.statistics().workers.server
                print(out.tolist(), server)

            asyncio.run(main())
            """
        )
    )
    done = subprocess.run(
        [sys.executable, "script.py"], capture_output=True, text=True, timeout=120,
        check=False, cwd=tmp_path,
    )  # fmt: skip
    assert (done.returncode, done.stdout.split()) == (0, ["2", "[4.0]", "forked"]), done.stderr


class _RefusesToPickle:
    def __reduce__(self) -> Any:
        raise OSError(24, "Too many open files")  # as torch's reductions fail out of descriptors


async def test_a_job_that_fails_to_pickle_leaves_its_worker_alone() -> None:
    """Pickling a job is not sending it: its error reaches the caller as it is, and the worker
    (alive, idle) is neither stopped nor replaced."""
    stats = WorkerRecorder()
    pool = bare_pool(stats=stats)
    await pool.start()
    try:
        with pytest.raises(OSError, match="Too many open files"):
            await pool.run(len, [_RefusesToPickle()])
        assert await pool.run(len, [1, 2]) == 2
        assert stats.restarts == 0 and stats.crashes == 0
    finally:
        await pool.aclose()


def test_an_open_text_file_is_refused_by_value_as_by_name(tmp_path: Path) -> None:
    handle = (tmp_path / "notes.txt").open("w")
    try:
        with pytest.raises(TypeError, match="TextIOWrapper"):
            portable(lambda: handle, SPAWNED)
    finally:
        handle.close()


class _Table:
    """A dataset-like object with a large table, and a method to pass as ``collate_fn``."""

    def __init__(self, rows: int) -> None:
        self.table = [f"/data/shard-{i:08d}/sample.jpg" for i in range(rows)]

    def collate(self, batch: list[int]) -> list[str]:
        return [self.table[i] for i in batch]


def test_a_bound_method_goes_to_each_worker_once_not_with_every_job() -> None:
    """A bound method (``collate_fn=dataset.collater``) pickles its object: sent by name with
    every job it carried the whole table each time; it goes by value, once per worker."""
    table = _Table(20_000)
    assert isinstance(portable(table.collate, SPAWNED), ByValue)
    assert isinstance(portable(functools.partial(max, 3), SPAWNED), ByValue)
    dl = aioloader.DataLoader(
        Counting(64), batch_size=4, num_workers=2, collate_fn=table.collate,
        persistent_workers=True,
    )  # fmt: skip
    with dl:
        first = list(dl)
        sent_once = dl.statistics().workers.bytes_sent
        second = list(dl)
        sent_again = dl.statistics().workers.bytes_sent - sent_once
    assert [row for batch in first for row in batch] == table.table[:64]
    assert second == first
    table_bytes = len(pickle.dumps(table))
    assert sent_once < 3 * table_bytes  # two workers, once each, and 16 small jobs
    assert sent_again < table_bytes / 10  # 16 jobs that name it by token


DEEP_COPY = """
import copy, functools, json
import aioloader

def add(k, batch):
    return [x + k for x in batch]

if __name__ == "__main__":
    loader = aioloader.DataLoader(
        list(range(4)), batch_size=2, num_workers=1, collate_fn=functools.partial(add, 100)
    )
    print(json.dumps({"batches": [[int(x) for x in b] for b in copy.deepcopy(loader)]}))
"""


def test_a_deep_copy_of_a_loader_keeps_its_functions_found_by_name(tmp_path: Path) -> None:
    """``copy.deepcopy(loader)`` (as some trainers do) copies a function argument sent by value
    in this process, not through pickle: a partial of the script's own function still holds
    that function (a pickled copy would be a function of the same name that pickle refuses to
    send by name, being not the script's)."""
    got = run_json_script(tmp_path, DEEP_COPY, env={})
    assert got == {"batches": [[100, 101], [102, 103]]}


class Configured(torch.utils.data.Dataset[int]):
    """A dataset with a table, configured by ``worker_init_fn``, whose ``collater`` is passed as
    ``collate_fn`` (fairseq's way)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tag = "unset"
        self.table = [f"/data/shard-{i:08d}/sample.jpg" for i in range(20_000)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index

    def configure(self, worker_id: int) -> None:
        self.tag = f"worker {worker_id}"

    def collater(self, batch: list[int]) -> tuple[str, bool, list[int]]:
        info = torch.utils.data.get_worker_info()
        return self.tag, info is not None and info.dataset is self, batch


def test_a_method_of_the_dataset_as_collate_fn_runs_on_the_worker_s_own_dataset() -> None:
    """As in torch, where a worker's dataset and ``collate_fn`` are pickled together:
    ``collate_fn=dataset.collater`` runs on the worker's dataset, which ``worker_init_fn``
    configured, and the dataset is not sent a second time with it."""
    dataset = Configured(16)
    loader = aioloader.DataLoader(
        dataset, batch_size=4, num_workers=2, collate_fn=dataset.collater,
        worker_init_fn=dataset.configure,
    )  # fmt: skip
    got = list(loader)
    assert sorted(i for _, _, batch in got for i in batch) == list(range(16))
    assert {(tag, own) for tag, own, _ in got} == {("worker 0", True), ("worker 1", True)}
    assert loader.statistics().workers.bytes_sent < len(pickle.dumps(dataset.table)) / 10
    assert dataset.tag == "unset"
    # In this process (no workers) it is the dataset's own method, on the dataset itself
    here = aioloader.DataLoader(dataset, batch_size=16, collate_fn=dataset.collater)
    assert [(tag, own) for tag, own, _ in here] == [("unset", False)]
