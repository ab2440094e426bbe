"""A torch user's blocking dataset runs where torch runs it: in the worker processes.

The datasets (``tests/support/worker_datasets.py``) are written as for torch: their work is in
``__getitem__``/``__iter__`` and they ask ``torch.utils.data.get_worker_info()`` who they run in.
Where the expected batches are torch's own, torch's ``DataLoader`` computes them in the test."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch
import torch.utils.data

import aioloader
from tests.conftest import aioloader_threads
from tests.support import worker_datasets as wd


def open_fds() -> dict[int, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the directory's own descriptor, closed by now
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
    return out


def children() -> list[Any]:
    import multiprocessing

    return multiprocessing.active_children()


def rows(batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-sample rows of collated ``WhoReads`` batches."""
    out = []
    for batch in batches:
        for k in range(len(batch["index"])):
            out.append({key: value[k] for key, value in batch.items()})
    return [
        {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in r.items()} for r in out
    ]


def test_getitem_runs_in_the_workers_and_torch_says_which() -> None:
    dl = aioloader.DataLoader(wd.WhoReads(24), batch_size=4, num_workers=2)
    got = rows(list(dl))
    assert [r["index"] for r in got] == list(range(24))  # in order, each once
    assert {r["pid"] for r in got}.isdisjoint({os.getpid()})
    assert len({r["pid"] for r in got}) == 2
    assert all(r["torch_id"] == r["our_id"] in (0, 1) for r in got)
    assert all(r["torch_workers"] == 2 and r["dataset_is_self"] for r in got)
    # A batch is one job: all its samples were read by one worker.
    for start in range(0, 24, 4):
        assert len({r["pid"] for r in got[start : start + 4]}) == 1
    assert children() == []


async def test_async_for_reads_in_the_workers_too() -> None:
    dl = aioloader.DataLoader(wd.WhoReads(12), batch_size=4, num_workers=2)
    async with dl:
        got = rows([b async for b in dl])
    assert [r["index"] for r in got] == list(range(12))
    assert all(r["torch_id"] in (0, 1) for r in got)


def test_without_workers_the_dataset_is_read_in_this_process() -> None:
    for kwargs in ({"num_workers": 0}, {"num_workers": 2, "worker_mode": "thread"}):
        got = rows(list(aioloader.DataLoader(wd.WhoReads(8), batch_size=4, **kwargs)))
        assert {r["pid"] for r in got} == {os.getpid()}
        assert all(r["torch_id"] == -1 for r in got)


def test_worker_init_fn_configures_the_workers_copy() -> None:
    dataset = wd.WhoReads(16)
    dl = aioloader.DataLoader(
        dataset, batch_size=4, num_workers=2, worker_init_fn=wd.offset_by_worker
    )
    got = rows(list(dl))
    assert all(r["value"] == r["index"] + 1000 * (r["torch_id"] + 1) for r in got)
    assert dataset.offset == 0 and dataset.reads == 0  # the main process's copy is untouched


def test_persistent_workers_keep_their_copy_across_plain_for_epochs() -> None:
    dl = aioloader.DataLoader(wd.WhoReads(8), batch_size=4, num_workers=1, persistent_workers=True)
    try:
        first, second = rows(list(dl)), rows(list(dl))
        assert {r["pid"] for r in first} == {r["pid"] for r in second}
        assert [r["reads"] for r in second] == list(range(9, 17))  # the same copy read on
        assert len(children()) == 1  # kept between epochs
    finally:
        dl.close()
    assert children() == [] and aioloader_threads() == []


def test_without_persistent_workers_each_plain_for_epoch_starts_fresh_workers() -> None:
    dl = aioloader.DataLoader(wd.WhoReads(8), batch_size=4, num_workers=1)
    first, second = rows(list(dl)), rows(list(dl))
    assert {r["pid"] for r in first}.isdisjoint({r["pid"] for r in second})
    assert [r["reads"] for r in second] == list(range(1, 9))  # a fresh copy
    assert children() == []
    stats = dl.statistics().workers
    assert stats is not None and stats.processes == 1


# torch's side runs with its default on Linux (and Python before 3.14).
TORCH_CONTEXT = {"multiprocessing_context": "fork"}


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
@pytest.mark.parametrize("split", ["contiguous", "strided", "skewed"])
@pytest.mark.parametrize(
    ("batch_size", "drop_last"), [(None, False), (1, False), (4, False), (4, True)]
)
def test_iterable_dataset_shards_itself_per_worker_like_torch(
    split: str, batch_size: int | None, drop_last: bool
) -> None:
    def make(cls: Any, **kwargs: Any) -> Any:
        return cls(
            wd.Ranges(0, 23, split=split),
            batch_size=batch_size,
            num_workers=3,
            drop_last=drop_last,
            **kwargs,
        )

    want = [torch.as_tensor(b).tolist() for b in make(torch.utils.data.DataLoader, **TORCH_CONTEXT)]
    got = [torch.as_tensor(b).tolist() for b in make(aioloader.DataLoader)]
    assert got == want  # round-robin over the workers still going, a worker's tail included
    assert children() == []


