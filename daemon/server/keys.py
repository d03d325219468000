"""Typed keys for the application's shared state."""

from __future__ import annotations

from aiohttp import web

from daemon.server.backend import NodeBackend

NODE = web.AppKey("node", NodeBackend)
