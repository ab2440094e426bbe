"""The ``gpu`` workload's memory by process: a configuration's process tree read from inside
(``/proc/PID/smaps_rollup``), each process put in a role: the main process, a fork server,
workers, or other (the resource tracker)."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Any

from aioloader._bench.harness_processes import cpu_ticks, process_tree, pss_kib


def role(pid: int, main: int) -> tuple[str, str]:
    """``(role, name)``: the role is ``main``, ``fork server`` (aioloader's forked one or its
    standby, or the stdlib's interpreter), ``workers`` (aioloader's or torch's) or ``other``;
    the name is the process's (``comm``), or what a ``python -c`` of multiprocessing's runs."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "other", "?"
    if "multiprocessing.forkserver" in command:
        return "fork server", "stdlib forkserver"
    if "multiprocessing.resource_tracker" in command:
        return "other", "resource tracker"
    if pid == main:
        return "main", comm
    if comm in ("aioloader-fs", "aioloader-sb"):
        return "fork server", comm
    if comm.startswith("aioloader-w") or comm == "pt_data_worker":
        return "workers", comm
    return "other", comm


def pss_by_process() -> dict[str, dict[str, Any]]:
    """This process's tree now: per role, its processes, their summed PSS (MiB) and names."""
    me = os.getpid()
    found: dict[str, dict[str, Any]] = {}
    for pid in process_tree(me):
        kind, name = role(pid, me)
        entry = found.setdefault(kind, {"processes": 0, "pss_mib": 0.0, "names": []})
        entry["processes"] += 1
        entry["pss_mib"] = round(entry["pss_mib"] + pss_kib(pid) / 1024, 1)
        if name not in entry["names"]:
            entry["names"].append(name)
    return found


def threads_cpu_s() -> dict[str, float]:
    """This process's threads' CPU time (user + system, seconds), by name: the Python name
    where the thread has one (``aioloader-loop``, ``aioloader-device_0``, torch's pin thread
    ``Thread-N (_pin_memory_loop)``), numbered names folded into one (``aioloader-files``),
    else the kernel's."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    found: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        name = names.get(int(tid)) or comm
        name = "main" if int(tid) == os.getpid() else re.sub(r"_\d+$", "", name)
        found[name] = found.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return found


def children_cpu_s() -> dict[str, float]:
    """CPU time (user + system, seconds) of each process below this one, by identity
    (``pid:start``, as pids are reused): the workers, the fork server, torch's or the stdlib's
    helpers."""
    tick = os.sysconf("SC_CLK_TCK")
    me = os.getpid()
    found: dict[str, float] = {}
    for pid in process_tree(me):
        if pid != me and (ticks := cpu_ticks(pid)) is not None:
            found[f"{pid}:{ticks[0]}"] = ticks[1] / tick
    return found
