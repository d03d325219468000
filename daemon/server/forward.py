"""``POST /forward``: hidden states in, hidden states (or the tail's token) out."""

from __future__ import annotations

from aiohttp import web

from daemon import wire
from daemon.server.keys import NODE


async def forward(request: web.Request) -> web.Response:
    service = request.app[NODE].service
    body = await request.read()
    parsed = wire.parse_forward(request.headers, body, hidden_size=service.hidden_size,
                                first_layer=service.start, end_layer=service.end)
    reply = await service.forward(parsed)
    headers = {wire.COMPUTE_MS: f"{reply.compute_ms:.3f}"}
    if reply.activation is not None:
        return web.Response(
            body=reply.activation.data,
            content_type=wire.ACTIVATION_CONTENT_TYPE,
            headers=reply.activation.headers() | headers,
        )
    return web.json_response(reply.token_json(), headers=headers)
