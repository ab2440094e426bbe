"""A dataset's tensors reach its workers as a forked worker has them: copies of their storages
that go with the start (``_workers/startcopy.py``), mapped copy-on-write, views of one storage
still views of one; a large storage, one already in shared memory and what is not a plain CPU
tensor go torch's way, moved to shared memory and shared."""

from __future__ import annotations

import itertools
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data
from hypothesis import given, settings
from hypothesis import strategies as st

import aioloader
from aioloader._workers import startcopy
from aioloader._workers.startonce import IN_FILE_FROM, OUT_OF_BAND_FROM
from tests.support.helpers import run_json_script


class Bumps(torch.utils.data.Dataset[torch.Tensor]):
    """Adds 100 to its own tensor ``i`` in place as it reads it."""

    def __init__(self, n: int) -> None:
        self.items = [torch.full((3,), float(i)) for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        self.items[i] += 100
        return self.items[i].clone()


def epochs(loader: Any, n: int) -> list[list[float]]:
    return [torch.cat(list(loader))[:, 0].tolist() for _ in range(n)]


@pytest.mark.parametrize("persistent", [False, True], ids=["per-epoch", "persistent"])
def test_a_worker_s_write_to_its_dataset_s_tensor_is_its_own_as_in_torch_s_forked_workers(
    persistent: bool,
) -> None:
    """torch's forked workers write to their copy-on-write pages: the main process's dataset
    stays as it was, each epoch's new workers start from it, persistent ones keep their own.
    (torch's sharing moved each tensor to shared memory where it was: the main process's
    changed, and each epoch added 100 more.)"""
    mine, torchs = Bumps(8), Bumps(8)
    ours = aioloader.DataLoader(mine, batch_size=4, num_workers=2, persistent_workers=persistent)
    theirs = torch.utils.data.DataLoader(
        torchs,
        batch_size=4,
        num_workers=2,
        persistent_workers=persistent,
        multiprocessing_context="fork",
    )
    got, expected = epochs(ours, 2), epochs(theirs, 2)
    ours.close()
    assert got == expected
    assert got[0] == [i + 100.0 for i in range(8)]
    assert [item[0].item() for item in mine.items] == [float(i) for i in range(8)]
    assert not any(item.is_shared() for item in mine.items)


class Views(torch.utils.data.Dataset[dict[str, Any]]):
    """Views of one storage, and tensors of every layout a dataset may hold: reports what it
    finds in the process that reads it."""

    def __init__(self, padding: int) -> None:
        base = torch.arange(24.0).reshape(4, 6)
        self.base = base
        self.also = {"base": base}  # the same tensor twice: one tensor in the worker
        self.rows = list(base.unbind(0))  # a cached dataset split into samples
        self.column = base[:, 1]  # a strided view
        self.tensors = {
            "float64": torch.linspace(0, 1, 7, dtype=torch.float64),
            "bfloat16": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
            "complex64": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64),
            "bool": torch.tensor([True, False, True]),
            "channels_last": torch.arange(2 * 3 * 4 * 5, dtype=torch.uint8)
            .reshape(2, 3, 4, 5)
            .contiguous(memory_format=torch.channels_last),
            "scalar": torch.tensor(7, dtype=torch.int64),
            "empty": torch.empty(0, 3),
            "expanded": torch.arange(3).expand(4, 3),
            "offset": torch.arange(10, dtype=torch.int16)[3:7],
            "conj": torch.tensor([1 + 2j, 3 - 1j]).conj(),  # lazy views torch's sharing drops
            "neg": torch._neg_view(torch.tensor([2.0, -1.0])),
            "large": torch.arange(20_000, dtype=torch.int32),  # out of the pickle's band
        }
        self.padding = b"p" * padding  # a start pickle of 1 MiB or more goes by a template

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> dict[str, Any]:
        aliased = (
            self.rows[0].untyped_storage().data_ptr() == self.base.untyped_storage().data_ptr()
        )
        self.rows[2][1] = -1.0  # through one view: the others see it
        seen = (self.base[2, 1].item(), self.column[2].item())
        self.rows[2][1] = 13.0
        layouts = {
            name: (
                tuple(t.shape),
                t.stride(),
                t.storage_offset(),
                t.dtype,
                t.is_conj(),
                t.is_neg(),
                t.is_shared(),
            )
            for name, t in self.tensors.items()
        }
        values = {name: t.clone() for name, t in self.tensors.items()}
        same = self.also["base"] is self.base
        return {"aliased": aliased and same, "seen": seen, "layouts": layouts, "values": values}


def as_read(sample: Any) -> Any:
    return sample


