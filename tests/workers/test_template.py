"""The workers that start together are forked from one template that unpickled their start
arguments once (``_workers/template.py``): a dataset of Python objects (``ImageFolder``'s list
of paths) is one copy, shared copy-on-write, not a copy in each worker; where unpickling it
opened a file or started a thread, each worker unpickles its own, as before."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

import aioloader
from tests.support import worker_datasets as wd
from tests.support.worker_datasets import unpicklers

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create . worker processes")


@pytest.fixture(autouse=True)
def _unpickled_s_setstate_may_run_in_a_template(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Unpickled`` notes who unpickles it in a ``__setstate__`` of its own, which makes
    nothing a worker must have its own of: let it (the default declines a class's own)."""
    monkeypatch.setenv("AIOLOADER_TEMPLATE", "always")


# ~26 MiB of str objects, 2 MiB pickled: over startonce.IN_FILE_FROM
NAMES = [f"/data/train/n{k % 1000:08d}/n{k % 1000:08d}_{k}.JPEG" for k in range(60_000)]
BIG = [f"{k:08d}" * 12 for k in range(400_000)]  # ~60 MiB of str objects


def rows(batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for batch in batches:
        for k in range(len(batch["index"])):
            out.append({key: _plain(value[k]) for key, value in batch.items()})
    return out


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def workers_of(dl: aioloader.DataLoader[Any]) -> aioloader.WorkerStatistics:
    stats = dl.statistics().workers
    assert stats is not None
    return stats


def test_a_start_s_workers_are_forked_from_one_template_that_unpickled_the_dataset_once(
    tmp_path: Path,
) -> None:
    log = str(tmp_path / "unpickled")
    dataset = wd.Unpickled(40, NAMES, log)
    dl = aioloader.DataLoader(dataset, batch_size=4, num_workers=3, worker_init_fn=wd.tag_by_worker)
    got = rows(list(dl))
    stats = workers_of(dl)
    assert [r["index"] for r in got] == list(range(40))
    assert [r["name"] for r in got] == [NAMES[i * 7] for i in range(40)]
    assert stats.template_pid and stats.template_why == ""
    assert unpicklers(log) == [stats.template_pid]  # once, in the template
    assert {r["ppid"] for r in got} == {stats.template_pid}
    pids = {r["pid"] for r in got}
    assert len(pids) == 3
    # Each worker's copy is its own: worker_init_fn's tag differs from worker to worker
    assert {r["tag"] for r in got} <= {100, 101, 102} and len({r["tag"] for r in got}) == 3
    assert len({(r["pid"], r["tag"]) for r in got}) == 3
    assert not psutil.pid_exists(stats.template_pid)  # gone with its workers
    assert "unpickled once, by a template" in str(dl.statistics())


@pytest.mark.parametrize("template", ["always", "0"])
def test_the_workers_share_the_template_s_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, template: str
) -> None:
    """Each worker's own memory (USS) holds a few MiB of its own with a template, the whole
    60 MiB list without one (``AIOLOADER_TEMPLATE=0``)."""
    monkeypatch.setenv("AIOLOADER_TEMPLATE", template)
    dataset = wd.Unpickled(16, BIG, str(tmp_path / "unpickled"))
    dl = aioloader.DataLoader(dataset, batch_size=4, num_workers=2, persistent_workers=True)
    try:
        got = rows(list(dl))
        own = [psutil.Process(pid).memory_full_info().uss for pid in {r["pid"] for r in got}]
    finally:
        dl.close()
    assert len(own) == 2
    if template == "always":
        assert workers_of(dl).template_pid
        assert max(own) < 25 * 2**20, own
    else:
        assert workers_of(dl).template_why == "AIOLOADER_TEMPLATE=0"
        assert min(own) > 50 * 2**20, own
        assert len(unpicklers(str(tmp_path / "unpickled"))) == 2


