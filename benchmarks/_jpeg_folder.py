"""``bench_busy_loop.py``'s folder configurations: the JPEGs written to a folder, read by a
torch ``Dataset`` (torch-files) or by ``aioloader.sources.files`` with a ``transform``
(aio-files). A module of its own, imported in the children only, so that worker processes
import it by name."""

from __future__ import annotations

import os

import torch
import torch.utils.data

from aioloader._bench.cpu_data import jpeg_crop, make_jpeg


class FolderJpegs(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """``bench_busy_loop.py``'s torch-files dataset: file ``i`` of ``paths`` read and decoded
    (:func:`jpeg_crop`) in ``__getitem__``."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        with open(self.paths[index], "rb") as file:
            return jpeg_crop(file.read()), index


def decode_keyed(item: tuple[str, bytes]) -> tuple[torch.Tensor, str]:
    """``bench_busy_loop.py``'s aio-files ``transform``: ``(key, JPEG bytes)`` to ``(crop,
    key)``."""
    key, payload = item
    return jpeg_crop(payload), key


def write_jpeg_folder(root: str, images: int) -> list[str]:
    """``bench_busy_loop.py``'s folder: ``images`` JPEGs (``make_jpeg(i % 128)``) written as
    ``root/000017.jpg``; their paths, in order."""
    payloads = [make_jpeg(k)[0] for k in range(128)]
    paths = [os.path.join(root, f"{i:06d}.jpg") for i in range(images)]
    for i, path in enumerate(paths):
        with open(path, "wb") as file:
            file.write(payloads[i % len(payloads)])
    return paths
