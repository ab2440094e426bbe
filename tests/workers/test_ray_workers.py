"""Ray workers: the process workers' semantics, each on a real Ray cluster of two nodes on this
machine (``tests/support/ray_cluster.py``): who the workers are, seeding, order, failures and
retries, streams, persistence, resuming, bounds, crashes, and no actor left behind."""

from __future__ import annotations

import contextlib
import json
import os
import select
from collections.abc import Callable
from typing import Any

import anyio
import pytest
import torch

import aioloader
from aioloader import default_collate
from tests.support import worker_datasets as wd
from tests.support import worker_fns
from tests.support.helpers import Counting, flat
from tests.support.ray_cluster import SECOND, RayCluster

# One cluster for the module in each process that runs its tests: under pytest-xdist, `--dist
# loadgroup` is meant to run them all in one process, in file order, but with pytest 9.2 the
# group is lost (pytest-xdist#1386) and both processes start a cluster (the node-loss tests
# bring their node back: `ensure_second`).
pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.xdist_group("ray")]


def rows(batches: list[Any]) -> list[dict[str, Any]]:
    return [
        {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in zip(b, values, strict=True)}
        for b in batches
        for values in zip(*b.values(), strict=True)
    ]


def notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


def gone(pids: set[int], timeout: float = 20.0) -> bool:
    """Whether every process in ``pids`` has exited within ``timeout`` (waited on pidfds: they
    are Ray's processes, not our children)."""
    fds = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            fds.append(os.pidfd_open(pid))
    try:
        waiting = set(fds)
        while waiting:
            ready, _, _ = select.select(list(waiting), [], [], timeout)
            if not ready:
                return False
            waiting -= set(ready)
        return True
    finally:
        for fd in fds:
            os.close(fd)


def indices_only(batch: list[tuple[int, int, str]]) -> list[int]:
    return [i for i, _, _ in batch]


def ray_loader(dataset: Any, **kw: Any) -> aioloader.DataLoader[Any]:
    kw.setdefault("num_workers", 2)
    kw.setdefault("worker_mode", "ray")
    return aioloader.DataLoader(dataset, **kw)


def through_failures(
    dl: aioloader.DataLoader[Any],
    *,
    after: Callable[[int, list[Any]], object] = lambda step, got: None,
    ends: tuple[type[BaseException], ...] = (),
) -> tuple[list[Any], list[BaseException]]:
    """One epoch of a plain ``for``, going on past the failures raised in their batches' turn:
    every sample of the batches it gave, and the failures (``WorkerCrashed``, and ``ends``, the
    first of which ends it). ``after(step, got)`` runs after each step. Bounded: the epoch must
    end within 40 steps. The loader is closed after."""
    got: list[Any] = []
    errors: list[BaseException] = []
    it = iter(dl)
    try:
        for step in range(40):
            try:
                got.extend(next(it))
            except StopIteration:
                return got, errors
            except (aioloader.WorkerCrashed, *ends) as exc:
                errors.append(exc)
                if isinstance(exc, ends):
                    return got, errors
            after(step, got)
        pytest.fail("the epoch did not end")
    finally:
        it.close()
        dl.close()


# -- who the workers are, and what they give -----------------------------------------------------


def test_each_actor_keeps_its_own_dataset_copy_and_knows_who_it_is() -> None:
    dl = ray_loader(wd.WhoReads(16), batch_size=4, worker_init_fn=wd.offset_by_worker)
    got = rows(list(dl))
    assert [r["index"] for r in got] == list(range(16))
    assert {r["torch_id"] for r in got} == {0, 1} and {r["torch_workers"] for r in got} == {2}
    assert all(r["our_id"] == r["torch_id"] for r in got)
    assert all(r["dataset_is_self"] for r in got)  # torch's WorkerInfo.dataset is the copy
    for r in got:  # worker_init_fn configured each actor's own copy
        assert r["value"] == r["index"] + 1000 * (r["torch_id"] + 1)
    pids = {r["pid"] for r in got}
    assert len(pids) == 2 and os.getpid() not in pids
    stats = dl.statistics().workers
    assert stats is not None and stats.server == "ray" and stats.processes == 2
    # Results in shared memory (the actors are on this machine): none through the object store.
    assert stats.jobs == 4 and stats.bytes_sent > 0 and stats.bytes_received == 0
    assert gone(pids)  # the epoch's scope ended: its actors are killed


