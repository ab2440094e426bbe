"""The work done for one batch on a worker: read (when the dataset lives there), transform each
sample, then collate.

Owns: the functions a worker runs, and their result type. They are module-level and take only
picklable arguments, so a thread runs them and a worker process can run them unchanged. Never:
touches the event loop, the loader or any shared state; decisions about failures (skip or raise)
are made by the caller on the event loop, where the failure budget lives.

Two shapes of job:

* :func:`run_batch`: the samples were read in the event loop (an async dataset, a source) and
  travel with the job.
* :func:`run_indices` and :func:`next_stream_batch`: a torch user's blocking dataset lives in
  the worker (:func:`~aioloader._workers.worker.worker_dataset`); the job carries a batch's
  indices, or asks the worker's own iterator for its next batch, as torch's workers do.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._base.exceptions import annotate, raised_of_its_own, worker_error
from .._base.retry import RetryPolicy
from .._base.stateful import StatefulPass
from .result import Failure, JobResult
from .worker import worker_dataset

__all__ = [
    "JobResult",
    "close_stream",
    "collate_only",
    "next_stream_batch",
    "open_stream",
    "run_batch",
    "run_indices",
]


def _transform_all(
    transform: Callable[[Any], Any] | None, samples: Sequence[Any], positions: Sequence[int]
) -> tuple[list[Any], list[Failure]]:
    if transform is None:
        return list(samples), []
    transformed: list[Any] = []
    failures: list[Failure] = []
    for position, sample in zip(positions, samples, strict=True):
        try:
            transformed.append(transform(sample))
        except Exception as exc:  # (a StopIteration would be a coroutine's RuntimeError)
            failures.append((position, "transform", worker_error(exc, "the transform")))
        except asyncio.CancelledError as exc:  # a plain call's own: this sample's failure
            failures.append((position, "transform", raised_of_its_own(exc, "the transform")))
    return transformed, failures


def run_batch(
    transform: Callable[[Any], Any] | None,
    collate: Callable[[Any], Any],
    samples: Sequence[Any],
    unbatched: bool,
    finish: Callable[[Any], Any] | None = None,
    *,
    failures: Sequence[Failure] = (),
    positions: Sequence[int] | None = None,
) -> JobResult:
    """Transform every sample, then collate them into one batch.

    Args:
        transform: Applied to each sample, or None.
        collate: Applied to the list of transformed samples (to the single sample when
            ``unbatched``).
        samples: The raw samples of one batch, in batch order.
        unbatched: ``batch_size=None``: ``samples`` holds one sample, collated on its own.
        finish: Applied to the collated batch (``device_transform`` when batches stay on the
            host), or None.
        failures: Failures found before the transform (reads that failed); the batch is then
            left uncollated, as for a transform failure.
        positions: Each sample's position in the batch (default: its place in ``samples``),
            for the failures reported.

    Returns:
        A :class:`JobResult`. A failure does not raise: it is reported in ``failures`` (in batch
        order) and the batch is left uncollated, its surviving samples in ``transformed``.

    Raises:
        Exception: Whatever ``collate`` or ``finish`` raises.
    """
    at = range(len(samples)) if positions is None else positions
    transformed, failed = _transform_all(transform, samples, at)
    if failures or failed:
        every = sorted([*failures, *failed], key=lambda failure: failure[0])
        return JobResult(transformed=transformed, failures=every, size=len(transformed))
    batch = collate_only(collate, transformed, unbatched, finish=finish)
    return JobResult(batch=batch, size=len(transformed))


def collate_only(
    collate: Callable[[Any], Any],
    transformed: list[Any],
    unbatched: bool,
    finish: Callable[[Any], Any] | None = None,
) -> Any:
    """Collate already transformed samples and apply ``finish`` to the batch.

    Raises:
        Exception: What ``collate`` or ``finish`` raised; a ``StopIteration`` as
            :class:`~aioloader._base.exceptions.StopInWorker` (a coroutine would make it PEP
            479's bare RuntimeError).
    """
    try:
        batch = collate(transformed[0] if unbatched else transformed)
        return batch if finish is None else finish(batch)
    except StopIteration as stop:
        what = "collate_fn" if finish is None else "collate_fn or device_transform"
        raise worker_error(stop, what) from stop


# -- a blocking dataset that lives in the worker --------------------------------------------------


def _retrying(
    call: Callable[[], Any], retry: RetryPolicy | None, rng: random.Random
) -> tuple[Any, int]:
    """``call()`` under the retry policy, sleeping between attempts; ``(result, retries)``."""
    failures = 0
    while True:
        try:
            return call(), failures
        except Exception as exc:
            failures += 1
            if retry is None or not retry.should_retry(exc, failures):
                if failures > 1:
                    exc.add_note(f"aioloader: gave up after {failures} attempts")
                raise
            time.sleep(retry.delay(exc, failures, rng))


def run_indices(
    indices: Sequence[int],
    transform: Callable[[Any], Any] | None,
    collate: Callable[[Any], Any],
    unbatched: bool,
    finish: Callable[[Any], Any] | None,
    retry: RetryPolicy | None,
    isolate: bool,
) -> JobResult:
    """Read a batch from the worker's copy of the dataset, then transform and collate it.

    The dataset's ``__getitems__`` (torch's batched protocol) is called once for the batch when
    it has one, else ``__getitem__`` per index (always without batching: torch calls it for
    batches only).

    Args:
        indices: The batch's dataset indices, in batch order.
        transform, collate, unbatched, finish: As :func:`run_batch`.
        retry: Retries failed reads (``TransientError`` and the like), sleeping in the worker.
        isolate: The loader may skip failed samples (``max_failures > 0``): a failed read is
            reported in ``failures`` (and a failed ``__getitems__`` is retried index by index
            so that only the bad samples go) instead of raising.

    Raises:
        Exception: A read failed and ``isolate`` is off (with a note naming the sample), or
            ``collate``/``finish`` raised.
    """
    dataset = worker_dataset()
    rng = random.Random()  # retry jitter only: never affects which data is produced
    getitems = None if unbatched else getattr(dataset, "__getitems__", None)
    retries = 0
    if getitems is not None:
        try:
            got, retries = _retrying(lambda: getitems(list(indices)), retry, rng)
            samples = list(got)
        except Exception as exc:
            if not isolate:
                annotate(exc, "fetch", index=list(indices))
                raise
        else:
            if len(samples) != len(indices):
                raise ValueError(
                    f"{type(dataset).__qualname__}.__getitems__ returned {len(samples)} items "
                    f"for {len(indices)} indices {list(indices)}"
                )
            result = run_batch(transform, collate, samples, unbatched, finish)
            result.retries = retries
            return result
    read: list[Any] = []
    positions: list[int] = []
    failures: list[Failure] = []
    for position, index in enumerate(indices):
        try:
            sample, tries = _retrying(functools.partial(dataset.__getitem__, index), retry, rng)
        except Exception as exc:
            error = worker_error(exc)
            annotate(error, "fetch", index=index)
            if not isolate and error is exc:
                raise
            if not isolate:
                raise error from exc  # a StopInWorker
            failures.append((position, "fetch", error))
            continue
        retries += tries
        read.append(sample)
        positions.append(position)
    result = run_batch(
        transform, collate, read, unbatched, finish, failures=failures, positions=positions
    )
    result.retries = retries
    return result


# -- a blocking iterable dataset iterated in the worker --------------------------------------

_stream: StatefulPass | None = None  # this worker's pass over its copy of the dataset


def open_stream(
    state: Any = None, prepare: Callable[[Any], object] | None = None
) -> tuple[bool, Any]:
    """Start a new pass over the worker's copy of the dataset (``iter(dataset)``), as torch's
    worker does at each epoch; an unfinished earlier pass is closed first. With ``state`` (a
    resumed epoch: what an earlier pass's batches carried), the pass starts where it stood
    (the dataset's ``load_state_dict`` before ``iter()``, its iterator's after: see
    ``_base/stateful.py``). Returns whether the pass keeps a state, and its state before its
    first item (``StatefulPass.opening``: None for a pass from the start whose dataset keeps
    the state). ``prepare(dataset)`` runs first: a DataPipe is seeded for the epoch there
    (``_data/datapipes.py``)."""
    global _stream
    close_stream()
    dataset = worker_dataset()
    if prepare is not None:
        prepare(dataset)
    _stream = StatefulPass(dataset, state)
    return _stream.resumable, _stream.opening


def close_stream() -> None:
    """End the worker's current pass (a generator's ``finally`` blocks run here, now)."""
    global _stream
    stream, _stream = _stream, None
    close = getattr(stream.iterator, "close", None) if stream is not None else None
    if close is not None:
        close()


def next_stream_batch(
    batch_size: int | None,
    drop_last: bool,
    transform: Callable[[Any], Any] | None,
    collate: Callable[[Any], Any],
    finish: Callable[[Any], Any] | None,
    isolate: bool = False,
) -> JobResult | None:
    """The next batch of the worker's own pass: up to ``batch_size`` samples (one, collated
    alone, when None), transformed and collated; None once the pass is over (a short last batch
    comes first unless ``drop_last``). With ``isolate`` (the loader may skip failed samples) a
    transform failure is reported in the result, its survivors left uncollated, as
    :func:`run_batch` does. A resumable pass's result carries its state after the batch's
    samples were read (``result.state``; None when neither the dataset nor its iterator keeps
    one), a failed batch's too: its samples are read, and a resumed pass starts past them.

    A batch that failed as a whole (``collate`` or ``finish`` raised, or a transform did
    without ``isolate``) does not raise: its result carries the exception (``result.error``,
    with a note naming the stage), for the caller to raise in the batch's turn.

    Raises:
        Exception: The dataset's iterator raised (with a note naming the stage); the pass is
            over.
    """
    global _stream
    if _stream is None:
        return None
    want = 1 if batch_size is None else batch_size
    try:
        samples = list(itertools.islice(_stream.items, want))
    except Exception as exc:
        _stream = None
        annotate(exc, "source")
        raise
    if not samples or (drop_last and len(samples) < want):
        close_stream()
        return None
    state = _stream.state() if _stream.resumable else None
    try:
        result = run_batch(transform, collate, samples, batch_size is None, finish)
    except Exception as exc:
        annotate(exc, "collate")
        result = JobResult(error=exc)
    if result.failures and not isolate:  # no budget to skip: the first one fails the batch
        _position, stage, error = result.failures[0]
        annotate(error, stage)
        result = JobResult(error=error)
    result.state = state
    return result
