"""The WebDataset tar format, parsed incrementally from a stream of chunks.

Owns: an incremental parser of tar headers (ustar, GNU long names, pax ``path``/``size``,
base-256 sizes, checksums), rejecting member names that escape, and grouping members with the
same key into sample dicts. Never: opens or reads anything (it is given chunks), decodes member
bytes, holds more than one sample, or uses :mod:`tarfile`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

__all__ = ["CorruptShardError", "read_samples"]

_BLOCK = 512
_REGULAR = (b"0", b"\0")
_GNU_LONGNAME = b"L"
_GNU_LONGLINK = b"K"
_PAX = b"x"
_PAX_GLOBAL = b"g"
_MAX_META = 1 << 20  # the largest GNU long name or pax header accepted, in bytes
_OCTAL = frozenset(b"01234567")
_HIGH_BYTES = bytes(range(128, 256))
_SKIP_STEP = 1 << 20  # bytes discarded per step when skipping a member


class CorruptShardError(ValueError):
    """A shard is truncated or not a valid tar file; the message names the shard and the byte
    offset where the problem was found."""


class _Stream:
    """Exact-size reads over a stream of chunks, tracking the byte offset."""

    def __init__(self, chunks: AsyncIterator[bytes], shard: str) -> None:
        self._chunks = chunks
        self._shard = shard
        self._buf = bytearray()
        self._pos = 0
        self.offset = 0  # the offset in the file of the next byte returned

    async def _fill(self, n: int) -> bool:
        """Make ``n`` bytes available; False at end of file before that."""
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0
        while len(self._buf) < n:
            chunk = await anext(self._chunks, None)
            if chunk is None:
                return False
            self._buf += chunk
        return True

    async def read(self, n: int, what: str) -> bytes:
        """Return exactly ``n`` bytes; raise CorruptShardError naming ``what`` at end of file."""
        if len(self._buf) - self._pos < n and not await self._fill(n):
            have = len(self._buf) - self._pos
            raise CorruptShardError(
                f"tar shard {self._shard!r} is truncated: {what} needs {n} bytes at offset "
                f"{self.offset}, only {have} left"
            )
        out = bytes(self._buf[self._pos : self._pos + n])
        self._pos += n
        self.offset += n
        return out

    async def at_eof(self) -> bool:
        """True if no byte is left."""
        return len(self._buf) - self._pos == 0 and not await self._fill(1)

    async def skip(self, n: int, what: str) -> None:
        """Discard ``n`` bytes, one chunk at a time."""
        while n > 0:
            step = min(n, _SKIP_STEP)
            await self.read(step, what)
            n -= step


def _padding(size: int) -> int:
    return -size % _BLOCK


def _corrupt(shard: str, offset: int, problem: str) -> CorruptShardError:
    return CorruptShardError(f"tar shard {shard!r} is corrupt at offset {offset}: {problem}")


def _checksum_ok(header: bytes, shard: str, offset: int) -> bool:
    field = header[148:156]
    digits = field.replace(b"\0", b" ").strip()
    if not digits or not set(digits) <= _OCTAL:
        raise _corrupt(shard, offset, f"checksum field is not octal: {field!r}")
    stored = int(digits, 8)
    blanked = header[:148] + b" " * 8 + header[156:]
    unsigned = sum(blanked)
    if stored == unsigned:
        return True
    # Some old tars summed signed chars: every byte >= 128 counts 256 less.
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
    if not set(digits) <= _OCTAL:
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


async def _members(stream: _Stream, shard: str) -> AsyncGenerator[tuple[str, int, bytes], None]:
    """Yield ``(name, header offset, data)`` for each regular member of one shard."""
    long_name: bytes | None = None
    pax: dict[bytes, bytes] = {}
    while True:
        offset = stream.offset
        if await stream.at_eof():
            raise CorruptShardError(
                f"tar shard {shard!r} is truncated: it ends at offset {offset} without an "
                "end-of-archive block"
            )
        header = await stream.read(_BLOCK, "a header")
        if header == bytes(_BLOCK):
            return  # end of archive (the second zero block and the padding are not read)
        if not _checksum_ok(header, shard, offset):
            raise _corrupt(shard, offset, "header checksum mismatch")
        size = _size(header, shard, offset)
        kind = header[156:157]
        if kind in (_GNU_LONGNAME, _GNU_LONGLINK, _PAX, _PAX_GLOBAL):
            if size > _MAX_META:
                raise _corrupt(shard, offset, f"metadata member of {size} bytes")
            data = await stream.read(size, "a metadata member")
            await stream.skip(_padding(size), "padding")
            if kind == _GNU_LONGNAME:
                long_name = data.rstrip(b"\0")
            elif kind == _PAX:
                pax = _parse_pax(data, shard, offset)
            continue
        raw = long_name if long_name is not None else _header_name(header)
        raw = pax.get(b"path", raw)
        if b"size" in pax:
            text = pax[b"size"]
            if not text.isdigit():
                raise _corrupt(shard, offset, f"pax size is not a number: {text!r}")
            size = int(text)
        long_name, pax = None, {}
        name = _check_name(_decode(raw), shard, offset)
        if kind in _REGULAR:
            data = await stream.read(size, f"member {name!r} (header at offset {offset})")
            await stream.skip(_padding(size), "padding")
            yield name, offset, data
        else:
            await stream.skip(size + _padding(size), f"member {name!r}")


async def read_samples(
    name: str, chunks: AsyncGenerator[bytes, None]
) -> AsyncGenerator[dict[str, Any], None]:
    """Yield the samples of one shard (``name``: as shown in samples and errors) from its
    bytes; ``chunks`` is closed when the generator ends or closes.

    Raises:
        ValueError: A member name escapes or a sample repeats an extension.
        CorruptShardError: The bytes are not a whole, valid tar file.
        OSError: Reading failed, with a note naming the shard.
    """
    try:
        async with (
            aclosing(chunks),
            aclosing(_members(_Stream(chunks, name), name)) as members,
        ):
            sample: dict[str, Any] | None = None
            async for member, offset, data in members:
                parts = _split(member)
                if parts is None:
                    continue
                key, ext = parts
                if sample is not None and sample["__key__"] != key:
                    yield sample
                    sample = None
                if sample is None:
                    sample = {"__key__": key, "__shard__": name}
                if ext in sample:
                    raise ValueError(
                        f"tar shard {name!r}: member {member!r} at offset {offset} repeats "
                        f"extension {ext!r} of sample {key!r}"
                    )
                sample[ext] = data
            if sample is not None:
                yield sample
    except OSError as exc:
        exc.add_note(f"aioloader.sources.tar_shards: reading {name!r}")
        raise
