"""A process's limit of open files, as the main process meets it taking batches.

Owns: telling whether this process is out of descriptors, and the errors that say so (the main
process's, taking a batch; a worker's, taking a job). Each
batch from a worker process arrives as a shared-memory descriptor (torch's default sharing
strategy), open as long as the batch's tensors are: a script that keeps its batches reaches the
limit, and the reply that fails to unpickle then fails deep in multiprocessing ("received 0
items of ancdata"). torch's ``DataLoader`` says what happened and what to do; so does this.
"""

from __future__ import annotations

import errno
import os
import resource

__all__ = ["JobNotTaken", "job_out_of_files", "out_of_descriptors", "too_many_open_files"]

MARGIN = 10  # torch's: one more descriptor is not a sufficient test, the failure let some go


def out_of_descriptors(margin: int = MARGIN) -> bool:
    """Whether this process cannot open ``margin`` more descriptors.

    Raises nothing: a failure to open one for another reason is not this.
    """
    opened: list[int] = []
    try:
        for _ in range(margin):
            opened.append(os.open(os.devnull, os.O_RDONLY))
    except OSError as exc:
        return exc.errno == errno.EMFILE
    finally:
        for fd in opened:
            os.close(fd)
    return False


def too_many_open_files() -> RuntimeError:
    """The error for a batch that could not be taken for want of descriptors: torch's words
    (its ``test_dataloader.py`` matches them), then this process's limit and why."""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return RuntimeError(
        "Too many open files. Communication with the workers is no longer possible. Please "
        "increase the limit using `ulimit -n` in the shell or change the sharing strategy by "
        "calling `torch.multiprocessing.set_sharing_strategy('file_system')` at the beginning "
        f"of your code (this process's limit is {limit} open files; each batch from a worker "
        "process arrives as a shared-memory descriptor, open as long as its tensors are kept)"
    )


class JobNotTaken(RuntimeError):
    """In a worker: a job whose tensors' descriptors it could not take (it did not run; what
    the job carried back, the blocks the main process freed, goes with the next one)."""


def job_out_of_files(count: int) -> JobNotTaken:
    """In a worker: the error for a job whose ``count`` tensors' descriptors it could not take
    (its pipe is still in step: they were all read, and let go of)."""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return JobNotTaken(
        f"Too many open files: a worker could not take {count} tensors of its job (its limit "
        f"is {limit} open files; each tensor it holds from a job or from the dataset is a "
        "shared-memory descriptor). Raise the limit (`ulimit -n`) or call "
        "torch.multiprocessing.set_sharing_strategy('file_system') first"
    )
