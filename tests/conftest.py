"""Shared test setup: every async test runs on asyncio and on uvloop (unless it names one with
``pytest.mark.asyncio(loop_factories=[...])``), in debug mode, every
test ends with no aioloader thread alive, and an S3-compatible server (moto) starts on
127.0.0.1 for the tests that ask for ``s3_endpoint``."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator, Mapping

import pytest
import uvloop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def aioloader_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("aioloader-")]


@pytest.fixture(autouse=True)
def _no_thread_left() -> Iterator[None]:
    yield
    assert aioloader_threads() == [], "a test left aioloader threads running"


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """The URL of moto's S3-compatible server on 127.0.0.1 (a free port), for the session.

    moto is imported here, not at the top: the tests that need no S3 server (the CUDA ones on a
    GPU machine, say) run where moto is not installed."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A two-node Ray cluster on this machine (``tests/support/ray_cluster.py``), joined by
    this process, for the module that asks for it (the tests of Ray workers): stopped as that
    module ends, not kept for the rest of the session (its daemons and idle workers use about
    7% of a core while they wait)."""
    from tests.support.ray_cluster import RayCluster

    cluster = RayCluster(tmp_path_factory.mktemp("ray"))
    try:
        cluster.join()
        yield cluster
    finally:
        cluster.close()
