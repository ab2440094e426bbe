"""A torch ``IterableDataset`` in worker processes resumes: each worker's copy saves its own
place (its ``state_dict()`` after each batch it read, sent back with the batch), and the
round-robin over the workers goes on where it stood."""

from __future__ import annotations

from typing import Any

import pytest

from aioloader import DataLoader
from tests.support.helpers import stop_and_resume
from tests.support.worker_datasets import Ranges, ResumableShards


def make(length: int, **kw: Any) -> DataLoader[Any]:
    uneven = kw.pop("uneven", False)
    return DataLoader(
        ResumableShards(length, uneven=uneven), batch_size=4, num_workers=2, collate_fn=list, **kw
    )


@pytest.mark.parametrize("stop", [0, 1, 5, 11, 14])
@pytest.mark.parametrize("kw", [{}, {"uneven": True}, {"in_order": False}])
def test_workers_resume_their_own_places(stop: int, kw: dict[str, Any]) -> None:
    full, first, rest, _ = stop_and_resume(lambda: make(60, **kw), stop)
    if kw.get("in_order", True):
        assert first + rest == full
    else:
        assert sorted(i for b in first + rest for i in b) == sorted(i for b in full for i in b)


def test_a_dataset_without_state_dict_in_workers_is_named() -> None:
    loader = DataLoader(Ranges(0, 10), batch_size=2, num_workers=2, collate_fn=list)
    assert loader.state_dict()["taken"] == {"through": 0, "beyond": []}  # an epoch's start
    it = iter(loader)
    first = next(it)
    with pytest.raises(TypeError, match="Ranges is read in worker processes, and neither it"):
        loader.state_dict()
    rest = list(it)
    assert sorted(i for b in [first, *rest] for i in b) == list(range(10))  # nothing lost
