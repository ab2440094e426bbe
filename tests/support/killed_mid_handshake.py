"""Run by ``tests/workers/test_main_killed.py``: a worker's resource sharer (the socket a
batch's tensors' descriptors cross by) sees the main process hang up mid-handshake.

Item 0 starts the worker's sharer and returns its address; this process connects to it and reads
the challenge (the sharer now waits for the answer). Then, by the second argument:

- ``killed``: this process kills itself (SIGKILL) while the worker's main thread works on item
  1, which waits for the main process's death, then 2 s more: the worker is still there when its
  sharer sees the hang-up.
- ``hangs-up``: this process closes its end and lives on: 2 s, then item 1, and a normal end.

First argument: the start method; third: the number of workers (each busy with an item of
its own while this process dies: with fork, a sibling holds the stdlib's pipe that tells a
worker of its parent's death, so that pipe cannot tell it)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.resource_sharer
import os
import signal
import socket
import sys
import time

import torch

from aioloader import DataLoader


class Handshake(torch.utils.data.Dataset[str]):
    def __init__(self, killed: bool, workers: int) -> None:
        self.killed, self.workers = killed, workers

    def __len__(self) -> int:
        return 1 + self.workers  # item 0, then one for each worker to be busy with

    def __getitem__(self, index: int) -> str:
        if index == 0:
            handed = multiprocessing.resource_sharer.DupFd(os.open(os.devnull, os.O_RDONLY))
            return str(handed._id[0])  # type: ignore[attr-defined]  # (address, key)
        if self.killed:
            main = multiprocessing.parent_process()
            assert main is not None
            main.join(30)
            time.sleep(2)
        return "item 1"


def main(method: str, killed: bool, workers: int) -> None:
    loader = DataLoader(
        Handshake(killed, workers),
        batch_size=None,
        num_workers=workers,
        multiprocessing_context=method,
    )
    batches = iter(loader)  # kept: its workers live as long as it does
    address = next(batches)
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(address)
    sock.recv(1)  # the challenge's first byte: the sharer waits for the answer
    if killed:
        print("killed mid-handshake", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    sock.close()
    time.sleep(2)  # the worker reports the hang-up while it lives
    print(next(batches), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "killed", int(sys.argv[3]))
