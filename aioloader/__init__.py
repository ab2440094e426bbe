"""aioloader: an asyncio-native data loader for PyTorch.

Import everything from here; the ``_modules`` behind it are private.
"""

# torch's own datasets, samplers and helpers, under the names a torch user imports them by
# (``from torch.utils.data import DataLoader, Dataset, random_split``): switching is changing
# the import line. They are torch's objects, not copies; the DataLoader, the four samplers of
# torch's names, default_collate/default_convert and get_worker_info below are ours.
from torch.utils.data import ChainDataset as ChainDataset
from torch.utils.data import ConcatDataset as ConcatDataset
from torch.utils.data import Dataset as Dataset
from torch.utils.data import IterableDataset as IterableDataset
from torch.utils.data import Sampler as Sampler
from torch.utils.data import StackDataset as StackDataset
from torch.utils.data import Subset as Subset
from torch.utils.data import SubsetRandomSampler as SubsetRandomSampler
from torch.utils.data import TensorDataset as TensorDataset
from torch.utils.data import WeightedRandomSampler as WeightedRandomSampler
from torch.utils.data import random_split as random_split

from ._base.exceptions import AioLoaderError as AioLoaderError
from ._base.exceptions import LoaderStateError as LoaderStateError
from ._base.exceptions import LoaderTimeout as LoaderTimeout
from ._base.exceptions import Overloaded as Overloaded
from ._base.exceptions import RemoteError as RemoteError
from ._base.exceptions import StrayCancellation as StrayCancellation
from ._base.exceptions import TransientError as TransientError
from ._base.exceptions import WorkerCrashed as WorkerCrashed
from ._base.public import report_public_module as _report_public_module
from ._base.retry import RetryPolicy as RetryPolicy
from ._base.stats import ConsumerStatistics as ConsumerStatistics
from ._base.stats import LatencySummary as LatencySummary
from ._base.stats import LoaderStatistics as LoaderStatistics
from ._base.stats import StageStatistics as StageStatistics
from ._base.stats import WorkerStatistics as WorkerStatistics
from ._data.collate import default_collate as default_collate
from ._data.convert import default_convert as default_convert
from ._data.dataset import AsyncDataset as AsyncDataset
from ._data.dataset import AsyncIterableDataset as AsyncIterableDataset
from ._data.epochs import OpensEpochs as OpensEpochs
from ._data.padding import PadCollate as PadCollate
from ._data.padding import PaddedBatch as PaddedBatch
from ._data.padding import pad_collate as pad_collate
from ._data.sampler import BatchSampler as BatchSampler
from ._data.sampler import DistributedSampler as DistributedSampler
from ._data.sampler import RandomSampler as RandomSampler
from ._data.sampler import SequentialSampler as SequentialSampler
from ._fanin.parts import Interleaved as Interleaved
from ._fanin.parts import interleave as interleave
from ._loader.loader import DataLoader as DataLoader
from ._loader.merging import merge_states as merge_states
from ._serving.batcher import DynamicBatcher as DynamicBatcher
from ._serving.stats import BatchCostStatistics as BatchCostStatistics
from ._serving.stats import BatcherStatistics as BatcherStatistics
from ._workers.rayspec import RayWorkers as RayWorkers
from ._workers.standby import fork_standby as _fork_standby
from ._workers.worker import WorkerInfo as WorkerInfo
from ._workers.worker import get_worker_info as get_worker_info

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
    "BatchCostStatistics",
    "BatchSampler",
    "BatcherStatistics",
    "ChainDataset",
    "ConcatDataset",
    "ConsumerStatistics",
    "DataLoader",
    "Dataset",
    "DistributedSampler",
    "DynamicBatcher",
    "Interleaved",
    "IterableDataset",
    "LatencySummary",
    "LoaderStateError",
    "LoaderStatistics",
    "LoaderTimeout",
    "OpensEpochs",
    "Overloaded",
    "PadCollate",
    "PaddedBatch",
    "RandomSampler",
    "RayWorkers",
    "RemoteError",
    "RetryPolicy",
    "Sampler",
    "SequentialSampler",
    "StackDataset",
    "StageStatistics",
    "StrayCancellation",
    "Subset",
    "SubsetRandomSampler",
    "TensorDataset",
    "TransientError",
    "WeightedRandomSampler",
    "WorkerCrashed",
    "WorkerInfo",
    "WorkerStatistics",
    "default_collate",
    "default_convert",
    "get_worker_info",
    "interleave",
    "merge_states",
    "pad_collate",
    "random_split",
]


_report_public_module(globals(), __all__, __name__)

# Last, while the importing process may still be safe to fork (before CUDA, before threads): a
# fork server in reserve for loaders built later (``_workers/standby.py``; AIOLOADER_STANDBY=0).
_fork_standby()
