"""Results through shared memory from a Ray worker on the loader's machine (``rayshm.py``),
without a cluster: blocks written and mapped, unlinked as they are mapped, discarded, swept, and
the way back to the object store when ``/dev/shm`` has no room."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from aioloader._workers import rayshm
from aioloader._workers.job import JobResult


@pytest.fixture
def shm_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(rayshm, "SHM_DIR", tmp_path)
    return tmp_path


def test_a_result_crosses_in_one_block_unlinked_as_it_is_mapped(shm_dir: Path) -> None:
    image = torch.randn(4, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    result = JobResult(batch={"image": image, "label": torch.arange(4), "name": "x"}, size=4)
    sent = rayshm.to_shm(result, "aioloader-ray-t")
    assert isinstance(sent.batch["image"], rayshm.ShmTensor) and sent.batch["name"] == "x"
    assert len(list(shm_dir.iterdir())) == 1  # one block for the whole result
    back = rayshm.from_shm(sent)
    assert list(shm_dir.iterdir()) == []  # unlinked as it was mapped: its memory lives on
    assert torch.equal(back.batch["image"], image)
    assert back.batch["image"].stride() == image.stride()
    assert torch.equal(back.batch["label"], torch.arange(4))
    back.batch["label"].add_(1)  # writable, its own memory
    assert back.batch["label"].tolist() == [1, 2, 3, 4]


def test_a_result_without_tensors_makes_no_block(shm_dir: Path) -> None:
    assert rayshm.to_shm(JobResult(batch=[1, 2], size=2), "aioloader-ray-t").batch == [1, 2]
    assert list(shm_dir.iterdir()) == []


def test_a_dropped_reply_is_discarded_and_a_pool_sweeps_what_is_left(shm_dir: Path) -> None:
    dropped = rayshm.to_shm(JobResult(batch=torch.ones(3)), "aioloader-ray-a")
    rayshm.discard(dropped)
    assert list(shm_dir.iterdir()) == []
    rayshm.to_shm(JobResult(batch=torch.ones(3)), "aioloader-ray-a")  # an actor killed after
    rayshm.to_shm(JobResult(batch=torch.ones(3)), "aioloader-ray-b")  # another pool's
    assert rayshm.sweep("aioloader-ray-a") == 1
    assert [p.name.split("-")[2] for p in shm_dir.iterdir()] == ["b"]


def test_a_block_that_cannot_be_made_leaves_nothing_and_says_oserror(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match="No space left"):
        rayshm.to_shm(JobResult(batch=torch.ones(3)), "aioloader-ray-t")
    assert list(shm_dir.iterdir()) == []


def test_a_missing_block_is_named(shm_dir: Path) -> None:
    sent = rayshm.to_shm(JobResult(batch=torch.ones(3)), "aioloader-ray-t")
    rayshm.sweep("aioloader-ray-t")
    with pytest.raises(FileNotFoundError, match="result block is gone"):
        rayshm.from_shm(sent)


def test_the_probe_tells_an_actor_whether_it_shares_this_machines_memory(shm_dir: Path) -> None:
    name = rayshm.probe("aioloader-ray-t")
    assert name is not None and rayshm.sees(name)
    assert not rayshm.sees("aioloader-ray-elsewhere-probe") and not rayshm.sees(None)
    assert rayshm.sweep("aioloader-ray-t") == 1  # the probe goes with the pool's blocks


def test_blocks_of_a_loader_process_that_is_gone_are_swept(shm_dir: Path) -> None:
    import subprocess
    import sys

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = f"aioloader-ray-{int(gone.stdout)}-abcd"
    rayshm.to_shm(JobResult(batch=torch.ones(3)), dead)  # left by a loader killed mid-epoch
    (shm_dir / f"{dead}-probe").touch()
    mine = rayshm.to_shm(JobResult(batch=torch.ones(3)), f"aioloader-ray-{os.getpid()}-ef01")
    (shm_dir / "unrelated").touch()
    assert rayshm.sweep_orphans() == 2
    assert sorted(p.name for p in shm_dir.iterdir()) == sorted([mine.batch.block, "unrelated"])