async def test_iterable_dataset_in_workers_with_in_order_false_yields_each_sample_once() -> None:
    dl = aioloader.DataLoader(wd.Ranges(0, 50), batch_size=4, num_workers=2, in_order=False)
    async with dl:
        got = [b.tolist() async for b in dl]
        again = [b.tolist() async for b in dl]  # a new pass per epoch
    assert sorted(x for b in got for x in b) == list(range(50))
    assert sorted(x for b in again for x in b) == list(range(50))
    # Each batch comes from one worker's share: 0..24 or 25..49, never mixed.
    assert all(len({x // 25 for x in b}) == 1 for b in got)


def test_a_failed_batch_raises_and_the_next_call_goes_on() -> None:
    for kwargs in ({"num_workers": 2}, {"num_workers": 0}):
        dl = aioloader.DataLoader(wd.FailsAt(16, {5}), batch_size=4, **kwargs)
        it = iter(dl)
        assert next(it).tolist() == [0, 1, 2, 3]
        with pytest.raises(KeyError, match="bad sample 5") as info:
            next(it)
        # One note, whether the read failed in a worker or here: the sample, its batch, epoch.
        wheres = [n for n in info.value.__notes__ if n.startswith("aioloader: failed in")]
        assert wheres == ["aioloader: failed in stage 'fetch', sample 5, batch 1, epoch 0"]
        if kwargs["num_workers"]:  # the worker's stack, without the error's line said again
            (stack,) = [n for n in info.value.__notes__ if "the worker's traceback" in n]
            assert "in __getitem__" in stack and "KeyError: 'bad sample 5'" not in stack
        assert [next(it).tolist(), next(it).tolist()] == [[8, 9, 10, 11], [12, 13, 14, 15]]
        with pytest.raises(StopIteration):
            next(it)
        del info, it
        gc.collect()
        assert children() == [] and aioloader_threads() == []


def test_torch_counts_the_same_errors() -> None:
    """torch's test_error pattern: every failing batch raises once, the others arrive."""

    def outcomes(cls: Any, **kwargs: Any) -> list[str]:
        it = iter(cls(wd.FailsAt(20, {1, 9, 10, 19}), batch_size=2, num_workers=2, **kwargs))
        seen = []
        for _ in range(len(it)):
            try:
                seen.append(str(next(it).tolist()))
            except KeyError:
                seen.append("error")
        return seen

    want = outcomes(torch.utils.data.DataLoader, **TORCH_CONTEXT)
    assert want.count("error") == 4  # batches [0, 1], [8, 9], [10, 11], [18, 19]
    assert outcomes(aioloader.DataLoader) == want
    # The errors' tracebacks hold the frame that held the iterator, in reference cycles
    # (through anyio's and concurrent.futures' frames); the collector frees them, as for torch.
    gc.collect()
    assert children() == [] and aioloader_threads() == []


async def test_async_for_a_failed_batch_raises_and_anext_goes_on() -> None:
    dl = aioloader.DataLoader(wd.FailsAt(12, {4}), batch_size=4, num_workers=2)
    async with dl:
        it = dl.__aiter__()
        assert (await anext(it)).tolist() == [0, 1, 2, 3]
        with pytest.raises(KeyError):
            await anext(it)
        assert (await anext(it)).tolist() == [8, 9, 10, 11]
        with pytest.raises(StopAsyncIteration):
            await anext(it)


def test_a_failed_batch_of_a_worker_stream_raises_and_the_stream_goes_on() -> None:
    it = iter(aioloader.DataLoader(wd.BadItemStream(12, bad=5), batch_size=4, num_workers=2))
    assert next(it).tolist() == [0, 1, 2, 3]
    with pytest.raises(TypeError) as info:
        next(it)
    assert "worker 0's pass" in "\n".join(info.value.__notes__)
    assert next(it).tolist() == [8, 9, 10, 11]
    with pytest.raises(StopIteration):
        next(it)


def test_transient_reads_are_retried_in_the_worker_and_counted() -> None:
    dl = aioloader.DataLoader(
        wd.FlakyOnce(16, {2, 7, 11}),
        batch_size=4,
        num_workers=2,
        retry=aioloader.RetryPolicy(attempts=2, initial_backoff=0.0),
    )
    assert [x for b in dl for x in b.tolist()] == list(range(16))
    assert dl.statistics().stages[1].retries == 3  # stage 1 is fetch


def test_max_failures_skips_a_bad_read_in_the_worker() -> None:
    dl = aioloader.DataLoader(wd.FailsAt(12, {6}), batch_size=4, num_workers=2, max_failures=1)
    got = [b.tolist() for b in dl]
    assert got == [[0, 1, 2, 3], [4, 5, 7], [8, 9, 10, 11]]
    assert dl.statistics().skipped_samples == (6,)


def test_augmentations_in_getitem_are_the_same_whatever_num_workers() -> None:
    def epoch(workers: int) -> list[list[int]]:
        return [
            b.tolist()
            for b in aioloader.DataLoader(
                wd.Augmenting(), batch_size=4, num_workers=workers, seed=3
            )
        ]

    one, two = epoch(1), epoch(2)
    assert one == two
    assert len({tuple(r[1:]) for b in one for r in b}) == 24  # no two samples drew alike


def test_a_dataset_that_cannot_be_sent_to_the_workers_is_named() -> None:
    dl = aioloader.DataLoader(wd.HoldsALock(), batch_size=2, num_workers=1)
    with pytest.raises(TypeError, match=r"the dataset \(HoldsALock\) cannot be sent.*lock"):
        list(dl)
    assert children() == [] and aioloader_threads() == []


def test_len_follows_a_dataset_whose_length_changes() -> None:
    dataset = wd.WhoReads(10)
    dl = aioloader.DataLoader(dataset, batch_size=4)
    assert len(dl) == 3
    dataset.n = 17
    assert len(dl) == 5
    assert len(list(dl)) == 5


SCRIPT = """
import sys
import torch.utils.data
import aioloader

class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return i * i

if __name__ == "__main__":
    loader = aioloader.DataLoader(Squares(), batch_size=4, num_workers=2, {extra})
    it = iter(loader)
    print(next(it).tolist(), flush=True)
    # ...and the script ends, the iterator open, the workers busy.
"""


@pytest.mark.parametrize("extra", ["", "persistent_workers=True"])
def test_a_script_ending_with_an_open_iterator_exits_cleanly(tmp_path: Path, extra: str) -> None:
    script = tmp_path / "ends_early.py"
    script.write_text(textwrap.dedent(SCRIPT.format(extra=extra)))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=False
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == "[0, 1, 4, 9]\n"


def test_with_takes_over_a_persistent_scope_and_closes_it() -> None:
    dl = aioloader.DataLoader(wd.WhoReads(8), batch_size=4, num_workers=1, persistent_workers=True)
    first = rows(list(dl))
    with dl:
        second = rows(list(dl))
    assert {r["pid"] for r in first} == {r["pid"] for r in second}
    assert children() == [] and aioloader_threads() == []
    dl.close()  # nothing open: no-op


@pytest.mark.parametrize("dataset", ["map", "iterable"])
@pytest.mark.parametrize("how", ["break", "cancel"])
async def test_leaving_early_leaves_nothing_behind(dataset: str, how: str) -> None:
    data: Any = wd.WhoReads(400) if dataset == "map" else wd.Ranges(0, 400)
    dl = aioloader.DataLoader(data, batch_size=4, num_workers=2)
    async with dl:  # once: the fork server (process-wide, it stays) is up after it
        pass
    gc.collect()
    fds = open_fds()
    async with dl:
        with anyio.CancelScope() as scope:
            async for batch in dl:
                del batch
                if how == "break":
                    break
                scope.cancel()
                await anyio.lowlevel.checkpoint()
        async for batch in dl:  # the next epoch still works, from its start
            first = batch["index"][0] if dataset == "map" else batch[0]
            assert first.item() == 0
            del batch, first
            break
    gc.collect()
    assert children() == [] and aioloader_threads() == []
    assert open_fds() == fds


def test_plain_for_break_leaves_nothing_behind() -> None:
    for data in (wd.WhoReads(400), wd.Ranges(0, 400)):
        for _ in aioloader.DataLoader(data, batch_size=4, num_workers=2):
            break
        assert children() == [] and aioloader_threads() == []


def test_persistent_workers_go_with_their_loader() -> None:
    dl = aioloader.DataLoader(wd.WhoReads(8), batch_size=4, num_workers=2, persistent_workers=True)
    it = iter(dl)
    next(it)
    assert len(children()) == 2
    del it, dl  # torch's persistent workers end with their loader; so do ours
    gc.collect()
    assert children() == [] and aioloader_threads() == []


def test_a_worker_killed_while_idle_is_replaced_for_the_next_batch() -> None:
    dl = aioloader.DataLoader(wd.WhoReads(16), batch_size=4, num_workers=2, persistent_workers=True)
    try:
        first = rows(list(dl))
        os.kill(first[-1]["pid"], signal.SIGKILL)  # between epochs, as an OOM kill would
        time.sleep(0.2)
        second = rows(list(dl))
        assert [r["index"] for r in second] == list(range(16))
        assert dl.statistics().workers.restarts == 1  # type: ignore[union-attr]
    finally:
        dl.close()


def test_an_iterable_worker_killed_while_idle_ends_the_epoch_with_its_crash() -> None:
    dl = aioloader.DataLoader(wd.Ranges(0, 400), batch_size=4, num_workers=2)
    it = iter(dl)
    next(it)
    for pid in {p.pid for p in children()}:
        os.kill(pid, signal.SIGKILL)
    errors: list[str] = []
    for _ in range(200):  # bounded: it must end, not raise for ever
        try:
            next(it)
        except StopIteration:
            break
        except Exception as exc:  # a reply cut short by the kill is a crash too
            errors.append(type(exc).__name__)
    else:
        pytest.fail(f"the epoch did not end after its workers died: {errors[:5]}")
    assert set(errors) == {"WorkerCrashed"} and len(errors) <= 3, errors
    del it
    gc.collect()


def test_a_non_thread_safe_dataset_reads_right_without_workers(tmp_path: Path) -> None:
    path = tmp_path / "records.bin"
    path.write_bytes(b"".join(i.to_bytes(4, "little") for i in range(64)))
    dataset = wd.SharedHandle(str(path), 64)
    dl = aioloader.DataLoader(dataset, batch_size=8)
    assert [x for b in dl for x in b.tolist()] == list(range(64))  # one thread, as in torch
    dataset.handle.close()


def test_system_exit_in_getitem_fails_its_batch_only() -> None:
    it = iter(aioloader.DataLoader(wd.ExitsAt(), batch_size=4, num_workers=2))
    assert next(it).tolist() == [0, 1, 2, 3]
    with pytest.raises(aioloader.RemoteError, match="SystemExit raised in a worker"):
        next(it)
    assert next(it).tolist() == [8, 9, 10, 11]
    del it
    gc.collect()  # the error's traceback cycles held the iterator's frame


def test_retry_applies_to_getitems_too() -> None:
    subset = torch.utils.data.Subset(wd.FlakyOnce(8, {1, 6}), range(8))  # has __getitems__
    dl = aioloader.DataLoader(
        subset,
        batch_size=4,
        num_workers=2,
        retry=aioloader.RetryPolicy(attempts=2, initial_backoff=0.0),
    )
    assert [x for b in dl for x in b.tolist()] == list(range(8))
    assert dl.statistics().stages[1].retries == 2


def test_a_workers_generator_finally_runs_after_break(tmp_path: Path) -> None:
    for _ in aioloader.DataLoader(wd.MarksFinally(str(tmp_path)), batch_size=4, num_workers=2):
        break
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done-0", "done-1"]


def test_an_iterator_collected_on_the_loop_thread_still_closes_its_epoch() -> None:
    dropped = threading.Event()
    collected_on: list[str] = []

    class CollectingSampler:  # iterated on the loader's loop thread
        def __len__(self) -> int:
            return 40

        def __iter__(self) -> Any:
            for i in range(40):
                if i == 12:
                    dropped.wait(10)
                    collected_on.append(threading.current_thread().name)
                    gc.collect()  # the dropped iterator's __del__ runs here, on the loop
                yield i

    gc.disable()  # the cycle below is collected where the sampler says, not before
    try:
        dl = aioloader.DataLoader(
            wd.WhoReads(40), batch_size=2, sampler=CollectingSampler(), num_workers=2, prefetch=8
        )
        it = iter(dl)
        next(it)
        cycle: list[Any] = [it]
        cycle.append(cycle)
        del it, cycle
        dropped.set()
        deadline = time.monotonic() + 20
        while aioloader_threads() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        gc.enable()
    assert collected_on == ["aioloader-loop"]
    assert aioloader_threads() == [] and children() == []
    assert len(list(dl)) == 20  # the loader is usable again


def test_max_failures_skips_a_failed_transform_in_a_worker_stream() -> None:
    from tests.support import worker_fns

    dl = aioloader.DataLoader(
        wd.Ranges(0, 12),
        batch_size=4,
        num_workers=2,
        transform=worker_fns.bad_value,  # raises for sample 5
        max_failures=1,
    )
    assert [b.tolist() for b in dl] == [[0, 1, 2, 3], [6, 7, 8, 9], [4], [10, 11]]
    assert dl.statistics().skipped_samples == ("worker 0, its batch 1, position 1",)
    strict = aioloader.DataLoader(
        wd.Ranges(0, 12), batch_size=4, num_workers=2, transform=worker_fns.bad_value
    )
    it = iter(strict)
    assert [next(it).tolist(), next(it).tolist()] == [[0, 1, 2, 3], [6, 7, 8, 9]]
    with pytest.raises(ValueError, match="cannot decode sample 5"):
        next(it)
    assert [b.tolist() for b in it] == [[10, 11]]
