"""Listing a local folder for :func:`~aioloader.sources.files`, once, in a stable order.

Owns: :func:`list_folder`: which entries are listed (the pattern, the suffixes, hidden parts,
regular files and links to them), the skipping of links that lead outside the folder (one
warning naming a few), and the order (relative paths compared folder by folder, in code-point
order). Never: reads a file.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

__all__ = ["list_folder"]

logger = logging.getLogger("aioloader")

_NAMED_SKIPS = 5  # escaping links named in the warning


def list_folder(
    root: Path, pattern: str, suffixes: tuple[str, ...], include_hidden: bool
) -> tuple[list[str], list[str]]:
    """The files under ``root`` that match (see ``sources/_files.py``): their keys (relative
    paths, ``/`` separators) and real paths, in the listing's order.

    Raises:
        FileNotFoundError: ``root`` does not exist.
        NotADirectoryError: ``root`` is not a folder.
        ValueError: Nothing matched (naming ``root`` and ``pattern``).
    """
    try:
        st = os.stat(root)
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            errno.ENOENT, "files(): root folder does not exist", os.fspath(root)
        ) from exc
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "files(): root is not a folder", os.fspath(root))
    real_root = os.path.realpath(root)
    real_dirs: dict[Path, str] = {}  # a folder's real path, resolved once per folder
    found: list[tuple[tuple[str, ...], str, str]] = []
    escaping: list[str] = []
    for path in root.glob(pattern):
        rel = path.relative_to(root)
        parts = rel.parts
        if not include_hidden and any(p.startswith(".") for p in parts):
            continue
        if suffixes and not path.name.lower().endswith(suffixes):
            continue
        try:
            lst = os.lstat(path)
        except OSError:  # vanished while listing
            continue
        if stat.S_ISLNK(lst.st_mode):
            real = os.path.realpath(path)
            try:
                if not stat.S_ISREG(os.stat(real).st_mode):
                    continue
            except OSError:  # a dangling link
                continue
        elif stat.S_ISREG(lst.st_mode):
            parent = path.parent
            real_parent = real_dirs.get(parent)
            if real_parent is None:  # under a linked folder, the folder is a link
                real_parent = real_dirs[parent] = os.path.realpath(parent)
            real = os.path.join(real_parent, path.name)
        else:
            continue
        if not _is_within(real, real_root):
            escaping.append(rel.as_posix())
            continue
        found.append((parts, rel.as_posix(), real))
    if escaping:
        named = ", ".join(repr(k) for k in sorted(escaping)[:_NAMED_SKIPS])
        more = f" and {len(escaping) - _NAMED_SKIPS} more" if len(escaping) > _NAMED_SKIPS else ""
        logger.warning(
            "aioloader.sources.files: skipped %d symbolic link(s) leading outside %s: %s%s",
            len(escaping),
            os.fspath(root),
            named,
            more,
        )
    if not found:
        what = f"pattern {pattern!r}"
        if suffixes:
            what += f" and suffix {list(suffixes)!r}"
        raise ValueError(f"files(): no file under {os.fspath(root)!r} matches {what}")
    found.sort(key=lambda item: item[0])
    return [key for _, key, _ in found], [real for _, _, real in found]


def _is_within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)
