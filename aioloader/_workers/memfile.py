"""Parts of a start (its pickle, its out-of-band buffers) written to one anonymous file in
memory (``memfd_create``: gone once the last process lets go of it), and mapped back in a
worker copy-on-write: a page stays shared by every worker until one writes to it, as a forked
worker shares its parent's.

Owns: :func:`available`, :func:`in_memory`, :func:`mapped`. Never: keeps a descriptor it
returns (the caller closes or hands it over).
"""

from __future__ import annotations

import functools
import mmap
import os
from typing import Any

__all__ = ["ALIGN", "IN_FILE_FROM", "OUT_OF_BAND_FROM", "Span", "available", "in_memory", "mapped"]

IN_FILE_FROM = 1 << 20  # bytes: smaller parts go in each worker's start, copied
ALIGN = 64  # bytes: where each part starts (a NumPy array's alignment)
# Bytes: a smaller array or storage goes in the pickle. Out of band, each costs a write here, a
# place in each worker's start and a view there: 600,000 arrays of two numbers (the boxes of a
# detection dataset) took 8.6 s to the first batch, against 5.7 s in the pickle. In the pickle,
# it is copied into it, out of it into the template and, a page at a time, into each worker:
# 15,000 images of 12 KiB (2 workers, 2-core box), 0.30-0.39 s to the first batch out of
# band, 0.53-0.60 s in the pickle from 64 KiB (tensors: 0.54 s against 0.71-0.80 s).
OUT_OF_BAND_FROM = 4 << 10

Span = tuple[int, int, bool]  # where a part is in its file: offset, length, read-only


@functools.cache
def available() -> bool:
    """Whether this process can make a file in memory (a sandbox may refuse
    ``memfd_create``)."""
    if not hasattr(os, "memfd_create"):
        return False
    try:
        os.close(os.memfd_create("aioloader-probe", os.MFD_CLOEXEC))
    except OSError:
        return False
    return True


def in_memory(parts: list[memoryview]) -> tuple[int, list[Span]] | None:
    """``parts`` written to one anonymous file in memory, each at an offset that is a
    multiple of 64 (a NumPy array's alignment): its descriptor and where each part is. None
    where they come to less than :data:`IN_FILE_FROM`, or no such file can be made (a
    sandbox that refuses ``memfd_create``)."""
    if sum(len(part) for part in parts) < IN_FILE_FROM or not available():
        return None
    spans, end = [], 0
    for part in parts:
        spans.append((end, len(part), part.readonly))
        end += -(-len(part) // ALIGN) * ALIGN
    try:
        fd = os.memfd_create("aioloader-start", os.MFD_CLOEXEC)
    except OSError:
        return None
    try:
        os.ftruncate(fd, end)
        for part, (offset, _, _) in zip(parts, spans, strict=True):
            with part.cast("B") as whole:  # no view left in an error's frames (gh-111049)
                done = 0
                while done < len(whole):
                    done += os.pwrite(fd, whole[done:], offset + done)
    except BaseException:
        os.close(fd)
        raise
    return fd, spans


def mapped(handle: Any, spans: list[Span]) -> list[memoryview]:
    """The buffers in their file, mapped copy-on-write (written to, a page becomes this
    process's own); the mapping lasts as long as something holds one of them."""
    fd = handle.detach()
    try:
        end = max(offset + length for offset, length, _ in spans)
        region = mmap.mmap(fd, end, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    whole = memoryview(region)
    views = [(whole[offset : offset + length], readonly) for offset, length, readonly in spans]
    return [view.toreadonly() if readonly else view for view, readonly in views]
