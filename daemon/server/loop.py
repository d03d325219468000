"""The event loop meshd serves on; the benchmark's loopback floor runs on the same one."""

from __future__ import annotations

import os


def loop_factory():
    """uvloop where it is installed (a hop's HTTP round trip costs less), else asyncio's own loop.

    ``MESHNET_EVENT_LOOP=asyncio`` forces asyncio's loop (to compare the two).
    """
    if os.environ.get("MESHNET_EVENT_LOOP", "").strip().lower() == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
