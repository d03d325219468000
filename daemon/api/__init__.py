"""What meshd shows the outside: the JSON shapes of its endpoints, and the rules a client follows.

The console imports nothing else from the daemon. No torch here, no aiohttp: the console must
start fast. The shapes themselves live in :mod:`daemon.api.shapes` and
:mod:`daemon.api.routes`.
"""

from __future__ import annotations

import re

from daemon.api.routes import GenerationStats, HopTotals, NodeMeasurement, RouteEvent, RouteHopInfo, RouteInfo
from daemon.api.shapes import (
    Hop,
    MemoryInfo,
    ModelSummary,
    NodeStatus,
    PeerSummary,
    Sampling,
    SessionInfo,
    SessionList,
    StoreStats,
    format_layers,
    parse_layers,
)

__all__ = [
    "GenerationStats", "Hop", "HopTotals", "MemoryInfo", "ModelSummary", "NodeMeasurement", "NodeStatus", "PeerSummary",
    "RouteEvent", "RouteHopInfo", "RouteInfo", "Sampling", "SessionInfo", "SessionList", "StoreStats",
    "TOKEN_PATTERN", "TOKEN_RULE", "auth_headers", "format_layers", "normalize_url", "parse_layers",
]

# the mesh token: printable ASCII without spaces (it travels in an HTTP header), 16-256 characters
TOKEN_PATTERN = re.compile(r"[!-~]{16,256}")
TOKEN_RULE = "16-256 printable ASCII characters without spaces"


def auth_headers(token: str | None) -> dict[str, str]:
    """The header that carries the mesh token on every request (none without a token)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def normalize_url(url: str) -> str:
    """``host:port`` or a URL -> ``http://host:port`` without a trailing slash; empty is a ValueError."""
    url = url.strip().rstrip("/")
    if not url:
        raise ValueError("an empty address")
    return url if "://" in url else f"http://{url}"
