"""``POST /forward/batch``: several sessions' steps in one request, each answered as ``POST /forward`` answers it.

A head running several generations sends each node one step per generation per token. As a request of its own,
each step is built, written, read, routed and answered on both ends: about 0.25 ms of CPU on each node a step on
a 2-core host (ADR-0054). The head gathers the decode steps for one node that are ready in the same turn of its
event loop (:class:`daemon.mesh.hops.HopClient`) and sends them in one body of request frames, the step
channel's framing (:mod:`daemon.channel`). The node submits them to its step queue together, where they run as
one batch, and answers with one reply frame per step, in their order.

Each step's answer is its own: a 409 for a session the node lost, a 400 for a malformed step, the others
answered. A body that is not whole frames is refused whole (400). While the node drains, every step is refused
with the node that took its session over (503), as ``POST /forward`` refuses it.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from daemon import channel, wire
from daemon.errors import BadRequest, Draining, MeshError
from daemon.logs import REQUEST_ID_HEADER, request_id, request_id_from
from daemon.server.errors import step_error
from daemon.server.forward import parse_step, reply_parts
from daemon.server.keys import NODE

log = logging.getLogger(__name__)

MAX_STEPS = 256  # a head sends one per generation it runs; far more than any node batches


async def forward_batch(request: web.Request) -> web.Response:
    node = request.app[NODE]
    # as the drain middleware found it. Taken as work (counted under way, so a drain waits for it), every step runs;
    # refused, none is counted, and each step may wait for its session's transfer, which waits for the steps under way
    draining = node.draining
    try:
        frames = channel.requests_in(await request.read())
    except channel.ChannelClosed as exc:
        raise BadRequest(f"the body is not a sequence of whole step frames: {exc}") from None
    if not 1 <= len(frames) <= MAX_STEPS:
        raise BadRequest(f"a batch carries 1 to {MAX_STEPS} steps, not {len(frames)}")
    answers = await asyncio.gather(*(_answer(node, headers, body, draining) for headers, body in frames))
    return web.Response(body=b"".join(channel.reply_frame(*answer) for answer in answers),
                        headers={"Content-Type": wire.BATCH_CONTENT_TYPE})


async def _answer(node, headers, body: bytearray,
                  draining: bool) -> tuple[int, dict[str, str], bytes | bytearray | memoryview]:
    """One step of a batch, answered as ``POST /forward`` would answer it alone (in a task of its own)."""
    request_id.set(request_id_from(headers.get(REQUEST_ID_HEADER)))  # the task's own context: no reset needed
    service = node.service
    try:
        if draining:
            raise Draining("this node is shutting down; send the request to another node or retry shortly",
                           moved_to=await node.session_moved_to(headers.get(wire.SESSION)))
        reply_headers, reply_body = reply_parts(await service.forward(parse_step(service, headers, body)))
        return 200, reply_headers, reply_body
    except MeshError as exc:
        return step_error(exc)
    except Exception:  # noqa: BLE001 - the node and the batch's other steps go on whatever one step did
        log.exception("unhandled error in a step of a batch")
        return step_error(None)
