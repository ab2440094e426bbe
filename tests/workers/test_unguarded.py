"""Scripts without ``if __name__ == "__main__":``, as torch users on Linux write them (torch's
fork workers never run the script again). Where the fork server cannot be forked from the
script as its loader is built (CUDA initialised, another thread), the standby forked as
aioloader was imported serves: it used to run the script again, and so build the model again,
initialise CUDA and come to the loader again, and every worker died. It now leaves the script
alone, and the workers are sent its classes by value, as a notebook's.

Each case runs a script in a fresh interpreter, beside torch's ``DataLoader`` where torch can
run it, and counts how many times the script's top level ran (a line appended to a file)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aioloader._workers import forkserver, serverstart
from aioloader._workers.mainscript import guarded_at

HEAD = """
import json, os, sys, threading, time
import torch, torch.utils.data
import aioloader

with open("runs.txt", "a") as runs:  # the top level's side effect: how often it ran
    runs.write(f"{os.getpid()}\\n")

class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 16
    def __getitem__(self, index):
        return index * index
"""

LOAD = """
if "cuda" in sys.argv:  # the model moved to the GPU first, as every training script does
    torch.cuda.is_initialized = lambda: True
if "thread" in sys.argv:  # a metrics or logging thread, started before the loader
    threading.Thread(target=threading.Event().wait, daemon=True).start()
Loader = torch.utils.data.DataLoader if "torch" in sys.argv else aioloader.DataLoader
loader = Loader(Squares(), batch_size=4, num_workers=2, shuffle=True)
batches = [b.tolist() for b in loader] + [b.tolist() for b in loader]
stats = loader.statistics().workers if Loader is aioloader.DataLoader else None
print(json.dumps({
    "samples": sorted(x for b in batches for x in b),
    "server": stats and stats.server,
    "why": stats and stats.server_why,
}))
"""

UNGUARDED = HEAD + LOAD
GUARDED = HEAD + "\nif __name__ == '__main__':\n" + textwrap.indent(LOAD, "    ")


def execute(
    folder: Path, script: str, *args: str, name: str = "train.py"
) -> subprocess.CompletedProcess[str]:
    """Write ``script`` (dedented) to ``folder/name`` and run it there as a user would:
    ``python name`` or, for a name of the form ``-m module``, ``python -m module``."""
    module = name.removeprefix("-m ") if name.startswith("-m ") else None
    path = folder / (module.replace(".", "/") + ".py" if module else name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(script))
    command = ["-m", module] if module else [name]
    return subprocess.run(
        [sys.executable, *command, *args],
        capture_output=True, text=True, timeout=90, check=False, cwd=folder,
    )  # fmt: skip


def run(folder: Path, script: str, *args: str, name: str = "train.py") -> dict[str, object]:
    (folder / "runs.txt").unlink(missing_ok=True)
    done = execute(folder, script, *args, name=name)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr[-3000:]
    got: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    got["runs"] = len((folder / "runs.txt").read_text().splitlines())
    return got


SQUARES = sorted(2 * [i * i for i in range(16)])


def test_an_unguarded_script_runs_once_and_its_workers_start(tmp_path: Path) -> None:
    theirs = run(tmp_path, UNGUARDED, "cuda", "torch")
    assert (theirs["samples"], theirs["runs"]) == (SQUARES, 1)  # torch's fork workers
    ours = run(tmp_path, UNGUARDED, "cuda")
    assert ours["samples"] == SQUARES
    assert ours["server"] == "standby"
    assert ours["runs"] == 1  # neither the standby nor a worker ran the script again


def test_run_with_a_relative_path_it_is_not_run_again_either(tmp_path: Path) -> None:
    """``python ./train.py`` (and a thread, not CUDA, first): multiprocessing compares the
    path as given with its normalised form, and a worker runs the script again where they
    differ."""
    ours = run(tmp_path, UNGUARDED, "thread", name="./train.py")
    assert (ours["samples"], ours["server"], ours["runs"]) == (SQUARES, "standby", 1)


def test_run_as_a_module_it_is_not_run_again_either(tmp_path: Path) -> None:
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "__init__.py").write_text("")
    got = run(tmp_path, UNGUARDED, "cuda", name="-m jobs.train")
    assert (got["samples"], got["server"]) == (SQUARES, "standby")
    assert got["runs"] == 1


def test_a_guarded_script_is_still_run_again_by_the_standby(tmp_path: Path) -> None:
    """With the guard, the standby runs the script's top level again (its classes then go by
    name), as spawn and the stdlib's server would: 2 runs."""
    ours = run(tmp_path, GUARDED, "cuda")
    assert (ours["samples"], ours["server"], ours["runs"]) == (SQUARES, "standby", 2)


