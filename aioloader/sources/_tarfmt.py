"""The WebDataset tar format, parsed incrementally from a stream of chunks.

Owns: an incremental parser of tar headers (ustar, GNU long names, pax ``path``/``size``,
base-256 sizes, checksums), rejecting member names that escape, and grouping members with the
same key into sample dicts, one chunk at a time. Never: opens or reads anything (it is given
chunks), decodes member bytes, or uses :mod:`tarfile`.
"""

from __future__ import annotations

import re
import zlib
from typing import Any

__all__ = ["CorruptShardError", "TarParser"]

_BLOCK = 512
_REGULAR = (b"0", b"\0", b"7")  # regular, old regular, contiguous (POSIX: read as regular)
_GNU_SPARSE = b"S"
_SPARSE = "not supported (write shards without tar's --sparse)"
_META = re.compile(r"__[^/]*__($|/)")  # webdataset's metadata names (``__info__/...``): skipped
_GNU_LONGNAME = b"L"
_GNU_LONGLINK = b"K"
_PAX = b"x"
_PAX_GLOBAL = b"g"
_MAX_META = 1 << 20  # the largest GNU long name or pax header accepted, in bytes
_OCTAL_DIGITS = b"01234567"
_HIGH_BYTES = bytes(range(128, 256))
_ZERO_BLOCK = bytes(_BLOCK)


class CorruptShardError(ValueError):
    """A shard is truncated or not a valid tar file; the message names the shard and the byte
    offset where the problem was found."""


def _padding(size: int) -> int:
    return -size % _BLOCK


def _corrupt(shard: str, offset: int, problem: str) -> CorruptShardError:
    return CorruptShardError(f"tar shard {shard!r} is corrupt at offset {offset}: {problem}")


def _octal(digits: bytes) -> bool:
    return bool(digits) and not digits.translate(None, _OCTAL_DIGITS)


def _byte_sum(block: bytes) -> int:
    """The sum of a 512-byte block's bytes, in C: Adler-32's first sum, started at 0, is the
    byte sum mod 65521, exact for 256 bytes (at most 65,280)."""
    return (zlib.adler32(block[:256], 0) & 0xFFFF) + (zlib.adler32(block[256:], 0) & 0xFFFF)


def _checksum_ok(header: bytes, shard: str, offset: int) -> bool:
    field = header[148:156]
    digits = field.replace(b"\0", b" ").strip()
    if not _octal(digits):
        raise _corrupt(shard, offset, f"checksum field is not octal: {field!r}")
    stored = int(digits, 8)
    unsigned = _byte_sum(header) - sum(field) + 8 * 0x20  # the field counts as 8 spaces
    if stored == unsigned:
        return True
    # Some old tars summed signed chars: every byte >= 128 counts 256 less.
    blanked = header[:148] + b" " * 8 + header[156:]
    high = len(blanked) - len(blanked.translate(None, _HIGH_BYTES))
    return stored == unsigned - 256 * high


def _size(header: bytes, shard: str, offset: int) -> int:
    field = header[124:136]
    if field[0] & 0x80:  # GNU base-256
        if field[0] == 0xFF:
            raise _corrupt(shard, offset, "negative size")
        return int.from_bytes(bytes([field[0] & 0x7F]) + field[1:], "big")
    digits = field.replace(b"\0", b" ").strip()
    if not digits:
        return 0
    if not _octal(digits):
        raise _corrupt(shard, offset, f"size field is not octal: {field!r}")
    return int(digits, 8)


def _cstr(field: bytes) -> bytes:
    end = field.find(b"\0")
    return field if end < 0 else field[:end]


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def _header_name(header: bytes) -> bytes:
    name = _cstr(header[0:100])
    if header[257:263] == b"ustar\x00":  # POSIX ustar: a prefix field may hold the folders
        prefix = _cstr(header[345:500])
        if prefix:
            name = prefix + b"/" + name
    return name


def _parse_pax(data: bytes, shard: str, offset: int) -> dict[bytes, bytes]:
    """Parse pax records ``"<len> <key>=<value>\\n"``."""
    out: dict[bytes, bytes] = {}
    pos = 0
    while pos < len(data):
        if data[pos:].strip(b"\0") == b"":
            break
        space = data.find(b" ", pos)
        length_text = data[pos:space] if space > pos else b""
        if not length_text.isdigit():
            raise _corrupt(shard, offset, "malformed pax header record")
        end = pos + int(length_text)
        record = data[space + 1 : end]
        if end > len(data) or end <= space or not record.endswith(b"\n") or b"=" not in record:
            raise _corrupt(shard, offset, "malformed pax header record")
        key, _, value = record[:-1].partition(b"=")
        out[key] = value
        pos = end
    return out


