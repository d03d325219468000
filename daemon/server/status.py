"""Health and the JSON endpoints the console reads (shapes in ``daemon.api``)."""

from __future__ import annotations

from aiohttp import web

from daemon.errors import NotFound
from daemon.server.keys import NODE


async def health(request: web.Request) -> web.Response:
    node = request.app[NODE]
    return web.json_response({"status": "ok", "layers": node.status().layers})


async def status(request: web.Request) -> web.Response:
    return web.json_response(request.app[NODE].status().to_dict())


async def sessions(request: web.Request) -> web.Response:
    return web.json_response(request.app[NODE].session_list().to_dict())


async def drop_session(request: web.Request) -> web.Response:
    session_id = request.match_info["session_id"]
    if not request.app[NODE].store.drop(session_id):
        raise NotFound(f"no session {session_id!r} on this node", param="session_id")
    return web.json_response({"dropped": session_id})


async def route(request: web.Request) -> web.Response:
    node = request.app[NODE]
    if request.query.get("refresh") == "1" or not node.route:
        try:
            node.plan_route()
        except Exception:  # noqa: BLE001 - the error is reported in the body
            pass
    return web.json_response(node.route_info().to_dict())
