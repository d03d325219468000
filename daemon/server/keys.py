"""Typed keys for the application's shared state."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from daemon.mesh.transport import HopTransport
from daemon.node import Node

NODE = web.AppKey("node", Node)
CLIENT = web.AppKey("client", aiohttp.ClientSession)
HOPS = web.AppKey("hops", HopTransport)  # the /forward hops: see daemon.mesh.transport
