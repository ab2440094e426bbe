"""``RayWorkers`` and ``worker_mode``'s Ray forms, checked as the loader is built (no cluster:
a Ray loader without workers, or a wrong argument, never joins one)."""

from __future__ import annotations

from typing import Any

import pytest

import aioloader


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
