"""Folder markers in an object store's listing: the zero-byte objects whose key ends with ``/``
(``train/``, ``train/sub/``), which the S3 console's "Create folder" and many sync tools write.

Owns: :func:`folder_markers`, which of a listing's entries are markers for certain, and which
might be. Never: lists or reads (``_objects.py`` and ``_object_stream.py`` do, and settle the
unsure ones).

obstore gives each listed key as a path without its trailing ``/``: the prefix's own marker
lists as ``""``, ``train/sub/`` as ``sub``, and reading that path asks for a key that does not
exist. Listed as samples, a marker failed its batch every epoch (``objects``) or ended the
stream at its first item (``object_stream``); found by review. For certain: ``""`` (nothing
can be read there) and a zero-byte entry with keys under it (``sub`` beside ``sub/x``). Unsure:
a zero-byte entry with none (an empty folder's marker, or an empty object): the object is
asked for, and one that is not there was a marker.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

__all__ = ["folder_markers"]


def folder_markers(listed: Sequence[tuple[str, int]]) -> tuple[set[str], list[str]]:
    """Of ``listed`` (``(path, size)`` sorted by path): the paths that are folder markers, and
    the zero-byte paths that may be (to be asked for), in order."""
    paths = [path for path, _ in listed]
    markers: set[str] = set()
    unsure: list[str] = []
    for path, size in listed:
        if size != 0:
            continue
        if path == "":
            markers.add(path)
            continue
        folder = path + "/"
        at = bisect.bisect_left(paths, folder)
        if at < len(paths) and paths[at].startswith(folder):
            markers.add(path)
        else:
            unsure.append(path)
    return markers, unsure
