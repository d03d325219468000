"""Health and the JSON endpoints the console reads (shapes in ``daemon.api``)."""

from __future__ import annotations

from aiohttp import web
from yarl import URL

from daemon import wire
from daemon.errors import BadRequest, Draining, NotFound
from daemon.metrics import CONTENT_TYPE
from daemon.server.errors import read_json
from daemon.server.keys import NODE

MAX_MOVED = 4096  # sessions a leaving node may name at once


async def health(request: web.Request) -> web.Response:
    node = request.app[NODE]
    if node.draining:
        return web.json_response({"status": "draining", "layers": node.status().layers}, status=503,
                                 headers={"Retry-After": str(Draining.retry_after)})
    return web.json_response({"status": "ok", "layers": node.status().layers})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[NODE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def status(request: web.Request) -> web.Response:
    return web.json_response(request.app[NODE].status().to_dict())


async def sessions(request: web.Request) -> web.Response:
    return web.json_response(request.app[NODE].sessions().to_dict())


async def drop_session(request: web.Request) -> web.Response:
    session_id = request.match_info["session_id"]
    if not request.app[NODE].drop_session(session_id):
        raise NotFound(f"no session {session_id!r} on this node", param="session_id")
    return web.json_response({"dropped": session_id})


async def retain_session(request: web.Request) -> web.Response:
    """A head's generation ended: keep its session here as a prefix a later request can start from."""
    session_id = request.match_info["session_id"]
    raw = request.query.get("past_len")
    if raw is not None and not (raw.isascii() and raw.isdigit() and len(raw) <= 9):
        raise BadRequest(f"past_len must be a non-negative integer, got {raw[:40]!r}", param="past_len")
    if not request.app[NODE].retain_session(session_id, int(raw) if raw is not None else None):
        raise NotFound(f"no session {session_id!r} on this node", param="session_id")
    return web.json_response({"retained": session_id})


async def import_session(request: web.Request) -> web.Response:
    """A draining node hands this one a live session of layers this node takes over (node to node, with the mesh's
    token): the session's cache as a safetensors file, checked whole before it is stored."""
    session_id = request.match_info["session_id"]
    if not wire.valid_session_id(session_id):
        raise BadRequest("a session id is 1-128 characters of [A-Za-z0-9._:-]", param="session_id")
    if request.content_type != wire.SESSION_CONTENT_TYPE:
        raise BadRequest(f"a session transfer is sent as {wire.SESSION_CONTENT_TYPE}, not {request.content_type}")
    info = await request.app[NODE].service.import_session(session_id, await request.read())
    return web.json_response({"imported": session_id, "past_len": info.past_len, "start_layer": info.start_layer,
                              "bytes": info.bytes})


async def route(request: web.Request) -> web.Response:
    info = request.app[NODE].route(refresh=request.query.get("refresh") == "1")
    return web.json_response(info.to_dict())


def _peer_url(value) -> str:
    """A well-formed ``http(s)://host[:port]`` address, or a 400 (a junk peer would be polled forever)."""
    problem = "url must be an http:// or https:// address like http://10.0.0.2:7070"
    if not isinstance(value, str) or len(value) > 2048:
        raise BadRequest(problem, param="url")
    value = value.strip()
    try:
        url = URL(value)
        port = url.port
    except ValueError:
        raise BadRequest(problem, param="url") from None
    if url.scheme not in ("http", "https") or not url.host or not port or any(c.isspace() for c in value) \
            or url.path not in ("", "/") or url.query_string or url.fragment or url.user:
        raise BadRequest(problem, param="url")
    return value


async def add_peer(request: web.Request) -> web.Response:
    """Tell this node about another one (the console's "add peer"); it is polled at once."""
    body = await read_json(request)
    url = _peer_url(body.get("url") if isinstance(body, dict) else None)
    peers = await request.app[NODE].add_peer(url)
    return web.json_response({"peers": [p.to_dict() for p in peers]})


async def announce(request: web.Request) -> web.Response:
    """Another node says it serves at ``url`` and joins (polled at once, then gossiped with this node's status),
    or, with ``"leaving": true``, that it stops: it leaves every route here at once."""
    body = await read_json(request)
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object like {\"url\": \"http://10.0.0.2:7070\"}")
    url = _peer_url(body.get("url"))
    leaving = body.get("leaving", False)
    if not isinstance(leaving, bool):
        raise BadRequest(f"leaving must be true or false, got {str(leaving)[:40]!r}", param="leaving")
    moved = _moved(body.get("moved", {}))
    if moved and not leaving:
        raise BadRequest("moved sessions are named only by a node that is leaving", param="moved")
    node = request.app[NODE]
    if leaving:
        return web.json_response({"left": url, "known": node.peer_left(url, moved)})
    joined, peers = await node.peer_announced(url)
    return web.json_response({"joined": joined, "peers": [p.to_dict() for p in peers]})


def _moved(value) -> dict[str, str]:
    """A leaving node's sessions and the nodes it handed them to: ``{"session id": "http://..."}``."""
    if not isinstance(value, dict) or len(value) > MAX_MOVED:
        raise BadRequest(f"moved must be an object of at most {MAX_MOVED} session ids and node addresses",
                         param="moved")
    for session_id in value:
        if not wire.valid_session_id(session_id):
            raise BadRequest("moved names a session id that is not 1-128 characters of [A-Za-z0-9._:-]",
                             param="moved")
    try:
        return {session_id: _peer_url(url) for session_id, url in value.items()}
    except BadRequest as exc:
        raise BadRequest(f"moved: {exc.message}", param="moved") from None


async def remove_peer(request: web.Request) -> web.Response:
    url = _peer_url(request.query.get("url"))
    if not request.app[NODE].remove_peer(url):
        raise NotFound(f"{url} is not a peer of this node", param="url")
    return web.json_response({"removed": url})
