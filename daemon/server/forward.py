"""``POST /forward``: hidden states in, hidden states (or the tail's token) out."""

from __future__ import annotations

import json

from aiohttp import web

from daemon import wire
from daemon.server.keys import NODE


async def forward(request: web.Request) -> web.Response:
    service = request.app[NODE].service
    headers, body = reply_parts(await service.forward(parse_step(service, request.headers, await request.read())))
    return web.Response(body=body, headers=headers)


def parse_step(service, headers, body: bytes | bytearray) -> wire.ForwardRequest:
    """A step's headers and body read against this node's layers: ``POST /forward``'s, a channel's, a batch's."""
    return wire.parse_forward(headers, body, hidden_size=service.hidden_size, first_layer=service.start,
                              end_layer=service.end)


def reply_parts(reply: wire.ForwardReply) -> tuple[dict[str, str], bytes | bytearray | memoryview]:
    """A step's answer as headers and body: the next hop's activations, or the tail's token as JSON."""
    headers = {wire.COMPUTE_MS: f"{reply.compute_ms:.3f}"}
    if reply.activation is not None:
        return reply.activation.headers() | headers | {"Content-Type": wire.ACTIVATION_CONTENT_TYPE}, \
            reply.activation.data
    return headers | {"Content-Type": "application/json; charset=utf-8"}, json.dumps(reply.token_json()).encode()