def test_a_seed_gives_the_same_batches_as_process_workers() -> None:
    on_ray = list(ray_loader(wd.Augmenting(), batch_size=4, seed=7, shuffle=True))
    in_processes = list(
        aioloader.DataLoader(wd.Augmenting(), batch_size=4, num_workers=2, seed=7, shuffle=True)
    )
    assert len(on_ray) == 6
    for a, b in zip(on_ray, in_processes, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("in_order", [True, False])
def test_every_sample_comes_once_in_order_or_not(in_order: bool) -> None:
    got = flat(
        list(
            ray_loader(
                wd.WhereRead(40),
                batch_size=4,
                in_order=in_order,
                collate_fn=indices_only,
            )
        )
    )
    if in_order:
        assert got == list(range(40))
    else:
        assert sorted(got) == list(range(40))


async def test_an_async_sources_transform_and_collation_run_in_the_actors() -> None:
    dl = ray_loader(Counting(12), batch_size=4, transform=worker_fns.whoami, collate_fn=list)
    async with dl:
        got = [r for b in [b async for b in dl] for r in b]
    assert sorted(r["x"] for r in got) == list(range(12))
    assert {r["id"] for r in got} <= {0, 1} and {r["num_workers"] for r in got} == {2}
    assert os.getpid() not in {r["pid"] for r in got}


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "object-store"])
def test_tensors_come_back_whole_writable_and_of_every_dtype(shared_memory: bool) -> None:
    spec = aioloader.RayWorkers(shared_memory=shared_memory)
    dl = ray_loader(
        Counting(8), batch_size=4, transform=every_dtype, collate_fn=channels_last, worker_mode=spec
    )
    batches = list(dl)
    through_the_store = dl.statistics().workers.bytes_received  # type: ignore[union-attr]
    assert (through_the_store == 0) is shared_memory
    assert len(batches) == 2
    for first, batch in zip((0, 4), batches, strict=True):
        expected = channels_last([every_dtype(x) for x in range(first, first + 4)])
        assert batch.keys() == expected.keys()
        for key, tensor in batch.items():
            assert tensor.dtype == expected[key].dtype and torch.equal(tensor, expected[key])
            if key == "image_t":  # a view with gaps: it arrives as a contiguous tensor
                assert tensor.is_contiguous()
            else:  # dense: its layout kept (the images channels-last)
                assert tensor.stride() == expected[key].stride(), key
    image = batches[1]["image"]
    image.add_(1)  # an ordinary tensor of its own, not a read-only view of the object store
    assert image[0, 0, 0, 0].item() == 5


DTYPES = (torch.uint8, torch.bfloat16, torch.bool, torch.complex64, torch.int64, torch.float16)


def every_dtype(x: int) -> dict[str, torch.Tensor]:
    """A sample with a tensor of each dtype, transposed ones, one 0-d."""
    grid = torch.arange(6).reshape(2, 3) + x
    sample = {str(dtype): grid.to(dtype).t() for dtype in DTYPES}
    sample["image"] = worker_fns.image(x)
    sample["scalar"] = torch.tensor(float(x))
    return sample


