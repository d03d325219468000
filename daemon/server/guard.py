"""What every request passes through before its handler: its request id, metrics, CORS, the token, draining.

Order (outermost first, see ``create_app``): :func:`context_middleware` names the
request and counts it; :func:`cors_middleware` answers a browser's preflight (which
carries no token, so before the check); then errors are mapped (``daemon.server.errors``);
then :func:`auth_middleware` and :func:`drain_middleware` may refuse it.
"""

from __future__ import annotations

import hmac
import logging
import re

from aiohttp import web

from daemon.errors import Draining, Unauthorized
from daemon.logs import REQUEST_ID_HEADER, request_id, request_id_from
from daemon.server.keys import NODE
from daemon.wire import BATCH_PATH, SESSION

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health"})  # answered without the token: load balancers and supervisors probe it
FORWARD_PATHS = frozenset({"/forward", BATCH_PATH})  # steps: a drain waits for those under way
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
    node = request.app[NODE]
    forward = request.path in FORWARD_PATHS
    if node.draining and request.path not in READ_ONLY:
        if request.path == BATCH_PATH:  # refused step by step, each naming its session's node: none is under way
            return await handler(request)
        # a step of a session being handed on waits for its transfer, then names the node that took it
        moved_to = await node.session_moved_to(request.headers.get(SESSION)) if forward else None
        raise Draining("this node is shutting down; send the request to another node or retry shortly",
                       moved_to=moved_to)
    if not forward:
        return await handler(request)
    node.forwards_in_flight += 1  # a drain hands sessions on once the steps taken before it have ended
    try:
        return await handler(request)
    finally:
        node.forwards_in_flight -= 1


# ---- CORS: which browser pages may call this node ----------------------------------------------

CORS_METHODS = "GET, POST, DELETE, OPTIONS"
CORS_HEADERS = f"Authorization, Content-Type, {REQUEST_ID_HEADER}"  # Authorization must be named: * omits it
CORS_EXPOSED = f"{REQUEST_ID_HEADER}, Retry-After"
CORS_MAX_AGE = "600"  # seconds a browser may reuse a preflight's answer


def _allowed_origin(origins: frozenset[str], request: web.Request) -> str | None:
    """What ``Access-Control-Allow-Origin`` says to this request: its origin, ``*``, or None (no CORS)."""
    origin = request.headers.get("Origin")
    if not origin:
        return None
    if "*" in origins:
        return "*"
    return origin if origin.rstrip("/").lower() in origins else None  # scheme and host ignore case


_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")


def _allowed_headers(request: web.Request) -> str:
    """Ours, and whatever else the page asked to send (SDKs add their own, e.g. OpenAI's ``X-Stainless-*``):
    an allowed origin may send any header; the key is what guards the node."""
    asked = request.headers.get("Access-Control-Request-Headers", "")
    extra = [name.strip() for name in asked.split(",")[:64] if _HEADER_NAME.fullmatch(name.strip())]
    known = {name.strip().lower() for name in CORS_HEADERS.split(",")}
    return ", ".join([CORS_HEADERS, *dict.fromkeys(n for n in extra if n.lower() not in known)])


def cors_middleware(origins: list[str]):
    """Answer a CORS preflight (``OPTIONS`` with ``Access-Control-Request-Method``) from an allowed origin.

    A preflight carries no Authorization header by design, so it is answered before the key is checked;
    the request it clears still needs the key. Other origins' preflights go on to the usual refusal.
    """
    allowed = frozenset(o.rstrip("/").lower() for o in origins)

    @web.middleware
    async def preflight(request: web.Request, handler):
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            origin = _allowed_origin(allowed, request)
            if origin is not None:
                return web.Response(status=204, headers={
                    "Access-Control-Allow-Origin": origin, "Access-Control-Allow-Methods": CORS_METHODS,
                    "Access-Control-Allow-Headers": _allowed_headers(request), "Access-Control-Max-Age": CORS_MAX_AGE,
                    "Vary": "Origin",
                })
        return await handler(request)

    return preflight


def cors_response_headers(origins: list[str]):
    """An ``on_response_prepare`` callback: every answer to an allowed origin carries its CORS headers.

    As a signal, not a middleware, so streamed answers (prepared inside their handler) and errors get them too.
    """
    allowed = frozenset(o.rstrip("/").lower() for o in origins)

    async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
        origin = _allowed_origin(allowed, request)
        if origin is not None and "Access-Control-Allow-Origin" not in response.headers:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = CORS_EXPOSED
            if origin != "*":
                response.headers.add("Vary", "Origin")

    return add_headers
