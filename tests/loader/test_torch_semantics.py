"""torch's public semantics that its own test_dataloader.py checks, each against torch's
``DataLoader`` in the same test where torch can run it: argument errors in torch's words,
frozen attributes, a second ``iter()``, the length warning of an iterable, which worker reads
which batch, seeds set in ``worker_init_fn``, the worker-crash message."""

from __future__ import annotations

import copy
import pickle
import threading
import warnings
from typing import Any

import pytest
import torch
import torch.utils.data

import aioloader
from tests.support import worker_datasets as wd
from tests.support.helpers import flat

TORCH_CONTEXT = {"multiprocessing_context": "fork"}  # torch's default on Linux


class Iterable(torch.utils.data.IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


MAP = list(range(20))
SAMPLER = torch.utils.data.SequentialSampler(MAP)
BATCHES = torch.utils.data.BatchSampler(SAMPLER, 3, False)

# (dataset, arguments, a phrase of torch's message that its tests match)
EXCLUSIVE = "batch_sampler option is mutually exclusive with"
UNSPECIFIED = "DataLoader with IterableDataset: expected unspecified"
BAD = [
    (MAP, {"batch_size": None, "drop_last": True}, "option disables auto-batching and is"),
    (MAP, {"multiprocessing_context": "forkserver"}, r"loading \(num_workers > 0\), but got"),
    (MAP, {"num_workers": 1, "multiprocessing_context": "bad"}, "should specify a valid start"),
    (MAP, {"num_workers": 1, "multiprocessing_context": object()}, "should be a valid context "),
    (MAP, {"sampler": SAMPLER, "shuffle": True}, "^sampler option is mutually exclusive with"),
    (MAP, {"batch_sampler": BATCHES, "sampler": SAMPLER, "shuffle": True}, "^sampler option is"),
    (MAP, {"batch_sampler": BATCHES, "sampler": SAMPLER, "shuffle": 3}, "^sampler option is"),
    (MAP, {"batch_sampler": BATCHES, "batch_size": 11}, EXCLUSIVE),
    (MAP, {"batch_sampler": BATCHES, "drop_last": 3}, EXCLUSIVE),
    (Iterable(5), {"shuffle": True}, UNSPECIFIED + " shuffle"),
    (Iterable(5), {"shuffle": 3}, UNSPECIFIED + " shuffle"),
    (Iterable(5), {"sampler": SAMPLER}, UNSPECIFIED + " sampler"),
    (Iterable(5), {"batch_sampler": BATCHES}, UNSPECIFIED + " batch_sampler"),
    (MAP, {"num_workers": -1}, "num_workers option should be non-negative"),
    (MAP, {"timeout": -1}, "timeout option should be non-negative"),
    # Found by test_torch_differential.py: torch's sampler and batch sampler check these.
    ([], {"shuffle": True}, "^num_samples should be a positive integer value, but got num_samp"),
    (MAP, {"batch_size": 0}, "^batch_size should be a positive integer value, but got batch_si"),
    (MAP, {"batch_size": "4"}, "^batch_size should be a positive integer value, but got batch_s"),
    (MAP, {"drop_last": 3}, "^drop_last should be a boolean value, but got drop_last=3"),
    (MAP, {"prefetch_factor": 2}, r"^prefetch_factor option could only be specified in multipr"),
    (MAP, {"num_workers": 1, "prefetch_factor": -1}, "^prefetch_factor option should be non-n"),
    # torch's order: the workers' options before the dataset's (both wrong here)
    (Iterable(5), {"shuffle": True, "persistent_workers": True}, "^persistent_workers option"),
    (MAP, {"batch_size": 0, "timeout": -1}, "^timeout option should be non-negative"),
]  # fmt: skip


@pytest.mark.parametrize(("dataset", "kwargs", "phrase"), BAD)
def test_argument_errors_have_torchs_type_and_words(
    dataset: Any, kwargs: dict[str, Any], phrase: str
) -> None:
    with pytest.raises(Exception, match=phrase) as theirs:
        torch.utils.data.DataLoader(dataset, **kwargs)
    with pytest.raises(type(theirs.value), match=phrase):
        aioloader.DataLoader(dataset, **kwargs)
    assert type(theirs.value) in (ValueError, TypeError)


@pytest.mark.parametrize(
    "name", ["dataset", "batch_size", "batch_sampler", "sampler", "drop_last", "persistent_workers"]
)
def test_attributes_that_define_the_epochs_are_frozen_like_torchs(name: str) -> None:
    for cls in (torch.utils.data.DataLoader, aioloader.DataLoader):
        dl = cls(MAP, batch_size=2)
        with pytest.raises(ValueError, match=f"{name} attribute should not be set after"):
            setattr(dl, name, {})
    dl = aioloader.DataLoader(MAP, batch_size=2)
    dl.timeout = 3  # others may change, as in torch
    assert dl.timeout == 3


def test_a_setting_changed_between_epochs_is_checked_and_runs_the_next_epoch() -> None:
    """torch reads its attributes when an iterator starts; ours re-plan when one is set:
    checked as at construction (a bad value changes nothing), in force from the next epoch."""
    dl = aioloader.DataLoader(wd.WhoReads(8), batch_size=4)
    assert {row for batch in dl for row in batch["torch_id"].tolist()} == {-1}
    with pytest.raises(ValueError, match="prefetch_factor option could only be specified in"):
        dl.prefetch_factor = 2
    assert dl.prefetch_factor is None
    dl.num_workers = 2  # the dataset now lives in two worker processes
    assert {row for batch in dl for row in batch["torch_id"].tolist()} == {0, 1}
    with pytest.raises(TypeError, match="max_inflight"):
        dl.max_inflight = 1.5  # type: ignore[assignment]
    assert dl.num_workers == 2 and dl.max_inflight == 64  # unchanged by the refusals
    with pytest.raises(AttributeError):
        dl.start_method = "spawn"  # type: ignore[misc]  # derived, not an argument


def test_more_workers_than_cpus_warns_like_torch() -> None:
    for cls in (torch.utils.data.DataLoader, aioloader.DataLoader):
        with pytest.warns(UserWarning, match="excessive worker creation might get DataLoader"):
            cls(MAP, batch_size=2, num_workers=1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        aioloader.DataLoader(MAP, batch_size=2, num_workers=1)


def test_a_second_iter_starts_a_new_epoch_and_the_first_says_it_ended() -> None:
    """torch gives each iterator an epoch of its own; ours ends the first iterator's epoch
    first. Its next ``next()`` used to stop silently: a training loop that evaluated on the
    same loader lost the rest of its epoch. It now raises, naming the remedy."""
    dl = aioloader.DataLoader(MAP, batch_size=4, num_workers=1)
    first = iter(dl)
    assert next(first).tolist() == [0, 1, 2, 3]
    second = iter(dl)
    assert [b.tolist() for b in second] == [list(range(k, k + 4)) for k in range(0, 20, 4)]
    with pytest.raises(aioloader.LoaderStateError, match=r"epoch \(0\) ended .* after 1 of"):
        next(first)
    with pytest.raises(aioloader.LoaderStateError, match=r"copy\.copy\(loader\)"):
        [b for b, _ in zip(dl, dl, strict=False)]


@pytest.mark.parametrize("workers", [0, 1])
def test_two_threads_iterating_one_loader_end_one_epoch_cleanly(workers: int) -> None:
    """A training thread and an evaluation thread each ``for`` over the same loader (found by
    review: both began an epoch on the loader's scope at once, and one got anyio's
    ``ClosedResourceError`` or hung, the loop thread dying with an ``ExceptionGroup``). The
    later one reads its epoch whole; the earlier one says it ended, as on one thread."""
    dl = aioloader.DataLoader(MAP, batch_size=4, num_workers=workers)
    start = threading.Barrier(2)
    got: dict[int, Any] = {}

    def read(k: int) -> None:
        start.wait()
        try:
            got[k] = [b.tolist() for b in dl]
        except Exception as exc:
            got[k] = exc

    threads = [threading.Thread(target=read, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), got
    whole = [list(range(k, k + 4)) for k in range(0, 20, 4)]
    assert whole in got.values(), got
    errors = [e for e in got.values() if isinstance(e, Exception)]
    assert len(errors) <= 1 and all(isinstance(e, aioloader.LoaderStateError) for e in errors)


def test_threads_iterating_one_loader_with_persistent_workers_stop_as_on_one_thread() -> None:
    """With persistent workers a later ``iter()`` ends the earlier one's epoch quietly, as on
    one thread (torch's persistent iterator is reset; torch hangs here). From three threads,
    a ``next()`` waiting as another thread began its epoch got anyio's
    ``ClosedResourceError`` (found by review)."""
    dl = aioloader.DataLoader(MAP, batch_size=2, num_workers=2, persistent_workers=True)
    errors: list[BaseException] = []

    def read() -> None:
        for _ in range(5):  # bounded: 5 epochs of at most 10 batches
            try:
                for _ in dl:
                    pass
            except Exception as exc:
                errors.append(exc)

    threads = [threading.Thread(target=read) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
    finally:
        dl.close()
    assert errors == []


def test_a_first_iterator_that_had_every_batch_stops_as_torchs() -> None:
    """A framework that iterates by ``len(loader)`` (Lightning) never sees the end: its next
    epoch's ``iter()`` comes first. Nothing of the first was left, and it stops quietly."""
    dl = aioloader.DataLoader(MAP, batch_size=4)
    first = iter(dl)
    assert len([next(first) for _ in range(len(dl))]) == 5
    second = iter(dl)
    with pytest.raises(StopIteration):
        next(first)
    assert len(list(second)) == 5


def test_a_copy_reads_beside_the_loader_as_torchs_second_iterator() -> None:
    """The remedy the error names: ``zip(loader, copy.copy(loader))`` gives torch's pairs."""
    ours = aioloader.DataLoader(MAP, batch_size=4)
    theirs = torch.utils.data.DataLoader(MAP, batch_size=4)
    pairs = [(a.tolist(), b.tolist()) for a, b in zip(ours, copy.copy(ours), strict=True)]
    assert pairs == [(a.tolist(), b.tolist()) for a, b in zip(theirs, theirs, strict=True)]


def test_an_iterable_yielding_past_its_length_warns_like_torch() -> None:
    class Longer(Iterable):
        def __iter__(self) -> Any:
            return iter(range(self.n + 3))

    for cls in (torch.utils.data.DataLoader, aioloader.DataLoader):
        dl = cls(Longer(4), batch_size=1)
        assert len(dl) == 4
        it = iter(dl)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(4):
                next(it)
        for _ in range(3):
            with pytest.warns(UserWarning, match="was reported to be 4"):
                next(it)
        with pytest.raises(StopIteration):
            next(it)


def test_batch_k_is_read_by_worker_k_mod_n_like_torch() -> None:
    def worker_ids(cls: Any, **kwargs: Any) -> list[int]:
        dl = cls(wd.WhoReads(64), batch_size=8, num_workers=2, **kwargs)
        return [int(batch["torch_id"][0]) for batch in dl]

    want = worker_ids(torch.utils.data.DataLoader, **TORCH_CONTEXT)
    assert want == [0, 1] * 4
    assert worker_ids(aioloader.DataLoader) == want


def test_a_seed_set_in_worker_init_fn_sticks_without_seed() -> None:
    """torch seeds each worker once, then runs worker_init_fn: what it seeds, stays. Per-batch
    reseeding (bit-identical augmentation whatever num_workers) comes with `seed=`."""

    def seeds(cls: Any, **kwargs: Any) -> list[int]:
        dl = cls(wd.InitialSeed(), batch_size=2, num_workers=2, worker_init_fn=wd.seed_12345)
        return [int(x) for batch in dl for x in batch]

    want = seeds(torch.utils.data.DataLoader, **TORCH_CONTEXT)
    assert want == [12345] * 8
    assert seeds(aioloader.DataLoader) == want
    seeded = aioloader.DataLoader(
        wd.InitialSeed(), batch_size=2, num_workers=2, worker_init_fn=wd.seed_12345, seed=0
    )
    assert 12345 not in [int(x) for batch in seeded for x in batch]


def test_unseeded_plain_for_epochs_draw_new_worker_seeds() -> None:
    dl = aioloader.DataLoader(wd.Augmenting(), batch_size=4, num_workers=2)
    first, second = [b.tolist() for b in dl], [b.tolist() for b in dl]
    assert first != second  # new workers each epoch, and new seeds, as torch's


def test_worker_crash_reads_like_torchs_and_rebuilds_from_its_message() -> None:
    crash = aioloader.WorkerCrashed(1, 4242, exitcode=-11, signal="SIGSEGV")
    assert str(crash).startswith("DataLoader worker (pid 4242) is killed by signal: ")
    assert "aioloader worker 1, SIGSEGV" in str(crash)
    again = type(crash)(str(crash))  # how code re-raises an exception it caught
    assert str(again) == str(crash) and isinstance(again, RuntimeError)
    copy = pickle.loads(pickle.dumps(crash))
    assert (copy.worker_id, copy.pid, copy.signal) == (1, 4242, "SIGSEGV")


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")
def test_nested_tensor_collate_error_reads_like_torchs() -> None:
    nested = [torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]) for _ in range(2)]
    for collate in (torch.utils.data.default_collate, aioloader.default_collate):
        with pytest.raises(RuntimeError, match="not currently supported by the default collate"):
            collate(nested)


def test_warnings_of_a_setting_point_at_the_users_line() -> None:
    """A setting checked again when set warns as construction does, at the caller's line."""
    if torch.cuda.is_available():
        pytest.skip("pin_memory warns only without an accelerator")
    with pytest.warns(UserWarning, match="pin_memory") as at_init:
        dl = aioloader.DataLoader(MAP, batch_size=2, pin_memory=True)
    dl = aioloader.DataLoader(MAP, batch_size=2)
    with pytest.warns(UserWarning, match="pin_memory") as when_set:
        dl.pin_memory = True
    dl = aioloader.DataLoader(MAP, batch_size=2)
    with pytest.warns(UserWarning, match="excessive worker creation") as many:
        dl.num_workers = 1000
    assert at_init[0].filename == when_set[0].filename == many[0].filename == __file__


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_that_is_its_own_iterator_is_iterated_once_per_pass(workers: int) -> None:
    """``__iter__`` once, then ``__next__``: a second ``iter()`` (as ``for`` or ``islice``
    make) would start a self-resetting iterator over, and the epoch would never end."""
    kw: dict[str, Any] = {"batch_size": 3, "num_workers": workers}
    context = TORCH_CONTEXT if workers else {}
    theirs = [b.tolist() for b in torch.utils.data.DataLoader(wd.Restarting(10), **kw, **context)]
    with aioloader.DataLoader(wd.Restarting(10), **kw) as loader:
        ours = [b.tolist() for _, b in zip(range(len(theirs) + 1), loader, strict=False)]
    assert ours == theirs


COPIES = {
    "copy": copy.copy,
    "deepcopy": copy.deepcopy,
    "pickle": lambda loader: pickle.loads(pickle.dumps(loader)),
}


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("dataset", ["map", "stream"])
def test_a_copy_reads_in_this_process_through_its_own_scope(how: str, dataset: str) -> None:
    """Found by review: a shallow copy shared the plan, whose reads in this process went
    through the original's scope (``LoaderStateError: the loader's scope is closed``)."""
    data: Any = list(range(12)) if dataset == "map" else Iterable(12)
    loader = aioloader.DataLoader(data, batch_size=3)
    copied = COPIES[how](loader)
    assert [b.tolist() for b in copied] == [b.tolist() for b in loader]
    with loader:  # the original's scope open: the copy reads through its own
        assert flat(copied) == list(range(12)) == flat(loader)


@pytest.mark.parametrize("how", COPIES)
def test_a_copy_of_a_loader_runs_its_own_epochs_and_leaves_the_originals(how: str) -> None:
    """A loader copies and pickles as torch's does after an epoch (ours raised: a lock of its
    running state went with it), and while persistent workers run, where torch's refuses: the
    copy starts its own. An epoch of the original under way goes on (``copy.copy`` shared it:
    iterating the copy ended it, and its last 3 batches were lost without a word)."""
    make = COPIES[how]
    kw: dict[str, Any] = {"batch_size": 3, "shuffle": True}
    theirs = torch.utils.data.DataLoader(list(range(12)), **kw)
    list(theirs)
    assert sorted(flat(make(theirs))) == list(range(12))  # torch's, after an epoch
    loader = aioloader.DataLoader(
        list(range(12)), seed=1, num_workers=1, persistent_workers=True, **kw
    )
    try:
        list(loader)
        running = iter(loader)  # the second epoch
        head = next(running)
        copied = make(loader)
        try:
            copys_first = [b.tolist() for b in copied]
            assert copied.statistics().workers.processes == 1  # its own
        finally:
            copied.close()
        rest = list(running)
        assert sorted(flat([head, *rest])) == list(range(12))  # the original's, whole
        # The copy's first epoch was the original's next: the third.
        assert copys_first == [b.tolist() for b in loader]
    finally:
        loader.close()


class Gated(torch.utils.data.Dataset[int]):
    """Samples from 8 on wait for ``gate``; asking for sample 8 sets ``asked``."""

    def __init__(self) -> None:
        self.asked, self.gate = threading.Event(), threading.Event()

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> int:
        if index >= 8:
            self.asked.set()
            assert self.gate.wait(10)
        return index


def test_an_epoch_ended_from_another_thread_says_so_in_the_waiting_next() -> None:
    """Found by review: a ``next()`` already waiting when another thread's ``iter()`` ended
    its epoch stopped quietly (or raised a bare ``CancelledError``), 2 of its 4 batches lost."""
    dataset = Gated()
    dl = aioloader.DataLoader(dataset, batch_size=4)
    got: list[Any] = []

    def first() -> None:
        try:
            for batch in dl:
                got.append(batch.tolist())
        except BaseException as exc:  # what the waiting next() raised
            got.append(exc)

    thread = threading.Thread(target=first)
    thread.start()
    assert dataset.asked.wait(10)  # the first loop waits on batch 2, inside next()
    second = iter(dl)
    dataset.gate.set()
    assert flat(second) == list(range(16))
    thread.join(10)
    assert got[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert isinstance(got[2], aioloader.LoaderStateError), got[2:]
    assert "after 2 of its batches" in str(got[2])


def test_a_split_streams_length_is_each_ranks_padded_share() -> None:
    """Found by review: ``len()`` of a stream split among 4 ranks rounded its 10 samples down
    to 2 a rank, where each rank yields 3 (the share is padded)."""
    for rank in range(4):
        dl = aioloader.DataLoader(
            Iterable(10), batch_size=1, distributed=True, rank=rank, world_size=4
        )
        assert len(dl) == len(list(dl)) == 3


@pytest.mark.parametrize("options", [{}, {"shuffle": True}, {"shuffle": True, "num_workers": 2}])
def test_building_a_loader_draws_from_no_generator_as_torchs(options: dict[str, Any]) -> None:
    """A script seeds torch, builds its loader, then its model: with the import swapped, the
    model's initial weights are torch's. Building ours drew its base seed from torch's
    default generator (or ``generator=``), so everything drawn after came out different."""
    weights = []
    for loader_class in (torch.utils.data.DataLoader, aioloader.DataLoader):
        torch.manual_seed(0)
        generator = torch.Generator().manual_seed(1)
        before = generator.get_state()
        loader_class(list(range(8)), generator=generator, **options)
        assert torch.equal(generator.get_state(), before), loader_class
        weights.append(torch.nn.Linear(4, 4).weight.detach())
    assert torch.equal(*weights)
