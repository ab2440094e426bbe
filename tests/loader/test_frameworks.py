"""The frameworks a torch user trains with, their loader swapped for ours: Lightning's
``Trainer`` under DDP and accelerate's ``prepare`` decide what to do with a loader by asking
``isinstance(loader, torch.utils.data.DataLoader)`` and ``isinstance(loader.sampler,
RandomSampler)``, rebuild it from its ``__init__`` arguments or ``vars(loader)``, and assign its
sampler a generator. Each is run for real on two CPU ranks (gloo), beside torch's ``DataLoader``
in the same run: before the loader was a torch ``DataLoader``, every rank read the whole
dataset under both (2 x 64 samples where torch read 64). Lightning's mid-epoch resume, which
saves a loader's ``state_dict()`` in its checkpoints, is run beside torchdata's
``StatefulDataLoader``."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data

import aioloader
from tests.support.torchrun import ROOT, run_script, torchrun

N = 64  # the jobs' dataset: samples 0..63


def test_the_loader_and_its_samplers_are_torchs_classes() -> None:
    loader = aioloader.DataLoader(list(range(10)), batch_size=3, shuffle=True)
    assert isinstance(loader, torch.utils.data.DataLoader)
    assert isinstance(loader.sampler, torch.utils.data.RandomSampler)
    assert isinstance(loader.batch_sampler, torch.utils.data.BatchSampler)
    assert loader._auto_collation and loader._index_sampler is loader.batch_sampler  # torch's own
    plain = aioloader.DataLoader(list(range(10)), batch_size=None)
    assert isinstance(plain.sampler, torch.utils.data.SequentialSampler)
    assert not plain._auto_collation and plain._index_sampler is plain.sampler
    sharded = aioloader.DataLoader(list(range(10)), distributed=True, rank=1, world_size=2)
    assert isinstance(sharded.sampler, torch.utils.data.DistributedSampler)


class _Counted(torch.utils.data.IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(5))

    def __len__(self) -> int:
        return 5


@pytest.mark.parametrize("dataset", [list(range(5)), _Counted()], ids=["map", "iterable"])
def test_torchs_private_attributes_of_the_loader_read_as_torchs(dataset: Any) -> None:
    """Composer's trainer reads ``_dataset_kind`` of any torch ``DataLoader`` before an epoch
    (an AttributeError with ours); iterators written by hand copy the rest."""
    theirs, ours = torch.utils.data.DataLoader(dataset), aioloader.DataLoader(dataset)
    names = ("_dataset_kind", "_IterableDataset_len_called", "_auto_collation", "_iterator")
    assert [getattr(ours, n) for n in names] == [getattr(theirs, n) for n in names]
    assert len(ours) == len(theirs) == 5  # an iterable's reported length is kept, as torch's
    assert ours._IterableDataset_len_called == theirs._IterableDataset_len_called
    with pytest.raises(AttributeError, match="follows the loader's dataset"):
        ours._dataset_kind = 1 - ours._dataset_kind


def test_torchs_attributes_of_the_samplers_read_as_torchs() -> None:
    ours = aioloader.DistributedSampler(10, rank=1, world_size=3, shuffle=False)
    theirs = torch.utils.data.DistributedSampler(range(10), num_replicas=3, rank=1, shuffle=False)
    assert list(ours) == list(theirs)
    for name in ("num_replicas", "rank", "num_samples", "total_size", "shuffle", "seed", "epoch"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert list(ours.dataset) == list(range(10))
    data = list(range(7))
    random = aioloader.RandomSampler(data, seed=3)
    assert random.data_source is data and random.num_samples == 7 and not random.replacement
    assert aioloader.SequentialSampler(5).data_source == range(5)


def test_a_batch_samplers_size_can_be_set_as_torchs_and_is_checked() -> None:
    batches = aioloader.BatchSampler(range(10), batch_size=3, drop_last=False)
    batches.batch_size, batches.drop_last = 4, True
    assert list(batches) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="batch_size"):
        batches.batch_size = 0
    with pytest.raises(ValueError, match="drop_last should be a boolean"):  # as at construction
        batches.drop_last = "yes"  # type: ignore[assignment]


def test_a_generator_assigned_to_the_random_sampler_draws_its_order_as_torchs() -> None:
    """accelerate assigns each rank's sampler a generator, kept in step across ranks, and
    expects the order drawn from it: once assigned, ours draws as torch's does."""
    data = list(range(50))
    sampler = aioloader.RandomSampler(data, seed=7)
    seeded = list(sampler)
    assert sampler.generator is None  # the generator given at construction only draws a seed
    assert list(sampler) != seeded  # iterated again: the next epoch, as torch's draws anew
    sampler.set_epoch(0)
    assert list(sampler) == seeded  # the seed's order for an epoch: the same every time
    sampler.generator = torch.Generator().manual_seed(11)
    theirs = torch.utils.data.RandomSampler(data, generator=torch.Generator().manual_seed(11))
    assert [list(sampler), list(sampler)] == [list(theirs), list(theirs)]
    assert list(sampler) != seeded
    with pytest.raises(TypeError, match=r"generator must be a torch\.Generator"):
        sampler.generator = 11  # type: ignore[assignment]


