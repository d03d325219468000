"""A draining node hands its live sessions to nodes that take its layers over: their generations go on there
without computing anything again.

On SIGTERM (``daemon.cli.serve_until_stopped``) a node:

1. holds the steps that arrive from now on (the drain middleware asks :meth:`Handover.moved_to`);
2. waits for the steps already under way: a prefill among them makes a session that moves too;
3. picks, for each live session it serves for another head, an up peer that keeps caches and runs this node's
   layers from the session's first layer to this node's end (the least busy);
4. sends each session's cache (``POST /v1/sessions/{id}/import``, the bytes of :mod:`daemon.model.migration`, with
   the mesh's token) and drops it here once the peer stored it;
5. answers each held or later step of a handed-on session with a 503 naming the peer (``moved_to``), and names
   them all in its leaving announcement (``"moved"``), so the heads go on there (``GenerationLoop._replace_span``).

A session with no such peer, one that cannot move (linear attention, a sliding window), or one whose transfer
fails stays: its steps get the 503 of any draining node, and its head replays the span elsewhere, as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from daemon import wire
from daemon.mesh.peers import PeerDirectory
from daemon.model.service import ShardService

log = logging.getLogger(__name__)

# the most a drain waits for the steps under way before it sends their sessions: they end on their own, in one
# step's time, which a busy host stretches to seconds (a session sent before its step ends would miss that step);
# the bound only guards against a request that never ends
SETTLE_SECONDS = 30.0
TRANSFER_TIMEOUT = aiohttp.ClientTimeout(total=30.0, sock_connect=2.0)


class Handover:
    """One node's sessions, handed on as it drains; ``moved``: session id -> the node that took it."""

    def __init__(self, service: ShardService, peers: PeerDirectory, steps_in_flight: Callable[[], int]) -> None:
        self._service = service
        self._peers = peers
        self._steps_in_flight = steps_in_flight  # /forward requests taken before the drain began, not yet answered
        self._moving: dict[str, asyncio.Future] = {}
        self._settled: asyncio.Future | None = None  # done once the steps under way at the drain have ended
        self.moved: dict[str, str] = {}

    async def run(self, http: aiohttp.ClientSession, *, keep: set[str]) -> dict[str, str]:
        """Hand every live session but those in ``keep`` (this node's own generations) to a node taking its layers
        over; the sessions moved, by id. The steps under way end first: a session one of them makes (a prefill)
        moves with the others, and a step arriving meanwhile waits to learn where its session went."""
        loop = asyncio.get_running_loop()
        self._settled = loop.create_future()  # before any await: the drain middleware holds steps from now
        started = time.monotonic()
        try:
            await self._settle()
            takers = {e.session_id: self._taker(e.start_layer) for e in self._service.store.entries()
                      if not e.retained and e.session_id not in keep}
            takers = {session_id: url for session_id, url in takers.items() if url is not None}
            self._moving = {session_id: loop.create_future() for session_id in takers}
            self._settled.set_result(None)
            if not takers:
                return {}
            for session_id, url in takers.items():
                if await self._send(http, session_id, url):
                    self.moved[session_id] = url
                self._moving[session_id].set_result(self.moved.get(session_id))
        finally:
            for future in (self._settled, *self._moving.values()):
                if not future.done():
                    future.set_result(None)
        log.info("handed %d of %d session(s) to the nodes taking this one's layers over, in %.2f s", len(self.moved),
                 len(takers), time.monotonic() - started)
        return dict(self.moved)

    async def moved_to(self, session_id: str | None) -> str | None:
        """The node ``session_id`` went to, once the steps under way have ended and its transfer is done (a step of
        it waits for both); None: it stays here."""
        if self._settled is not None:
            await asyncio.shield(self._settled)
        future = self._moving.get(session_id) if session_id else None
        return await asyncio.shield(future) if future is not None else None

    def _taker(self, start_layer: int) -> str | None:
        """The least busy up peer that keeps caches and runs layers ``start_layer`` to this node's end."""
        options = [c for c in self._peers.candidates() if c.takes_over(start_layer, self._service.end)]
        return min(options, key=lambda c: c.busy).url if options else None

    async def _settle(self) -> None:
        """Wait for the steps taken before the drain to end (new ones are held or refused now), at most
        SETTLE_SECONDS: a session goes on from where its last step left it. Counted from their requests, not their
        computing: a step may still be reading its body."""
        deadline = time.monotonic() + SETTLE_SECONDS
        while self._steps_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    async def _send(self, http: aiohttp.ClientSession, session_id: str, url: str) -> bool:
        data = await self._service.export_session(session_id)
        if data is None:
            return False
        try:
            async with http.post(f"{url}/v1/sessions/{session_id}/import", data=data, timeout=TRANSFER_TIMEOUT,
                                 headers={"Content-Type": wire.SESSION_CONTENT_TYPE}) as resp:
                answer = await resp.text()
                if resp.status != 200:
                    log.warning("session %s: %s refused it (%s): %s", session_id, url, resp.status, answer[:200])
                    return False
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("session %s: handing it to %s failed: %s", session_id, url, exc)
            return False
        self._service.drop_session(session_id)
        log.info("session %s: handed to %s (%d bytes)", session_id, url, len(data))
        return True
