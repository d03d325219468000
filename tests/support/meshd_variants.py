"""meshd with a test-only twist, for tests that need a node no real meshd is any more:

    python -m tests.support.meshd_variants legacy-tail <meshd options>   # a tail from before token ids: text only
    python -m tests.support.meshd_variants slow-300 <meshd options>      # every /forward step answers 300 ms later
    python -m tests.support.meshd_variants slow-prefill-3000 <meshd options>  # every prefill step 3 s later, saying
                                                                         # "holding a prefill" on stderr as it waits
    python -m tests.support.meshd_variants no-prefix <meshd options>     # a node from before prefix reuse
    python -m tests.support.meshd_variants forgetful <meshd options>     # loses a session every 4th decode step of
                                                                         # a request whose X-Request-Id starts "forget-"
    python -m tests.support.meshd_variants no-speculation <meshd options>  # a node from before verify steps

The node is meshd's own (``daemon.cli.load_node``, ``node_app``, ``run``); only a middleware is added. Each
twist is on ``POST /forward``, so a variant opens no step channel (``GET /v1/steps`` answers 404, as a node from
before them): every step of it takes the twist.
"""

from __future__ import annotations

import asyncio
import json
import sys

from aiohttp import web

from daemon import cli
from tests.support.headers import CACHE, PREFIX, PREFIX_MODE, REQUEST_ID, SESSION


@web.middleware
async def legacy_tail(request: web.Request, handler):
    """Answer a tail's step as nodes did before token ids: ``{"text": ...}`` only."""
    response = await handler(request)
    if request.path == "/forward" and response.content_type == "application/json" and response.status == 200:
        return web.json_response({"text": json.loads(response.body)["text"]})
    return response


@web.middleware
async def no_prefix(request: web.Request, handler):
    """A node from before prefix reuse: it knows neither the prefix headers nor retaining a session."""
    if request.path.endswith("/retain"):
        raise web.HTTPNotFound()
    if request.path == "/forward":
        from multidict import CIMultiDict

        headers = CIMultiDict((k, v) for k, v in request.headers.items()
                              if k.lower() not in (PREFIX.lower(), PREFIX_MODE.lower()))
        request = request.clone(headers=headers)
    return await handler(request)


_decode_steps: dict[str, int] = {}


@web.middleware
async def forgetful(request: web.Request, handler):
    """Drop the session before every 4th decode step of a "forget-" request: the step answers 409, as after an
    eviction, and the head must re-prefill (only those requests: the others on the same mesh run undisturbed)."""
    from daemon.server.keys import NODE

    session = request.headers.get(SESSION)
    if (request.path == "/forward" and request.headers.get(CACHE) == "decode" and session
            and request.headers.get(REQUEST_ID, "").startswith("forget-")):
        _decode_steps[session] = _decode_steps.get(session, 0) + 1
        if _decode_steps[session] % 4 == 0:
            request.app[NODE].service.drop_session(session)
    return await handler(request)


def slow(milliseconds: int):
    """Answer every step this much later: a slow replica."""

    @web.middleware
    async def delay(request: web.Request, handler):
        if request.path == "/forward":
            await asyncio.sleep(milliseconds / 1000.0)
        return await handler(request)

    return delay


def slow_prefill(milliseconds: int):
    """Take every prefill step this much later, with a line on stderr as it starts waiting (a test can act while a
    step is under way but has made nothing yet)."""

    @web.middleware
    async def delay(request: web.Request, handler):
        if request.path == "/forward" and request.headers.get(CACHE) == "prefill":
            print("test variant: holding a prefill", file=sys.stderr, flush=True)
            await asyncio.sleep(milliseconds / 1000.0)
        return await handler(request)

    return delay


@web.middleware
async def no_speculation(request: web.Request, handler):
    """A node from before speculative decoding: its status says nothing of verify steps."""
    response = await handler(request)
    if request.path == "/v1/status" and response.status == 200:
        status = json.loads(response.body)
        status.pop("speculation", None)
        return web.json_response(status)
    return response


def middleware_for(variant: str):
    if variant == "legacy-tail":
        return legacy_tail
    if variant == "no-prefix":
        return no_prefix
    if variant == "forgetful":
        return forgetful
    if variant == "no-speculation":
        return no_speculation
    if variant.startswith("slow-") and variant[5:].isdigit():
        return slow(int(variant[5:]))
    if variant.startswith("slow-prefill-") and variant[13:].isdigit():
        return slow_prefill(int(variant[13:]))
    raise SystemExit(f"unknown variant {variant!r}: legacy-tail, no-prefix, forgetful, no-speculation, slow-MS or "
                     "slow-prefill-MS")


@web.middleware
async def no_step_channels(request: web.Request, handler):
    if request.path == "/v1/steps":
        raise web.HTTPNotFound()
    return await handler(request)


def main(argv: list[str]) -> int:
    variant, *options = argv
    middleware = middleware_for(variant)
    try:
        node = cli.load_node(options)
    except cli.Refused as exc:
        print(f"meshd: error: {exc.message}", file=sys.stderr)
        return exc.code
    app = cli.node_app(node)
    app.middlewares.extend([no_step_channels, middleware])
    return cli.run(app, node)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
