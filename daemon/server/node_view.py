"""What a node's endpoints read and change: its status, its sessions, its route and its peers.

``daemon.node.Node`` builds a node's pieces and wires them together; this is the side of it the
HTTP handlers see (the ``NodeBackend`` protocol of ``daemon.server.backend``), assembled from
those pieces on each request.
"""

from __future__ import annotations

import contextlib
import time

import aiohttp

from daemon import __version__
from daemon.api import ModelSummary, NodeStatus, PeerSummary, RouteInfo, SessionList
from daemon.errors import RouteUnavailable
from daemon.mesh.head import Head
from daemon.mesh.peers import PeerDirectory
from daemon.mesh.planner import RoutePlanner
from daemon.metrics import Metrics
from daemon.model.service import ShardService


class NodeView:
    """A node as its endpoints see it. ``http`` is the client session of a serving node (None otherwise)."""

    def __init__(self, *, url: str, node_id: str, service: ShardService, head: Head, peers: PeerDirectory,
                 planner: RoutePlanner, metrics: Metrics, quantize: str | None) -> None:
        self.url = url
        self.node_id = node_id
        self.service = service
        self.head = head
        self.peers = peers
        self.planner = planner
        self.metrics = metrics
        self.quantize = quantize
        self.draining = False  # set on SIGTERM: finish what runs, take nothing new
        self.forwards_in_flight = 0  # /forward requests past the drain check and not yet answered
        self.started_at = time.time()
        self.http: aiohttp.ClientSession | None = None

    def status(self) -> NodeStatus:
        """Everything ``/v1/status`` reports: the model, this node's layers, load, counters, caches and peers."""
        service, head, info = self.service, self.head, self.service.info
        return NodeStatus(
            url=self.url, version=__version__,
            model=ModelSummary(info.name, info.model_type, info.num_layers, info.hidden_size, info.fingerprint),
            start=service.start, end=service.end,
            roles=["head", "tail"] if service.shard.is_tail else ["head"],  # any node heads; embeddings load lazily
            kv_cache_enabled=service.kv_cache_enabled, supports_kv_cache=service.supports_kv_cache,
            threads=service.threads, node_id=self.node_id, busy=round(service.busy(), 4), draining=self.draining,
            active_generations=head.active_generations, active_steps=service.active_steps,
            weights_bytes=service.shard.loaded_bytes(), store=service.store.stats(), peers=self.peers.summaries(),
            time=time.time(), started_at=self.started_at, steps_served=service.steps_served,
            tokens_served=service.tokens_served, generations=head.generations, tokens_generated=head.tokens_generated,
            dtype=service.dtype, device=str(service.shard.device), quantize=self.quantize,
            memory=service.memory(), context_length=head.context_length, max_tokens_cap=head.max_tokens_cap,
            speculation=service.caches, step_channels=service.executor.channels,
            channel_steps=service.channel_steps,
        )

    def sessions(self) -> SessionList:
        """The session caches this node holds, with its store's counters."""
        return SessionList(time=time.time(), sessions=self.service.sessions(), store=self.service.store.stats())

    def drop_session(self, session_id: str) -> bool:
        """Forget a session's cache; False when there is none."""
        return self.service.drop_session(session_id)

    def retain_session(self, session_id: str, past_len: int | None = None) -> bool:
        """Keep an ended generation's session as a prefix later requests can start from, cut back to ``past_len``
        positions where a verify step left more; False when there is none."""
        return self.service.retain_session(session_id, past_len)

    def route(self, *, refresh: bool) -> RouteInfo:
        """The head's route, planned afresh when ``refresh`` or when there is none yet."""
        if refresh or not self.planner.route:
            with contextlib.suppress(RouteUnavailable):  # the error is reported in the route info
                self.planner.plan(explore=False)
        return self.planner.info()

    async def add_peer(self, url: str) -> list[PeerSummary]:
        """Add a peer and, while serving, ask it for its status at once; the peers as they stand then."""
        self.peers.add(url)
        if self.http is not None:
            await self.peers.refresh(self.http)  # polled at once: the console shows it up or down now
        return self.peers.summaries()

    async def peer_announced(self, url: str) -> tuple[bool, list[PeerSummary]]:
        """A node announced itself: whether it was taken as a peer (polled at once), and the peers then."""
        joined = self.peers.announced(url)
        if joined and self.http is not None:
            await self.peers.refresh(self.http)
        return joined, self.peers.summaries()

    def peer_left(self, url: str, moved: dict[str, str] | None = None) -> bool:
        """A node said it stops: out of this node's routes now; False when it was not a peer. ``moved``: the
        sessions it handed to other nodes, where this node's generations go on with them."""
        if moved:
            self.planner.sessions_moved(url, moved)
        return self.peers.left(url)

    def remove_peer(self, url: str) -> bool:
        """Forget a peer (also as others report it); False when it was not known."""
        return self.peers.remove(url)