def channels_last(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Collation whose batch keeps a layout of its own: the images channels-last."""
    batch: dict[str, torch.Tensor] = default_collate(samples)
    batch["image"] = batch["image"].contiguous(memory_format=torch.channels_last)
    batch["image_t"] = batch["image"][:, 0].transpose(1, 2)  # a view with gaps, not dense
    return batch


# -- failures ------------------------------------------------------------------------------------


def test_a_failed_sample_names_itself_its_batch_and_its_ray_worker() -> None:
    with pytest.raises(KeyError, match="bad sample 5") as info:
        list(ray_loader(wd.FailsAt(16, {5}), batch_size=4))
    said = notes(info.value)
    assert "Ray worker" in said and "node" in said and "batch 1" in said
    skipped = flat(list(ray_loader(wd.FailsAt(16, {5}), batch_size=4, max_failures=1)))
    assert skipped == [i for i in range(16) if i != 5]


def test_transient_failures_are_retried_in_the_actor() -> None:
    dl = ray_loader(
        wd.FlakyOnce(12, {2, 9}),
        batch_size=4,
        retry=aioloader.RetryPolicy(attempts=2, initial_backoff=0.0),
    )
    assert flat(list(dl)) == list(range(12))
    assert dl.statistics().stage("fetch").retries == 2


def test_a_failing_worker_init_fn_fails_the_start_with_its_own_error() -> None:
    with pytest.raises(LookupError, match="no config for worker") as info:
        list(ray_loader(wd.WhoReads(4), batch_size=2, worker_init_fn=worker_fns.failing_init))
    assert "Ray worker" in notes(info.value)


# -- streams, persistence, resuming, bounds --------------------------------------------------


def test_each_actor_iterates_its_own_copy_of_an_iterable_dataset() -> None:
    got = flat(list(ray_loader(wd.Ranges(0, 40), batch_size=4)))
    assert sorted(got) == list(range(40))


def test_persistent_workers_keep_their_actors_and_others_start_anew() -> None:
    kept = ray_loader(wd.WhereRead(8), batch_size=4, persistent_workers=True)
    try:
        first = {pid for b in kept for pid in b[1].tolist()}
        second = {pid for b in kept for pid in b[1].tolist()}
        assert first == second
    finally:
        kept.close()
    assert gone(first)
    fresh = ray_loader(wd.WhereRead(8), batch_size=4)
    first = {pid for b in fresh for pid in b[1].tolist()}
    second = {pid for b in fresh for pid in b[1].tolist()}
    assert not first & second and gone(first | second)


def test_a_stream_in_actors_resumes_from_its_state_dict() -> None:
    def make() -> aioloader.DataLoader[Any]:
        return ray_loader(wd.ResumableShards(40), batch_size=4, collate_fn=list)

    full = list(make())
    loader = make()
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    state = json.loads(json.dumps(loader.state_dict()))
    it.close()
    resumed = make()
    resumed.load_state_dict(state)
    assert first + list(resumed) == full


async def _jobs_while_the_consumer_waits(worker_mode: str) -> tuple[int, int]:
    dl = ray_loader(Counting(400), batch_size=2, prefetch=2, worker_mode=worker_mode)
    async with dl:
        it = aiter(dl)
        await anext(it)
        with anyio.move_on_after(1.0):  # give the workers every chance to run ahead
            await anyio.sleep_forever()
        stats = dl.statistics()
        await it.aclose()
    assert stats.workers is not None
    return stats.workers.jobs, stats.stage("transform").max_in_flight


async def test_batches_in_flight_are_bounded_as_with_process_workers() -> None:
    on_ray, at_once = await _jobs_while_the_consumer_waits("ray")
    in_processes, _ = await _jobs_while_the_consumer_waits("process")
    # The window's bound (max_inflight), not the epoch's 200 batches; a Ray actor takes a
    # second call behind its running one (RayPool.depth): one more batch per actor.
    assert on_ray <= in_processes + 2 < 200
    assert at_once <= 2 * 2  # two calls per actor at once, no more


# -- crashes, and nothing left behind ----------------------------------------------------------


def test_a_killed_actor_is_named_with_its_node_and_replaced() -> None:
    dl = ray_loader(Counting(16), batch_size=4, transform=worker_fns.kill_on_7, max_failures=0)
    with dl:
        with pytest.raises(aioloader.WorkerCrashed) as info:
            list(dl)
        crash = info.value
        assert crash.actor and crash.node and crash.pid and crash.worker_id in (0, 1)
        assert f"DataLoader worker (pid {crash.pid}) is gone: Ray actor {crash.actor}" in str(crash)
        assert "stage 'transform'" in notes(crash) and "batch 1" in notes(crash)
        assert gone({crash.pid})
    stats = dl.statistics().workers
    # One batch failed: the one queued behind it in the actor (a second call, RayPool.depth)
    # had not started, and went to the replacement.
    assert stats is not None and stats.crashes == 1
    batches = [[0, 1], [7], [2, 3]]
    again = ray_loader(
        Counting(16), batch_sampler=batches, num_workers=1, transform=worker_fns.kill_on_7
    )
    with again:
        with pytest.raises(aioloader.WorkerCrashed):
            list(again)
        batches.remove([7])
        assert flat(list(again)) == [0, 1, 2, 3]
        stats = again.statistics().workers
        assert stats is not None and stats.restarts == 1


def test_a_dead_actor_fails_only_the_batch_it_ran_and_the_epoch_goes_on_in_order() -> None:
    """A dataset in the workers, in order: each actor has a second call waiting behind the one
    it runs (RayPool.depth). Killed mid-batch, it fails that batch only; the one waiting behind
    it goes to its replacement, in the epoch's order."""
    dl = ray_loader(list(range(32)), batch_size=4, transform=worker_fns.kill_on_7)
    got, crashes = through_failures(dl)
    assert len(crashes) == 1 and "batch 1" in notes(crashes[0])
    assert [int(i) for i in got] == [i for i in range(32) if i // 4 != 1]  # the others, in order
    stats = dl.statistics().workers
    assert stats is not None and stats.crashes == 1 and stats.restarts == 1


def _actors(dl: aioloader.DataLoader[Any]) -> list[Any]:
    pool = dl._state.scope.work  # type: ignore[union-attr]
    return list(pool._slots.now)


def dead_now(actors: list[Any]) -> bool:
    """Whether Ray says each actor is dead, asked right away: the handles are held here, so
    only the loader's kill (not Ray's collection of an actor whose handles are gone) explains
    it; and their processes are gone within a second."""
    import ray

    for actor in actors:
        try:
            ray.get(actor.handle.ready.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            continue
        return False
    return gone({a.pid for a in actors}, timeout=1.0)


def test_break_an_exception_and_close_leave_no_actor() -> None:
    dl = ray_loader(wd.WhereRead(64), batch_size=2)
    for batch in dl:
        actors = _actors(dl)
        assert set(batch[1].tolist()) <= {a.pid for a in actors}
        break
    del batch
    dl.close()
    assert len(actors) == 2 and dead_now(actors)
    dl = ray_loader(wd.WhereRead(64), batch_size=2, persistent_workers=True)
    with pytest.raises(ZeroDivisionError):
        for _ in dl:
            actors = _actors(dl)
            1 / 0  # noqa: B018
    dl.close()
    assert dead_now(actors)


async def test_cancelling_an_epoch_leaves_no_actor() -> None:
    dl = ray_loader(wd.WhereRead(64, delay=0.05), batch_size=2)
    async with dl:
        with anyio.move_on_after(1.0):
            async for _ in dl:
                actors = _actors(dl)
    assert dead_now(actors)


def test_an_actor_no_node_can_place_times_out_naming_what_it_asked_for() -> None:
    spec = aioloader.RayWorkers(resources={"nowhere": 1}, start_timeout=2.0)
    with pytest.raises(aioloader.LoaderTimeout, match=r"resources=\{'nowhere': 1\}"):
        list(ray_loader(wd.WhoReads(4), batch_size=2, worker_mode=spec))


# -- two nodes -------------------------------------------------------------------------------


def test_actors_are_placed_on_the_node_with_their_resource(ray_cluster: RayCluster) -> None:
    ray_cluster.ensure_second()
    spec = aioloader.RayWorkers(resources={SECOND: 1})
    nodes = {n for b in ray_loader(wd.WhereRead(8), batch_size=4, worker_mode=spec) for n in b[2]}
    assert nodes == {ray_cluster.second_node}


def test_losing_a_node_mid_epoch_fails_its_batches_and_the_epoch_goes_on(
    ray_cluster: RayCluster,
) -> None:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray_cluster.ensure_second()
    lost = ray_cluster.second_node
    second = NodeAffinitySchedulingStrategy(lost, soft=True)
    # Half a CPU each: the second node has room for both actors even while an earlier test's
    # last actors release theirs, and so does the head for their replacements.
    spec = aioloader.RayWorkers(num_cpus=0.5, options={"scheduling_strategy": second})
    dl = ray_loader(wd.WhereRead(48, delay=0.02), batch_size=4, worker_mode=spec, collate_fn=list)
    before: list[int] = []

    def lose_it(step: int, got: list[Any]) -> None:
        if len(got) == 8 and not before:  # two batches from it: the node goes
            before.append(len(got))
            ray_cluster.stop_second()

    got, crashes = through_failures(dl, after=lose_it)
    nodes = [node for _, _, node in got]
    assert set(nodes[: before[0]]) == {lost}  # placed there first
    assert nodes[-4:] == [ray_cluster.head_node()] * 4  # replaced on the head when it went
    assert crashes
    assert all(isinstance(c, aioloader.WorkerCrashed) and c.node and c.actor for c in crashes)
    stats = dl.statistics().workers
    assert stats is not None and stats.crashes >= len(crashes) and stats.restarts >= 1
    indices = [i for i, _, _ in got]
    assert len(indices) == len(set(indices)) and len(indices) + 4 * len(crashes) == 48


def test_a_cluster_that_goes_away_ends_the_epoch_with_a_clear_error(
    ray_cluster: RayCluster,
) -> None:
    """Every node that could hold the actors is lost: their replacements cannot be placed, and
    the epoch ends with an error that says so, not a hang."""
    ray_cluster.ensure_second()
    # Room for the first start on a loaded machine (an actor imports torch): 8 s was once
    # too little on 2 cores beside another busy test process.
    spec = aioloader.RayWorkers(resources={SECOND: 1}, start_timeout=20.0)
    dl = ray_loader(wd.WhereRead(48, delay=0.02), batch_size=4, worker_mode=spec, collate_fn=list)

    def lose_it(step: int, got: list[Any]) -> None:
        if step == 1:  # two batches in: every node that can hold the actors goes
            ray_cluster.stop_second()

    _, errors = through_failures(dl, after=lose_it, ends=(aioloader.LoaderTimeout,))
    assert isinstance(errors[-1], aioloader.LoaderTimeout), errors
    assert f"resources={{'{SECOND}': 1}}" in str(errors[-1])
