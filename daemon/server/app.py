"""The aiohttp application factory for one node."""

from __future__ import annotations

from aiohttp import web

from daemon import channel as step_channel
from daemon import wire
from daemon.server import batch, channel, completions, forward, openai, status
from daemon.server.backend import NodeBackend
from daemon.server.errors import error_middleware
from daemon.server.guard import (
    auth_middleware,
    body_limit_middleware,
    context_middleware,
    cors_middleware,
    cors_response_headers,
    drain_middleware,
)
from daemon.server.keys import NODE

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024


def create_app(node: NodeBackend, *, token: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               allowed_origins: list[str] = ()) -> web.Application:
    """Build a node's application: its routes, the middlewares every request passes, and the node's
    background work for as long as the app serves. With ``token`` (the API key), every path but /health
    needs it; ``allowed_origins`` (or ``*``) may call it from a browser (CORS; none by default)."""
    cors = [cors_middleware(list(allowed_origins))] if allowed_origins else []
    middlewares = [context_middleware, *cors, error_middleware, auth_middleware(token),
                   body_limit_middleware(max_body_bytes), drain_middleware]
    app = web.Application(middlewares=middlewares, client_max_size=max_body_bytes)
    app[NODE] = node
    if allowed_origins:
        app.on_response_prepare.append(cors_response_headers(list(allowed_origins)))

    async def serving(app: web.Application):
        async with app[NODE].serving():
            yield

    app.cleanup_ctx.append(serving)
    app.router.add_post("/forward", forward.forward)
    app.router.add_post(wire.BATCH_PATH, batch.forward_batch)
    app.router.add_get(step_channel.PATH, channel.steps)
    app.router.add_post("/v1/chat/completions", openai.chat_completions)
    app.router.add_get("/v1/models", openai.models)
    app.router.add_get("/v1/models/{model_id:.+}", openai.model)
    app.router.add_post("/v1/completions", completions.completions)
    app.router.add_get("/health", status.health)
    app.router.add_get("/metrics", status.metrics)
    app.router.add_get("/v1/status", status.status)
    app.router.add_get("/v1/sessions", status.sessions)
    app.router.add_delete("/v1/sessions/{session_id}", status.drop_session)
    app.router.add_post("/v1/sessions/{session_id}/retain", status.retain_session)
    app.router.add_post("/v1/sessions/{session_id}/import", status.import_session)
    app.router.add_get("/v1/route", status.route)
    app.router.add_post("/v1/peers", status.add_peer)
    app.router.add_post("/v1/peers/announce", status.announce)
    app.router.add_delete("/v1/peers", status.remove_peer)
    return app
