"""The loopback floor's server, run as ``python -m daemon.bench.floor_server PORT`` (see :mod:`daemon.bench.floor`).

A bare hop on meshd's own stack with nothing of meshnet in it: aiohttp on meshd's event loop answers
``POST /forward`` after one hand-off to a worker thread that idles ``X-Pause`` seconds (as a node
computes), with a tail's JSON answer.
"""

from __future__ import annotations

import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from daemon.server.loop import loop_factory

_WORKER = ThreadPoolExecutor(1)  # one worker thread, as a node computes on one


async def step(request: web.Request) -> web.Response:
    """Read the body, idle ``X-Pause`` seconds on the worker thread, answer as a tail does."""
    await request.read()
    pause = float(request.headers["X-Pause"])
    await asyncio.get_running_loop().run_in_executor(_WORKER, time.sleep, pause)
    return web.json_response({"token_id": 1, "text": "x"})


async def serve(port: int) -> None:
    """Serve on 127.0.0.1:``port`` until the process is ended."""
    app = web.Application()
    app.router.add_post("/forward", step)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    """``floor_server PORT``: serve until the process is ended."""
    port = int((sys.argv[1:] if argv is None else argv)[0])
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(serve(port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
