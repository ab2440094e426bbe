"""The remote workload's sizes and its object server, a subprocess: small objects over HTTP
with first-byte latency, or moto's S3 server for ``--store s3``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing.connection
import threading
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from aioloader._bench.harness_server import wait_for_stop

QUICK_ITEMS = 400
OBJECT_SIZE = 64 * 1024
CEILING_CONCURRENCY = 64
THREADS = 32
JOIN_TIMEOUT_S = 10.0
SERVER_START_S = 60.0

# The optional peers (the ``.[bench]`` extra), by top-level package: the module their
# configurations import, and the distribution that installs it.
PEERS: dict[str, tuple[str, str]] = {
    "torchdata": ("torchdata.nodes", "torchdata"),
    "spdl": ("spdl.pipeline", "spdl-core"),
}
NOT_INSTALLED = "not installed (pip install -e '.[bench]')"


def payload(index: int) -> bytes:
    """The 64 KiB body of object ``index``: its index as 4 little-endian bytes, repeated."""
    return index.to_bytes(4, "little") * (OBJECT_SIZE // 4)


# -- the server (a subprocess) -----------------------------------------------------------------


def serve(items: int, latency: float, conn: multiprocessing.connection.Connection) -> None:
    """Serve ``/obj/{i}`` on 127.0.0.1 (port 0), send the port through ``conn``, and run until
    anything arrives on ``conn`` (or it closes)."""

    async def handle(request: web.Request) -> web.Response:
        index = int(request.match_info["index"])
        if not 0 <= index < items:
            raise web.HTTPNotFound()
        await asyncio.sleep(latency)
        return web.Response(body=payload(index), content_type="application/octet-stream")

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/obj/{index}", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        port: int = runner.addresses[0][1]
        conn.send(port)
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, wait_for_stop, conn)
        finally:
            await runner.cleanup()

    asyncio.run(main())


BUCKET, REGION, S3_KEYS = "bench", "us-east-1", "testing"
WARM_UP_GETS = 400


def serve_s3(items: int, latency: float, conn: multiprocessing.connection.Connection) -> None:
    """moto's S3 server on 127.0.0.1 (port 0), threaded, with ``latency`` before each GET's
    response (a WSGI wrapper: each request has its thread, so the waits overlap, as a store's
    first-byte latency does); ``items`` objects ``obj/{i}`` put into ``BUCKET``; then the port
    through ``conn``, and run until anything arrives on ``conn`` (or it closes)."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    app = DomainDispatcherApplication(create_backend_app)

    def delayed(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ.get("REQUEST_METHOD") == "GET":
            time.sleep(latency)
        return app(environ, start_response)

    server = make_server("127.0.0.1", 0, delayed, threaded=True)
    thread = threading.Thread(target=server.serve_forever, name="moto", daemon=True)
    thread.start()
    client = s3_client(server.port, connections=8)  # the uploads' threads
    client.create_bucket(Bucket=BUCKET)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        puts = [pool.submit(client.put_object, Bucket=BUCKET, Key=f"obj/{i}", Body=payload(i))
                for i in range(items)]  # fmt: skip
        for put in puts:
            put.result()
        # Warm moto's GET path up (its first requests are slower), so that the first row is
        # not measured against a colder server than the next ones.
        warm = [f"obj/{i}" for i in range(min(items, WARM_UP_GETS))]
        list(pool.map(lambda key: client.get_object(Bucket=BUCKET, Key=key)["Body"].read(), warm))
    conn.send(server.port)
    wait_for_stop(conn)
    server.shutdown()
    thread.join()


def s3_client(port: int, connections: int) -> Any:
    """A boto3 S3 client of the moto server on ``port``, pooling ``connections`` connections
    (boto3 keeps 10; a client is shared by as many threads as use it)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{port}",
        region_name=REGION,
        aws_access_key_id=S3_KEYS,
        aws_secret_access_key=S3_KEYS,
        config=Config(max_pool_connections=connections),
    )