def test_vars_of_the_loader_hold_its_arguments_as_given_and_follow_changes() -> None:
    """Lightning rebuilds a loader made outside its hooks from ``vars(loader)``, as torch's
    ``DataLoader`` keeps its attributes there."""
    data = list(range(10))
    loader = aioloader.DataLoader(data, batch_size=4, shuffle=True, prefetch=3, progress=False)
    given = vars(loader)
    assert given["dataset"] is data
    assert (given["batch_size"], given["shuffle"], given["prefetch"]) == (4, True, 3)
    assert given["num_workers"] == 0 and given["device"] is None
    loader.num_workers = 2
    assert vars(loader)["num_workers"] == 2 == loader.num_workers
    with pytest.raises(ValueError, match="num_workers"):
        loader.num_workers = -1
    assert vars(loader)["num_workers"] == 2  # a refused value is not kept
    assert loader.progress() == "no epoch started"  # a method the argument does not hide
    rebuilt = aioloader.DataLoader(**{k: v for k, v in vars(loader).items() if k[0] != "_"})
    assert len(rebuilt) == len(loader) == 3 and rebuilt.num_workers == 2


def read(out: Path, config: str, stage: str) -> list[list[list[int]]]:
    """Per rank, per epoch: the samples ``config``'s rank read in ``stage``."""
    return [json.loads((out / f"{config}-{rank}.json").read_text())[stage] for rank in (0, 1)]


def assert_shared_out(per_rank: list[list[list[int]]]) -> None:
    """Each epoch, the two ranks read every sample once between them."""
    for epoch in range(len(per_rank[0])):
        both = per_rank[0][epoch] + per_rank[1][epoch]
        assert sorted(both) == list(range(N)), (epoch, per_rank)


@pytest.mark.timeout(240)
def test_lightning_ddp_gives_each_rank_the_share_torchs_loader_gets(tmp_path: Path) -> None:
    """``Trainer(strategy="ddp", devices=2)``: Lightning injects its ``DistributedSampler`` into
    our loader as into torch's (made in the hook, a setting changed there; or before the trainer
    saw it; or anew each epoch), with worker processes too, or over an ``AsyncDataset``, and
    adds none to one already sharded (``distributed=True``). Found by review: a setting changed
    in the hook replaced the injected sampler (every rank read everything), and with a loader
    rebuilt each epoch, the loader's own epoch count undid Lightning's ``set_epoch`` (epochs 1
    and 2 had the same order)."""
    out = tmp_path / "out"
    out.mkdir()
    run_script(ROOT / "tests/support/lightning_job.py", str(out), cwd=tmp_path, timeout=200)
    for made in ("hook", "outside", "reload"):
        for stage in ("train", "val"):
            theirs = read(out, f"torch-{made}", stage)
            assert_shared_out(theirs)
            assert read(out, f"aio-{made}", stage) == theirs, (made, stage)
    reloaded = read(out, "aio-reload", "train")[0]
    assert len({tuple(epoch) for epoch in reloaded}) == 3  # each epoch its own order
    assert read(out, "aio-workers", "train") == read(out, "torch-hook", "train")
    assert read(out, "aio-async", "train") == read(out, "torch-hook", "train")
    assert_shared_out(read(out, "aio-stream", "train"))  # use_distributed_sampler=False
    sharded = read(out, "aio-distributed", "train")
    assert_shared_out(sharded)
    assert sharded[0][0] != sharded[0][1] != sharded[0][2]  # reshuffled each epoch


