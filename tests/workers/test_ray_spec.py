"""``RayWorkers`` and ``worker_mode``'s Ray forms, checked as the loader is built (no cluster:
a Ray loader without workers, or a wrong argument, never joins one)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

import aioloader
from aioloader._workers import rayspec
from aioloader._workers.rayactor import WireTensor
from tests.support import worker_datasets as wd


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"num_cpus": -1}, ValueError, "num_cpus must be >= 0, got -1"),
        ({"num_gpus": "1"}, TypeError, "num_gpus must be a number, got '1'"),
        ({"num_cpus": float("nan")}, ValueError, "num_cpus must be >= 0"),
        ({"resources": {"decode": 0}}, TypeError, "resources must map resource names"),
        ({"resources": ["decode"]}, TypeError, "resources must map resource names"),
        ({"options": {"num_cpus": 2}}, ValueError, "options may not set num_cpus"),
        ({"options": {"max_restarts": 3}}, ValueError, "options may not set max_restarts"),
        ({"start_timeout": 0}, ValueError, "start_timeout must be > 0 seconds, got 0"),
        ({"address": 6379}, TypeError, "address must be a str or None, got 6379"),
        ({"shared_memory": 1}, TypeError, "shared_memory must be a bool, got 1"),
    ],
)
def test_a_wrong_ray_workers_argument_is_named(
    kwargs: dict[str, Any], error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words.replace("(", r"\(").replace("[", r"\[")):
        aioloader.RayWorkers(**kwargs)


def test_ray_workers_keep_their_own_copies_and_give_ray_its_options() -> None:
    resources = {"decode": 1.0}
    spec = aioloader.RayWorkers(num_cpus=2, resources=resources, options={"memory": 1 << 30})
    resources["decode"] = 5.0  # the caller's later change does not reach the spec
    assert spec.actor_options() == {
        "memory": 1 << 30,
        "num_cpus": 2,
        "num_gpus": 0.0,
        "resources": {"decode": 1.0},
        "max_restarts": 0,
        "max_concurrency": 1,
    }
    assert spec.asked() == "num_cpus=2, resources={'decode': 1.0}"


def test_an_unknown_worker_mode_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"'process', 'thread', 'ray' or an aioloader\.RayWorkers"):
        aioloader.DataLoader(list(range(4)), num_workers=1, worker_mode="rays")  # type: ignore[arg-type]


def test_ray_without_workers_warns_and_makes_batches_here() -> None:
    with pytest.warns(UserWarning, match="has no effect with num_workers=0"):
        loader = aioloader.DataLoader(list(range(4)), batch_size=2, worker_mode="ray")
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    assert loader.statistics().workers is None


def test_worker_mode_ray_without_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = rayspec.importlib.util.find_spec
    monkeypatch.setattr(
        rayspec.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "ray" else real(name, *a),
    )
    with pytest.raises(ImportError, match=r"pip install 'aioloader\[ray\]'"):
        aioloader.DataLoader(wd.WhoReads(4), num_workers=2, worker_mode="ray")


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(24.0).reshape(2, 3, 4),
        torch.arange(24.0).reshape(2, 3, 4).permute(2, 0, 1),
        torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
        torch.tensor(3.5),
        torch.arange(10)[::2],
        torch.arange(6).reshape(2, 3).expand(4, 2, 3),
        torch.randn(3, 4, dtype=torch.complex64).conj(),
        torch.ones(2, 2, dtype=torch.bfloat16).t(),
    ],
    ids=["contiguous", "permuted", "channels_last", "0-d", "strided", "expanded", "conj", "bf16"],
)
def test_a_tensor_crosses_the_wire_whole_with_its_layout_where_dense(tensor: torch.Tensor) -> None:
    sent = pickle.loads(pickle.dumps(WireTensor(tensor), protocol=5))
    back = sent.tensor()
    assert back.dtype == tensor.dtype and torch.equal(back, tensor.resolve_conj())
    if tensor.stride() in ((2,), (0, 3, 1)):  # gaps or overlaps: arrives contiguous
        assert back.is_contiguous()
    else:  # a permutation of a dense block: its strides kept
        assert back.stride() == tensor.stride()
    back.add_(1)  # its own memory, writable
