"""The fork server: a fork of this process when that is safe (workers then share its pages and
start without importing torch again), else the stdlib's, with torch preloaded. Each case runs
in a fresh interpreter: the server is process-wide and starts once."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

PROBE = """
import json, multiprocessing.forkserver, os, select, sys, threading
import torch.utils.data
import aioloader

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
    if sys.argv[1] == "thread":  # another Python thread: forking is not safe
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
    loader = aioloader.DataLoader(
        Pids(), batch_size=4, num_workers=2, worker_init_fn=close_inherited
    )
    workers = {tuple(row) for batch in loader for row in torch.stack(batch, 1).tolist()}
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    server_fds = {os.readlink(f"/proc/{server}/fd/{fd}") for fd in os.listdir(f"/proc/{server}/fd")}
    os.close(pipe_w)
    readable, _, _ = select.select([pipe_r], [], [], 5.0)
    pipe_eof = bool(readable) and os.read(pipe_r, 1) == b""
    print(json.dumps({
        "pipe_eof": pipe_eof,
        "me": os.getpid(),
        "my_cmdline": cmdline(os.getpid()),
        "server_parent": ppid(server),
        "server_cmdline": cmdline(server),
        "server_holds_app_file": os.path.realpath(held.name) in server_fds,
        "workers": len(workers),
        "workers_children_of_server": all(parent == server for _, parent in workers),
    }))
"""


def probe(tmp_path: Path, mode: str) -> dict[str, Any]:
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(PROBE))
    done = subprocess.run(
        [sys.executable, str(script), mode], capture_output=True, text=True, timeout=60, check=False
    )
    assert (done.returncode, done.stderr) == (0, "")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_the_server_is_a_fork_of_a_single_threaded_process(tmp_path: Path) -> None:
    got = probe(tmp_path, "alone")
    assert got["workers"] == 2 and got["workers_children_of_server"]
    assert got["server_parent"] == got["me"]
    assert got["server_cmdline"] == got["my_cmdline"]  # forked, not a fresh interpreter
    assert got["server_holds_app_file"]  # a module's open file reads in a worker, as with fork
    assert got["pipe_eof"]


def test_with_another_thread_the_stdlib_starts_its_server(tmp_path: Path) -> None:
    got = probe(tmp_path, "thread")
    assert got["workers"] == 2
    assert "multiprocessing.forkserver import main" in got["server_cmdline"]
    assert "aioloader._workers.worker" in got["server_cmdline"]  # torch preloaded in it
    assert got["pipe_eof"]
