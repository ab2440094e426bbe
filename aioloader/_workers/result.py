"""What a batch job sends back (:class:`JobResult`): its own module, so that the worker's loop
(``worker.py``) can tell a job's batch from the rest of its result without importing the jobs
(``job.py``), which import the worker's state.

Owns: the result type. Never: runs a job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Failure", "JobResult"]

Failure = tuple[int, str, Exception]  # (position in the batch, stage, exception)


@dataclass(slots=True)
class JobResult:
    """The outcome of a batch job.

    Attributes:
        batch: The collated batch, when every sample was read and transformed; else None.
        transformed: The samples that did transform, when some did not (so the caller can
            collate the survivors after deciding to skip the failures).
        failures: ``(position in the batch, stage, exception)`` for each sample that could not be
            read (stage ``"fetch"``) or transformed (``"transform"``).
        retries: Reads retried under the loader's retry policy (worker-side datasets).
        size: Samples in the batch (for a stream's batch, which the worker sized).
        state: The worker's dataset's ``state_dict()`` after the batch's samples were read (a
            copy), when asked for (a resumable stream's batch).
        error: Why the batch failed as a whole, where the job reports it rather than raising
            it (a stream's batch, whose ``state`` must reach the caller all the same).
    """

    batch: Any = None
    transformed: list[Any] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    retries: int = 0
    size: int = 0
    state: Any = None
    error: Exception | None = None
