"""A real two-node Ray cluster on this machine, as a user starts one: ``ray start --head`` and a
second ``ray start --address=...`` with a custom resource of its own (``"second"``), each a
child process of the test session (``--block``), so the second node can be stopped mid-test
and started again.

Ray binds its servers itself (all interfaces, in Ray 2.60, whatever ``--node-ip-address``
says); the test process joins it at 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["RayCluster"]

SECOND = "second"  # the custom resource only the second node has
_START_TIMEOUT = 90.0
_AUTH = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")
# The GCS's health checks of the nodes, as an operator tunes them for a cluster that must
# notice a lost machine quickly: a node gone unannounced (killed) is marked dead after 4 missed
# checks half a second apart (a check waits a second for its answer, room for a loaded 2-core
# machine), not Ray's default of about 15 s (3 s apart, 5 missed), which is what the
# node-loss tests waited for before the lost actors' replacements could be placed.
_HEALTH_CHECKS = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "4",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RayCluster:
    """Two Ray nodes: the head (2 CPUs) and a second node (2 CPUs, ``{"second": 4}``)."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._ray = str(Path(sys.executable).parent / "ray")
        # Ray's token authentication, on (as Ray 2.61 will have it for every cluster): every
        # node and this process, the driver, share a token made for the session.
        self._saved_env = {k: os.environ.get(k) for k in _AUTH}
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))
        # A temp dir of its own (short: Ray's socket paths live in it): ``ray start --head``
        # leaves the address of its cluster there, and a later ``ray.init()`` on this machine
        # (an example run by the tests) would try to join it once it is gone.
        self.temp_dir = tempfile.mkdtemp(prefix="aioray-", dir="/tmp")
        self.head = self._start(
            "head", "--head", f"--port={self.port}", f"--temp-dir={self.temp_dir}"
        )
        self.second: subprocess.Popen[bytes] | None = None

    def _start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = (self.logs / f"ray-{name}.log").open("ab")
        cmd = [self._ray, "start", "--block", "--num-cpus=2", "--disable-usage-stats", *args]
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **_HEALTH_CHECKS}
        try:
            return subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
        finally:
            log.close()

    def join(self) -> None:
        """Connect this process (the driver) to the head, then start the second node and wait
        until a task placed by its resource has run there."""
        import ray

        self._wait_for_head()
        ray.init(address=self.address)
        self.start_second()

    def _wait_for_head(self) -> None:
        """Until the head's GCS accepts connections (bounded): ``ray.init`` gives up on an
        address that does not answer yet."""
        deadline = time.monotonic() + _START_TIMEOUT
        while True:
            if self.head.poll() is not None:
                raise RuntimeError(f"ray start --head exited ({self.head.returncode}): see logs")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def start_second(self) -> None:
        import ray

        self.second = self._start(
            "second", f"--address={self.address}", f'--resources={{"{SECOND}": 4}}'
        )
        probe = ray.remote(num_cpus=0, resources={SECOND: 0.001})(_node_id)
        self.second_node = str(ray.get(probe.remote(), timeout=_START_TIMEOUT))

    def ensure_second(self) -> None:
        """The second node up (a test that stopped it leaves it stopped: the next test that
        needs it starts it, and the last one to stop it pays for no restart)."""
        if self.second is None:
            self.start_second()

    def stop_second(self) -> None:
        """Stop the second node as an operator or a lost machine would: its processes go."""
        if self.second is not None:
            _stop(self.second)
            self.second = None

    def close(self) -> None:
        import ray

        ray.shutdown()
        self.stop_second()
        _stop(self.head)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def head_node(self) -> str:
        import ray

        probe = ray.remote(num_cpus=0, resources={"node:__internal_head__": 0.001})(_node_id)
        return str(ray.get(probe.remote(), timeout=_START_TIMEOUT))


def _node_id() -> Any:
    import ray

    return ray.get_runtime_context().get_node_id()


def _stop(process: subprocess.Popen[bytes]) -> None:
    """The node's every process killed at once, as a lost machine goes (``ray start``'s own
    SIGTERM drains for up to 30 s first): ``ray start``, its GCS or raylet and the raylet's
    workers all stay in the session ``ray start`` leads (the workers each in a process group
    of their own)."""
    for pid in _session(process.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait(timeout=30)


def _session(sid: int) -> list[int]:
    """The processes of session ``sid`` (Linux's /proc: field 6 of a process's stat)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        if int(fields[3]) == sid:
            found.append(int(entry.name))
    return found
