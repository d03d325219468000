"""The aiohttp application factory for one node."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
from aiohttp import web

from daemon.api import auth_headers
from daemon.mesh.transport import HopTransport
from daemon.node import Node
from daemon.server import forward, openai, status
from daemon.server.errors import error_middleware
from daemon.server.guard import auth_middleware, body_limit_middleware, context_middleware, drain_middleware
from daemon.server.keys import CLIENT, HOPS, NODE

log = logging.getLogger(__name__)

PEER_REFRESH_SECONDS = 2.0


async def _client_ctx(app: web.Application):
    # keep-alive connections for the hops (lean, see daemon.mesh.transport) and for everything else (peer
    # polls, session releases); the mesh token goes on each request
    headers = auth_headers(app[NODE].config.token)
    connector = aiohttp.TCPConnector(limit=64, keepalive_timeout=60)
    # nodes set no cookies: a jar that keeps none skips a cookie filter on every hop of every step
    async with aiohttp.ClientSession(connector=connector, headers=headers,
                                     cookie_jar=aiohttp.DummyCookieJar()) as session:
        app[CLIENT] = session
        app[HOPS] = HopTransport(headers=headers)
        app[NODE].planner.http = session
        yield
        app[NODE].planner.http = None
        await app[HOPS].close()


async def _peer_poll_ctx(app: web.Application):
    node = app[NODE]

    async def poll() -> None:
        while True:
            # the next poll is scheduled only once this one finished: a slow peer stretches the cycle
            try:
                await node.peers.refresh(app[CLIENT])
            except Exception:  # noqa: BLE001 - polling must outlive any one bad answer
                log.exception("peer refresh failed")
            await asyncio.sleep(PEER_REFRESH_SECONDS)

    task = asyncio.create_task(poll())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _node_ctx(app: web.Application):
    yield
    app[NODE].close()


def create_app(node: Node) -> web.Application:
    """Build the node's application: routes, error mapping, shared client, peer polling."""
    middlewares = [context_middleware, error_middleware, auth_middleware(node.config.token),
                   body_limit_middleware(node.config.max_body_bytes), drain_middleware]
    app = web.Application(middlewares=middlewares, client_max_size=node.config.max_body_bytes)
    app[NODE] = node
    app.cleanup_ctx.extend([_client_ctx, _peer_poll_ctx, _node_ctx])
    app.router.add_post("/forward", forward.forward)
    app.router.add_post("/v1/chat/completions", openai.chat_completions)
    app.router.add_get("/v1/models", openai.models)
    app.router.add_get("/health", status.health)
    app.router.add_get("/metrics", status.metrics)
    app.router.add_get("/v1/status", status.status)
    app.router.add_get("/v1/sessions", status.sessions)
    app.router.add_delete("/v1/sessions/{session_id}", status.drop_session)
    app.router.add_get("/v1/route", status.route)
    app.router.add_post("/v1/peers", status.add_peer)
    app.router.add_delete("/v1/peers", status.remove_peer)
    return app