@pytest.mark.parametrize("does", ["opens a file", "starts a thread", "starts a raw thread"])
def test_a_dataset_that_opens_a_file_or_starts_a_thread_as_it_unpickles_is_each_worker_s_own(
    tmp_path: Path, does: str
) -> None:
    """Forked workers would share the file's offset (an HDF5 or LMDB handle must not be shared)
    or lose the thread: each worker unpickles its own copy, and the statistics say why."""
    data = tmp_path / "train.h5"
    data.write_bytes(b"x" * 100)
    log = str(tmp_path / "unpickled")
    opens = str(data) if does == "opens a file" else None
    thread = {"starts a thread": True, "starts a raw thread": "raw"}.get(does, False)
    dataset = wd.Unpickled(16, NAMES, log, opens=opens, thread=thread)
    dl = aioloader.DataLoader(dataset, batch_size=4, num_workers=2)
    got = rows(list(dl))
    stats = workers_of(dl)
    assert [r["index"] for r in got] == list(range(16))
    assert stats.template_pid == 0
    if opens:
        assert stats.template_why == f"unpickling them opened {data}"
    elif thread == "raw":
        assert stats.template_why == "unpickling them started 1 native thread(s)"
    else:
        assert stats.template_why == "after unpickling them, this process had 2 Python threads"
    workers = {r["pid"] for r in got}
    # the template tried, then each worker unpickled its own
    assert len(unpicklers(log)) == 3 and set(unpicklers(log)[1:]) == workers
    assert f"unpickled by each worker ({stats.template_why})" in str(dl.statistics())
    # The next epoch's start does without one: the dataset is not unpickled twice in turn
    again = rows(list(dl))
    assert {r["pid"] for r in again}.isdisjoint(workers)
    assert len(unpicklers(log)) == 5 and workers_of(dl).template_why == stats.template_why


def test_a_process_the_application_forks_does_not_keep_a_template_alive(tmp_path: Path) -> None:
    """A fork-context process of the application's (a checkpoint writer, torch's fork workers)
    started while a template serves: it lets go of the template's alive pipe, so the template
    stops with its workers (it held the epoch's end 5 s, then was killed; found by review)."""
    dl = aioloader.DataLoader(
        wd.Unpickled(16, NAMES, str(tmp_path / "log")), batch_size=2, num_workers=2
    )
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)
    try:
        for i, _ in enumerate(dl):
            if i == 1:
                child.start()
            last = time.monotonic()
        # The epoch's end: its workers stopped, then the template (the pool waits 5 s for a
        # template to exit before it kills it; without its workers and this process, it
        # exits at once)
        ending = time.monotonic() - last
        template = workers_of(dl).template_pid
        assert template and not psutil.pid_exists(template)
        assert ending < 4.0
        assert child.is_alive()
    finally:
        child.terminate()
        child.join()


@pytest.mark.parametrize("names", [NAMES, NAMES[:10]], ids=["template", "small"])
def test_a_dataset_that_fails_to_unpickle_raises_its_error_named(
    tmp_path: Path, names: list[str]
) -> None:
    """Its own error, from a worker's start, with a note naming the worker (it read as a
    worker that died starting, with a note about ``__main__``)."""
    log = str(tmp_path / "unpickled")
    dl = aioloader.DataLoader(
        wd.Unpickled(16, names, log, raises=True), batch_size=4, num_workers=2
    )
    with pytest.raises(ValueError, match="Unpickled refuses to be unpickled") as raised:
        list(dl)
    notes = "\n".join(raised.value.__notes__)
    assert "as it unpickled the dataset and worker_init_fn it was sent" in notes
    assert "__setstate__" in notes  # the worker's traceback
    # With a template: it tried first, then the workers' own starts raised it
    assert len(unpicklers(log)) >= (2 if names is NAMES else 1)


def test_each_epoch_s_template_holds_the_dataset_as_it_is_then(tmp_path: Path) -> None:
    log = str(tmp_path / "unpickled")
    dataset = wd.Unpickled(8, NAMES, log)
    dl = aioloader.DataLoader(dataset, batch_size=4, num_workers=2)
    first = rows(list(dl))
    template = workers_of(dl).template_pid
    dataset.names = [name.upper() for name in NAMES]  # as a script changes it between epochs
    second = rows(list(dl))
    assert [r["name"] for r in first] == [NAMES[i * 7] for i in range(8)]
    assert [r["name"] for r in second] == [NAMES[i * 7].upper() for i in range(8)]
    assert workers_of(dl).template_pid not in (0, template)
    assert unpicklers(log) == [template, workers_of(dl).template_pid]
    assert not psutil.pid_exists(template)