@pytest.mark.parametrize("padding", [0, IN_FILE_FROM], ids=["in-the-start", "by-a-template"])
def test_views_dtypes_and_layouts_arrive_as_they_were(padding: int) -> None:
    dataset = Views(padding)
    here = dataset[0]
    loader = aioloader.DataLoader(dataset, batch_size=None, num_workers=2, collate_fn=as_read)
    (there,) = list(loader)
    assert here["aliased"] and there["aliased"]
    assert here["seen"] == there["seen"] == (-1.0, -1.0)
    assert there["layouts"] == here["layouts"]
    assert not any(layout[-1] for layout in there["layouts"].values())
    for name, value in here["values"].items():
        assert torch.equal(there["values"][name], value), name
    assert (loader.statistics().workers.template_pid != 0) == bool(padding)


class Held(torch.utils.data.Dataset[tuple[bool, float]]):
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> tuple[bool, float]:
        return self.tensor.is_shared(), float(self.tensor.detach().sum())


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.ones(2048),  # 8 KiB: over MOVED_FROM as this test sets it
        lambda: torch.ones(4).share_memory_(),  # already shared: meant to be
        lambda: torch.nn.Parameter(torch.ones(4)),
    ],
    ids=["large", "shared", "parameter"],
)
def test_a_large_storage_one_in_shared_memory_or_a_parameter_goes_torch_s_way(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Moved to shared memory once and shared: a later write here reaches persistent workers,
    as with torch's spawn workers."""
    monkeypatch.setattr(startcopy, "MOVED_FROM", 4096)
    tensor = make()
    loader = aioloader.DataLoader(
        Held(tensor), batch_size=None, num_workers=1, persistent_workers=True, collate_fn=as_read
    )
    first = list(loader)
    with torch.no_grad():
        tensor += 1
    second = list(loader)
    loader.close()
    n = float(tensor.numel())
    assert tensor.is_shared()
    assert first == [(True, n), (True, n)] and second == [(True, 2 * n), (True, 2 * n)]


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "per-epoch"])
def test_a_small_tensor_is_copied_as_it_is_at_each_start(persistent: bool) -> None:
    """Below ``MOVED_FROM``: the worker's copy, as a forked worker's: a later write here is
    not seen by persistent workers, and is by the next epoch's new ones (torch's forked
    workers alike)."""
    tensor = torch.ones(4)
    loader = aioloader.DataLoader(
        Held(tensor),
        batch_size=None,
        num_workers=1,
        persistent_workers=persistent,
        collate_fn=as_read,
    )
    first = list(loader)
    tensor += 1
    second = list(loader)
    loader.close()
    assert not tensor.is_shared()
    assert first == [(False, 4.0), (False, 4.0)]
    assert second == [(False, 4.0 if persistent else 8.0)] * 2


class OnParameter(torch.utils.data.Dataset[tuple[bool, float]]):
    """A plain tensor on a ``Parameter``'s storage, met before it: one storage, one way."""

    def __init__(self) -> None:
        parameter = torch.nn.Parameter(torch.zeros(4))
        self.held = {"plain": parameter.detach(), "parameter": parameter}

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> tuple[bool, float]:
        plain, parameter = self.held["plain"], self.held["parameter"]
        same = plain.untyped_storage().data_ptr() == parameter.untyped_storage().data_ptr()
        plain[0] += 5  # through the plain view
        return same, float(parameter.detach()[0])


def test_a_storage_a_parameter_is_on_goes_torch_s_way_for_every_view_every_epoch() -> None:
    """Decided per storage: the plain view and the ``Parameter`` stay one storage, shared as
    torch's spawn workers share it, in every epoch (decided per tensor, the first epoch's
    worker got two storages, and the second's one, moved by the first)."""
    dataset = OnParameter()
    loader = aioloader.DataLoader(dataset, batch_size=None, num_workers=1, collate_fn=as_read)
    got = [list(loader) for _ in range(2)]
    assert got == [[(True, 5.0)], [(True, 10.0)]]
    assert dataset.held["plain"].is_shared()


class Sized(torch.utils.data.Dataset[bool]):
    def __init__(self, sizes: list[int]) -> None:
        self.held = [torch.zeros(size, dtype=torch.uint8) for size in sizes]

    def __len__(self) -> int:
        return len(self.held)

    def __getitem__(self, i: int) -> bool:
        return self.held[i].is_shared()


