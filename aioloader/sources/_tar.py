"""A streaming reader of WebDataset-style tar shards, on the local disk, over HTTP(S) or in an
object store.

Owns: ``tar_shards``' options and public surface, the per-epoch shard shuffle, the rank split of
shards and the plan of an epoch (shards in flight, read-ahead per shard, the shuffles' seeds).
Naming and reading shards is ``_tarread.py``'s (bytes resumed by ``_streams.py``, parsed by
``_tarfmt.py``); where an epoch stands, and checking a saved state, ``_tarstate.py``'s. Never:
decodes member bytes, or reads a whole shard into memory or to disk first.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._base.checks import check_bool, check_int, check_seed
from .._base.retry import RetryPolicy
from .._data.epochs import OpensEpochs
from .._data.restream import Piece, split_pieces
from .._data.seeds import derive_seed
from .._data.sharding import SplitsByRank, epoch_parts, resolve_rank
from .._fanin.lanes import ahead_for, plan_digest
from ._tarfmt import CorruptShardError
from ._tarread import ShardReading, _display, _sample_bytes, shard_names
from ._tarstate import EpochRun, ShuffleBuffer, check_saved_state

if TYPE_CHECKING:
    from ._slots import SlotPolicy, SlotStreams

__all__ = ["CorruptShardError", "TarShards", "tar_shards"]

_DEFAULT_RETRY = RetryPolicy(attempts=5)


class TarShards(SplitsByRank, OpensEpochs[dict[str, Any]]):
    """Streams the samples of WebDataset-style tar shards, several shards read at once.

    Shards are named by local paths, ``file://`` URLs, ``http(s)://`` URLs, or object-store
    URLs (``s3://bucket/key``, ``gs://``, ``az://``, ... read through obstore, configured from
    ``config``/``client_options`` or the usual environment variables), or, with ``store``, by keys
    in that store. A single string is a brace pattern: ``"shard-{000..127}.tar"`` names 128 shards
    (see :func:`~aioloader.sources._braces.expand_braces`).

    Each shard is read start to end in chunks of about ``chunk_size`` bytes and parsed
    incrementally: nothing is downloaded whole. ``shards_in_flight`` shards are read at once,
    each into a read-ahead buffer of its own, and their samples are interleaved: a seeded
    round-robin over the open shards (each round visits every open shard once, in slot order,
    or, with ``shuffle_shards``, in an order drawn for the round), a shard that ends giving its
    place to the next shard of the epoch's order. The order depends only on the seed, the epoch
    and ``shards_in_flight``, never on which bytes arrive first. A few more shards (a quarter of
    ``shards_in_flight``, at least one) are opened ahead, so the next shard is already flowing
    when one ends. Memory: the samples read ahead hold at most ``buffer_bytes`` in all (split
    evenly over the open shards, at least one ``chunk_size`` each; a sample counts its members'
    bytes and 256 more), plus, per open shard, one sample waiting for room, the sample being
    assembled and the chunk being parsed (a member larger than a chunk is held whole until it
    is complete), plus the shuffle buffer; a slow consumer stops the reads. A transfer that
    breaks (a reset, a 5xx, throttling, a body cut short, no byte for ``timeout`` seconds)
    resumes at the byte where it stopped, with a range request, as ``retry`` allows;
    :attr:`retries` counts the resumptions.

    Samples: consecutive regular-file members with the same key (the member path up to the first
    dot of its last component, folders included) form one sample, a dict, with webdataset's
    names so that code written for webdataset runs unchanged::

        {"__key__": "dir/0001", "__url__": "/data/shard-0.tar", "jpg": b"...", "cls": b"...",
         "__local_path__": "/data/shard-0.tar", "__shard__": "/data/shard-0.tar"}

    ``__key__`` and ``__url__`` are ``str`` (the member name decoded as UTF-8 with
    ``surrogateescape``; the shard as given, a URL without its query string or user info);
    ``__local_path__`` is there for a local shard (its path), and ``__shard__`` (ours, the same
    as ``__url__``) always. Every other value is the member's ``bytes``, under its extension in
    lower case (everything after that first dot: ``x.Seg.PNG`` is ``"seg.png"``). Directories,
    links and other non-regular members are skipped (contiguous-file members, type ``7``, are
    regular), as are members whose last component has no extension or starts with a dot, and
    webdataset's metadata (names starting ``__something__`` followed by ``/`` or the end), as
    webdataset does. A leading ``./`` of a member name is dropped. A GNU sparse member is an
    error (:class:`CorruptShardError` naming it), never a sample with the wrong bytes.

    Compressed shards (gzip: ``.tar.gz``, ``.tgz``, as ``webdataset.TarWriter(compress=True)``
    writes them; bzip2; xz) are recognised by their first bytes and decompressed as they stream.
    A broken transfer resumes at the compressed byte where it stopped, so decompression goes on
    where it was; offsets in error messages count uncompressed bytes.

    Epochs: read by a :class:`~aioloader.DataLoader`, the loader owns them (its epoch is
    passed in as each opens; choose it with ``loader.set_epoch``: the dataset's own
    :meth:`set_epoch` raises once a loader reads it). Iterated directly, each :meth:`__aiter__`
    call starts the next epoch (the first is 0); :meth:`set_epoch` chooses the next one. See
    :class:`~aioloader.OpensEpochs`.

    Resuming: :meth:`state_dict` gives where the open epoch's iterator stands (the interleave's
    order, how many samples it took from each open shard, and what the shuffle buffer holds, by
    shard and place, with the generators' states), and :meth:`load_state_dict` makes the next
    epoch go on from there: the open shards are read again from their starts, their samples
    already taken passed over, and the buffer's samples read again, so the samples that follow
    are exactly those of the uninterrupted epoch. A loader calls both for you
    (``DataLoader.state_dict()``). The state also names what this rank reads: its rank and
    world size, and its *pieces* (null for its shards of the epoch's split, whole; after
    :func:`~aioloader.merge_states` re-divided an epoch among another number of ranks, the
    shard byte ranges and held samples it was dealt), so that ``merge_states(states,
    world_size=...)`` can deal what every rank left to another number of ranks, as often as an
    epoch is resumed (see ``docs/design.md``, "Resuming").

    Shuffling: with ``shuffle_shards`` the epoch's shard order is a permutation drawn with
    ``random.Random(derive_seed(seed, epoch))``, and the interleave's rounds are drawn with
    ``random.Random(derive_seed(seed, epoch, 2))``; with ``shuffle_buffer > 1`` samples pass
    through a buffer of that size (filled first, then each new sample takes a random slot and
    the evicted sample is yielded; what is left is yielded in random order at the end), drawn with
    ``random.Random(derive_seed(seed, epoch, 1))``. The same seed and epoch give the same order.

    Order without ``shuffle_shards``: ``shards_in_flight`` shards are read at once and their
    samples interleaved round by round (seeded, as above), so the order is not webdataset's
    shard after shard. To read one shard after the other, pass ``shards_in_flight=1`` (the
    next shard is still opened ahead, so it flows when one ends).

    Ranks: after the shuffle, shard ``j`` of the epoch's order goes to rank ``j % world_size``
    (``rank`` and ``world_size`` resolved with :func:`aioloader._data.sharding.resolve_rank` at each
    epoch: explicit values, else ``torch.distributed``, else rank 0 of 1). When the number of
    shards is not a multiple of ``world_size``, the last ``len(shards) % world_size`` shards of the
    epoch's order are dropped, so every rank reads the same number of shards (equal shard counts,
    not equal sample counts: shards of different sizes still give ranks different numbers of
    samples). A loader given ``distributed=True`` refuses it, as it would split the stream a
    second time (unless ``world_size=1`` is given here: every rank reads every shard).

    Stateful sequence models: :meth:`per_slot` gives a dataset where position ``i`` of every
    batch continues stream ``i``.

    Args:
        shards: Paths or URLs of tar files, or one brace pattern.
        shuffle_shards: Shuffle the shard order each epoch.
        shuffle_buffer: Size of the sample shuffle buffer; 0 or 1 keeps the stream order.
        shards_in_flight: Shards read at once, or None for the default: 16 for remote shards
            (HTTP, object stores: enough connections for a fast link with tens of ms to the
            first byte), 4 for local files; never more than the epoch has. 1 reads the shards
            one after the other.
        buffer_bytes: Bytes of samples held read ahead, over all open shards (16 MiB by
            default).
        seed: The base seed of both shuffles.
        rank: This rank, or None to detect it.
        world_size: The number of ranks, or None to detect it.
        chunk_size: Bytes per read of a shard (the least an object-store chunk holds). An
            HTTP connection buffers up to twice this much besides (aiohttp raises its limits
            to the read size), so it is kept small by default: 256 KiB.
        retry: When to resume a broken read (the default: 5 attempts per stall, exponential
            backoff with jitter, for transient errors); None fails at the first break.
        timeout: Seconds without a byte after which a read counts as stalled (and is resumed).
        headers: HTTP headers for every request (e.g. ``Authorization``); never shown.
        config: obstore store configuration (``endpoint``, ``region``, ...).
        client_options: obstore client options (``{"allow_http": True}``, ...).
        store: An obstore store; then every shard names a key in it.

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: ``shards`` is empty or a bad brace pattern, ``shuffle_buffer < 0``,
            ``shards_in_flight < 1``, ``buffer_bytes < 1``, ``chunk_size < 1``, ``timeout`` is
            not positive, or ``rank``/``world_size`` are out of range.

    Iterating raises:
        ValueError: A member name is absolute, has a ``..`` component or a NUL, or a sample has
            the same extension twice (naming the shard, the member and its header offset).
        Every error of a shard is raised where its samples would have come, after the samples
        before it, with a note naming the shard; the other open shards are closed.
        CorruptShardError: A shard is truncated (including a missing end-of-archive block), a
            header checksum does not match, or a size field is not a number (naming the shard
            and the byte offset).
        OSError: A local shard cannot be opened or read, with a note naming it.
        aioloader.sources.HTTPStatusError, TransientHTTPError, HTTPConnectionError,
        TransientStoreError, FileNotFoundError, TimeoutError: A remote read failed and ``retry``
            gave up, with a note naming the shard, the byte offset and the attempt.
    """

    #: :meth:`state_dict` builds a new object each call: the loader need not copy it.
    state_dict_is_a_copy = True

    def __init__(
        self,
        shards: str | Sequence[str | os.PathLike[str]],
        *,
        shuffle_shards: bool = False,
        shuffle_buffer: int = 0,
        shards_in_flight: int | None = None,
        buffer_bytes: int = 16 << 20,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        chunk_size: int = 256 << 10,
        retry: RetryPolicy | None = _DEFAULT_RETRY,
        timeout: float = 60.0,
        headers: Mapping[str, str] | None = None,
        config: Mapping[str, Any] | None = None,
        client_options: Mapping[str, Any] | None = None,
        store: Any = None,
    ) -> None:
        self._shards = shard_names(shards, store)
        self._shuffle_shards = check_bool("shuffle_shards", shuffle_shards)
        self._shuffle_buffer = check_int("shuffle_buffer", shuffle_buffer, minimum=0)
        self._chunk_size = check_int("chunk_size", chunk_size, minimum=1)
        if shards_in_flight is not None:
            check_int("shards_in_flight", shards_in_flight, minimum=1)
        self._in_flight = shards_in_flight
        self._buffer_bytes = check_int("buffer_bytes", buffer_bytes, minimum=1)
        self._seed = check_seed(seed)
        # What decides the split, the same on every rank: a re-divided state must be of it.
        self._dataset = plan_digest(self._shards, self._seed, self._shuffle_shards)
        if rank is not None and world_size is not None:
            resolve_rank(rank, world_size)  # validate early
        self._rank = rank
        self._world_size = world_size
        self._reading = ShardReading(
            chunk_size=self._chunk_size,
            retry=retry,
            timeout=timeout,
            headers=headers,
            config=config,
            client_options=client_options,
            store=store,
            on_retry=self._count_retry,
        )
        self._running: EpochRun | None = None  # the open epoch, whose state state_dict() gives
        #: Reads resumed after a transient failure, over the dataset's life.
        self.retries = 0

    def _count_retry(self) -> None:
        self.retries += 1

    @property
    def shards(self) -> list[str]:
        """The shard paths or URLs, in the order given (a copy)."""
        return list(self._shards)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(shards={len(self._shards)}, "
            f"first={_display(self._shards[0])!r}, "
            f"shuffle_shards={self._shuffle_shards}, shuffle_buffer={self._shuffle_buffer})"
        )

    def state_dict(self) -> dict[str, Any]:
        """Where the open epoch's iterator stands (after the samples it has given), or, with no
        epoch open, the start of the next epoch: a JSON-serialisable dict whose size does not
        grow with the epoch (a few numbers per open shard and per buffered sample, and the
        shuffles' generator states)."""
        run = self._running
        if run is None:
            return self.next_state(self.epoch_start_state(0))
        return run.state()

    def epoch_start_state(self, epoch: int) -> dict[str, Any]:
        """The state at the start of ``epoch``, nothing read: this rank's split of it.

        Raises:
            TypeError, ValueError: A bad rank or world size.
        """
        rank, world = resolve_rank(self._rank, self._world_size)
        return {**self._split(epoch, rank, world, None), "cursor": None}

    def _split(
        self, epoch: int, rank: int, world: int, pieces: list[Piece] | None
    ) -> dict[str, Any]:
        """What a state names of what this rank reads (``_data/restream.py``)."""
        return {
            "epoch": epoch,
            "shards": len(self._shards),
            "dataset": self._dataset,
            "seed": self._seed,
            "shuffle_shards": self._shuffle_shards,
            "split": [rank, world],
            "pieces": None if pieces is None else tuple(tuple(p.to_json()) for p in pieces),
        }

    def check_state(self, state: dict[str, Any]) -> int:
        """The epoch of ``state`` (from :meth:`state_dict`, or one of ``merge_states``' for
        this rank); the rest is checked as the epoch opens.

        Raises:
            TypeError, ValueError: ``state`` is malformed, of a different list of shards or
                seed, or of another rank or world size.
        """
        return check_saved_state(
            state,
            count=len(self._shards),
            dataset=self._dataset,
            rank=self._rank,
            world_size=self._world_size,
        )

    def epoch_shards(self, epoch: int) -> list[str]:
        """The shards this rank reads in ``epoch``, in reading order.

        Raises:
            TypeError, ValueError: ``epoch`` is not an int >= 0, or a bad rank/world size.
        """
        return epoch_parts(
            self._shards,
            epoch,
            seed=self._seed,
            shuffle=self._shuffle_shards,
            rank=self._rank,
            world_size=self._world_size,
        )

    def shards_in_flight(self, shards: int) -> int:
        """How many shards are read at once in an epoch of ``shards`` shards (see the class)."""
        if self._in_flight is not None:
            return max(1, min(self._in_flight, shards))
        remote = self._reading.remote(self._shards[0])
        return max(1, min(16 if remote else 4, shards))

    def per_slot(
        self, slots: int, *, policy: SlotPolicy = "shortest", fill: Any = None
    ) -> SlotStreams[dict[str, Any]]:
        """A dataset of ``slots`` parallel streams over this rank's shards, for stateful
        sequence models: pass it to a loader with ``batch_size=slots`` and position ``i`` of every
        batch continues stream ``i``. See :class:`~aioloader.sources.SlotStreams`.

        Each epoch, this rank's shards (shuffled as :meth:`epoch_shards` says) are dealt out:
        stream ``i`` reads shards ``i, i + slots, ...`` of that order, one after the other (its
        next shard opened before the current one ends; ``buffer_bytes`` shared by the open
        shards); the sample shuffle buffer does not apply (it would mix the streams).

        Raises:
            TypeError, ValueError: ``slots`` is not an int >= 1, or ``policy`` is unknown.
        """
        from ._slots import SlotStreams

        return SlotStreams(
            self.epoch_shards,
            self._reading.open_reader,
            slots=slots,
            policy=policy,
            fill=fill,
            buffer=max(self._chunk_size, self._buffer_bytes // (2 * slots)),
            size=_sample_bytes,
        )

    def epoch_items(
        self, epoch: int, state: dict[str, Any] | None
    ) -> contextlib.AbstractAsyncContextManager[AsyncIterator[dict[str, Any]]]:
        """Epoch ``epoch`` (see :meth:`~aioloader.OpensEpochs.open_epoch`): an async context
        manager giving an iterator over this rank's samples, from ``state`` on if given; the
        shards' readers run until the ``async with`` is left.

        Cancellation: leaving the block early (``break``, an error, cancellation) closes every
        open shard (its file or connection) before the block is left.
        """
        rank, world = resolve_rank(self._rank, self._world_size)
        named = state.get("pieces") if state is not None else None
        if named is None:  # this rank's shards of the epoch's split, whole
            pieces = split_pieces(
                len(self._shards),
                epoch,
                seed=self._seed,
                shuffle=self._shuffle_shards,
                rank=rank,
                world_size=world,
            )
        else:  # what a re-division dealt this rank (checked by check_state)
            pieces = [Piece.from_json(p) for p in named]
        split = self._split(epoch, rank, world, None if named is None else pieces)
        resume = state if state is not None and state.get("cursor") is not None else None
        return self._samples(pieces, split, resume)

    @contextlib.asynccontextmanager
    async def _samples(
        self, pieces: list[Piece], split: dict[str, Any], resume: dict[str, Any] | None
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        epoch, shards = split["epoch"], [self._shards[p.part] for p in pieces]
        width = self.shards_in_flight(len(pieces))
        ahead = ahead_for(width, len(pieces))
        per_shard = max(self._chunk_size, self._buffer_bytes // (width + ahead))
        order = random.Random(derive_seed(self._seed, epoch, 2)) if self._shuffle_shards else None
        plan: list[object] = [shards, self._seed, self._shuffle_shards, self._shuffle_buffer]
        if split["pieces"] is not None:  # a fresh split's digest is the one saved before
            plan.append(split["pieces"])
        digest = plan_digest(*plan)
        run = EpochRun(split, digest, width, order, resume)
        if self._shuffle_buffer > 1:
            rng = random.Random(derive_seed(self._seed, epoch, 1))
            run.buffer = ShuffleBuffer(self._shuffle_buffer, rng, run)
            if resume is not None:
                run.buffer.restore(resume.get("buffer"))

        async with self._reading.epoch(
            self._shards, pieces, run, width=width, ahead=ahead, part_limit=per_shard, order=order
        ) as samples:
            self._running = run
            try:
                yield samples
            finally:
                self._running = None


#: ``aioloader.sources.tar_shards(...)``: the constructor under the name the other sources use
#: (``objects``, ``files``, ``urls``). Example::
#:
#:     ds = aioloader.sources.tar_shards("s3://bucket/train-{000000..000127}.tar",
#:                                       shuffle_shards=True, shuffle_buffer=1000)
tar_shards = TarShards
