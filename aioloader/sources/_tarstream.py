"""A shard's chunks to samples: decompressed when they are (gzip, bzip2, xz), then parsed by
:class:`~._tarfmt.TarParser` as they come.

Owns: driving the parser over an async stream of a shard's chunks, and recognising and
undoing its compression. Never: opens or reads anything (it is given the chunks), or parses a
tar header itself (``_tarfmt.py`` does).
"""

from __future__ import annotations

import bz2
import lzma
import zlib
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from ._tarfmt import CorruptShardError, TarParser

__all__ = ["read_located", "read_samples"]


async def read_samples(
    name: str, chunks: AsyncGenerator[bytes, None], fields: dict[str, Any] | None = None
) -> AsyncGenerator[dict[str, Any], None]:
    """Yield the samples of one shard (``name``: as shown in samples and errors) from its
    bytes; ``chunks`` is closed when the generator ends or closes (at the end-of-archive block,
    before the padding after it is read).

    Raises:
        ValueError: A member name escapes or a sample repeats an extension.
        CorruptShardError: The bytes are not a whole, valid tar file.
        OSError: Reading failed, with a note naming the shard.
    """
    async with aclosing(read_located(name, chunks, fields)) as located:
        async for sample, _, _ in located:
            yield sample


async def read_located(
    name: str,
    chunks: AsyncGenerator[bytes, None],
    fields: dict[str, Any] | None = None,
    *,
    start: int = 0,
) -> AsyncGenerator[tuple[dict[str, Any], int | None, int | None], None]:
    """As :func:`read_samples`, each sample with where it lies in the shard: ``(sample, start,
    end)``, a resumed read going on with the next sample at ``end``; ``chunks`` being the
    shard's bytes from ``start`` on. A compressed shard's offsets are None (its uncompressed
    offsets cannot be read from)."""
    parser = TarParser(name, fields, start)
    plain = [True]
    try:
        async with aclosing(chunks), aclosing(_decompressed(chunks, name, plain)) as data:
            async for chunk in data:
                samples = parser.feed(chunk)
                for sample, (begin, end) in zip(samples, parser.take_spans(), strict=True):
                    yield (sample, begin, end) if plain[0] else (sample, None, None)
                parser.check()  # a problem after those samples
                if parser.done:
                    break
        for sample in parser.finish():
            begin, end = parser.take_spans()[0]
            yield (sample, begin, end) if plain[0] else (sample, None, None)
    except OSError as exc:
        exc.add_note(f"aioloader.sources.tar_shards: reading {name!r}")
        raise


_GZIP = b"\x1f\x8b"
_BZIP2 = b"BZh"
_XZ = b"\xfd7zXZ\x00"


async def _decompressed(
    chunks: AsyncGenerator[bytes, None], name: str, plain: list[bool] | None = None
) -> AsyncGenerator[bytes, None]:
    """``chunks``, decompressed when they start as gzip (``.tar.gz``, ``.tgz``: several gzip
    members one after the other too), bzip2 or xz; as they are otherwise (``plain[0]`` says
    which, once the first bytes are read)."""
    first = b""
    async for chunk in chunks:
        first += chunk
        if len(first) >= len(_XZ):
            break
    if first.startswith(_GZIP):
        make: Any = lambda: zlib.decompressobj(wbits=31)  # noqa: E731
    elif first.startswith(_BZIP2):
        make = bz2.BZ2Decompressor
    elif first.startswith(_XZ):
        make = lzma.LZMADecompressor
    else:
        if first:
            yield first
        async for chunk in chunks:
            yield chunk
        return
    if plain is not None:
        plain[0] = False
    decompressor = make()
    pending = first
    while True:
        while pending:
            try:
                out = decompressor.decompress(pending)
            except (OSError, EOFError, zlib.error, lzma.LZMAError) as exc:
                raise CorruptShardError(
                    f"tar shard {name!r} is not valid compressed data: {exc}"
                ) from None
            if out:
                yield out
            if not decompressor.eof:
                break
            pending = decompressor.unused_data  # the next member of a multi-member file
            decompressor = make()
        try:
            pending = await anext(chunks)
        except StopAsyncIteration:
            break
