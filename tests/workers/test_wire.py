"""What torch's forked workers take as it is reaches ours too: a dataset holding a lambda, local
functions as ``collate_fn`` and ``worker_init_fn``, a notebook's classes (by value, cloudpickle);
what can be found by name still goes by name, and what cannot be sent at all is named."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import aioloader
from aioloader._workers import wire

ROOT = Path(__file__).parents[2]


def by_name(x: int) -> int:
    return x + 1


def test_what_can_be_found_by_name_goes_by_name_and_the_rest_by_value() -> None:
    sent = bytes(wire.dumps((by_name, torch.arange(3))))
    assert b"cloudpickle" not in sent
    assert pickle.loads(sent)[0] is by_name
    offset = 10
    sent = bytes(wire.dumps(lambda x: x + offset))  # a closure: the standard pickle refuses it
    assert b"cloudpickle" in sent
    assert pickle.loads(sent)(1) == 11


def test_main_s_own_functions_go_by_value_where_the_workers_do_not_run_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def in_main(x: int) -> int:
        return x * 3

    in_main.__module__ = "__main__"
    in_main.__qualname__ = "in_main"
    monkeypatch.setitem(sys.modules["__main__"].__dict__, "in_main", in_main)
    monkeypatch.setattr(wire, "main_runs_again", lambda: True)  # a script, or python -m
    assert b"cloudpickle" not in bytes(wire.dumps(in_main))
    monkeypatch.setattr(wire, "main_runs_again", lambda: False)  # a notebook, python -c
    sent = bytes(wire.dumps(in_main))
    assert b"cloudpickle" in sent and pickle.loads(sent)(2) == 6
    # A worker's reply to the main process, which has every name of its __main__, goes by name.
    assert b"cloudpickle" not in bytes(wire.dumps(in_main, to_main=True))


def test_a_dataset_holding_a_lambda_with_local_collate_and_init_runs_in_the_workers() -> None:
    """What a torch user on Linux writes (their workers are forked): every piece local."""

    class Scaled(torch.utils.data.Dataset[int]):
        def __init__(self) -> None:
            self.scale = lambda i: i * 10
            self.offset = 0

        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> tuple[int, int, int]:
            info = torch.utils.data.get_worker_info()
            assert info is not None
            return self.scale(i) + self.offset, info.id, info.num_workers

    def init(worker_id: int) -> None:
        info = aioloader.get_worker_info()
        assert info is not None
        info.dataset.offset = 1000 * (worker_id + 1)  # this worker's own copy

    def collate(samples: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        return sorted(samples)

    loader = aioloader.DataLoader(
        Scaled(), batch_size=2, num_workers=2, worker_init_fn=init, collate_fn=collate
    )
    got = [sample for batch in loader for sample in batch]
    assert [value % 1000 for value, _, _ in got] == [i * 10 for i in range(8)]
    assert {(value // 1000, worker) for value, worker, _ in got} == {(1, 0), (2, 1)}
    assert {n for _, _, n in got} == {2}


def test_a_notebook_s_classes_go_by_value_and_come_back_as_themselves() -> None:
    """``python -c`` (as a notebook or a REPL: no main module for the workers to run): the
    dataset and sample classes of ``__main__`` reach the workers by value, and the samples come
    back as instances of the main process's own class."""
    program = textwrap.dedent(
        """
        import dataclasses, json, torch, aioloader

        @dataclasses.dataclass
        class Sample:
            index: int
            worker: int

        class Numbers(torch.utils.data.Dataset):
            def __len__(self):
                return 6

            def __getitem__(self, i):
                return Sample(i, torch.utils.data.get_worker_info().id)

        loader = aioloader.DataLoader(Numbers(), batch_size=3, num_workers=2, collate_fn=list)
        batches = list(loader)
        print(json.dumps({
            "same_class": all(type(s) is Sample for b in batches for s in b),
            "indices": [[s.index for s in b] for b in batches],
            "workers": sorted({s.worker for b in batches for s in b}),
        }))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"same_class": True, "indices": [[0, 1, 2], [3, 4, 5]], "workers": [0, 1]}


class Locked(torch.utils.data.Dataset[int]):
    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i


def test_a_dataset_that_cannot_be_sent_even_by_value_is_named() -> None:
    loader = aioloader.DataLoader(Locked(), batch_size=2, num_workers=1)
    with pytest.raises(TypeError, match=r"cannot pickle '_thread\.lock'") as info:
        list(loader)
    notes: Any = getattr(info.value, "__notes__", [])
    assert any("the dataset (Locked) is sent to each worker process" in n for n in notes), notes


def test_a_class_the_workers_cannot_find_by_name_is_named_not_a_crash(tmp_path: Path) -> None:
    """A script whose dataset class is defined under its ``__main__`` guard, with spawn (the
    workers run the main module again without that block): before, each worker died as it
    started (``WorkerCrashed``); now the start fails with the unpickling error and a note that
    names the dataset and the guard."""
    script = tmp_path / "guarded.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch, aioloader

            if __name__ == "__main__":
                class Hidden(torch.utils.data.Dataset):
                    def __len__(self):
                        return 4

                    def __getitem__(self, i):
                        return i

                loader = aioloader.DataLoader(
                    Hidden(), batch_size=2, num_workers=1, multiprocessing_context="spawn"
                )
                try:
                    list(loader)
                except AttributeError as exc:
                    print(exc)
                    print(exc.__notes__[0])
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    error, note = done.stdout.strip().splitlines()[-2:]
    assert "Hidden" in error, done.stdout
    assert note.startswith("aioloader: the dataset (Hidden) was pickled in the main process")
    assert "`if __name__ == '__main__':` block" in note