def test_past_the_copy_budget_the_largest_movable_storages_are_moved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """8 storages of 32 KiB, 4 of 30 KiB and 50 of 100 bytes (a budget of 130 KiB, movable
    from 16 KiB): the largest are moved until the copies come to 130 KiB or less (the 30 KiB
    ones and the small ones, 125 KiB); the next epoch's start copies and moves the same."""
    monkeypatch.setattr(startcopy, "COPIED_AT_MOST", 130 << 10)
    monkeypatch.setattr(startcopy, "MOVABLE_FROM", 16 << 10)
    sizes = [30 << 10] * 4 + [32 << 10] * 8 + [100] * 50
    dataset = Sized(sizes)
    loader = aioloader.DataLoader(dataset, batch_size=None, num_workers=1, collate_fn=as_read)
    epochs = [list(loader) for _ in range(2)]
    moved = [True] * 8
    assert epochs[0] == epochs[1] == [False] * 4 + moved + [False] * 50
    assert [tensor.is_shared() for tensor in dataset.held] == epochs[0]


def test_without_files_in_memory_tensors_go_torch_s_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where ``memfd_create`` is refused (a sandbox), copies would go down each worker's pipe:
    torch's way instead, moved once and shared."""
    monkeypatch.setattr(startcopy.memfile, "available", lambda: False)
    dataset = Sized([8, 5000])
    loader = aioloader.DataLoader(dataset, batch_size=None, num_workers=1, collate_fn=as_read)
    assert list(loader) == [True, True]


