"""Shared test setup: every async test runs on asyncio and on uvloop, in debug mode, and every
test ends with no aioloader thread alive."""

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