THREAD_FIRST = (
    """
import threading
threading.Thread(target=threading.Event().wait, daemon=True).start()  # before aioloader
"""
    + UNGUARDED
)


@pytest.mark.parametrize("name", ["late.py", "-m jobs.late"])
def test_with_no_standby_the_stdlibs_server_stands_in_for_the_script(
    tmp_path: Path, name: str
) -> None:
    """A thread started before aioloader was imported: no server can be forked, nor a standby.
    The stdlib's fresh interpreter serves, marked as the script (``standin.py``), so that its
    workers do not run the script again (each used to, came back to the loader and died)."""
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "__init__.py").write_text("")
    theirs = run(tmp_path, THREAD_FIRST, "torch", name=name)
    assert (theirs["samples"], theirs["runs"]) == (SQUARES, 1)
    ours = run(tmp_path, THREAD_FIRST, name=name)
    assert (ours["samples"], ours["server"], ours["runs"]) == (SQUARES, "interpreter", 1)
    assert "this process had 2 Python threads" in str(ours["why"])


KILLED = (
    THREAD_FIRST
    + """
import multiprocessing.forkserver, signal
server = multiprocessing.forkserver._forkserver._forkserver_pid
os.kill(server, signal.SIGKILL)  # the server standing in for the script dies between epochs
os.waitid(os.P_PID, server, os.WEXITED | os.WNOWAIT)  # dead (left for the stdlib to reap)
again = sorted(x for b in loader for x in b.tolist())
print(json.dumps({"samples": again, "server": loader.statistics().workers.server}))
"""
)


def test_a_server_standing_in_that_died_is_started_again_standing_in(tmp_path: Path) -> None:
    """Found by review: the stdlib starts its server again where it died, and that one did
    not stand in for the script, so each later worker ran it again and died."""
    got = run(tmp_path, KILLED)
    once = sorted(i * i for i in range(16))
    assert (got["samples"], got["server"], got["runs"]) == (once, "interpreter", 1)


def test_whether_a_server_may_have_exited_is_told_without_reaping_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Alive: no. Exited: yes, and it is left for the stdlib to reap. Without ``os.waitid``
    (macOS before 3.13; found by review: every unguarded script failed there) it cannot be
    told: yes, and the stdlib's own check decides."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert forkserver.may_have_exited(child.pid) is False
        with monkeypatch.context() as patched:
            patched.delattr(os, "waitid")
            assert forkserver.may_have_exited(child.pid) is True
        child.kill()
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        assert forkserver.may_have_exited(child.pid) is True
        assert child.poll() == -9  # not reaped by the check: its owner's wait still sees it
    finally:
        child.kill()
        child.wait()


FLAKY = """
import json, os, sys, threading
if "first" in sys.argv:  # a thread before aioloader: no standby, the stdlib's server
    threading.Thread(target=threading.Event().wait, daemon=True).start()
import torch.utils.data
import aioloader

class Flaky(Exception):  # the script's own: its workers do not have it by name
    pass

class Once(torch.utils.data.Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, index):
        if not os.path.exists(f"tried-{index}"):  # each sample fails the first time
            open(f"tried-{index}", "w").close()
            raise Flaky(index)
        return index

threading.Thread(target=threading.Event().wait, daemon=True).start()  # the standby serves
retry = aioloader.RetryPolicy(retry_on=(Flaky,), initial_backoff=0.001)
loader = aioloader.DataLoader(Once(), batch_size=4, num_workers=2, retry=retry)
samples = sorted(x for b in loader for x in b.tolist())
print(json.dumps({"samples": samples, "server": loader.statistics().workers.server}))
"""