@pytest.mark.timeout(120)
def test_fabric_gives_each_rank_the_share_torchs_loader_gets(tmp_path: Path) -> None:
    """Lightning Fabric's ``setup_dataloaders`` rebuilds our loader with its
    ``DistributedSampler`` as it rebuilds torch's."""
    run_script(ROOT / "tests/support/fabric_job.py", str(tmp_path), cwd=tmp_path, timeout=100)
    theirs = read(tmp_path, "torch", "train")
    assert_shared_out(theirs)
    assert read(tmp_path, "aio", "train") == theirs


@pytest.mark.timeout(120)
def test_accelerate_prepare_gives_each_rank_a_share_as_with_torchs_loader(tmp_path: Path) -> None:
    """accelerate rebuilds a prepared loader as its own (torch) ``DataLoader`` around our
    samplers, and keeps the ranks' orders in step through the generator it assigns."""
    out = tmp_path / "out"
    out.mkdir()
    torchrun(2, ROOT / "tests/support/accelerate_job.py", str(out), cwd=tmp_path, timeout=100)
    for name in ("torch", "aio"):
        runs: list[Any] = [json.loads((out / f"{name}-{r}.json").read_text()) for r in (0, 1)]
        assert_shared_out([run["seen"] for run in runs])
        assert runs[0]["type"] == "DataLoaderShard"


@pytest.mark.timeout(240)
def test_lightning_resumes_mid_epoch_from_our_state_as_from_torchdatas(tmp_path: Path) -> None:
    """A checkpoint 4 batches into the second epoch, a new process resumed from it: the epoch
    goes on from the checkpoint's batch, every sample once, as with torchdata's
    ``StatefulDataLoader`` (torch's ``DataLoader``, which keeps no state, starts the epoch
    again: the control)."""
    job = ROOT / "tests/support/lightning_resume_job.py"
    epochs: dict[str, list[list[int]]] = {}
    names = ("torch", "torchdata", "aio")
    for phase in ("first", "second"):  # the second phase in a new process
        run_script(job, ",".join(names), phase, str(tmp_path), cwd=tmp_path, timeout=150)
    for name in names:
        first, second = (
            json.loads((tmp_path / f"{name}-{p}.json").read_text()) for p in ("first", "second")
        )
        assert len(first) == 23 and len(second) == 12  # steps 21-32 of 32
        epochs[name] = first[16:20] + second  # the second epoch, across the restart
        if name != "torch":
            assert first[20:23] == second[:3], name  # the batches after the checkpoint, again
    for name, batches in epochs.items():
        samples = sorted(x for batch in batches for x in batch)
        assert (samples == list(range(N))) == (name != "torch"), (name, samples)


