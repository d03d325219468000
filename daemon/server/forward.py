"""``POST /forward``: hidden states in, hidden states (or the tail's token) out."""

from __future__ import annotations

import asyncio
import os

from aiohttp import web

from daemon import wire
from daemon.server.keys import NODE

# test-only: behave like a tail from before ADR-0022 that answers text without a token id
_LEGACY_TAIL = os.environ.get("MESHNET_TEST_LEGACY_TAIL") == "1"
# test-only: answer every step this much later, to play a slow replica
_STEP_DELAY = float(os.environ.get("MESHNET_TEST_STEP_DELAY_MS") or 0) / 1000.0


async def forward(request: web.Request) -> web.Response:
    node = request.app[NODE]
    body = await request.read()
    parsed = wire.parse_forward(
        request.headers,
        body,
        hidden_size=node.hidden_size,
        first_layer=node.shard.start,
        end_layer=node.shard.end,
    )
    if _STEP_DELAY:
        await asyncio.sleep(_STEP_DELAY)
    reply = await node.forward(parsed)
    headers = {wire.COMPUTE_MS: f"{reply.compute_ms:.3f}"}
    if reply.activation is not None:
        return web.Response(
            body=reply.activation.data,
            content_type=wire.ACTIVATION_CONTENT_TYPE,
            headers=reply.activation.headers() | headers,
        )
    if _LEGACY_TAIL:
        return web.json_response({"text": reply.text})
    return web.json_response({"token_id": reply.token_id, "text": reply.text}, headers=headers)
