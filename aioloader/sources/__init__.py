"""Datasets that read from where training data lives: object stores, local folders, HTTP(S),
and WebDataset tar shards streamed from any of them.

``objects``, ``files`` and ``urls`` give an :class:`aioloader.AsyncDataset` of ``bytes`` (listed
once, indexed by position; with ``with_keys=True``, of ``(key, bytes)``) that a
:class:`aioloader.DataLoader` reads with bounded concurrency; ``tar_shards`` streams samples;
``slot_streams`` and ``TarShards.per_slot`` give one stream per batch position, for stateful
sequence models. Sources that hold a client are async context managers: the loader's scope
opens and closes them.
"""

from ._files import FileDataset as FileDataset
from ._files import files as files
from ._http import UrlDataset as UrlDataset
from ._http import urls as urls
from ._httperrors import HTTPConnectionError as HTTPConnectionError
from ._httperrors import HTTPStatusError as HTTPStatusError
from ._httperrors import HTTPTimeoutError as HTTPTimeoutError
from ._httperrors import TransientHTTPError as TransientHTTPError
from ._keyed import Keyed as Keyed
from ._object_stream import ObjectStream as ObjectStream
from ._object_stream import object_stream as object_stream
from ._objects import ObjectDataset as ObjectDataset
from ._objects import TransientStoreError as TransientStoreError
from ._objects import objects as objects
from ._slots import SlotSample as SlotSample
from ._slots import SlotStreams as SlotStreams
from ._slots import slot_streams as slot_streams
from ._streams import StallError as StallError
from ._tar import TarShards as TarShards
from ._tar import tar_shards as tar_shards
from ._tarfmt import CorruptShardError as CorruptShardError

__all__ = [
    "CorruptShardError",
    "FileDataset",
    "HTTPConnectionError",
    "HTTPStatusError",
    "HTTPTimeoutError",
    "Keyed",
    "ObjectDataset",
    "ObjectStream",
    "SlotSample",
    "SlotStreams",
    "StallError",
    "TarShards",
    "TransientHTTPError",
    "TransientStoreError",
    "UrlDataset",
    "files",
    "object_stream",
    "objects",
    "slot_streams",
    "tar_shards",
    "urls",
]

from .._base.public import report_public_module

report_public_module(globals(), __all__, __name__)
