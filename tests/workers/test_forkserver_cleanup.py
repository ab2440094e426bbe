"""What a killed application leaves: nothing of its fork server. The server (ours: forked from
it, or the standby) exits when the application's end of the alive pipe closes, and removes its
listening socket and the socket's folder, its own (not the application's ``pymp-*`` folder,
which only the application's exit handlers remove, and they never run when it is killed). Each
case runs in a fresh interpreter, killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

KILLED = """
import multiprocessing.forkserver, multiprocessing.process, sys, threading, time
import torch.utils.data
import aioloader

class Ids(torch.utils.data.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return i

if __name__ == "__main__":
    if "thread" in sys.argv:  # forking is no longer safe: the standby serves
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    loader = aioloader.DataLoader(Ids(), batch_size=2, num_workers=2, persistent_workers=True)
    batches = iter(loader)
    next(batches)
    server = multiprocessing.forkserver._forkserver
    # The application's multiprocessing folder: the server's (its workers' too).
    made = multiprocessing.process.current_process()._config.get("tempdir")
    print(loader.statistics().workers.server, server._forkserver_address, made, flush=True)
    time.sleep(60)  # killed before this ends
"""

GONE_WITHIN_S = 15.0


def gone(path: Path) -> bool:
    deadline = time.monotonic() + GONE_WITHIN_S
    while path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize(("argument", "server"), [("", "forked"), ("thread", "standby")])
def test_a_killed_applications_server_removes_its_socket_and_temporary_folder(
    tmp_path: Path, argument: str, server: str
) -> None:
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    process = subprocess.Popen(
        [sys.executable, str(script), argument],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        assert process.stdout is not None
        how, address, made = process.stdout.readline().split()
        socket_file = Path(address)
        folder = socket_file.parent
        assert (how, made) == (server, str(folder))
        assert socket_file.exists() and folder.name.startswith("aioloader-fs-")
        process.kill()  # SIGKILL: no exit handler of the application runs
        process.wait(timeout=10)
        assert gone(folder), sorted(p.name for p in folder.iterdir())
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()
        # Whatever is left of the session (nothing, if the servers and workers exited).
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
