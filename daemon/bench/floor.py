"""What loopback HTTP costs on this host, with nothing of meshnet in it: the floor under a hop's overhead."""

from __future__ import annotations

import statistics
import time

from daemon.api.launch import MeshdProcess, free_port
from daemon.bench.progress import say


def loopback_floor(pause_ms: float, steps: int = 60) -> dict:
    """A bare hop on meshd's own stack (aiohttp server, the head's hop transport, the same event loop): the
    same body, one hand-off to a worker thread that idles ``pause_ms`` (as a node computes), the same JSON
    answer. Its latency minus the pause is what any hop costs here before meshnet adds anything: on a
    virtual machine, mostly waking idle cores."""
    import asyncio

    from daemon.mesh.transport import HopTransport, TransportError
    from daemon.server.loop import loop_factory

    port = free_port()
    server = MeshdProcess([str(port)], module="daemon.bench.floor_server", label="loopback floor server",
                          on_line=lambda line: say(f"loopback floor server: {line}"))

    async def measure() -> list[float]:
        hops = HopTransport()
        url = f"http://127.0.0.1:{port}/forward"
        for _ in range(100):
            try:
                await hops.post(url, b"0", headers={"X-Pause": "0"}, timeout=5.0, connect_timeout=1.0)
                break
            except TransportError:
                await asyncio.sleep(0.1)
        body = bytes(2304)
        overheads = []
        for _ in range(steps):
            started = time.perf_counter()
            await hops.post(url, body, headers={"X-Pause": str(pause_ms / 1000)}, timeout=5.0, connect_timeout=1.0)
            overheads.append((time.perf_counter() - started) * 1000 - pause_ms)
        await hops.close()
        return overheads

    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            overheads = runner.run(measure())
    finally:
        server.stop()
    return {"pause_ms": pause_ms, "steps": steps, "median_ms": statistics.median(overheads),
            "min_ms": min(overheads)}
