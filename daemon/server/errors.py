"""The one place where meshd's exceptions become HTTP statuses and OpenAI-style error bodies."""

from __future__ import annotations

import json
import logging

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.web_protocol import RequestPayloadError

from daemon.errors import BadRequest, CacheMiss, Draining, MeshError

log = logging.getLogger(__name__)

JSON = "application/json; charset=utf-8"


def error_body(message: str, *, type: str, code: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


async def read_json(request: web.Request):
    """The request body as JSON; anything unreadable (bad JSON, nesting too deep, an unknown charset) is a 400."""
    try:
        return await request.json()
    except (ValueError, RecursionError, LookupError):
        # ValueError covers bad JSON and undecodable text; RecursionError, JSON nested thousands deep;
        # LookupError, a Content-Type naming a charset Python does not know
        raise BadRequest("the request body is not valid JSON") from None


def error_parts(exc: MeshError) -> tuple[int, dict, dict[str, str]]:
    """What a request that raised ``exc`` is answered: status, JSON body and extra headers (HTTP or a step
    channel's frame alike)."""
    if isinstance(exc, CacheMiss):
        # The shape heads match on (docs/adr/0022-sessions-and-cache-misses.md): {"error": "cache_miss", "reason": ...}
        body = {"error": "cache_miss", "reason": exc.reason, "message": exc.message}
    else:
        body = error_body(exc.message, type=exc.type, code=exc.code, param=exc.param)
        if isinstance(exc, Draining) and exc.moved_to:
            body["moved_to"] = exc.moved_to  # the node that took the step's session over (a head goes on there)
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else {}
    return exc.status, body, headers


def step_error(exc: MeshError | None) -> tuple[int, dict[str, str], bytes]:
    """A step's refusal as status, headers and body, for a frame (a step channel's, a batch's): ``exc``'s, or with
    None, the 500 of a step that failed unexpectedly (logged by the caller)."""
    if exc is None:
        error = error_body("internal error; see the node's log", type="server_error", code="internal_error")
        return 500, {"Content-Type": JSON}, json.dumps(error).encode()
    status, error, extra = error_parts(exc)
    return status, {"Content-Type": JSON, **extra}, json.dumps(error).encode()


def error_response(exc: MeshError) -> web.Response:
    status, body, headers = error_parts(exc)
    return web.json_response(body, status=status, headers=headers or None)


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Map MeshError to its status; anything unexpected is a logged 500, never a dead node."""
    try:
        return await handler(request)
    except MeshError as exc:
        return error_response(exc)
    except (RequestPayloadError, BadHttpMessage) as exc:
        # e.g. a Content-Encoding the body does not actually have
        message = f"the request body cannot be read: {exc}"
        return web.json_response(error_body(message, type="invalid_request_error", code="invalid_request"),
                                 status=400)
    except web.HTTPRequestEntityTooLarge as exc:
        message = f"{exc.text}; this node's limit is --max-body-bytes"
        return web.json_response(error_body(message, type="invalid_request_error", code="request_too_large"),
                                 status=413)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        return web.json_response(
            error_body(exc.reason, type="invalid_request_error", code=str(exc.status)), status=exc.status
        )
    except Exception:  # noqa: BLE001 - the node must keep serving whatever one request did
        log.exception("unhandled error in %s %s", request.method, request.path)
        return web.json_response(
            error_body("internal error; see the node's log", type="server_error", code="internal_error"),
            status=500,
        )
