"""Datasets that read from where training data lives: object stores, local folders, HTTP(S),
and WebDataset tar shards (local, streamed).

Each is an :class:`aioloader.AsyncDataset` of ``bytes`` (listed once, indexed by position) that
a :class:`aioloader.DataLoader` reads with bounded concurrency. Sources that hold a client are
async context managers: the loader's scope opens and closes them.
"""

from ._files import FileDataset as FileDataset
from ._files import files as files
from ._http import HTTPConnectionError as HTTPConnectionError
from ._http import HTTPStatusError as HTTPStatusError
from ._http import HTTPTimeoutError as HTTPTimeoutError
from ._http import TransientHTTPError as TransientHTTPError
from ._http import UrlDataset as UrlDataset
from ._http import urls as urls
from ._objects import ObjectDataset as ObjectDataset
from ._objects import TransientStoreError as TransientStoreError
from ._objects import objects as objects
from ._tar import CorruptShardError as CorruptShardError
from ._tar import TarShards as TarShards
from ._tar import tar_shards as tar_shards

__all__ = [
    "CorruptShardError",
    "FileDataset",
    "HTTPConnectionError",
    "HTTPStatusError",
    "HTTPTimeoutError",
    "ObjectDataset",
    "TarShards",
    "TransientHTTPError",
    "TransientStoreError",
    "UrlDataset",
    "files",
    "objects",
    "tar_shards",
    "urls",
]