class CollectsAsItPickles(torch.utils.data.Dataset[bool]):
    """Says whether the collector ran as it was pickled and as it was unpickled."""

    def __init__(self) -> None:
        self.tensors = [torch.ones(3) for _ in range(4)]
        self.pickled_with_collector = False

    def __getstate__(self) -> dict[str, Any]:
        import gc

        return {**self.__dict__, "pickled_with_collector": gc.isenabled()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        import gc

        self.__dict__.update(state, unpickled_with_collector=gc.isenabled())

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> bool:
        return bool(self.pickled_with_collector and self.unpickled_with_collector)


def test_a_dataset_s_own_pickling_code_runs_with_the_collector() -> None:
    """The collector is paused for the table of tensors only: a dataset's ``__getstate__``
    and ``__setstate__`` may make garbage, and it is collected."""
    loader = aioloader.DataLoader(
        CollectsAsItPickles(), batch_size=None, num_workers=1, collate_fn=as_read
    )
    assert list(loader) == [True]


SPARSE_AND_NESTED = """
import json, warnings
warnings.filterwarnings("ignore", "Sparse invariant checks")  # as a worker rebuilds one
warnings.filterwarnings("ignore", "The PyTorch API of nested tensors")
import torch
import aioloader


class Held(torch.utils.data.Dataset):
    def __init__(self):
        self.sparse = torch.sparse_coo_tensor([[0, 1]], [1.5, 2.5], (3,))
        self.values = self.sparse._values()  # a plain view of its values: one storage
        self.nested = [torch.nested.nested_tensor([torch.ones(2), torch.ones(3) * i])
                       for i in range(70)]  # 280 descriptors: more than a start hands over

    def __len__(self):
        return 1

    def __getitem__(self, i):
        self.values[0] = 99.0
        return [float(self.sparse._values()[0]),
                sum(float(nested.unbind()[1].sum()) for nested in self.nested)]


if __name__ == "__main__":
    loader = aioloader.DataLoader(Held(), batch_size=None, num_workers=1)
    print(json.dumps(list(loader)))
"""


def test_a_sparse_tensor_s_values_view_and_nested_tensors_arrive_as_torch_shares_them(
    tmp_path: Path,
) -> None:
    """A plain view of a sparse tensor's values is on its storage: shared with it, not copied
    (a write through it reaches the sparse tensor, as in torch's workers). A nested tensor
    hands over four descriptors: 70 of them are more than a fork server's start takes, so
    they go down the worker's pipe (counted one each, the start failed: too many fds). (A
    script of its own: torch warns as a worker rebuilds one, an error here.)"""
    env = {"PYTHONPATH": str(Path(__file__).parents[2])}
    expected = [99.0, 3.0 * sum(range(70))]
    assert run_json_script(tmp_path, SPARSE_AND_NESTED, env=env) == [expected]


class Rows(torch.utils.data.Dataset[tuple[bool, float]]):
    """A tensor's 300 rows (``list(tensor)``: views of its storage), and 20,000 names (the
    start pickles to over 1 MiB: a template's)."""

    def __init__(self) -> None:
        self.whole = torch.zeros(300, 8)
        self.rows = list(self.whole)
        self.names = [f"sample-{i:08d}" * 6 for i in range(20_000)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[bool, float]:
        self.rows[i][0] = i  # through the row: the whole tensor sees it
        return self.rows[i].is_shared(), float(self.whole[i, 0])


def test_the_rows_of_a_moved_tensor_are_its_views_and_hand_over_one_descriptor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Moved (``MOVED_FROM`` lowered here), the storage is handed over once, however many
    views of it the dataset holds: the start keeps its template (300 views, each shared on
    its own, were 300 descriptors, more than a fork server's start takes: no template), and
    the rows are views of the whole tensor in the worker."""
    monkeypatch.setattr(startcopy, "MOVED_FROM", 1024)
    dataset = Rows()
    loader = aioloader.DataLoader(dataset, batch_size=100, num_workers=2)
    batches = list(loader)
    shared, values = (torch.cat([batch[k] for batch in batches]) for k in (0, 1))
    assert bool(shared.all()) and values.tolist() == [float(i) for i in range(300)]
    workers = loader.statistics().workers
    assert workers.template_pid != 0, workers.template_why
    assert dataset.whole[:, 0].tolist() == [float(i) for i in range(300)]  # shared with them


_DTYPES = [torch.uint8, torch.bool, torch.int16, torch.int64, torch.bfloat16, torch.float32,
           torch.float64, torch.complex64]  # fmt: skip


@st.composite
def held_tensors(draw: st.DrawFn) -> list[torch.Tensor]:
    """Tensors a dataset may hold: some alone on their storage, whole or not, some views of
    one base (slices at an offset, transposes, size-1 dimensions with strides of any value,
    0-d items, lazily conjugated ones)."""
    out: list[torch.Tensor] = []
    for _ in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(_DTYPES))
        n = draw(st.integers(1, 2_000))  # past the pickle's band too, for 8-byte dtypes
        base = (torch.arange(n) % 7).to(dtype)
        for _ in range(draw(st.integers(1, 3))):
            kind = draw(st.sampled_from(["whole", "rows", "slice", "odd", "item", "conj"]))
            if kind == "rows" and n % 2 == 0:
                view = base.view(2, n // 2)
                out.append(view.t() if draw(st.booleans()) else view)
            elif kind == "slice" and n > 2:
                out.append(base[draw(st.integers(1, n - 1)) :])
            elif kind == "odd":  # a size-1 dimension whose stride is not the contiguous one
                out.append(base.as_strided((1, n), (draw(st.integers(0, 9)), 1)))
            elif kind == "item":
                out.append(base[draw(st.integers(0, n - 1))])
            elif kind == "conj" and dtype.is_complex:
                out.append(base.conj())
            else:
                out.append(base)
    return out


@settings(max_examples=60, deadline=None)
@given(held_tensors())
def test_the_table_rebuilds_each_tensor_as_it_was_and_views_of_one_storage_as_views(
    tensors: list[torch.Tensor],
) -> None:
    """``StartCopies`` and ``rebuilt`` on their own: each tensor with its dtype, shape,
    strides, offset, lazy bits and values; tensors on one storage still on one, others not."""
    copies = startcopy.StartCopies()
    refs = [copies.reduce(t) for t in tensors]
    assert all(ref is not None for ref in refs)
    out_of_band: list[pickle.PickleBuffer] = []

    def in_band(buffer: pickle.PickleBuffer) -> bool:
        if buffer.raw().nbytes < OUT_OF_BAND_FROM:
            return True
        out_of_band.append(buffer)
        return False

    table = copies.dumps(in_band, lambda value: pytest.fail("no storage goes torch's way"))
    rebuilt = startcopy.rebuilt(table, iter([b.raw() for b in out_of_band]), [])  # as mapped
    for was, now in zip(tensors, rebuilt, strict=True):
        assert (now.dtype, now.shape, now.stride(), now.storage_offset()) == (
            was.dtype, was.shape, was.stride(), was.storage_offset()
        )  # fmt: skip
        assert (now.is_conj(), now.is_neg()) == (was.is_conj(), was.is_neg())
        assert torch.equal(now.resolve_conj(), was.resolve_conj())
        assert now.untyped_storage().nbytes() == was.untyped_storage().nbytes()
    for i, j in itertools.combinations(range(len(tensors)), 2):
        shared = tensors[i].untyped_storage()._cdata == tensors[j].untyped_storage()._cdata
        ptrs = {t.untyped_storage().data_ptr() for t in (rebuilt[i], rebuilt[j])}
        assert (len(ptrs) == 1) == shared


def test_the_table_keeps_small_storages_in_the_pickle() -> None:
    """Under ``OUT_OF_BAND_FROM`` (the start's one threshold) a storage's bytes are in the
    table's pickle; from it, they are offered to the buffer callback."""
    copies = startcopy.StartCopies()
    small, large = (
        torch.ones(OUT_OF_BAND_FROM - 1, dtype=torch.uint8),
        torch.ones(OUT_OF_BAND_FROM, dtype=torch.uint8),
    )
    for tensor in (small, large):
        copies.reduce(tensor)
    offered: list[int] = []
    copies.dumps(lambda buffer: offered.append(buffer.raw().nbytes) or True, lambda value: 0)
    assert offered == [OUT_OF_BAND_FROM]
