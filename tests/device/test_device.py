"""The device stage without a GPU: the tree walk, ``device=`` resolution, the pinned pool, and
the stage's machinery (ordering, bounds, threads, failures, cancellation) driven through an
accelerator that implements the stage's device seam on the CPU. The real CUDA calls are tested
in ``test_device_cuda.py``."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import pickle
import threading
import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple
from unittest import mock

import anyio
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

import aioloader
from aioloader._base.tree import map_pinnable, map_tensors, tensors_in
from aioloader._device import stage as stage_module
from aioloader._device.accelerator import PinnedPool, cuda_index, resolve_device, size_class
from aioloader._device.hostcopy import HostCopy
from aioloader._device.plan import DevicePlan
from aioloader._device.stage import DeviceStage
from tests.conftest import aioloader_threads
from tests.support.helpers import Counting, other_tasks

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA behaviour")


# -- structures -------------------------------------------------------------------------------


class Pair(NamedTuple):
    a: Any
    b: Any


@dataclasses.dataclass
class Box:
    value: Any
    tag: str = "box"


@dataclasses.dataclass(frozen=True, slots=True)
class Frozen:
    value: Any
    extra: Any = None


@dataclasses.dataclass
class Counted:
    """``__post_init__`` must not run again when the tensors inside are replaced."""

    value: Any
    inits: int = 0
    derived: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        self.inits += 1


class ReadOnly(Mapping[str, Any]):
    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().reshape(-1).contiguous().view(torch.uint8)


def same(got: Any, want: Any, path: str = "batch") -> None:
    """``got`` has ``want``'s structure and types; tensors equal bit for bit, with the dtype,
    shape and strides ``want.to(device)`` would have; other leaves equal."""
    assert type(got) is type(want), (path, type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert got.stride() == torch.empty_like(want).stride(), (path, got.stride())
        assert torch.equal(bits(got), bits(want)), path
    elif isinstance(want, Mapping):
        assert list(got.keys()) == list(want.keys()), path
        for key in want:
            same(got[key], want[key], f"{path}[{key!r}]")
    elif dataclasses.is_dataclass(want):
        for field in dataclasses.fields(want):
            same(getattr(got, field.name), getattr(want, field.name), f"{path}.{field.name}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            same(g, w, f"{path}[{i}]")
    else:
        assert got == want, path


# -- map_tensors -------------------------------------------------------------------------------


def test_map_tensors_rebuilds_every_container_kind() -> None:
    t = torch.arange(4)
    factory_dd: defaultdict[str, Any] = defaultdict(list, {"t": t})
    data = {
        "dict": {"t": t, "s": "text", "n": None},
        "ordered": OrderedDict(t=t, i=3),
        "default": factory_dd,
        "proxy": MappingProxyType({"t": t}),
        "readonly": ReadOnly({"t": t}),
        "list": [t, 1.5, b"raw"],
        "tuple": (t, "x"),
        "pair": Pair(t, Pair("leaf", t)),
        "box": Box(t),
        "frozen": Frozen(t, extra=[t]),
    }
    out = map_tensors(lambda x: x + 10, data)
    assert type(out) is dict
    assert torch.equal(out["dict"]["t"], t + 10) and out["dict"]["s"] == "text"
    assert type(out["ordered"]) is OrderedDict and out["ordered"]["i"] == 3
    assert type(out["default"]) is defaultdict and out["default"].default_factory is list
    assert type(out["proxy"]) is MappingProxyType
    assert type(out["readonly"]) is ReadOnly
    assert type(out["list"]) is list and out["list"][2] == b"raw"
    assert type(out["tuple"]) is tuple  # a tuple stays a tuple (torch's pin_memory lists it)
    assert type(out["pair"]) is Pair and out["pair"].b.a == "leaf"
    assert torch.equal(out["pair"].b.b, t + 10)
    assert type(out["box"]) is Box and out["box"].tag == "box"
    assert type(out["frozen"]) is Frozen and torch.equal(out["frozen"].extra[0], t + 10)
    assert torch.equal(data["frozen"].value, t), "the input is left as it was"


def test_map_tensors_keeps_dataclass_state_without_running_init_again() -> None:
    t = torch.ones(2)
    counted = Counted(t)
    counted.derived = 7  # an init=False field
    out = map_tensors(lambda x: x * 3, counted)
    assert out is not counted and out.inits == 1 and out.derived == 7
    assert torch.equal(out.value, t * 3)


def test_map_tensors_returns_the_same_object_when_nothing_changes() -> None:
    t = torch.zeros(1)
    data = {"a": [t, (t, "s")], "b": Box(Pair(t, 1)), "r": range(3)}
    assert map_tensors(lambda x: x, data) is data
    assert map_tensors(lambda x: x + 1, "a string") == "a string"


def test_tensors_in_lists_each_tensor_once_in_walk_order() -> None:
    a, b = torch.zeros(1), torch.ones(1)
    found = tensors_in({"x": [a, b, a], "y": Box(b), "z": "no"})
    assert len(found) == 2 and found[0] is a and found[1] is b


_leaves = st.one_of(
    st.integers(),
    st.text(max_size=3),
    st.none(),
    st.builds(torch.tensor, st.lists(st.integers(-100, 100), max_size=4)),
)


def _plain_containers(children: st.SearchStrategy[Any]) -> list[st.SearchStrategy[Any]]:
    """Lists, tuples, dicts and a named tuple of ``children``: what torch's walks enter too."""
    return [
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=2), children, max_size=3),
        st.builds(Pair, children, children),
    ]


