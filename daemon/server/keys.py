"""Typed keys for the application's shared state."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from daemon.node import Node

NODE = web.AppKey("node", Node)
CLIENT = web.AppKey("client", aiohttp.ClientSession)