def test_a_worker_killed_is_replaced_and_the_template_outlives_it_until_the_last(
    tmp_path: Path,
) -> None:
    log = str(tmp_path / "unpickled")
    dl = aioloader.DataLoader(
        wd.Unpickled(24, NAMES, log), batch_size=4, num_workers=2, persistent_workers=True
    )
    try:
        first = rows(list(dl))
        template = workers_of(dl).template_pid
        os.kill(first[0]["pid"], signal.SIGKILL)
        psutil.Process(first[0]["pid"]).wait(timeout=30)  # gone, reaped by its template
        second = rows(list(dl))
        # The survivor still reports through its template; the replacement started alone
        assert psutil.pid_exists(template)
        assert workers_of(dl).restarts == 1
    finally:
        dl.close()
    assert [r["index"] for r in second] == list(range(24))
    fresh = {r["pid"] for r in second} - {r["pid"] for r in first}
    assert len(fresh) == 1
    assert {r["ppid"] for r in second if r["pid"] in fresh} != {template}
    assert len(unpicklers(log)) == 2  # the template's, and the replacement's own
    assert not psutil.pid_exists(template)


async def test_cancelled_while_the_template_unpickles_leaves_no_process(tmp_path: Path) -> None:
    log = str(tmp_path / "unpickled")
    dataset = wd.Unpickled(8, NAMES, log, sleep=30.0)  # a slow __setstate__
    dl = aioloader.DataLoader(dataset, batch_size=4, num_workers=2)
    before = set(psutil.Process().children(recursive=True))
    with anyio.move_on_after(3.0) as scope:
        async with dl:
            async for _ in dl:
                pass
    assert scope.cancelled_caught
    [template] = unpicklers(log)
    assert not psutil.pid_exists(template)
    after = {p for p in psutil.Process().children(recursive=True) if p.status() != "zombie"}
    assert after <= before


def test_a_class_that_runs_its_own_setstate_is_unpickled_by_each_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``__setstate__`` that draws a random generator gives each of torch's spawn workers its
    own stream; run once, in a template, it would give every worker the same one (found by
    review). By default such a class is unpickled by each worker, and the statistics name it;
    a class of the standard library's or NumPy's (a generator pickled whole) goes in a
    template, its state restored as it was pickled, as torch's spawn restores it."""
    monkeypatch.delenv("AIOLOADER_TEMPLATE")
    dl = aioloader.DataLoader(wd.DrawsOnUnpickling(NAMES), batch_size=4, num_workers=2)
    got = rows(list(dl))
    stats = workers_of(dl)
    assert stats.template_pid == 0
    assert stats.template_why == "DrawsOnUnpickling runs its own __setstate__ as it is unpickled"
    streams: dict[int, set[int]] = {r["pid"]: set() for r in got}
    for r in got:
        streams[r["pid"]].add(r["drawn"])
    first, second = streams.values()
    assert not first & second  # each worker its own generator
    # Restored whole: numpy's generator and the stdlib's Random, pickled with their state
    kept = aioloader.DataLoader(wd.HoldsGenerators(NAMES), batch_size=4, num_workers=2)
    rows(list(kept))
    assert workers_of(kept).template_pid and workers_of(kept).template_why == ""


def test_what_unpickling_prints_is_printed_once_not_again_by_each_fork(tmp_path: Path) -> None:
    """Printed in the template to a pipe (block-buffered), it was still in the buffer as the
    workers were forked, and each wrote it again (found by review)."""
    script = tmp_path / "prints.py"
    script.write_text(
        "import aioloader\n"
        "from tests.support import worker_datasets as wd\n"
        "from tests.workers.test_template import NAMES\n"
        "if __name__ == '__main__':\n"
        f"    dataset = wd.Unpickled(8, NAMES, {str(tmp_path / 'log')!r}, says='unpickled!')\n"
        "    loader = aioloader.DataLoader(dataset, batch_size=4, num_workers=3)\n"
        "    assert len(list(loader)) == 2\n"
        "    assert loader.statistics().workers.template_pid\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).parents[2]),
        "AIOLOADER_TEMPLATE": "always",
    }
    env.pop("PYTHONUNBUFFERED", None)
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["unpickled!"]