@pytest.mark.parametrize(("first", "server"), [("", "standby"), ("first", "interpreter")])
def test_a_retry_policy_naming_the_scripts_exception_reaches_the_workers(
    tmp_path: Path, first: str, server: str
) -> None:
    """Found by review: the retry policy went to the workers by name, and its exception class
    (the script's, which these workers do not run) could not be found: every worker died."""
    done = execute(tmp_path, FLAKY, first, name="flaky.py")
    assert (done.returncode, done.stderr) == (0, ""), done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"samples": list(range(8)), "server": server}
    assert len(list(tmp_path.glob("tried-*"))) == 8  # each failed once, in a worker


DIES = """
import os, threading, torch.utils.data
import aioloader

class Ids(torch.utils.data.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, index):
        return index

def die(worker_id):  # a worker killed as it starts (out of memory, a native crash)
    os._exit(3)

threading.Thread(target=threading.Event().wait, daemon=True).start()
loader = aioloader.DataLoader(Ids(), batch_size=2, num_workers=1, worker_init_fn=die)
print(list(loader))
"""


@pytest.mark.parametrize(
    "first",
    [
        "",
        "import threading\nthreading.Thread(target=threading.Event().wait, daemon=True).start()\n",
    ],
)
def test_a_worker_dying_unguarded_is_not_blamed_on_the_script(tmp_path: Path, first: str) -> None:
    """Found by review: the standby's workers do not run the script again, and the error said
    they did (and to import aioloader earlier, which the script does). The same under the
    stdlib's server (a thread before aioloader: no standby)."""
    done = execute(tmp_path, first + DIES, name="dies.py")
    assert done.returncode == 1
    assert "exit code 3" in done.stderr and "died while starting" in done.stderr
    assert "not in the main script" in done.stderr


@pytest.mark.parametrize(("running", "blamed"), [(123, False), (456, True)])
def test_a_server_started_without_the_stand_in_is_blamed(
    monkeypatch: pytest.MonkeyPatch, running: int, blamed: bool
) -> None:
    """Where the stdlib's server running now is not the one started standing for the script
    (it died and the stdlib started another, or someone else started it), its workers ran
    the script again, and the note says so."""
    monkeypatch.setattr(
        serverstart, "_started", serverstart.ServerStart("interpreter", "x", main_again=False)
    )
    monkeypatch.setattr(serverstart, "_stood_in", 123)
    monkeypatch.setattr(serverstart, "running_server_pid", lambda: running)
    note = serverstart.died_starting_note("forkserver")
    assert ("runs the script again in each" in note) is blamed
    assert ("not in the main script" in note) is not blamed


SOURCE = """\
import os                               # 1
@decorate                               # 2
def f():                                # 3
    pass                                # 4
if __name__ == "__main__":              # 5
    main()                              # 6
    if x:                               # 7
        run()                           # 8
elif other:                             # 9
    more()                              # 10
if "__main__" == __name__ and ok:       # 11
    go()                                # 12
else:                                   # 13
    if __name__ == "__main__":          # 14
        never()                         # 15
    stop()                              # 16
try:                                    # 17
    if __name__ == "__main__":          # 18
        main()                          # 19
    work()                              # 20
except KeyboardInterrupt:               # 21
    with lock:                          # 22
        if __name__ == "__main__":      # 23
            more()                      # 24
def g():                                # 25
    if __name__ == "__main__":          # 26
        inner()                         # 27
"""


@pytest.mark.parametrize(
    ("line", "guarded"),
    [(1, False), (2, False), (3, False), (5, False), (6, True), (8, True), (10, False),
     (11, False), (12, True), (15, True), (16, False), (19, True), (20, False), (24, True),
     (27, False), (99, False)],
)  # fmt: skip
def test_which_lines_lie_inside_the_main_guard(line: int, guarded: bool) -> None:
    assert guarded_at(ast.parse(SOURCE).body, line) is guarded