def _check_name(name: str, shard: str, offset: int) -> str:
    """Reject names that escape; return the name without leading ``./``."""
    bad = ""
    if "\0" in name:
        bad = "contains a NUL"
    elif name.startswith("/"):
        bad = "is absolute"
    elif ".." in name.split("/"):
        bad = "has a '..' component"
    elif not name:
        bad = "is empty"
    if bad:
        raise ValueError(
            f"tar shard {shard!r}: member {name!r} at offset {offset} {bad}; refusing to read it"
        )
    while name.startswith("./"):
        name = name[2:]
    return name


def _split(name: str) -> tuple[str, str] | None:
    """``dir/0001.seg.png`` -> ``("dir/0001", "seg.png")``; None without an extension."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not stem or not dot:
        return None
    return (f"{folder}/{stem}" if folder else stem), ext


class TarParser:
    """An incremental parser of one shard: :meth:`feed` it chunks as they come, and it returns
    the samples they completed; :meth:`finish` at the end of the bytes.

    Work is per chunk, not per member read: a chunk is parsed in one synchronous pass over its
    members, by index, and each member's bytes are copied once (into the sample). A member
    larger than a chunk waits in a list of chunks that is joined once, when it is whole.
    """

    def __init__(self, shard: str, fields: dict[str, Any] | None = None, start: int = 0) -> None:
        self._shard = shard
        self._fields = {"__url__": shard, "__shard__": shard, **(fields or {})}
        self._pending: list[bytes] = []
        self._have = 0  # bytes in _pending
        self._offset = start  # the offset in the shard of _pending's first byte
        self._chain = start  # where the current member's headers (long name, pax) start
        self._member_end = start  # the end of the member just read (its data and padding)
        self._span = (start, start)  # where the sample being assembled starts and ends
        #: ``(start, end)`` in the shard of each sample returned, in order (taken by
        #: :meth:`take_spans`): a shard resumed at a sample's ``end`` goes on with the next.
        self.spans: list[tuple[int, int]] = []
        self._need = _BLOCK  # bytes the next unit needs
        self._header: tuple[bytes, int, int, str | None] | None = None  # kind, size, offset, name
        self._long_name: bytes | None = None
        self._pax: dict[bytes, bytes] = {}
        self._sample: dict[str, Any] | None = None
        self._error: ValueError | None = None  # found by feed, raised by check
        self._failed = False
        #: True once the end-of-archive block was read (or a problem found): what follows is
        #: not parsed.
        self.done = False

    def feed(self, chunk: bytes) -> list[dict[str, Any]]:
        """Parse ``chunk``, the shard's next bytes; return the samples it completed. A problem
        found in the chunk is kept until the samples before it are returned: :meth:`check`
        (or the next :meth:`feed`, or :meth:`finish`) raises it.

        Raises:
            ValueError, CorruptShardError: As :func:`read_samples`, for an earlier chunk.
        """
        self.check()
        if self.done or not chunk:
            return []
        self._pending.append(chunk)
        self._have += len(chunk)
        if self._have < self._need:
            return []
        buf = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        out: list[dict[str, Any]] = []
        try:
            at = self._units(buf, out)
        except ValueError as exc:  # CorruptShardError too
            self._error = exc
            self.done = True
            return out
        rest = buf[at:] if at < len(buf) else b""
        self._pending = [rest] if rest else []
        self._offset += at
        self._have = len(rest)
        return out

    def check(self) -> None:
        """Raise the problem the last :meth:`feed` found after the samples it returned.

        Raises:
            ValueError, CorruptShardError: As :func:`read_samples`.
        """
        if self._error is not None:
            error, self._error = self._error, None
            self._failed = True
            raise error

    def finish(self) -> list[dict[str, Any]]:
        """The end of the bytes: the last sample, or an error if the shard is cut short.

        Raises:
            CorruptShardError: The bytes end inside a member or before the end-of-archive block.
            ValueError: As :meth:`check`.
        """
        self.check()
        if self._failed:
            return []
        if not self.done:
            if self._header is None and self._have == 0:
                raise CorruptShardError(
                    f"tar shard {self._shard!r} is truncated: it ends at offset {self._offset} "
                    "without an end-of-archive block"
                )
            if self._header is None:
                what, need, at, have = "a header", _BLOCK, self._offset, self._have
            else:
                _kind, size, offset, name = self._header
                if self._have >= size:  # the member is whole; its padding is cut
                    what, need, at = "padding", self._need - size, self._offset + size
                    have = self._have - size
                else:
                    what = (
                        "a metadata member"
                        if name is None
                        else (f"member {name!r} (header at offset {offset})")
                    )
                    need, at, have = size, self._offset, self._have
            raise CorruptShardError(
                f"tar shard {self._shard!r} is truncated: {what} needs {need} bytes at "
                f"offset {at}, only {have} left"
            )
        if self._sample is None:
            return []
        self.spans.append(self._span)
        return [self._sample]

    def _units(self, buf: bytes, out: list[dict[str, Any]]) -> int:
        """Parse every whole unit (header, member) of ``buf``; return where the rest starts."""
        at = 0
        end = len(buf)
        shard = self._shard
        while end - at >= self._need:
            if self._header is None:
                header = buf[at : at + _BLOCK]
                if header == _ZERO_BLOCK:
                    self.done = True  # the second zero block and the padding are not read
                    return end
                self._start_member(header, self._offset + at)
                at += _BLOCK
                continue
            kind, size, offset, name = self._header
            data = buf[at : at + size]
            at += self._need
            self._member_end = self._offset + at
            self._header = None
            self._need = _BLOCK
            if name is None:
                if kind == _GNU_LONGNAME:
                    self._long_name = data.rstrip(b"\0")
                elif kind == _PAX:  # path, size and sparse maps matter; mtime and such do not
                    wanted = b" path=" in data or b" size=" in data or b" GNU.sparse." in data
                    self._pax = _parse_pax(data, shard, offset) if wanted else {}
            elif kind in _REGULAR:
                self._add(name, offset, data, out)
            elif kind == _GNU_SPARSE:
                raise _corrupt(shard, offset, f"member {name!r} is a GNU sparse file, {_SPARSE}")
        return at

    def _start_member(self, header: bytes, offset: int) -> None:
        shard = self._shard
        if self._long_name is None and not self._pax:  # no header before it: a new chain
            self._chain = offset
        if not _checksum_ok(header, shard, offset):
            raise _corrupt(shard, offset, "header checksum mismatch")
        size = _size(header, shard, offset)
        kind = header[156:157]
        name: str | None = None
        if kind in (_GNU_LONGNAME, _GNU_LONGLINK, _PAX, _PAX_GLOBAL):
            if size > _MAX_META:
                raise _corrupt(shard, offset, f"metadata member of {size} bytes")
        else:
            if any(key.startswith(b"GNU.sparse.") for key in self._pax):
                raw = self._pax.get(b"GNU.sparse.name", self._pax.get(b"path", b"?"))
                raise _corrupt(
                    shard, offset, f"member {_decode(raw)!r} is a GNU sparse file: " + _SPARSE
                )
            raw = self._long_name if self._long_name is not None else _header_name(header)
            raw = self._pax.get(b"path", raw)
            if b"size" in self._pax:
                text = self._pax[b"size"]
                if not text.isdigit():
                    raise _corrupt(shard, offset, f"pax size is not a number: {text!r}")
                size = int(text)
            self._long_name, self._pax = None, {}
            name = _check_name(_decode(raw), shard, offset)
        self._header = (kind, size, offset, name)
        self._need = size + _padding(size)

    def _add(self, member: str, offset: int, data: bytes, out: list[dict[str, Any]]) -> None:
        if _META.match(member):
            return
        parts = _split(member)
        if parts is None:
            return
        key, ext = parts
        ext = ext.lower()  # webdataset's convention: x.JPG is sample["jpg"]
        sample = self._sample
        if sample is not None and sample["__key__"] != key:
            out.append(sample)
            self.spans.append(self._span)
            sample = None
        if sample is None:
            sample = self._sample = {"__key__": key, **self._fields}
            self._span = (self._chain, self._chain)
        if ext in sample:
            raise ValueError(
                f"tar shard {self._shard!r}: member {member!r} at offset {offset} repeats "
                f"extension {ext!r} of sample {key!r}"
            )
        sample[ext] = data
        self._span = (self._span[0], self._member_end)

    def take_spans(self) -> list[tuple[int, int]]:
        """The spans of the samples returned since the last call (see :attr:`spans`)."""
        spans, self.spans = self.spans, []
        return spans
