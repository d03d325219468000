"""``GET /v1/steps``: a head opens a step channel (:mod:`daemon.channel`), which the node's torch thread serves.

The upgrade passes the middlewares as any request does (the token, the drain refusal). The handler stops the
event loop reading the connection, answers ``101 Switching Protocols``, and hands a duplicate of the socket to
the torch thread; aiohttp then closes its own. From there :class:`ChannelSteps` reads each frame on the torch
thread, runs it as ``POST /forward`` would (:meth:`ShardService.serve_now`) and answers in a frame, which the
thread writes as it puts its OpenMP team to sleep (:class:`daemon.model.worker.TorchThread`): a malformed
step gets the same 4xx, a failed one the same 5xx, and the channel stays open. A frame without headers
continues the channel's last step one position on (:func:`continued`), once that step answered 200. A broken
frame, a peer too slow to send one, or a node that begins to drain closes the channel; the head then sends that
step on ``POST /forward``, where a draining node answers as it does every request.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket

from aiohttp import web

from daemon import channel, wire
from daemon.errors import BadRequest, MeshError
from daemon.logs import REQUEST_ID_HEADER, request_id, request_id_from
from daemon.server.errors import step_error
from daemon.server.forward import parse_step, reply_parts
from daemon.server.keys import NODE

log = logging.getLogger(__name__)


async def steps(request: web.Request) -> web.StreamResponse:
    if request.headers.get("Upgrade", "").strip().lower() != channel.UPGRADE:
        raise BadRequest(f"GET {channel.PATH} opens a step channel: send 'Connection: Upgrade' and "
                         f"'Upgrade: {channel.UPGRADE}'", param="Upgrade")
    transport = request.transport
    if transport is None or transport.is_closing():
        raise BadRequest("the connection closed before the step channel opened")
    if request.secure:
        raise BadRequest("a step channel is plain TCP; over TLS, send steps to POST /forward")
    node = request.app[NODE]
    transport.pause_reading()  # the first frame may follow the 101 at once: it is the channel's to read
    fd = os.dup(transport.get_extra_info("socket").fileno())
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    response = web.Response(status=101, headers={"Upgrade": channel.UPGRADE, "Connection": "Upgrade"})
    try:
        await response.prepare(request)
        await response.write_eof()
    except BaseException:
        sock.close()
        raise
    request.protocol.force_close()  # aiohttp closes its descriptor; the channel's duplicate keeps the connection
    try:
        served = node.service.serve_channel(sock, ChannelSteps(node))
    except BaseException:
        sock.close()
        raise
    if not served:
        log.warning("refused a step channel from %s: the torch thread serves as many as it can", request.remote)
    return response


class ChannelSteps:
    """One channel's steps, on the torch thread: each call reads the frame that has arrived and answers it."""

    def __init__(self, node) -> None:
        self._node = node
        self._service = node.service
        self._last: tuple[wire.ForwardRequest, str | None] | None = None  # the step a continuation follows, its id

    def __call__(self, sock: socket.socket) -> bytes | None:
        """The answer to the step that arrived, as the frame the torch thread writes back; None closes the channel."""
        if self._node.draining:  # closed unread: the head sends the step to POST /forward, which refuses it
            return None
        try:
            frame = channel.read_request(sock)
        except channel.ChannelClosed as exc:
            log.info("step channel closed: %s", exc)
            return None
        if frame is None:
            return None
        headers, body = frame
        last, self._last = self._last, None  # a continuation follows a step that answered 200, and only that
        if headers is not None or last is None:
            rid = request_id_from(headers.get(REQUEST_ID_HEADER) if headers is not None else None)
        else:
            rid = last[1]
        token = request_id.set(rid)
        try:
            status, reply_headers, reply_body = self._answer(headers, body, last)
        finally:
            request_id.reset(token)
        return channel.reply_frame(status, reply_headers, reply_body)

    def _answer(self, headers, body: bytearray, last) -> tuple[int, dict[str, str], bytes]:
        service = self._service
        try:
            request = parse_step(service, headers, body) if headers is not None else continued(last, body)
            if request.mode != "decode" or request.activation.shape[1] != 1 or request.prefix is not None:
                raise BadRequest("a step channel carries one-position decode steps of a running session; "
                                 "send this step to POST /forward", param=wire.CACHE)
            reply_headers, reply_body = reply_parts(service.serve_now(request))
        except MeshError as exc:
            return step_error(exc)
        except Exception:  # noqa: BLE001 - the node keeps serving whatever one step did
            log.exception("unhandled error in a step on a channel")
            return step_error(None)
        if request.history is None:  # a penalty's history grows each token: its steps carry their headers
            self._last = request, request_id.get()
        return 200, reply_headers, reply_body


def continued(last: tuple[wire.ForwardRequest, str | None] | None, body: bytearray) -> wire.ForwardRequest:
    """The step a frame without headers makes: the channel's last step one position on, with ``body`` for its
    activation (:func:`daemon.channel.continues`)."""
    if last is None:
        raise BadRequest("a frame without headers continues the last step on this channel, which must have "
                         "answered 200 and carried no penalty history; send this step's headers",
                         param=wire.PAST_LEN)
    before = last[0]
    if len(body) != len(before.activation.data):
        raise BadRequest(f"body is {len(body)} bytes but the step it continues took {len(before.activation.data)}",
                         param="body")
    return dataclasses.replace(before, activation=dataclasses.replace(before.activation, data=body),
                               past_len=before.past_len + 1)
