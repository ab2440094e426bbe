"""A loader's ``state_dict`` and ``load_state_dict``: where its consumer stands, saved, and a
saved state gone on from.

Owns: :class:`Resumable`, the part of ``DataLoader`` (one of its base classes) that saves the
state of the running epoch (or the start of the next) and loads one for the next epoch to go
on from, ending the epoch still running first. Never: checks, resolves or re-divides a state
itself (``checkpoint.py``, ``resuming.py``, ``merging.py`` do), or begins an epoch.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

from .._base.exceptions import LoaderStateError
from .._data.order import owner_epoch
from .._workers.offload import ThreadOffload
from .checkpoint import EpochState, dumps_checked, fresh_state, restore_sampler
from .plain import PlainIterator
from .plan import LoaderPlan
from .resuming import check_place, check_resumable, resolve
from .scope import LoaderState, Scope
from .session import Session

__all__ = ["Resumable", "ResumableLoader"]


class ResumableLoader(Protocol):
    """What saving and loading a state need of a loader (``loader.DataLoader`` is one): its
    plan and shared state, the epoch it runs next and a state loaded for it, and what runs
    its epochs (a scope, a plain ``for``'s session or iterator)."""

    _plan: LoaderPlan
    _state: LoaderState
    _session: Session | None
    _plain: weakref.ref[PlainIterator[Any]] | None
    _resume: EpochState | None
    _loaded: EpochState | None
    _copied: bool
    _dropped: BaseException | None
    _next_epoch: int
    _epoch_given: bool

    @property
    def _scope(self) -> Scope | None: ...

    @property
    def dataset(self) -> Any: ...

    @property
    def seed(self) -> int | None: ...

    def _end_running_epoch(self) -> None: ...

    def _choose_epoch(self, epoch: int, by: str) -> None: ...

    def _offload(self) -> ThreadOffload: ...

    def _refresh_plan(self, *, raising: bool = True) -> None: ...


class Resumable:
    """``state_dict`` and ``load_state_dict`` (a base class of ``DataLoader``, whose
    ``__init__`` sets the attributes below, which loading a state sets again)."""

    _plan: LoaderPlan
    _resume: EpochState | None
    _loaded: EpochState | None = None  # the state ``_resume`` was resolved from, as loaded
    _copied = False  # a copy whose plan is still the original's (see ``_refresh_plan``)
    _dropped: BaseException | None = None  # why a loaded state was dropped, not yet raised
    _next_epoch: int
    _epoch_given: bool  # set_epoch chose the next epoch (not a sampler's owner)

    def state_dict(self: ResumableLoader) -> dict[str, Any]:
        """Where the loader stands: the batches of the current epoch its consumer has taken (a
        ``for``/``async for`` between two batches: "batches ``0..k`` were taken"), as a small
        JSON-serialisable dict (a seed and counters, whatever the epoch's size; no pickles).
        Between epochs (and before the first) it is the start of the next one. After a
        ``break`` it is where the loop stopped, until :meth:`set_epoch` or the next iteration
        starts another epoch. It may be called from any thread.

        :meth:`load_state_dict` on a new loader with the same dataset and settings (in
        another process, perhaps with another ``world_size``: see :func:`merge_states`) goes on
        from there: every sample of the epoch once, none twice, none lost. It does not depend on
        ``num_workers``, ``max_inflight``, ``prefetch`` or the order batches completed in.

        A stream's state is its dataset's ``state_dict()``, or, for a blocking one whose
        ``__iter__`` gives an iterator that keeps its own (torchdata's ``Stateful``), both.
        A user's sampler given a ``torch.Generator`` has the generator's state as the epoch
        began kept (:meth:`load_state_dict` sets it back). At an epoch's start (nothing of it
        taken yet) any dataset and any order have a state.

        Raises:
            TypeError: The loader cannot resume, named: batches were taken from a stream that
                keeps no state (neither the dataset nor its iterator defines
                ``state_dict``/``load_state_dict``: an async generator, say) or from a sampler
                whose order cannot be replayed (one drawing from torch's global generator); a
                stream split by ``distributed=True``; or a dataset's state that is not
                JSON-serialisable (tensors, arrays, tuples and int keys are kept).
        """
        self._refresh_plan()
        check_resumable(self._plan)
        resumable: bool | None = None  # a loaded state's stream was checked as it was saved
        if self._resume is not None:
            state = self._resume
        else:
            progress = self._state.progress
            last = None if progress is None else progress.base.epoch
            plan = self._plan
            owned = None if self._epoch_given else owner_epoch(plan.sampler, plan.batch_sampler)
            if owned is not None and owned != last:  # the owner chose the next: its start
                state = fresh_state(plan, owned)
            elif progress is None or progress.finished:
                after = self._next_epoch if owned is None or last is None else last + 1
                state = fresh_state(plan, after)
            else:
                state, resumable = progress.state(), progress.resumable
        check_place(self._plan, state, resumable=resumable)
        document = state.to_json()
        dumps_checked(document, self.dataset)
        return document

    def load_state_dict(self: ResumableLoader, state: dict[str, Any]) -> None:
        """Go on from ``state`` (:meth:`state_dict` of a loader over the same data with the
        same settings, or :func:`merge_states` of every rank's): the next iteration runs the
        state's epoch and yields its batches not yet taken, with the places (and per-batch
        seeds) they had, so with the same seed and world size the batches are the same as an
        uninterrupted run's. With another ``world_size`` (a merged state, or a single rank's
        state of a world of 1) the epoch's remaining samples are re-divided among the new
        ranks: together they yield exactly those, every rank as many batches.

        A loader built without ``seed`` takes the state's (its shuffle order is the saved
        run's); a stream dataset gets its own state through its ``load_state_dict`` when the
        epoch starts.

        Raises:
            TypeError, ValueError: ``state`` is malformed (the message names the field), or it
                does not fit this loader (another dataset length, ``batch_size``, ``drop_last``,
                ``seed``, kind of dataset), or a single rank's state of a world of several is
                loaded with another ``world_size`` or rank (merge the ranks' states first).
            TypeError: This loader cannot resume (see :meth:`state_dict`).

        An epoch still running (a loop left by ``break``, an iterator kept) is ended first, as
        starting another epoch would end it: an iterator still held stops.
        """
        loaded = EpochState.from_json(state)
        self._resume = self._loaded = self._dropped = None  # replaced: not resolved again
        self._refresh_plan()
        check_resumable(self._plan)
        check_place(self._plan, loaded)
        resume = resolve(self._plan, loaded)
        restore_sampler(self._plan, resume.sampler, loading=True, check=True)
        self._end_running_epoch()
        restore_sampler(self._plan, resume.sampler, loading=True)  # between epochs: now
        plan = self._plan
        if self.seed is None and (resume.seed, resume.order_seed) != (
            plan.base_seed,
            plan.order_seed,
        ):
            object.__setattr__(self, "_plan", plan.reseeded(resume.seed, resume.order_seed))
            if self._scope is not None:  # the open scope's next epoch runs with these seeds
                self._scope.plan = self._plan
        self._resume, self._loaded = resume, loaded
        self._next_epoch = resume.epoch  # (not given to a sampler of another's: its owner's)
        self._state.progress = None

    def _refresh_plan(self: ResumableLoader, *, raising: bool = True) -> None:
        """Make the plan again where it is not this process's or not this moment's: a copy's
        (``ScopeLifecycle.__setstate__``), and one whose share of a ``distributed`` dataset
        ``torch.distributed`` now gives otherwise (neither ``rank`` nor ``world_size`` given:
        ``LoaderPlan.made_again``); a state loaded meanwhile is resolved again
        for the new share. Not while a scope is open: its epochs, and ``len()``, keep its plan.
        Called as a scope opens, by a plain ``for``, ``len()`` and the two state methods.

        Raises:
            TypeError, ValueError: A state loaded before the process group started cannot go
                on with this rank's share (a stream's): it is dropped, the loader reads on.
                Raised once; without ``raising`` (``len()``, which tools probe for a
                ``TypeError``) kept for the next call that raises.
        """
        dropped, self._dropped = self._dropped, None
        if dropped is not None:
            if raising:
                raise dropped
            self._dropped = dropped
        if self._scope is not None:
            return
        plan = self._plan.made_again(self._offload, copied=self._copied)
        self._copied = False
        if plan is None:
            return
        earlier, loaded, resuming = self._plan, self._loaded, self._resume
        object.__setattr__(self, "_plan", plan)
        if (plan.rank, plan.world_size) == (earlier.rank, earlier.world_size):
            return  # the same share: a state loaded stays as it was resolved
        self._resume = self._loaded = None
        if resuming is not None and loaded is not None:
            try:  # as load_state_dict would check it, for the new share
                check_resumable(plan)
                check_place(plan, loaded)
                resume = resolve(plan, loaded)
            except (TypeError, ValueError) as exc:  # the state goes: the loader stays usable
                exc.add_note(
                    f"aioloader: a state loaded before the process group started cannot go on "
                    f"as rank {plan.rank} of {plan.world_size}; it was dropped (the next epoch "
                    "starts afresh)"
                )
                if raising:
                    raise
                self._dropped = exc
                return
            restore_sampler(plan, resume.sampler, loading=True)
            self._resume, self._loaded = resume, loaded

    def _choose_epoch(self: ResumableLoader, epoch: int, by: str) -> None:
        """The next iteration runs ``epoch``, chosen by ``by`` (``set_epoch``, or the sampler's).

        Raises:
            LoaderStateError: A loaded state is of another epoch.
        """
        if self._resume is not None:
            if epoch != self._resume.epoch:
                raise LoaderStateError(
                    f"the state loaded with load_state_dict() goes on with epoch "
                    f"{self._resume.epoch}; {by}({epoch}) would drop it (call "
                    f"{by}({self._resume.epoch}), or none, to resume)"
                )
        elif self._state.progress is not None and not self._state.progress.finished:
            self._state.progress = None  # left by a break: the next epoch starts afresh
        self._next_epoch = epoch

    def _end_running_epoch(self: ResumableLoader) -> None:
        """End the epoch in progress, if any (from the thread that calls the loader)."""
        owner = self._plain() if self._plain is not None else None
        if owner is not None and self._session is None:
            owner.close()  # a plain for's own scope: closed with its epoch
            return
        scope = self._scope
        running = scope.current if scope is not None else None
        if running is None or running.closed:
            return
        if self._session is not None:  # the scope's loop runs on the session's thread
            self._session.portal.call(running.close_stream)
        else:
            running.close_stream()
