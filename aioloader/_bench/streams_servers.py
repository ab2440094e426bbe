"""The shards workload's servers, each a subprocess: an HTTP server that serves the shards with
first-byte latency and a bandwidth cap a connection (ranges honoured), and moto's S3 server
holding them.

Servers, each in a subprocess of its own on ``127.0.0.1`` (port 0, reported through a pipe, up for
the whole run, stopped at its end, or when this process dies):

* an aiohttp server of the shard files at ``/shard-{k:04d}.tar``: ``--latency`` (default 20 ms)
  of ``await asyncio.sleep`` before each response starts, then the body streamed in 64 KiB
  chunks, each response paced to at most ``--bandwidth`` (default 50 MB/s; 0: no cap). It sends
  ``Content-Length``, an ``ETag`` and ``Accept-Ranges``, and answers ``Range: bytes=N-`` with
  206 and ``Content-Range`` (``If-Range`` honoured), as aioloader's resumption needs;
* moto's S3 server (``ThreadedMotoServer``), the shards uploaded with boto3 to bucket ``bench``
  with ``ACL="public-read"``: moto refuses an anonymous GET of a private object (403, empty
  body), and webdataset's curl sends no credentials. No latency or bandwidth cap there. Needs
  ``moto[server]`` (the ``dev`` extra); without it the S3 rows are skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import re
from pathlib import Path

from aiohttp import web

from aioloader._bench.harness_server import wait_for_stop
from aioloader._bench.streams_data import (
    BUCKET,
    CHUNK,
    REGION,
    S3_KEYS,
    SHARD_NAME,
)

# -- the servers (subprocesses) ----------------------------------------------------------------


def _start_range(header: str | None, size: int) -> int | None:
    """The first byte asked for by ``Range: bytes=N-`` (or ``bytes=N-M``, answered to the end),
    or None for no usable range."""
    match = re.fullmatch(r"bytes=(\d+)-(\d*)", (header or "").strip())
    return int(match[1]) if match else None


async def _send_paced(
    response: web.StreamResponse, path: Path, start: int, bandwidth: float
) -> None:
    """Write ``path`` from byte ``start`` in ``CHUNK``s, at most ``bandwidth`` bytes/s (0: no
    cap): each chunk waits until the bytes up to its end are due since the headers went out."""
    loop = asyncio.get_running_loop()
    began, sent = loop.time(), 0
    with path.open("rb") as stream:
        stream.seek(start)
        while chunk := stream.read(CHUNK):
            sent += len(chunk)
            if bandwidth > 0 and (ahead := began + sent / bandwidth - loop.time()) > 0:
                await asyncio.sleep(ahead)
            await response.write(chunk)


def serve_shards(
    directory: str, latency: float, bandwidth: float, conn: multiprocessing.connection.Connection
) -> None:
    """Serve ``directory``'s shards at ``/shard-NNNN.tar`` on 127.0.0.1 (port 0), send the port
    through ``conn``, and run until anything arrives on it (or it closes)."""
    root = Path(directory)

    async def handle(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        path = root / name
        if not SHARD_NAME.fullmatch(name) or not path.is_file():
            raise web.HTTPNotFound()
        stat = path.stat()
        size, etag = stat.st_size, f'"{stat.st_mtime_ns:x}-{stat.st_size:x}"'
        start = _start_range(request.headers.get("Range"), size)
        if_range = request.headers.get("If-Range")
        if start is not None and if_range is not None and if_range != etag:
            start = None  # the object changed: send all of it
        if start is not None and start >= size:
            raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size}"})
        await asyncio.sleep(latency)
        headers = {"ETag": etag, "Accept-Ranges": "bytes"}
        if start:
            headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
        response = web.StreamResponse(status=206 if start else 200, headers=headers)
        response.content_type = "application/x-tar"
        response.content_length = size - (start or 0)
        # A client that goes away (a timed-out configuration) is no error of the server's.
        with contextlib.suppress(ConnectionError):
            await response.prepare(request)
            await _send_paced(response, path, start or 0, bandwidth)
            await response.write_eof()
        return response

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/{name}", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
            await site.start()
            conn.send(runner.addresses[0][1])
            await asyncio.get_running_loop().run_in_executor(None, wait_for_stop, conn)
        finally:
            await runner.cleanup()

    asyncio.run(main())


def serve_moto(directory: str, conn: multiprocessing.connection.Connection) -> None:
    """Run moto's S3 server on 127.0.0.1 (port 0), upload ``directory``'s shards to ``BUCKET``
    (public-read) with boto3, send the port through ``conn``, run until told to stop."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    port = server.get_host_and_port()[1]
    client = boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{port}",
        region_name=REGION,
        aws_access_key_id=S3_KEYS,
        aws_secret_access_key=S3_KEYS,
    )
    client.create_bucket(Bucket=BUCKET)
    for path in sorted(Path(directory).glob("shard-*.tar")):
        client.put_object(Bucket=BUCKET, Key=path.name, Body=path.read_bytes(), ACL="public-read")
    conn.send(port)
    wait_for_stop(conn)
    server.stop()
