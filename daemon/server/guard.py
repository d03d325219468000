"""What every request passes through before its handler: its request id, metrics, the token, draining.

Order (outermost first, see ``create_app``): :func:`context_middleware` names the
request and counts it; then errors are mapped (``daemon.server.errors``); then
:func:`auth_middleware` and :func:`drain_middleware` may refuse it.
"""

from __future__ import annotations

import hmac
import logging

from aiohttp import web

from daemon.errors import Draining, Unauthorized
from daemon.logs import REQUEST_ID_HEADER, request_id, request_id_from
from daemon.server.keys import NODE

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health"})  # answered without the token: load balancers and supervisors probe it
# while draining, a node still answers what only reads its state; work (chat, /forward, peer changes) is refused
READ_ONLY = frozenset({"/health", "/metrics", "/v1/status", "/v1/sessions", "/v1/route", "/v1/models"})


def _endpoint(request: web.Request) -> str:
    """The route's template (``/v1/sessions/{session_id}``), so metric labels stay few."""
    info = request.match_info
    resource = info.route.resource if info.http_exception is None else None
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def context_middleware(request: web.Request, handler):
    node = request.app[NODE]
    rid = request_id_from(request.headers.get(REQUEST_ID_HEADER))
    token = request_id.set(rid)
    endpoint = _endpoint(request)
    running = node.metrics.running.labels(endpoint)
    running.inc()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        if not response.prepared:
            response.headers[REQUEST_ID_HEADER] = rid
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        running.dec()
        node.metrics.requests.labels(endpoint, str(status)).inc()
        request_id.reset(token)


def auth_middleware(token: str | None):
    """Require ``Authorization: Bearer <token>`` on every path but /health (none when no token is set)."""
    expected = f"Bearer {token}".encode() if token else None

    @web.middleware
    async def check(request: web.Request, handler):
        if expected is not None and request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization", "").encode("utf-8", "replace")
            if not hmac.compare_digest(given, expected):  # constant time: the token is not guessed byte by byte
                log.warning("refused %s %s from %s: %s", request.method, request.path, request.remote,
                            "wrong token" if given else "no token")
                raise Unauthorized("this mesh needs its token: send 'Authorization: Bearer <token>'")
        return await handler(request)

    return check


def body_limit_middleware(max_bytes: int):
    """Refuse a body whose declared length is over the limit before reading a byte of it.

    (aiohttp enforces ``client_max_size`` only while reading, after buffering up to the limit.)
    """

    @web.middleware
    async def check(request: web.Request, handler):
        if request.content_length is not None and request.content_length > max_bytes:
            raise web.HTTPRequestEntityTooLarge(max_size=max_bytes, actual_size=request.content_length)
        return await handler(request)

    return check


@web.middleware
async def drain_middleware(request: web.Request, handler):
    if request.app[NODE].draining and request.path not in READ_ONLY:
        raise Draining("this node is shutting down; send the request to another node or retry shortly")
    return await handler(request)