def test_a_torch_samplers_epoch_is_its_owners_unless_the_loader_is_given_one() -> None:
    """torch's loader never calls a sampler's ``set_epoch``: the user does (the
    ``DistributedSampler`` idiom), or Lightning for the sampler it injects. Ours calls it for
    its own samplers, and for any when the epoch was given (``loader.set_epoch``)."""
    data = list(range(12))
    results = []
    for cls in (torch.utils.data.DataLoader, aioloader.DataLoader):
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=0, seed=1)
        loader = cls(data, batch_size=3, sampler=sampler)
        epochs = []
        for epoch in (4, 4, 7):  # the owner sets the epoch; the loader's count is 0, 1, 2
            sampler.set_epoch(epoch)
            epochs.append([x for batch in loader for x in batch.tolist()])
        results.append(epochs)
        assert sampler.epoch == 7
    assert results[0] == results[1]
    assert results[0][0] == results[0][1] != results[0][2]
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=0, seed=1)
    loader = aioloader.DataLoader(data, batch_size=3, sampler=sampler)
    loader.set_epoch(7)
    assert [x for batch in loader for x in batch.tolist()] == results[0][2]
    assert sampler.epoch == 7


def test_a_state_without_a_generator_is_refused_where_the_sampler_draws_from_one() -> None:
    """Found by review: a state saved before a generator was assigned to the loader's sampler,
    loaded after, resumed another order (samples twice, others never)."""
    data = list(range(12))
    saved = aioloader.DataLoader(data, batch_size=2, shuffle=True, seed=3)
    iterator = iter(saved)
    next(iterator)
    state = saved.state_dict()
    iterator.close()
    resumed = aioloader.DataLoader(data, batch_size=2, shuffle=True, seed=3)
    resumed.sampler.generator = torch.Generator().manual_seed(5)
    with pytest.raises(ValueError, match=r"draws its order from a generator.*no generator state"):
        resumed.load_state_dict(state)


def test_torchs_batch_sampler_over_our_random_sampler_reshuffles_each_epoch() -> None:
    """The loader's own batch sampler is torch's class; handed to another loader (found by
    review), its sampler, ours, still takes each epoch."""
    data = list(range(16))
    first = aioloader.DataLoader(data, batch_size=4, shuffle=True, seed=1)
    assert type(first.batch_sampler) is torch.utils.data.BatchSampler
    second = aioloader.DataLoader(data, batch_sampler=first.batch_sampler)
    orders = [[x for batch in second for x in batch.tolist()] for _ in range(3)]
    assert len({tuple(order) for order in orders}) == 3
    assert all(sorted(order) == data for order in orders)


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")  # Lightning's own
def test_lightnings_teardown_stops_our_persistent_workers_as_torchs() -> None:
    """Lightning ends a fit by calling each train loader's ``_iterator._shutdown_workers()``
    where the iterator is torch's, then setting ``loader._iterator = None``. Our loader had no
    ``_iterator``: its persistent workers outlived the fit until the loader was collected."""
    import lightning as L
    import psutil

    class Pids(torch.utils.data.Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return 16

        def __getitem__(self, index: int) -> torch.Tensor:
            import os

            return torch.tensor([float(os.getpid())])

    class Module(L.LightningModule):
        def __init__(self, loader: Any) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)
            self.loader = loader
            self.pids: set[int] = set()

        def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
            self.pids.update(int(p) for p in batch.flatten().tolist())
            return self.layer(batch * 0).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)

        def train_dataloader(self) -> Any:
            return self.loader

    for loader_class in (torch.utils.data.DataLoader, aioloader.DataLoader):
        loader = loader_class(Pids(), batch_size=4, num_workers=2, persistent_workers=True)
        module = Module(loader)
        quiet: dict[str, Any] = {"logger": False, "enable_progress_bar": False}
        trainer = L.Trainer(max_epochs=2, accelerator="cpu", enable_checkpointing=False, **quiet)
        trainer.fit(module)
        assert len(module.pids) == 2, loader_class  # two workers read, for both epochs
        assert loader._iterator is None, loader_class
        for pid in module.pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                process = psutil.Process(pid)
                with contextlib.suppress(psutil.TimeoutExpired):
                    process.wait(10)  # a zombie of torch's until it reaps it
                assert process.status() == psutil.STATUS_ZOMBIE, (loader_class, pid)
