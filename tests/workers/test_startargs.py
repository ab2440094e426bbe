"""A worker's start arguments: the dataset and ``worker_init_fn`` go in one pickle (a method of
the dataset works on the worker's own copy), and a dataset the worker cannot unpickle is named
with where it must be defined, not a crash at the start."""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

import aioloader
from aioloader._workers import startargs

ROOT = Path(__file__).parents[2]


class Sharded(torch.utils.data.Dataset[int]):
    def __init__(self) -> None:
        self.offset = 0

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i + self.offset

    def init_worker(self, worker_id: int) -> None:
        self.offset = 1000 * (worker_id + 1)


@pytest.mark.parametrize("context", ["forkserver", "spawn"])
def test_worker_init_fn_a_method_of_the_dataset_sets_up_the_worker_s_copy(context: str) -> None:
    """torch's idiom: the bound method and the dataset arrive in one pickle, one object."""
    dataset = Sharded()
    loader = aioloader.DataLoader(
        dataset,
        batch_size=2,
        num_workers=1,
        worker_init_fn=dataset.init_worker,
        multiprocessing_context=context,
    )
    assert [b.tolist() for b in loader] == [[1000, 1001], [1002, 1003]]
    assert dataset.offset == 0  # this process's copy is its own


class Table(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self, table: torch.Tensor) -> None:
        self.table = table

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.table[i]


def check_table(table: torch.Tensor, worker_id: int) -> None:
    assert table.sum().item() == 6.0


def test_a_tensor_the_dataset_and_worker_init_fn_share_crosses_once_with_spawn() -> None:
    """One tensor in both arguments: its storage is reduced once (spawn refuses a descriptor
    given twice: "bad value(s) in fds_to_keep")."""
    table = torch.arange(4.0)
    loader = aioloader.DataLoader(
        Table(table),
        batch_size=2,
        num_workers=1,
        worker_init_fn=functools.partial(check_table, table),
        multiprocessing_context="spawn",
    )
    assert [b.tolist() for b in loader] == [[0.0, 1.0], [2.0, 3.0]]


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


def fake_main(spec_name: str | None = None, file: str | None = None) -> types.ModuleType:
    main = types.ModuleType("__main__")
    main.__spec__ = None if spec_name is None else types.SimpleNamespace(name=spec_name)  # type: ignore[assignment]
    if file is not None:
        main.__file__ = file
    return main


@pytest.mark.parametrize(
    ("spec_name", "file", "again"),
    [
        ("pkg.train", None, True),  # python -m pkg.train
        ("pkg.__main__", None, False),  # python -m pkg: multiprocessing skips a __main__
        ("__main__", None, False),  # python somedir/
        (None, __file__, True),  # a script
        (None, "<stdin>", False),  # python - < file
        (None, None, False),  # python -c, a notebook
    ],
)
def test_whether_the_workers_run_the_main_module_again_follows_multiprocessing(
    monkeypatch: pytest.MonkeyPatch, spec_name: str | None, file: str | None, again: bool
) -> None:
    monkeypatch.setitem(sys.modules, "__main__", fake_main(spec_name, file))
    assert startargs.main_runs_again() is again