def _nest(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        *_plain_containers(children),
        st.builds(Box, children),
        st.builds(Frozen, children, children),
    )


_trees = st.recursive(_leaves, _nest, max_leaves=12)


def _reference(fn: Any, data: Any) -> Any:
    """What map_tensors must return, written the obvious way for the types the strategy makes."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, dict):
        return {k: _reference(fn, v) for k, v in data.items()}
    if isinstance(data, Pair):
        return Pair(_reference(fn, data.a), _reference(fn, data.b))
    if isinstance(data, Box):
        return Box(_reference(fn, data.value), data.tag)
    if isinstance(data, Frozen):
        return Frozen(_reference(fn, data.value), _reference(fn, data.extra))
    if isinstance(data, list | tuple):
        return type(data)(_reference(fn, v) for v in data)
    return data


@given(_trees)
def test_map_tensors_matches_the_obvious_recursion(data: Any) -> None:
    out = map_tensors(lambda t: t * 2 - 1, data)
    same(out, _reference(lambda t: t * 2 - 1, data))
    assert map_tensors(lambda t: t, data) is data
    leaves = tensors_in(data)
    assert len({id(t) for t in leaves}) == len(leaves)
    moved = tensors_in(out)
    assert not any(m is t for m in moved for t in leaves), "every tensor was replaced"


class Pinnable:
    """A custom batch type, pinned by its own method (torch's documented hook)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def pin_memory(self) -> tuple[str, Any]:
        return ("pinned by its method", self.value)


class PinnedPair(NamedTuple):  # a container with the method too, as PackedSequence is
    a: Any
    b: Any

    def pin_memory(self) -> tuple[str, Any, Any]:
        return ("pinned pair", self.a, self.b)


class Record:
    """An object with no method of its own, given one on the instance (torch asks the object)."""

    def __init__(self, value: Any, pinnable: bool) -> None:
        self.value = value
        if pinnable:
            self.pin_memory = lambda: ("pinned by the instance's", value)


class LateDict(dict[str, Any]):
    """A dict whose instances may carry ``pin_memory``: pinned by it, else walked."""


def late_dict(items: dict[str, Any], pinnable: bool) -> LateDict:
    made = LateDict(items)
    if pinnable:
        made.pin_memory = lambda: ("pinned dict", sorted(made))  # type: ignore[attr-defined]
    return made


_pin_trees = st.recursive(
    _leaves,
    lambda children: st.one_of(
        *_plain_containers(children),
        st.builds(Pinnable, children),
        st.builds(PinnedPair, children, children),
        st.builds(Record, children, st.booleans()),
        st.builds(
            late_dict, st.dictionaries(st.text(max_size=2), children, max_size=3), st.booleans()
        ),
    ),
    max_leaves=12,
)


@given(_pin_trees)
def test_pinning_walks_a_batch_as_torch_s_pin_memory_does(data: Any) -> None:
    """Host pinning's walk (``map_pinnable``) against torch's own ``pin_memory`` on a batch,
    a tensor's pinning replaced by a visible change: the same objects pinned by their own
    ``pin_memory`` methods, the same containers walked and rebuilt."""
    from torch.utils.data._utils.pin_memory import pin_memory as torch_pin_memory

    def pin(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return t * 2 - 1

    with mock.patch.object(torch.Tensor, "pin_memory", pin):
        want = torch_pin_memory(data)
    got = map_pinnable(
        lambda leaf: pin(leaf) if isinstance(leaf, torch.Tensor) else leaf.pin_memory(), data
    )
    same(got, want)


# -- device= --------------------------------------------------------------------------------------


def test_resolve_device_accepts_cpu_and_none() -> None:
    assert resolve_device(None) is None
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.parametrize(
    ("device", "error", "match"),
    [
        (3, TypeError, "device must be a str, a torch.device or None"),
        ("gpu0", ValueError, "device='gpu0' is not a device"),
        ("meta", ValueError, "device='meta'.*not to 'meta'"),
    ],
)
def test_resolve_device_rejects_bad_values(device: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        resolve_device(device)
    with pytest.raises(error, match=match):
        aioloader.DataLoader(Counting(4), device=device)


@no_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_cuda_without_cuda_is_a_construction_error(device: Any) -> None:
    with pytest.raises(ValueError, match=r"device=.*needs CUDA.*is_available\(\) is False"):
        aioloader.DataLoader(Counting(4), batch_size=2, device=device)


def test_cuda_index_follows_the_local_rank_then_the_current_device() -> None:
    def current() -> int:
        return 1

    assert cuda_index(2, local_rank="0", count=4, current=current) == 2
    assert cuda_index(None, local_rank="3", count=4, current=current) == 3
    assert cuda_index(None, local_rank=None, count=4, current=current) == 1
    # One visible device per process (CUDA_VISIBLE_DEVICES per rank): the current one.
    assert cuda_index(None, local_rank="5", count=1, current=lambda: 0) == 0
    with pytest.raises(ValueError, match="CUDA device 4 does not exist"):
        cuda_index(4, local_rank=None, count=4, current=current)
    with pytest.raises(ValueError, match="LOCAL_RANK='x' is not an int"):
        cuda_index(None, local_rank="x", count=4, current=current)


def test_device_transform_must_be_callable_and_picklable_for_processes() -> None:
    with pytest.raises(TypeError, match="device_transform must be callable"):
        aioloader.DataLoader(Counting(4), device_transform=5)  # type: ignore[arg-type]
    lock = threading.Lock()  # a lambda goes by value, but not one holding a lock
    with pytest.raises(TypeError, match=r"device_transform=.*cannot be sent to worker processes"):
        aioloader.DataLoader(Counting(4), num_workers=1, device_transform=lambda b: (lock, b))
    # Threads need no pickling.
    aioloader.DataLoader(
        Counting(4), num_workers=1, worker_mode="thread", device_transform=lambda b: (lock, b)
    )


# -- the pinned pool --------------------------------------------------------------------------


class FakeEvent:
    """Completes when the test says so, or when someone synchronizes on it."""

    def __init__(self, done: bool = False, log: list[str] | None = None) -> None:
        self.done = done
        self.log = log if log is not None else []

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.log.append(threading.current_thread().name)
        self.done = True


def test_size_classes_are_powers_of_two() -> None:
    assert size_class(0) == size_class(1) == size_class(1 << 16) == 1 << 16
    assert size_class((1 << 16) + 1) == 1 << 17
    assert size_class(3_000_000) == 1 << 22


def test_pool_reuses_a_buffer_only_after_its_copy_completed() -> None:
    allocated: list[int] = []

    def allocate(n: int) -> torch.Tensor:
        allocated.append(n)
        return torch.empty(n, dtype=torch.uint8)

    pool = PinnedPool(allocate, capacity=3)
    first = pool.take(1000)
    event = FakeEvent()
    pool.give_back(first, event)
    second = pool.take(1000)
    assert second.data_ptr() != first.data_ptr(), "reused while its copy was in flight"
    event.done = True
    pool.give_back(second, FakeEvent(done=True))
    again = pool.take(500)
    assert again.data_ptr() == first.data_ptr()
    assert pool.allocations == len(allocated) == 2 and pool.waits == 0
    assert event.log == []


def test_pool_at_capacity_waits_for_the_oldest_copy() -> None:
    pool = PinnedPool(lambda n: torch.empty(n, dtype=torch.uint8), capacity=2)
    log: list[str] = []
    events = [FakeEvent(log=log), FakeEvent(log=log)]
    buffers = [pool.take(100), pool.take(100)]
    for buffer, event in zip(buffers, events, strict=True):
        pool.give_back(buffer, event)
    reused = pool.take(100)
    assert reused.data_ptr() == buffers[0].data_ptr()
    assert events[0].done and not events[1].done, "only the oldest copy is waited for"
    assert pool.count == 2 and pool.allocations == 2 and pool.waits == 1
    assert log == [threading.current_thread().name]


def test_pool_replaces_the_smallest_free_buffer_when_none_fits() -> None:
    pool = PinnedPool(lambda n: torch.empty(n, dtype=torch.uint8), capacity=2)
    small = [pool.take(10), pool.take(10)]
    for buffer in small:
        pool.give_back(buffer, FakeEvent(done=True))
    big = pool.take(1 << 20)
    assert big.numel() == 1 << 20 and pool.count == 2 and pool.allocations == 3
    pool.give_back(big, FakeEvent(done=True))
    assert pool.take(1 << 19).data_ptr() == big.data_ptr()  # the smallest that fits


def test_pool_clear_waits_for_busy_buffers() -> None:
    pool = PinnedPool(lambda n: torch.empty(n, dtype=torch.uint8), capacity=2)
    event = FakeEvent()
    pool.give_back(pool.take(1), event)
    pool.clear()
    assert event.done and pool.count == 0
    with pytest.raises(ValueError, match="capacity"):
        PinnedPool(lambda n: torch.empty(n), capacity=0)


# -- the stage through a CPU accelerator ------------------------------------------------------


class FakeAccelerator:
    """``aioloader._device.stage.Accelerator`` on the CPU: the "device" is the CPU, so the stage's
    copies are real copies into new tensors; events complete when ``complete`` says so (or on
    ``synchronize``); every call records the thread it ran on."""

    device = torch.device("cpu")

    def __init__(self, *, complete: bool = True, refuse: bool = False) -> None:
        self.complete = complete
        self.refuse = refuse  # register() refuses, as a device under a memlock limit does
        self.registered: list[tuple[int, int]] = []  # (address, nbytes) of each registration
        self.unregistered: list[int] = []
        self.calls: list[tuple[str, str]] = []
        self.pinned_sizes: list[int] = []
        self.synced_on: list[str] = []
        self.handed: list[tuple[int, FakeEvent, list[torch.Tensor]]] = []
        self.events: list[FakeEvent] = []
        self.closed = False
        self._side = threading.local()

    def _log(self, what: str) -> None:
        self.calls.append((what, threading.current_thread().name))

    def on_side(self) -> bool:
        return getattr(self._side, "active", False)

    def open(self) -> None:
        self._log("open")

    @contextlib.contextmanager
    def side(self) -> Iterator[None]:
        self._side.active = True
        try:
            yield
        finally:
            self._side.active = False

    def pinned(self, nbytes: int) -> torch.Tensor:
        self._log("pinned")
        self.pinned_sizes.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def register(self, address: int, nbytes: int) -> Callable[[], None] | None:
        self._log("register")
        if self.refuse:
            return None
        self.registered.append((address, nbytes))
        return lambda: self.unregistered.append(address)

    def record(self) -> FakeEvent:
        assert self.on_side(), "events are recorded on the side stream"
        self._log("record")
        event = FakeEvent(self.complete, self.synced_on)
        self.events.append(event)
        return event

    def hand_over(self, event: Any, tensors: Sequence[torch.Tensor]) -> None:
        assert isinstance(event, FakeEvent)
        self.handed.append((threading.get_ident(), event, list(tensors)))

    def close(self) -> None:
        self._log("close")
        self.closed = True


def on_fake_device(
    loader: aioloader.DataLoader[Any],
    fake: FakeAccelerator | None = None,
    *,
    pin: bool = True,
    transform: Any = None,
) -> FakeAccelerator:
    """Give ``loader`` a device stage on ``fake`` (what ``device="cuda"`` builds, with the
    CUDA calls swapped out); takes effect when its scope opens."""
    fake = fake or FakeAccelerator()
    plan = DevicePlan(lambda: fake, pin, transform)
    loader._plan = dataclasses.replace(loader._plan, device_plan=plan)
    return fake


class Records(aioloader.AsyncDataset[dict[str, Any]]):
    """Samples of several dtypes and non-tensors."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    async def get(self, index: int) -> dict[str, Any]:
        await anyio.lowlevel.checkpoint()
        g = torch.Generator().manual_seed(index)
        return {
            "image": torch.randint(0, 256, (3, 5, 4), dtype=torch.uint8, generator=g),
            "half": torch.randn(7, generator=g).half(),
            "flag": torch.rand(2, generator=g) > 0.5,
            "label": index,
            "name": f"sample-{index}",
            "pair": Pair(torch.tensor(index * 1.5, dtype=torch.float64), "meta"),
        }


def collate_records(samples: list[dict[str, Any]]) -> dict[str, Any]:
    batch = aioloader.default_collate(samples)
    batch["image"] = batch["image"].contiguous(memory_format=torch.channels_last)
    batch["box"] = Frozen(batch["half"][:, 1:3], extra=(batch["label"], "kept"))
    batch["empty"] = torch.empty(0, 3)
    return batch


@pytest.mark.parametrize("chunk", [None, 16])  # 16: tensors over 32 bytes go in chunks
async def test_batches_equal_the_host_path_with_layout_and_non_tensors_kept(
    chunk: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if chunk is not None:
        monkeypatch.setattr(stage_module, "_CHUNK_BYTES", chunk)
    kwargs: dict[str, Any] = {"batch_size": 5, "collate_fn": collate_records, "prefetch": 2}
    async with aioloader.DataLoader(Records(23), **kwargs) as plain:
        want = [b async for b in plain]
    dl = aioloader.DataLoader(Records(23), **kwargs)
    fake = on_fake_device(dl)
    async with dl:
        got = [b async for b in dl]
        pool = dl._scope.device.pool if dl._scope and dl._scope.device else None
        assert pool is not None and pool.allocations <= pool.capacity
    assert len(got) == len(want) == 5
    for g, w in zip(got, want, strict=True):
        same(g, w)
        assert g["image"].is_contiguous(memory_format=torch.channels_last)
    # Every tensor was copied (new memory), every batch handed over with all its tensors.
    assert got[0]["image"].data_ptr() != want[0]["image"].data_ptr()
    assert len(fake.handed) == 5
    for (_, _, tensors), batch in zip(fake.handed, got, strict=True):
        assert {id(t) for t in tensors} == {id(t) for t in tensors_in(batch)}
    assert [what for what, _ in fake.calls][:1] == ["open"] and fake.closed
    assert {thread for _, thread in fake.calls} == {"aioloader-device_0"}
    stats = dl.statistics()
    assert stats.stage("device").completed == 5 and "device" in repr(stats)


async def test_stage_copies_tensors_and_passes_everything_else_through() -> None:
    fake = FakeAccelerator()
    stage = DeviceStage(DevicePlan(lambda: fake, True), depth=1)
    names, meta, x = ["a", "b"], {"k": object()}, torch.arange(6).reshape(2, 3)
    await stage.open()
    try:
        staged = await stage.stage({"x": x, "pair": Pair(x.t(), names), "meta": meta, "n": 7})
        assert fake.handed == []  # nothing is handed over before ready()
        out = staged.ready()
    finally:
        await stage.aclose()
    assert out["meta"] is meta and out["pair"].b is names and out["n"] == 7
    assert out["x"] is not x and out["x"].data_ptr() != x.data_ptr()
    assert torch.equal(out["x"], x) and torch.equal(out["pair"].a, x.t())
    assert out["pair"].a.stride() == x.t().stride()  # a permuted dense tensor keeps its layout
    assert len(fake.handed) == 1 and fake.closed


# -- large tensors, chunk by chunk --------------------------------------------------------------


class CopyLog(TorchFunctionMode):
    """Logs every ``copy_`` made while it is active (on the thread that entered it), and fails
    the ``fail_at``-th copy out of a pinned buffer."""

    def __init__(self, fake: CopyingAccelerator) -> None:
        super().__init__()
        self.fake = fake

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and not self.fake.quiet:
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            self.fake.copied(args[0], args[1], bool(non_blocking))
        return func(*args, **kwargs)


class CopyingAccelerator(FakeAccelerator):
    """A :class:`FakeAccelerator` that logs, in order, the side stream's copies into a pinned
    buffer (``"host"``) and out of one (``"device"``: the H2D copies on a GPU), each as (kind,
    destination address, source address, bytes, ``non_blocking``), and each event recorded
    (``("record", 0, 0, 0, False)``)."""

    def __init__(self, *, fail_at: int | None = None) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.buffers: list[torch.Tensor] = []
        self.log: list[tuple[str, int, int, int, bool]] = []
        self.quiet = False  # inside a host copy: logged once, as itself

    def pinned(self, nbytes: int) -> torch.Tensor:
        buffer = super().pinned(nbytes)
        self.buffers.append(buffer)
        return buffer

    @contextlib.contextmanager
    def side(self) -> Iterator[None]:
        """The side stream, with its copies logged: torch's ``copy_`` calls, and the stage's
        host copies (``HostCopy.copy``: NumPy's, on its threads), each once."""
        fake, original = self, HostCopy.copy

        def logged(host: HostCopy, dst: torch.Tensor, src: torch.Tensor) -> None:
            fake.copied(dst, src, False)
            fake.quiet = True
            try:
                original(host, dst, src)
            finally:
                fake.quiet = False

        with super().side(), CopyLog(self), mock.patch.object(HostCopy, "copy", logged):
            yield

    def record(self) -> FakeEvent:
        self.log.append(("record", 0, 0, 0, False))
        return super().record()

    def _pinned(self, t: torch.Tensor) -> bool:
        return any(b.data_ptr() <= t.data_ptr() < b.data_ptr() + b.numel() for b in self.buffers)

    def copied(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        kind = "host" if self._pinned(dst) else "device" if self._pinned(src) else "other"
        nbytes = dst.numel() * dst.element_size()
        self.log.append((kind, dst.data_ptr(), src.data_ptr(), nbytes, non_blocking))
        if kind == "device" and self.fail_at is not None:
            self.fail_at -= 1
            if self.fail_at == 0:
                raise torch.OutOfMemoryError("pretend the device is full")

    def device_copies(self, out: torch.Tensor) -> list[tuple[int, int]]:
        """The copies out of a pinned buffer into ``out``'s memory: (offset, bytes) each."""
        start, end = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
        return [(d - start, n) for k, d, _, n, _ in self.log if k == "device" and start <= d < end]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bytes as ``dtype`` (NaN payloads and all), except bool: 0 or 1."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    nbytes = torch.empty(shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dtype).view(shape)


CHUNK = 1024  # bytes: what the tests patch _CHUNK_BYTES to


def chunks(nbytes: int) -> list[tuple[int, int]]:
    return [(s, min(CHUNK, nbytes - s)) for s in range(0, nbytes, CHUNK)]


@pytest.mark.parametrize(
    "dtype",
    [torch.uint8, torch.float32, torch.int64, torch.bool, torch.bfloat16, torch.complex64],
    ids=str,
)
async def test_large_tensors_go_chunk_by_chunk_and_arrive_bit_exact(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stage_module, "_CHUNK_BYTES", CHUNK)
    big = random_tensor((7, 13, 29), dtype, 1)  # 2639 elements: no multiple of the chunk
    conj = random_tensor((40, 40), torch.complex64, 6).conj()  # its bytes are not its values
    batch = {
        "big": big,
        "exact": random_tensor((4 * CHUNK,), torch.uint8, 2),  # a multiple of the chunk
        "two": random_tensor((2 * CHUNK,), torch.uint8, 8),  # not over two chunks: whole
        "permuted": random_tensor((29, 13, 7), dtype, 3).permute(2, 0, 1),  # dense, permuted
        "sliced": big[:, ::2],  # not dense
        "small": random_tensor((5,), dtype, 4),
        "scalar": random_tensor((), dtype, 5),
        "conj": conj,
        "label": 3,
    }
    fake = CopyingAccelerator()
    stage = DeviceStage(DevicePlan(lambda: fake, True), depth=1)
    await stage.open()
    try:
        out = (await stage.stage(batch)).ready()
    finally:
        await stage.aclose()
    same(out, {**batch, "conj": conj.resolve_conj()})
    nbytes = big.numel() * big.element_size()
    assert nbytes > 2 * CHUNK and nbytes % CHUNK
    assert fake.device_copies(out["big"]) == chunks(nbytes)
    assert fake.device_copies(out["exact"]) == chunks(4 * CHUNK)
    for key in ("two", "permuted", "sliced", "small", "scalar", "conj"):  # each copied whole
        t = out[key]
        assert fake.device_copies(t) == [(0, t.numel() * t.element_size())], key
    assert all(nb for kind, *_, nb in fake.log if kind == "device"), "H2D copies not non_blocking"
    assert {kind for kind, *_ in fake.log} == {"host", "device", "record"}


async def test_each_chunk_is_sent_before_the_next_is_copied_and_one_event_ends_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(stage_module, "_CHUNK_BYTES", CHUNK)
    big = random_tensor((10 * CHUNK + 3,), torch.uint8, 7)
    fake = CopyingAccelerator()
    stage = DeviceStage(DevicePlan(lambda: fake, True), depth=1)
    await stage.open()
    try:
        out = (await stage.stage([big, torch.arange(3)])).ready()
        pool = stage.pool
        assert pool is not None and [e for _, e in pool._busy] == [fake.events[-1]]
    finally:
        await stage.aclose()
    same(out, [big, torch.arange(3)])
    log = fake.log
    assert [kind for kind, *_ in log] == ["host", "device"] * 12 + ["record"]
    assert len(fake.events) == 1  # one event, after every copy: the buffer's reuse waits for it
    pairs = zip(log[0:-1:2], log[1:-1:2], strict=True)
    for (_, staged, _, n, _), (_, _, src, m, non_blocking) in pairs:
        assert src == staged and m == n and non_blocking  # chunk k, sent as soon as staged
    assert fake.device_copies(out[0]) == chunks(10 * CHUNK + 3)


async def test_chunking_off_copies_each_tensor_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stage_module, "_CHUNK_BYTES", 0)  # what benchmarks/gpu_check.py sets
    big = random_tensor((64 << 10,), torch.float32, 8)
    fake = CopyingAccelerator()
    stage = DeviceStage(DevicePlan(lambda: fake, True), depth=1)
    await stage.open()
    try:
        out = (await stage.stage(big)).ready()
    finally:
        await stage.aclose()
    same(out, big)
    assert [kind for kind, *_ in fake.log] == ["host", "device", "record"]


async def test_a_failure_between_chunks_gives_the_buffer_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(stage_module, "_CHUNK_BYTES", CHUNK)
    big = random_tensor((8 * CHUNK,), torch.uint8, 9)
    fake = CopyingAccelerator(fail_at=3)
    stage = DeviceStage(DevicePlan(lambda: fake, True), depth=1)
    await stage.open()
    try:
        with pytest.raises(torch.OutOfMemoryError, match="pretend"):
            await stage.stage({"x": big})
        pool = stage.pool
        assert pool is not None and pool._lent == 0
        # Given back with an event after the copies issued before the failure.
        assert [kind for kind, *_ in fake.log] == ["host", "device"] * 3 + ["record"]
        assert [e for _, e in pool._busy] == [fake.events[-1]]
        out = (await stage.stage({"x": big})).ready()  # the stage goes on
    finally:
        await stage.aclose()
    same(out, {"x": big})
    assert fake.pinned_sizes == [1 << 16]


async def test_async_for_hands_over_on_the_loop_thread() -> None:
    dl = aioloader.DataLoader(Counting(12), batch_size=4)
    fake = on_fake_device(dl)
    async with dl:
        got = [b async for b in dl]
    assert torch.cat(got).tolist() == list(range(12))
    assert [thread for thread, _, _ in fake.handed] == [threading.get_ident()] * 3


def test_plain_for_hands_over_on_the_consumers_thread() -> None:
    dl = aioloader.DataLoader(Counting(12), batch_size=4, num_workers=2, worker_mode="thread")
    fake = on_fake_device(dl)
    got = []
    for batch in dl:
        got.append(batch)
        # The batch was made ready on this thread's stream, before it reached this thread.
        assert fake.handed[-1][0] == threading.get_ident()
        assert fake.handed[-1][2][0] is batch
    assert torch.cat(got).tolist() == list(range(12))
    assert len(fake.handed) == 3 and fake.closed
    assert aioloader_threads() == []


async def test_device_transform_runs_on_the_side_stream_after_the_copy() -> None:
    seen: list[tuple[str, bool, int]] = []
    fake = FakeAccelerator()

    def normalise(batch: torch.Tensor) -> torch.Tensor:
        seen.append((threading.current_thread().name, fake.on_side(), len(fake.events)))
        return batch.float() / 2

    dl = aioloader.DataLoader(Counting(8), batch_size=4)
    on_fake_device(dl, fake, transform=normalise)
    async with dl:
        got = [b async for b in dl]
    assert [b.tolist() for b in got] == [[0.0, 0.5, 1.0, 1.5], [2.0, 2.5, 3.0, 3.5]]
    # On the stage's thread, on the side stream, after the copy's event; then one more event.
    assert seen == [("aioloader-device_0", True, 1), ("aioloader-device_0", True, 3)]
    assert [event for _, event, _ in fake.handed] == [fake.events[1], fake.events[3]]
    assert [t.dtype for _, _, ts in fake.handed for t in ts] == [torch.float32] * 2


@pytest.mark.parametrize(("prefetch", "depth"), [(0, 1), (1, 1), (3, 3)])
async def test_at_most_prefetch_batches_wait_on_the_device(prefetch: int, depth: int) -> None:
    dl = aioloader.DataLoader(Counting(200), batch_size=2, prefetch=prefetch)
    on_fake_device(dl)
    async with dl:
        it = aiter(dl)
        got = [await anext(it)]

        def ahead() -> int:
            s = dl.statistics()
            return s.stage("device").completed - s.consumer.batches

        # The consumer stops: the stage fills to its bound, and stays there.
        with anyio.fail_after(10):
            while ahead() < depth:
                await anyio.lowlevel.checkpoint()
        for _ in range(300):
            await anyio.lowlevel.checkpoint()
        assert ahead() == depth
        assert dl.statistics().stage("device").queued == depth
        async for batch in it:
            got.append(batch)
            assert ahead() <= depth
    assert torch.cat(got).tolist() == list(range(200))
    s = dl.statistics().stage("device")
    assert s.max_queued == depth == s.queue_capacity
    if prefetch:  # (with 0, the stage waits in the hand-off to the consumer instead)
        assert s.blocked_put_s > 0  # the stage did wait for the consumer


async def test_pinned_buffers_wait_for_copies_off_the_loop() -> None:
    dl = aioloader.DataLoader(Counting(40), batch_size=4, prefetch=1)
    fake = on_fake_device(dl, FakeAccelerator(complete=False))  # copies never finish alone
    async with dl:
        got = [b async for b in dl]
        pool = dl._scope.device.pool if dl._scope and dl._scope.device else None
        assert pool is not None
        assert pool.allocations == pool.capacity == 2 and pool.waits >= 8
    assert torch.cat(got).tolist() == list(range(40))
    assert fake.pinned_sizes == [1 << 16] * 2
    assert set(fake.synced_on) == {"aioloader-device_0"}


async def test_unpinned_copies_use_no_pool() -> None:
    dl = aioloader.DataLoader(Counting(8), batch_size=4)
    fake = on_fake_device(dl, pin=False)
    async with dl:
        assert dl._scope is not None and dl._scope.device is not None
        assert dl._scope.device.pool is None
        got = [b async for b in dl]
    assert torch.cat(got).tolist() == list(range(8)) and fake.pinned_sizes == []


async def test_device_failure_comes_after_the_batches_before_it() -> None:
    def explode_on_third(batch: torch.Tensor) -> torch.Tensor:
        if int(batch[0]) == 8:
            raise torch.OutOfMemoryError("pretend the device is full")
        return batch

    dl = aioloader.DataLoader(Counting(40), batch_size=4, prefetch=3)
    on_fake_device(dl, transform=explode_on_third)
    got = []
    async with dl:
        with pytest.raises(torch.OutOfMemoryError) as info:
            async for batch in dl:
                got.append(batch)
        assert torch.cat(got).tolist() == list(range(8))
        assert any("stage 'device'" in note for note in info.value.__notes__)
        assert dl.statistics().stage("device").failed == 1
    assert aioloader_threads() == []


async def test_a_failure_carried_on_a_batch_stays_in_order_with_a_device() -> None:
    dl = aioloader.DataLoader(Counting(40, fail={21}), batch_size=4, prefetch=2)
    on_fake_device(dl)
    got = []
    async with dl:
        with pytest.raises(KeyError, match="bad sample 21"):
            async for batch in dl:
                got.append(batch)
    assert torch.cat(got).tolist() == list(range(20))


async def test_break_drops_staged_batches_and_leaves_nothing_behind() -> None:
    refs: list[weakref.ref[torch.Tensor]] = []

    def track(batch: torch.Tensor) -> torch.Tensor:
        refs.append(weakref.ref(batch))
        return batch

    dl = aioloader.DataLoader(Counting(400), batch_size=4, prefetch=3)
    fake = on_fake_device(dl, transform=track)
    async with dl:
        it = aiter(dl)
        first = await anext(it)
        with anyio.fail_after(10):
            while dl.statistics().stage("device").queued < 3:
                await anyio.lowlevel.checkpoint()
        await it.aclose()
        gc.collect()
        alive = [r() for r in refs if r() is not None]
        assert len(alive) == 1 and alive[0] is first, "staged batches outlived their epoch"
        assert torch.cat([b async for b in dl]).tolist() == list(range(400))
    assert fake.closed and other_tasks() == set() and aioloader_threads() == []


async def test_leaving_the_scope_while_a_batch_is_being_staged() -> None:
    entered, release = threading.Event(), threading.Event()

    def slow(batch: torch.Tensor) -> torch.Tensor:
        if int(batch[0]) == 8:
            entered.set()
            release.wait(10)
        return batch

    dl = aioloader.DataLoader(Counting(400), batch_size=4, prefetch=2)
    fake = on_fake_device(dl, transform=slow)
    with anyio.CancelScope() as scope:
        async with dl:
            async for _ in dl:
                await anyio.to_thread.run_sync(entered.wait, 10)
                release.set()  # the staging in flight finishes while the scope closes
                scope.cancel()
                await anyio.lowlevel.checkpoint()
    assert scope.cancelled_caught
    assert fake.closed and [w for w, _ in fake.calls][-1] == "close"
    assert other_tasks() == set() and aioloader_threads() == []
    async with dl:  # a new scope, a whole epoch
        assert torch.cat([b async for b in dl]).tolist() == list(range(400))


# -- without a device ---------------------------------------------------------------------------


async def test_cpu_device_is_a_no_op() -> None:
    dl = aioloader.DataLoader(Counting(10), batch_size=4, device="cpu")
    assert dl.device == torch.device("cpu")
    async with dl:
        got = [b async for b in dl]
        assert not any(name.startswith("aioloader-device") for name in aioloader_threads())
        assert dl._scope is not None and dl._scope.device is None
    assert torch.cat(got).tolist() == list(range(10))
    assert [s.name for s in dl.statistics().stages] == ["window", "fetch", "transform", "output"]


def double(batch: torch.Tensor) -> torch.Tensor:
    return batch * 2


@pytest.mark.parametrize(
    "workers", [{}, {"num_workers": 2, "worker_mode": "thread"}, {"num_workers": 1}]
)
@pytest.mark.parametrize("device", [None, "cpu"])
def test_device_transform_on_the_host_runs_after_collate(
    device: str | None, workers: dict[str, Any]
) -> None:
    pickle.dumps(double)  # process workers receive it by reference
    dl = aioloader.DataLoader(
        list(range(10)), batch_size=4, device=device, device_transform=double, **workers
    )
    assert [b.tolist() for b in dl] == [[0, 2, 4, 6], [8, 10, 12, 14], [16, 18]]


@no_cuda
def test_pin_memory_with_cpu_device_warns_and_still_works() -> None:
    with pytest.warns(UserWarning, match="pin_memory"):
        dl = aioloader.DataLoader(list(range(6)), batch_size=3, pin_memory=True, device="cpu")
    got = list(dl)
    assert [b.tolist() for b in got] == [[0, 1, 2], [3, 4, 5]]
    assert not any(b.is_pinned() for b in got)
    assert dl.pin_memory is True  # torch's attribute keeps what was asked


class CustomBatch:
    """torch's documented custom batch type: a ``collate_fn`` returns it, and its own
    ``pin_memory`` pins it (here, without CUDA, it says it was called)."""

    def __init__(self, samples: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.inp = torch.stack([inp for inp, _ in samples])
        self.tgt = torch.stack([tgt for _, tgt in samples])
        self.pinned_in: int | None = None

    def pin_memory(self) -> CustomBatch:
        self.pinned_in = threading.get_ident()
        return self


@pytest.mark.parametrize("num_workers", [0, 1])
def test_pinning_on_the_host_calls_a_custom_batch_s_own_pin_memory(
    num_workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pin_memory=True`` without ``device``: a batch type with a ``pin_memory`` method is
    pinned by it, on the stage's thread, as torch's pin thread does (torch's
    ``TestCustomPinFn``, which needs CUDA there)."""
    monkeypatch.setattr(stage_module, "page_locked", lambda shape, strides, dtype: (
        torch.empty_strided(shape, strides, dtype=dtype)
    ))  # fmt: skip
    values = torch.arange(50, dtype=torch.float32).view(10, 5)
    dataset = torch.utils.data.TensorDataset(values, values + 100)
    loader = aioloader.DataLoader(
        dataset, batch_size=2, collate_fn=CustomBatch, num_workers=num_workers
    )
    loader._plan = dataclasses.replace(loader._plan, device_plan=DevicePlan(None, True))
    got = list(loader)
    assert [type(b) for b in got] == 5 * [CustomBatch]
    assert torch.equal(torch.cat([b.inp for b in got]), values)
    assert torch.equal(torch.cat([b.tgt for b in got]), values + 100)
    threads = {b.pinned_in for b in got}
    assert len(threads) == 1 and None not in threads and threading.get_ident() not in threads


def test_a_batch_handed_out_is_not_kept_by_the_loader() -> None:
    refs: list[weakref.ref[torch.Tensor]] = []

    def track(batch: torch.Tensor) -> torch.Tensor:
        refs.append(weakref.ref(batch))
        return batch

    dl = aioloader.DataLoader(Counting(16), batch_size=4, prefetch=1)
    on_fake_device(dl, FakeAccelerator(), transform=track)
    with dl:
        it = iter(dl)
        first = next(it)
        assert refs[0]() is first
        del first
        fake = dl._scope.device.accelerator if dl._scope and dl._scope.device else None
        assert isinstance(fake, FakeAccelerator)
        fake.handed.clear()  # (the fake keeps what it was handed)
        assert refs[0]() is None, "the plain `for` machinery kept the batch alive"
        assert len(list(it)) == 3
