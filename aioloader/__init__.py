"""aioloader: an asyncio-native data loader for PyTorch.

Import everything from here; the ``_modules`` behind it are private.
"""

import contextlib

from ._batcher import DynamicBatcher as DynamicBatcher
from ._batcher_stats import BatcherStatistics as BatcherStatistics
from ._collate import default_collate as default_collate
from ._collate import default_convert as default_convert
from ._dataset import AsyncDataset as AsyncDataset
from ._dataset import AsyncIterableDataset as AsyncIterableDataset
from ._exceptions import AioLoaderError as AioLoaderError
from ._exceptions import LoaderStateError as LoaderStateError
from ._exceptions import LoaderTimeout as LoaderTimeout
from ._exceptions import Overloaded as Overloaded
from ._exceptions import RemoteError as RemoteError
from ._exceptions import TransientError as TransientError
from ._exceptions import WorkerCrashed as WorkerCrashed
from ._lanes import OpensEpochs as OpensEpochs
from ._loader import DataLoader as DataLoader
from ._padding import PadCollate as PadCollate
from ._padding import PaddedBatch as PaddedBatch
from ._padding import pad_collate as pad_collate
from ._parts import Interleaved as Interleaved
from ._parts import interleave as interleave
from ._retry import RetryPolicy as RetryPolicy
from ._sampler import BatchSampler as BatchSampler
from ._sampler import DistributedSampler as DistributedSampler
from ._sampler import RandomSampler as RandomSampler
from ._sampler import SequentialSampler as SequentialSampler
from ._stats import ConsumerStatistics as ConsumerStatistics
from ._stats import LatencySummary as LatencySummary
from ._stats import LoaderStatistics as LoaderStatistics
from ._stats import StageStatistics as StageStatistics
from ._stats import WorkerStatistics as WorkerStatistics
from ._worker import WorkerInfo as WorkerInfo
from ._worker import get_worker_info as get_worker_info

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # `aioloader.sources` is imported on first use: it brings aiohttp and obstore along.
    if name == "sources":
        import importlib

        return importlib.import_module(".sources", __name__)
    raise AttributeError(f"module 'aioloader' has no attribute {name!r}")


__all__ = [
    "AioLoaderError",
    "AsyncDataset",
    "AsyncIterableDataset",
    "BatchSampler",
    "BatcherStatistics",
    "ConsumerStatistics",
    "DataLoader",
    "DistributedSampler",
    "DynamicBatcher",
    "Interleaved",
    "LatencySummary",
    "LoaderStateError",
    "LoaderStatistics",
    "LoaderTimeout",
    "OpensEpochs",
    "Overloaded",
    "PadCollate",
    "PaddedBatch",
    "RandomSampler",
    "RemoteError",
    "RetryPolicy",
    "SequentialSampler",
    "StageStatistics",
    "TransientError",
    "WorkerCrashed",
    "WorkerInfo",
    "WorkerStatistics",
    "default_collate",
    "default_convert",
    "get_worker_info",
    "interleave",
    "pad_collate",
]


def _report_public_module(namespace: dict[str, object], names: list[str], module: str) -> None:
    """Public objects say they live where users import them from (as anyio's and trio's do):
    ``aioloader.DataLoader``, not ``aioloader._loader.DataLoader``, in reprs, tracebacks and
    pickles (pickling by reference finds them here)."""
    for name in names:
        obj = namespace[name]
        if getattr(obj, "__module__", "").startswith(f"{module}."):
            # A builtin or slotted object refuses: it is left as it is.
            with contextlib.suppress(AttributeError, TypeError):
                obj.__module__ = module


_report_public_module(globals(), __all__, __name__)
