"""Serve a torch model over HTTP with dynamic batching: concurrent requests, one model call per
batch.

Each ``POST /predict`` with a JSON body ``{"x": [16 numbers]}`` is one ``batcher.submit``; the
batcher collates up to 32 waiting requests (waiting at most 5 ms for the batch to fill), runs the
MLP once on the batch in a thread, and hands every handler its own row:
``{"y": [4 numbers]}``. A full queue answers 503 with ``Retry-After`` (admission control), a
request past its 2 s deadline 504, a malformed body 400. ``GET /stats`` shows the batcher's
statistics. A client that disconnects cancels its handler, which withdraws its request.

Run:  python examples/serve_http.py [--port 8080]     (port 0, the default, picks a free one)
      python examples/serve_http.py --selftest         (serve, send 200 concurrent requests,
                                                        check each answer, print, exit)
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from typing import Any

import aiohttp
import anyio
import anyio.abc
import torch
from aiohttp import web

from aioloader import DynamicBatcher, Overloaded

IN_FEATURES, OUT_FEATURES = 16, 4
BATCHER = web.AppKey("batcher", DynamicBatcher)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, OUT_FEATURES),
    ).eval()


def model_fn(model: torch.nn.Module) -> Any:
    def run(batch: torch.Tensor) -> torch.Tensor:  # runs in the batcher's thread
        with torch.inference_mode():
            out: torch.Tensor = model(batch)
        return out

    return run


async def predict(request: web.Request) -> web.Response:
    try:
        sample = torch.tensor((await request.json())["x"], dtype=torch.float32)
    except (ValueError, KeyError, TypeError) as exc:
        return web.json_response({"error": f"bad request: {exc}"}, status=400)
    if sample.shape != (IN_FEATURES,):
        return web.json_response({"error": f"x must hold {IN_FEATURES} numbers"}, status=400)
    try:
        y = await request.app[BATCHER].submit(sample)
    except Overloaded:
        return web.json_response({"error": "overloaded"}, status=503, headers={"Retry-After": "1"})
    except TimeoutError:
        return web.json_response({"error": "deadline exceeded"}, status=504)
    return web.json_response({"y": y.tolist()})


async def stats(request: web.Request) -> web.Response:
    return web.Response(text=repr(request.app[BATCHER].statistics()) + "\n")


async def serve(
    batcher: DynamicBatcher,
    port: int,
    stop: anyio.Event,
    *,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until ``stop`` is set; report the bound port through ``task_status``."""
    async with batcher:  # the batcher outlives the HTTP server: handlers never see it closed
        app = web.Application()
        app[BATCHER] = batcher
        app.add_routes([web.post("/predict", predict), web.get("/stats", stats)])
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", port)
            await site.start()
            task_status.started(runner.addresses[0][1])
            await stop.wait()
        finally:
            await runner.cleanup()  # stop accepting, end the handlers; then the batcher drains


async def selftest(port: int, requests: int) -> bool:
    """Send ``requests`` concurrent requests; check each answer against the model itself."""
    model = build_model()
    rng = random.Random(0)
    inputs = [[rng.uniform(-1, 1) for _ in range(IN_FEATURES)] for _ in range(requests)]
    with torch.inference_mode():
        expected = model(torch.tensor(inputs))
    url = f"http://127.0.0.1:{port}/predict"
    async with aiohttp.ClientSession() as session:

        async def one(x: list[float]) -> list[float]:
            async with session.post(url, json={"x": x}) as response:
                response.raise_for_status()
                answer: list[float] = (await response.json())["y"]
                return answer

        started = time.perf_counter()
        answers = await asyncio.gather(*(one(x) for x in inputs))
        elapsed = time.perf_counter() - started
        async with session.get(f"http://127.0.0.1:{port}/stats") as response:
            print(await response.text())
    ok = all(
        torch.allclose(torch.tensor(a), e, atol=1e-5)
        for a, e in zip(answers, expected, strict=True)
    )
    for x, a in list(zip(inputs, answers, strict=True))[:3]:
        print(f"x[:3]={[round(v, 3) for v in x[:3]]} -> y={[round(v, 4) for v in a]}")
    print(f"{requests} concurrent requests in {elapsed:.3f}s; every answer its own: {ok}")
    return ok


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: any free)")
    parser.add_argument("--selftest", action="store_true", help="serve, send requests, exit")
    parser.add_argument("--requests", type=int, default=200, help="requests of the selftest")
    args = parser.parse_args()
    batcher = DynamicBatcher(
        model_fn(build_model()), max_batch_size=32, max_delay=0.005, max_queue=1024, timeout=2.0
    )
    stop = anyio.Event()
    ok = True
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve, batcher, args.port, stop)
        print(f"serving on http://127.0.0.1:{port} (POST /predict, GET /stats)", flush=True)
        if args.selftest:
            try:
                with anyio.fail_after(60):
                    ok = await selftest(port, args.requests)
            finally:
                stop.set()
    pending = batcher.statistics().pending
    print(f"shut down; requests left without an answer: {pending}")
    return 0 if ok and pending == 0 else 1


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main()))
    except KeyboardInterrupt:  # Ctrl-C: the scopes above have closed everything
        sys.exit(130)
