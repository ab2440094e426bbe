"""The fork server: a fork of this process when that is safe (workers then share its pages and
start without importing torch again); else the standby started as aioloader was imported (forked
then, or a fresh interpreter where that was not safe either), caught up with the main module;
else the stdlib's, with torch preloaded. Each case runs in a fresh interpreter: the server is
process-wide and starts once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

PROBE = """
import json, multiprocessing.forkserver, os, select, sys, threading, time
import torch.utils.data
if "repl" in sys.argv and __name__ == "__main__":  # a session, a thread before the import
    sys.ps1 = ">>> "  # (as Python's prompt has it; a kernel's IPython is found likewise)
    first = threading.Event()
    first_thread = threading.Thread(target=first.wait, daemon=True)
    first_thread.start()
if "authkey" in sys.argv:  # a server we do not know, as 3.14's (it has an authentication key)
    multiprocessing.forkserver._forkserver._forkserver_authkey = None
import aioloader
from aioloader._workers import standby

if "slow-import" in sys.argv:  # an import after aioloader's taking 0.6 s (in the standby too)
    time.sleep(0.6)

class Pids(torch.utils.data.Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return [os.getpid(), os.getppid()]

def cmdline(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\\0", b" ").decode()

def ppid(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])

FILES = []


def close_inherited(worker_id):
    # Objects inherited with the memory close "their" descriptors (as a collected one would):
    # that must not close what the worker's pipe reuses.
    for f in FILES:
        f.close()


if __name__ == "__main__":
    held = open(__file__)  # an application file: kept, as torch's fork workers keep it
    FILES.extend(open(__file__) for _ in range(16))
    pipe_r, pipe_w = os.pipe()  # a pipe's write end: let go of, or its reader never sees EOF
    standby_pid = standby._standby.server.pid if standby._standby else None
    if "first-ends" in sys.argv:  # that thread is done before the loader is built
        first.set()
        first_thread.join()
    if "thread" in sys.argv:  # another Python thread: forking is not safe
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
    if "cuda" in sys.argv:  # the check's seam: a CUDA context, as a training script has one
        torch.cuda.is_initialized = lambda: True
    loader = aioloader.DataLoader(
        Pids(), batch_size=4, num_workers=2, worker_init_fn=close_inherited
    )
    server_at_build = multiprocessing.forkserver._forkserver._forkserver_pid
    workers = {tuple(row) for batch in loader for row in torch.stack(batch, 1).tolist()}
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    server_fds = {os.readlink(f"/proc/{server}/fd/{fd}") for fd in os.listdir(f"/proc/{server}/fd")}
    os.close(pipe_w)
    readable, _, _ = select.select([pipe_r], [], [], 5.0)
    pipe_eof = bool(readable) and os.read(pipe_r, 1) == b""
    stats = loader.statistics().workers
    print(json.dumps({
        "server": stats.server,
        "server_why": stats.server_why,
        "server_s": stats.server_s,
        "standby_was": standby_pid,
        "standby_alive": standby_pid is not None and os.path.exists(f"/proc/{standby_pid}")
            and open(f"/proc/{standby_pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z",
        "pipe_eof": pipe_eof,
        "me": os.getpid(),
        "my_cmdline": cmdline(os.getpid()),
        "server_parent": ppid(server),
        "server_cmdline": cmdline(server),
        "server_at_build": server_at_build,
        "server_pid": server,
        "server_holds_app_file": os.path.realpath(held.name) in server_fds,
        "workers": len(workers),
        "workers_children_of_server": all(parent == server for _, parent in workers),
    }))
"""


def probe(tmp_path: Path, *modes: str, standby: bool = True) -> dict[str, Any]:
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(PROBE))
    env = {**os.environ, "AIOLOADER_STANDBY": "1" if standby else "0"}
    done = subprocess.run(
        [sys.executable, str(script), *modes],
        capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip
    assert (done.returncode, done.stderr) == (0, "")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def run_script(folder: Path, files: dict[str, str], main: str) -> subprocess.CompletedProcess[str]:
    """Write ``files`` (dedented) into ``folder`` and run ``main`` there, as a user's script."""
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(textwrap.dedent(text))
    return subprocess.run(
        [sys.executable, main],
        capture_output=True, text=True, timeout=60, check=False, cwd=folder,
    )  # fmt: skip


def test_the_server_is_a_fork_of_a_single_threaded_process(tmp_path: Path) -> None:
    got = probe(tmp_path, "alone")
    assert got["workers"] == 2 and got["workers_children_of_server"]
    assert got["server_parent"] == got["me"]
    assert got["server_cmdline"] == got["my_cmdline"]  # forked, not a fresh interpreter
    assert got["server_holds_app_file"]  # a module's open file reads in a worker, as with fork
    assert got["pipe_eof"]
    assert (got["server"], got["server_why"]) == ("forked", "")
    assert got["server_s"] < 0.5  # a fork of this process: milliseconds
    # The standby was there, and is gone: the server forked now replaced it.
    assert got["standby_was"] is not None and not got["standby_alive"]


@pytest.mark.parametrize(
    ("unsafe", "why"),
    [
        ("thread", "this process had 2 Python threads"),
        ("cuda", "CUDA was initialised in this process"),
    ],
)
def test_once_forking_is_unsafe_the_standby_serves(tmp_path: Path, unsafe: str, why: str) -> None:
    got = probe(tmp_path, unsafe)
    assert got["workers"] == 2 and got["workers_children_of_server"]
    assert (got["server"], got["server_why"]) == ("standby", why)
    assert got["standby_was"] is not None
    assert got["server_parent"] == got["me"]
    assert got["server_cmdline"] == got["my_cmdline"]  # forked, not a fresh interpreter
    assert got["pipe_eof"]
    assert 0 < got["server_s"] < 0.6  # waking it: the probe's imports are all in it already


def test_what_the_main_module_imports_after_aioloader_is_the_standbys_ready_time(
    tmp_path: Path,
) -> None:
    """Found on a GPU box: a script importing torchvision after aioloader had its standby
    import it again as it woke (5 s), which ``startup_s`` did not show; ``server_s`` does."""
    got = probe(tmp_path, "cuda", "slow-import")
    assert (got["server"], got["workers"]) == ("standby", 2)
    assert got["server_s"] >= 0.6


def test_without_a_standby_the_stdlib_starts_its_server(tmp_path: Path) -> None:
    """As the loader is built, not as its first epoch starts: the server's imports (seconds,
    a fresh interpreter's torch) run while the application goes on (a notebook's next cell)."""
    got = probe(tmp_path, "thread", standby=False)
    assert got["workers"] == 2
    assert got["server_at_build"] is not None
    assert got["server_at_build"] == got["server_pid"]  # the one the workers came from
    assert "multiprocessing.forkserver import main" in got["server_cmdline"]
    assert "aioloader._workers.worker" in got["server_cmdline"]  # torch preloaded in it
    assert got["pipe_eof"]
    assert got["server"] == "interpreter"
    assert got["server_why"] == "this process had 2 Python threads; no standby: AIOLOADER_STANDBY=0"


def test_a_thread_before_the_import_gets_a_fresh_standby_in_a_session(tmp_path: Path) -> None:
    """An interactive session, where no fork is safe as aioloader is imported: the standby is
    a fresh interpreter started then (its imports run while the user goes on), and it serves
    as a forked one. (The notebook test runs one in a real Jupyter kernel.)"""
    got = probe(tmp_path, "repl")
    assert got["workers"] == 2 and got["workers_children_of_server"]
    assert got["server"] == "fresh standby"
    why = "this process had 2 Python threads"
    assert got["server_why"] == f"{why}; when aioloader was imported, {why}"
    assert got["standby_was"] == got["server_at_build"] == got["server_pid"]
    assert got["server_parent"] == got["me"]
    assert "serve_fresh" in got["server_cmdline"]  # a fresh interpreter, not a fork
    assert not got["server_holds_app_file"]  # (it has none of this process's files)
    assert got["pipe_eof"]


def test_a_fresh_standby_not_needed_is_stopped(tmp_path: Path) -> None:
    """The thread ended before the loader was built: a server is forked from this process
    (it has everything the application imported), and the fresh standby is stopped."""
    got = probe(tmp_path, "repl", "first-ends")
    assert (got["server"], got["server_why"]) == ("forked", "")
    assert got["server_parent"] == got["me"] and got["workers_children_of_server"]
    assert got["standby_was"] is not None and not got["standby_alive"]


INTERRUPTED_IMPORT = """
import os, signal, sys, threading
# Ctrl-C as a terminal's job takes it, whatever the test's runner left ignored or blocked
# (in one CI run this script waited out its 30 s: it never saw the signal)
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
if __name__ == "__main__":  # an interactive session (a prompt runs no script again)
    sys.ps1 = ">>> "
    threading.Thread(target=threading.Event().wait, daemon=True).start()
import torch.utils.data
import aioloader

class Ids(torch.utils.data.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return i

if __name__ == "__main__":
    try:  # Ctrl-C in the terminal, as the fresh standby starts and imports torch
        os.killpg(0, signal.SIGINT)
        threading.Event().wait(20)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    loader = aioloader.DataLoader(Ids(), batch_size=2, num_workers=1)
    print([b.tolist() for b in loader], loader.statistics().workers.server)
"""


def test_ctrl_c_as_a_fresh_standby_starts_is_the_application_s_alone(tmp_path: Path) -> None:
    """The terminal sends Ctrl-C to the whole process group: the application takes it, and
    the fresh standby, still starting, neither prints a traceback nor dies of it (it is
    blocked in it from its start, then ignored until it is woken): it serves the loader."""
    (tmp_path / "job.py").write_text(textwrap.dedent(INTERRUPTED_IMPORT))
    done = subprocess.run(
        [sys.executable, "job.py"],
        capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path,
        start_new_session=True,  # its own process group, as a terminal's job
    )  # fmt: skip
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == "interrupted\n[[0, 1], [2, 3]] fresh standby\n"


SPAWN_INTERRUPTED = """
import os, signal, sys, threading
signal.signal(signal.SIGINT, signal.default_int_handler)  # (a background job has it ignored)
if __name__ == "__main__":
    sys.ps1 = ">>> "  # an interactive session: a fresh standby
    threading.Thread(target=threading.Event().wait, daemon=True).start()
import torch.utils.data
from multiprocessing import util

real, spawned = util.spawnv_passfds, []

def spawnv_passfds(*args):  # Ctrl-C arriving as the standby is spawned (held: SIGINT blocked)
    spawned.append(real(*args))
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    return spawned[-1]

util.spawnv_passfds = spawnv_passfds
before = set(os.listdir("/proc/self/fd"))
try:
    import aioloader
except KeyboardInterrupt:
    print("interrupted")
util.spawnv_passfds = real
from aioloader._workers import standby
left = sorted(set(os.listdir("/proc/self/fd")) - before - {str(fd) for fd in range(3)})
print(standby._standby, os.path.exists(f"/proc/{spawned[0]}"), left)
"""


def test_ctrl_c_as_the_fresh_standby_is_spawned_leaves_nothing(tmp_path: Path) -> None:
    """Found by review: the Ctrl-C held while the standby was spawned was raised once it was,
    and the child was left running, known to nobody, with both ends of its pipe open here."""
    done = run_script(tmp_path, {"job.py": SPAWN_INTERRUPTED}, "job.py")
    assert (done.returncode, done.stderr) == (0, ""), done.stderr[-2000:]
    assert done.stdout == "interrupted\nNone False []\n"  # killed and reaped, nothing open


SPAWN_INTERRUPTED_ELSEWHERE = """
import os, signal, sys, threading, time, _posixsubprocess
signal.signal(signal.SIGINT, signal.default_int_handler)  # (a background job has it ignored)
threading.Thread(target=threading.Event().wait, daemon=True).start()  # it takes the signal
import aioloader
from aioloader._workers.spawned import spawn_server

real, spawned = _posixsubprocess.fork_exec, []

def fork_exec(*args):  # a Ctrl-C to the process (a terminal's, a kernel's) as the child starts
    spawned.append(real(*args))
    os.kill(os.getpid(), signal.SIGINT)  # blocked in this thread: another thread takes it
    for _ in range(500):  # (on a busy machine, later)
        if signal.SIGINT not in signal.sigpending():
            break
        time.sleep(0.01)
    time.sleep(0.01)  # its handler would run here, on this (the main) thread
    return spawned[-1]

_posixsubprocess.fork_exec = fork_exec
line, theirs = os.pipe()  # (the standby's wake line, as fork_standby makes it)
before = set(os.listdir("/proc/self/fd"))
try:
    spawn_server("aioloader._workers.standby:serve_fresh", (theirs,), (0, os.getpgrp()))
except KeyboardInterrupt:
    print("interrupted")
_posixsubprocess.fork_exec = real
print(os.path.exists(f"/proc/{spawned[0]}"), sorted(set(os.listdir("/proc/self/fd")) - before))
"""


def test_a_ctrl_c_another_thread_takes_as_the_standby_is_spawned_leaves_nothing(
    tmp_path: Path,
) -> None:
    """Found by the second review: raised inside the stdlib's spawn call, it lost the pid. A
    search by the child's command line, which replaced it, came back empty under load (read
    while the child exec'd); the handler now runs once the pid is known."""
    done = run_script(tmp_path, {"job.py": SPAWN_INTERRUPTED_ELSEWHERE}, "job.py")
    assert (done.returncode, done.stderr) == (0, ""), done.stderr[-2000:]
    assert done.stdout == "interrupted\nFalse []\n"


WOKEN_ENVIRON = """
import os, sys, torch.utils.data
import aioloader

with open(f"seen-{os.getpid()}", "w") as seen:  # the top level, here and again in the standby
    seen.write(os.environ.get("AIOLOADER_TEST_ROOT", "unset"))

class Ids(torch.utils.data.Dataset):
    def __len__(self):
        return 2
    def __getitem__(self, i):
        return i

if __name__ == "__main__":
    os.environ["AIOLOADER_TEST_ROOT"] = "/data/b"  # set after the standby was forked
    torch.cuda.is_initialized = lambda: True  # the check's seam: the standby is woken
    loader = aioloader.DataLoader(Ids(), batch_size=2, num_workers=1)
    assert [b.tolist() for b in loader] == [[0, 1]]
    from multiprocessing.forkserver import _forkserver
    print(loader.statistics().workers.server, _forkserver._forkserver_pid)
"""


def test_the_standby_runs_the_main_module_again_with_this_process_s_environment(
    tmp_path: Path,
) -> None:
    done = run_script(tmp_path, {"job.py": WOKEN_ENVIRON}, "job.py")
    assert (done.returncode, done.stderr) == (0, ""), done.stderr[-2000:]
    how, server = done.stdout.split()
    assert how == "standby"
    seen = {p.name: p.read_text() for p in tmp_path.glob("seen-*")}
    assert seen[f"seen-{server}"] == "/data/b"  # as woken, not as forked at the import
    assert sorted(seen.values()) == ["/data/b", "unset"]  # (the script's own run: unset then)


LIBRARY = """
import os
import aioloader  # the standby is forked here, with this module half-imported
import torch.utils.data

class Pids(torch.utils.data.Dataset):  # defined after it: the standby imports this module again
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return os.getpid()
"""

SCRIPT = """
import sys, threading
import library

if __name__ == "__main__":
    threading.Thread(target=threading.Event().wait, daemon=True).start()
    loader = library.aioloader.DataLoader(library.Pids(), batch_size=4, num_workers=2)
    pids = {pid for batch in loader for pid in batch.tolist()}
    print(len(pids), loader.statistics().workers.server)
"""


def test_the_standby_imports_again_what_was_half_imported_when_it_was_forked(
    tmp_path: Path,
) -> None:
    done = run_script(tmp_path, {"library.py": LIBRARY, "script.py": SCRIPT}, "script.py")
    assert (done.returncode, done.stderr, done.stdout) == (0, "", "2 standby\n")


FORKS = """
import os, sys, threading
import torch.utils.data
import aioloader

class Ids(torch.utils.data.Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return i

def run(who):
    threading.Thread(target=threading.Event().wait, daemon=True).start()
    loader = aioloader.DataLoader(Ids(), batch_size=4, num_workers=2)
    got = [i for batch in loader for i in batch.tolist()]
    print(who, got == list(range(8)), loader.statistics().workers.server, flush=True)

if __name__ == "__main__":
    child = os.fork()  # the application's own fork, after aioloader forked its standby
    if child == 0:
        run("child")
        os._exit(0)
    os.waitpid(child, 0)
    run("parent")
"""


def test_a_forked_child_leaves_its_parents_standby_alone(tmp_path: Path) -> None:
    done = run_script(tmp_path, {"forks.py": FORKS}, "forks.py")
    # The child has no standby of its own (it was forked after it), the parent keeps its own.
    expected = "child True interpreter\nparent True standby\n"
    assert (done.returncode, done.stderr, done.stdout) == (0, "", expected)


LATE = """
import threading
threading.Thread(target=threading.Event().wait, daemon=True).start()  # before aioloader

import torch.utils.data
import aioloader

class Ids(torch.utils.data.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return i

if __name__ == "__main__":
    loader = aioloader.DataLoader(Ids(), batch_size=2, num_workers=1)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    workers = loader.statistics().workers
    print(workers.server, "|", workers.server_why)
"""


def test_imported_after_a_thread_started_the_fallback_says_so(tmp_path: Path) -> None:
    """In a script, a thread before aioloader's import: no standby (a fresh one is for an
    interactive session), the stdlib's server."""
    done = run_script(tmp_path, {"late.py": LATE}, "late.py")
    why = "this process had 2 Python threads"
    expected = f"interpreter | {why}; no standby: when aioloader was imported, {why}\n"
    assert (done.returncode, done.stderr, done.stdout) == (0, "", expected)


AT_EXIT = """
import atexit, json, os, sys, threading, time

servers = {}


def report():  # registered before aioloader's hook: runs after it, before the teardown
    alive = {name: os.path.exists(f"/proc/{pid}") for name, pid in servers.items()}
    print(json.dumps({"servers": sorted(servers), "alive": alive}), flush=True)


atexit.register(report)

import torch.utils.data
if "repl" in sys.argv and __name__ == "__main__":  # a fresh standby, started at the import
    sys.ps1 = ">>> "
    threading.Thread(target=threading.Event().wait, daemon=True).start()
import aioloader
import multiprocessing.forkserver
from aioloader._workers import standby

class Ids(torch.utils.data.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return i

if __name__ == "__main__":
    if standby._standby is not None:
        servers["standby"] = standby._standby.server.pid
    if "thread" in sys.argv:  # forking is not safe: the standby serves
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    if "loader" in sys.argv:
        loader = aioloader.DataLoader(Ids(), batch_size=2, num_workers=1, persistent_workers=True)
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
        servers["server"] = multiprocessing.forkserver._forkserver._forkserver_pid
    context = multiprocessing.get_context("forkserver")
    if "daemon" in sys.argv:  # the application's own process, left to multiprocessing's hook
        context.Process(target=time.sleep, args=(1000,), daemon=True).start()
    if "forkchild" in sys.argv:  # a child forked from this process, alive at exit
        multiprocessing.get_context("fork").Process(
            target=time.sleep, args=(1000,), daemon=True
        ).start()
    if "pool" in sys.argv:  # the application's own pool, left open
        pool = context.Pool(2)
        assert pool.map(abs, [-1, -2]) == [1, 2]
"""


@pytest.mark.parametrize(
    ("modes", "alive"),
    [
        ((), {"standby": False}),  # imported only: the standby never served
        (("repl",), {"standby": False}),  # a fresh standby, never woken
        (("repl", "loader"), {"server": False, "standby": False}),  # it served
        (("loader",), {"server": False, "standby": False}),  # a server forked from this process
        (("loader", "thread"), {"server": False, "standby": False}),  # the standby woken
        # A server whose processes are alive is left (found by review: waiting for it hung).
        (("loader", "daemon"), {"server": True, "standby": False}),
        (("loader", "thread", "pool"), {"server": True, "standby": True}),  # one process
        # A fork of this process holds no copy of the server's alive pipe (found by review).
        (("loader", "forkchild"), {"server": False, "standby": False}),
    ],
)
def test_the_servers_are_gone_before_the_interpreter_tears_down(
    tmp_path: Path, modes: tuple[str, ...], alive: dict[str, bool]
) -> None:
    """They share the heap copy-on-write: alive while the teardown writes to it, they would
    have every page it touches copied (the tree's PSS rose by a third as a script ended). One
    that forked processes still alive (the application's, here) stops only once they have
    exited: it is left as it was, and the script exits as promptly as before."""
    (tmp_path / "exits.py").write_text(textwrap.dedent(AT_EXIT))
    done = subprocess.run(
        [sys.executable, "exits.py", *modes],
        capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert (done.returncode, done.stderr) == (0, "")
    got = json.loads(done.stdout)
    assert got == {"servers": sorted(alive), "alive": alive}


FORK_EXIT = """
import json, os, signal, sys, time
import aioloader

if __name__ == "__main__":
    loader = aioloader.DataLoader(list(range(8)), batch_size=4, num_workers=1,
                                  persistent_workers=True)
    first = [b.tolist() for b in loader]
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)  # a hang ends here, as SIGALRM
        sys.exit(0)  # the exit hooks run in the child
    began = time.monotonic()
    _, status = os.waitpid(pid, 0)
    print(json.dumps({
        "child": os.waitstatus_to_exitcode(status),
        "child_s": time.monotonic() - began,
        "epochs": [first, [b.tolist() for b in loader]],
    }))
"""


def test_a_forked_child_s_exit_leaves_its_parent_s_loader_alone(tmp_path: Path) -> None:
    """Found by review: a child forked while a persistent loader was open hung as it exited,
    its exit hook waiting for the loader's loop thread, which is the parent's."""
    done = run_script(tmp_path, {"forks.py": FORK_EXIT}, "forks.py")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["child"] == 0 and got["child_s"] < 10
    assert got["epochs"] == [[[0, 1, 2, 3], [4, 5, 6, 7]]] * 2


# Per version, whether a forked server is handed to the stdlib's (checked by CI on 3.11 and 3.12,
# by hand on 3.13): 3.14 gave the stdlib's server an authentication key, so there it starts its own.
FAST_PATH_TAKEN = (3, 11) <= sys.version_info[:2] <= (3, 13)


def test_the_fast_path_is_taken_on_the_pythons_whose_server_we_know(tmp_path: Path) -> None:
    from aioloader._workers.forkserver import server_protocol_known
    from aioloader._workers.standby import UNKNOWN_PROTOCOL

    assert server_protocol_known() == FAST_PATH_TAKEN
    got = probe(tmp_path, "alone")
    assert got["workers"] == 2 and got["workers_children_of_server"]
    if FAST_PATH_TAKEN:
        assert (got["server"], got["server_why"]) == ("forked", "")
        assert got["server_cmdline"] == got["my_cmdline"]
    else:  # said, and the stdlib's own start: a fresh interpreter, no standby forked
        assert (got["server"], got["server_why"]) == ("interpreter", UNKNOWN_PROTOCOL)
        assert "multiprocessing.forkserver import main" in got["server_cmdline"]
        assert got["standby_was"] is None


def test_a_server_we_do_not_know_gets_the_stdlibs_own_start_and_says_why(tmp_path: Path) -> None:
    """3.14's fallback, on every Python: a stdlib server with an authentication key is not
    handed a forked server (nor is a standby forked for it)."""
    from aioloader._workers.standby import UNKNOWN_PROTOCOL

    got = probe(tmp_path, "authkey")
    assert got["workers"] == 2 and got["workers_children_of_server"]
    assert (got["server"], got["server_why"]) == ("interpreter", UNKNOWN_PROTOCOL)
    assert "multiprocessing.forkserver import main" in got["server_cmdline"]
    assert got["standby_was"] is None
    assert got["pipe_eof"]


PACKAGE = {
    "pack/__init__.py": (
        "from . import helpers  # imported whole before aioloader, it holds this package\n"
        "from .data import Squares  # .data imports aioloader: the standby is forked there\n"
        "SCALE = 10  # set after it: never in the half-imported package\n"
    ),
    "pack/helpers.py": "import pack\n\ndef scale(x):\n    return x * pack.SCALE\n",
    "pack/data.py": (
        "import torch.utils.data\nimport aioloader\nfrom . import helpers\n\n"
        "class Squares(torch.utils.data.Dataset):\n"
        "    def __len__(self):\n        return 4\n"
        "    def __getitem__(self, i):\n        return helpers.scale(i)\n"
    ),
    "main.py": (
        "import multiprocessing, signal, threading\nimport pack  # imports aioloader\n\n"
        "def handler(queue):\n    queue.put(str(signal.getsignal(signal.SIGINT)))\n\n"
        "if __name__ == '__main__':\n"
        "    threading.Thread(target=threading.Event().wait, daemon=True).start()\n"
        "    loader = pack.data.aioloader.DataLoader(pack.Squares(), batch_size=2, num_workers=1)\n"
        "    print([b.tolist() for b in loader], loader.statistics().workers.server)\n"
        "    context = multiprocessing.get_context('forkserver')  # the application's own\n"
        "    queue = context.Queue()\n"
        "    child = context.Process(target=handler, args=(queue,))\n"
        "    child.start()\n"
        "    print(queue.get() == str(signal.getsignal(signal.SIGINT)))  # Ctrl-C as here\n"
        "    child.join()\n"
    ),
}


def test_a_half_imported_packages_submodules_are_imported_again_and_ctrl_c_is_kept(
    tmp_path: Path,
) -> None:
    """Found by review: a submodule imported whole before the fork held the half-built package
    (its late attributes missing in the workers); and the application's own forkserver children
    ignored Ctrl-C, the handler the standby had while it waited. They now take Ctrl-C as the
    application does: Python's handler, or ignored where the application was started with
    SIGINT ignored (a background job of a shell without job control, as CI may run us)."""
    done = run_script(tmp_path, PACKAGE, "main.py")
    expected = "[[0, 10], [20, 30]] standby\nTrue\n"
    assert (done.returncode, done.stderr, done.stdout) == (0, "", expected)


THREADS_AT_IMPORT = """
import os, threading, torch.utils.data, aioloader

class Ids(torch.utils.data.Dataset):
    def __len__(self):
        return 2
    def __getitem__(self, i):
        names = sorted(t.name for t in threading.enumerate())
        return i, os.getpid(), "metrics" in names  # the top level ran in this worker

threading.Thread(target=threading.Event().wait, daemon=True, name="metrics").start()

if __name__ == "__main__":
    loader = aioloader.DataLoader(Ids(), batch_size=None, num_workers=2)
    got = list(loader)
    assert [i for i, _, _ in got] == [0, 1], got
    assert {pid for _, pid, _ in got} != {os.getpid()} and all(ran for *_, ran in got), got
    workers = loader.statistics().workers
    print(workers.server, "|", workers.server_why, "|", workers.main_left_unsafe)
"""


def test_a_standby_left_unsafe_by_the_main_module_gives_way_to_its_reserve(tmp_path: Path) -> None:
    """Running the main module's top level again started a thread in the standby: workers
    forked from it could inherit a lock that thread holds (a review's script hung so, when one
    session let it serve). The reserve, forked beside it at import, serves instead, each
    worker running the main module after its fork, as the stdlib's server's workers do (the
    thread runs in each), without the stdlib's fresh interpreter (2 s here)."""
    done = run_script(tmp_path, {"threads.py": THREADS_AT_IMPORT}, "threads.py")
    assert (done.returncode, done.stderr) == (0, "")
    how, why, main_left_unsafe = done.stdout.strip().split(" | ")
    assert how == "standby"
    assert why == (
        "this process had 2 Python threads; the standby server could not serve: running the "
        "main module again, this process had 2 Python threads; its reserve serves, each "
        "worker running the main module"
    )
    assert main_left_unsafe == "True"


PRELOADED = """
import os, multiprocessing, threading, torch.utils.data, aioloader
import heavy  # after aioloader: the standbys do not have it

multiprocessing.set_forkserver_preload(["heavy"])

class Pids(torch.utils.data.Dataset):
    def __len__(self):
        return 2
    def __getitem__(self, i):
        return os.getpid()

threading.Thread(target=threading.Event().wait, daemon=True).start()  # at the top level

if __name__ == "__main__":
    loader = aioloader.DataLoader(Pids(), batch_size=None, num_workers=2)
    workers = set(loader)
    imported = {int(line) for line in open("imported")}
    assert os.getpid() in imported and not workers & imported, (workers, imported)
    print(loader.statistics().workers.server)
"""

HEAVY = """
import os
with open("imported", "a") as f:
    f.write(f"{os.getpid()}\\n")
"""


def test_the_reserve_imports_the_applications_preload_list_as_the_stdlibs_server_does(
    tmp_path: Path,
) -> None:
    """Found by review: its workers each imported the modules the script asked the server to
    preload (``set_forkserver_preload``), which the stdlib's server had imported once."""
    done = run_script(tmp_path, {"pre.py": PRELOADED, "heavy.py": HEAVY}, "pre.py")
    assert (done.returncode, done.stderr, done.stdout) == (0, "", "standby\n")


RESERVE_GONE = """
import os, signal, threading, torch.utils.data, aioloader
from aioloader._workers import standby

if __name__ == "__main__":
    os.kill(standby._reserve.server.pid, signal.SIGKILL)  # the OOM killer, say

class Ids(torch.utils.data.Dataset):
    def __len__(self):
        return 2
    def __getitem__(self, i):
        return i

threading.Thread(target=threading.Event().wait, daemon=True).start()  # at the top level

if __name__ == "__main__":
    loader = aioloader.DataLoader(Ids(), batch_size=2, num_workers=1)
    assert [b.tolist() for b in loader] == [[0, 1]]
    workers = loader.statistics().workers
    print(workers.server, "|", workers.server_why, "|", workers.main_left_unsafe)
"""


def test_without_its_reserve_the_standby_s_reason_is_kept(tmp_path: Path) -> None:
    """Found by review: the reserve's refusal replaced the first standby's, and with it the
    verdict's advice (the ``__main__`` guard)."""
    done = run_script(tmp_path, {"gone.py": RESERVE_GONE}, "gone.py")
    assert (done.returncode, done.stderr) == (0, "")
    how, why, main_left_unsafe = done.stdout.strip().split(" | ")
    assert how == "interpreter" and main_left_unsafe == "True"
    assert "the standby server could not serve: running the main module again" in why
    assert "; its reserve could not serve: the standby server exited" in why


NO_FORK = """
import os, threading, torch.utils.data

def refuse():
    raise PermissionError(1, "fork is not allowed here")

real_fork, os.fork = os.fork, refuse  # a sandbox without fork, as aioloader is imported
import aioloader
os.fork = real_fork

class Ids(torch.utils.data.Dataset):
    def __len__(self):
        return 2
    def __getitem__(self, i):
        return i

if __name__ == "__main__":
    threading.Thread(target=threading.Event().wait, daemon=True).start()
    loader = aioloader.DataLoader(Ids(), batch_size=2, num_workers=1)
    assert [b.tolist() for b in loader] == [[0, 1]]
    workers = loader.statistics().workers
    print(workers.server, "|", workers.server_why, "|", workers.main_left_unsafe)
"""


def test_a_standby_that_cannot_be_forked_leaves_the_import_alone(tmp_path: Path) -> None:
    done = run_script(tmp_path, {"nofork.py": NO_FORK}, "nofork.py")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == (
        "interpreter | this process had 2 Python threads; no standby: forking it failed "
        "(PermissionError(1, 'fork is not allowed here')) | False\n"
    )


def test_waiting_for_a_server_to_exit_takes_a_descriptor_past_select_s_range() -> None:
    """Found by review: a process with a thousand files open got a pidfd past 1023, and
    ``select()`` refused it (the exit hook's wait raised)."""
    import resource

    from aioloader._workers.pidfd import exited_within

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"this machine allows {hard} open files: no descriptor past 1023")
    resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
    held: list[int] = []
    try:
        while not held or held[-1] < 1200:
            held.append(os.open(os.devnull, os.O_RDONLY))
        for fd in held[-100:]:  # the pidfd takes the lowest free number: one past 1100
            os.close(fd)
        del held[-100:]
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        assert exited_within(child.pid, 30)
        assert child.wait(timeout=30) == 0
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


PRINTS = """
import os, sys, threading, torch.utils.data
import aioloader

class Prints(torch.utils.data.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        # One write each (a pipe's writes under PIPE_BUF are whole): two workers' prints,
        # text and newline written apart, may interleave
        os.write(1, f"out {i}\\n".encode())
        os.write(2, f"err {i}\\n".encode())
        return i

if __name__ == "__main__":
    if "thread" in sys.argv:  # forking is unsafe now: the standby forked at import serves
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    loader = aioloader.DataLoader(Prints(), batch_size=2, num_workers=2)
    print([b.tolist() for b in loader], loader.statistics().workers.server, flush=True)
"""


@pytest.mark.parametrize("how", ["forked", "standby"])
def test_what_workers_print_reaches_this_process_s_output_and_error_pipes(
    tmp_path: Path, how: str
) -> None:
    """A worker's prints (and a dying worker's traceback) go where this process's go, as from
    torch's workers, where its output and error are pipes (a container's log, ``| tee``, a
    captured subprocess): the server had pointed them at /dev/null."""
    script = tmp_path / "prints.py"
    script.write_text(PRINTS)
    args = [sys.executable, str(script), *(["thread"] if how == "standby" else [])]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == f"[[0, 1], [2, 3]] {how}"
    assert sorted(lines[:-1]) == [f"out {i}" for i in range(4)]
    errors = [line for line in done.stderr.splitlines() if line.startswith("err ")]
    assert sorted(errors) == [f"err {i}" for i in range(4)]
