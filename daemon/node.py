"""One meshd node, wired together: its shard service, its head, its peers and its metrics.

The pieces do the work (``daemon.model.service`` runs ``/forward`` steps, ``daemon.mesh.head``
runs generations); this is what the HTTP handlers see of them (``daemon.server.backend.NodeBackend``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from daemon import __version__
from daemon.api import ModelSummary, NodeStatus, PeerSummary, RouteInfo, SessionList, auth_headers
from daemon.api.tls import NodeTLS, client_context
from daemon.config import NodeConfig
from daemon.errors import RouteUnavailable
from daemon.kvstore import SessionCacheStore
from daemon.mesh.head import Head, HeadSettings
from daemon.mesh.peers import PeerDirectory
from daemon.mesh.planner import RoutePlanner
from daemon.mesh.routing import Candidate
from daemon.mesh.transport import HopTransport
from daemon.metrics import Metrics
from daemon.model.service import ShardService

log = logging.getLogger(__name__)

PEER_REFRESH_SECONDS = 2.0


class Node:
    """A loaded shard service plus everything a node does with it. Build with :meth:`load`."""

    def __init__(self, config: NodeConfig, service: ShardService, metrics: Metrics, *,
                 tls: NodeTLS | None = None) -> None:
        self.config = config
        self.tls = tls or NodeTLS(server=None, client=client_context(config.ssl_ca_file))
        self.service = service
        self.metrics = metrics
        self.url = config.url
        self.node_id = uuid.uuid4().hex  # tells this node apart from others at any address, for this run
        info = service.info
        self.peers = PeerDirectory(config.peers, self_url=self.url, fingerprint=info.fingerprint, node_id=self.node_id)
        self.planner = RoutePlanner(
            self._own_candidate, self.peers, info.num_layers,
            explore=config.route_explore, failover_wait=config.failover_wait_seconds,
            on_hop=lambda hop, mode, ms: metrics.hop_done(hop.url, mode, ms / 1000.0),
        )
        names = config.served_model_name or [info.name]
        self.head = Head(service, self.planner, metrics, model_name=names[0], aliases=names[1:], settings=HeadSettings(
            wire_dtype=config.wire_dtype or service.dtype, hop_timeout_seconds=config.hop_timeout_seconds,
            max_generations=config.max_generations, max_tokens_default=config.max_tokens_default,
            max_tokens_cap=config.max_tokens_cap, prefix_reuse=config.prefix_reuse,
            max_model_len=config.max_model_len,
        ))
        self.draining = False  # set on SIGTERM: finish what runs, take nothing new
        self.started_at = time.time()
        self._http: aiohttp.ClientSession | None = None

    @classmethod
    def load(cls, config: NodeConfig, folder: Path, start: int, end: int, threads: int, *,
             tls: NodeTLS | None = None, chat_template: str | None = None) -> Node:
        """Load the shard (blocking). ``[start, end)`` is half-open; ``chat_template`` replaces the model's."""
        store = SessionCacheStore(ttl_seconds=config.kv_ttl_seconds, max_sessions=config.kv_max_sessions,
                                  max_bytes=config.kv_max_bytes)
        metrics = Metrics(store.stats)
        service = ShardService.load(folder, start, end, store=store, kv_cache=config.kv_cache, threads=threads,
                                    share_cores=config.threads is None, dtype=config.dtype, device=config.device,
                                    quantize=config.quantize, on_step=metrics.step_done,
                                    max_batch=config.max_batch, step_tokens=config.step_tokens,
                                    on_batch=metrics.batch_done, tune_kernels=config.tune_kernels == "on")
        service.chat_template = chat_template
        return cls(config, service, metrics, tls=tls)

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """Keep-alive connections for the hops (lean, see ``daemon.mesh.transport``) and for everything else
        (peer polls, session releases), and the peer poll, for as long as the node serves."""
        headers = auth_headers(self.config.api_key)  # the mesh's API key goes on every request
        # https:// peers are verified (the system's trust store, or --ssl-ca-file) on every connection
        connector = aiohttp.TCPConnector(limit=64, keepalive_timeout=60, ssl=self.tls.client)
        # nodes set no cookies: a jar that keeps none skips a cookie filter on every hop of every step
        async with aiohttp.ClientSession(connector=connector, headers=headers,
                                         cookie_jar=aiohttp.DummyCookieJar()) as http:
            transport = HopTransport(headers=headers, ssl_context=self.tls.client)
            self._http = self.planner.http = http
            self.head.connect(transport, http)
            poll = asyncio.create_task(self._poll_peers(http))
            try:
                yield
            finally:
                poll.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await poll
                self._http = self.planner.http = None
                await transport.close()
                self.service.close()

    async def _poll_peers(self, http: aiohttp.ClientSession) -> None:
        while True:
            # the next poll is scheduled only once this one finished: a slow peer stretches the cycle
            try:
                await self.peers.refresh(http)
            except Exception:  # noqa: BLE001 - polling must outlive any one bad answer
                log.exception("peer refresh failed")
            await asyncio.sleep(PEER_REFRESH_SECONDS)

    def _own_candidate(self) -> Candidate:
        service = self.service
        return Candidate(url=self.url, start=service.start, end=service.end, kv_cache=service.caches, local=True,
                         busy=service.busy())

    # ---- what the endpoints read and change ----------------------------------------------------

    def status(self) -> NodeStatus:
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
            dtype=service.dtype, device=str(service.shard.device), quantize=self.config.quantize,
            memory=service.memory(), context_length=head.context_length, max_tokens_cap=head.max_tokens_cap,
        )

    def sessions(self) -> SessionList:
        return SessionList(time=time.time(), sessions=self.service.sessions(), store=self.service.store.stats())

    def drop_session(self, session_id: str) -> bool:
        return self.service.drop_session(session_id)

    def retain_session(self, session_id: str) -> bool:
        return self.service.retain_session(session_id)

    def route(self, *, refresh: bool) -> RouteInfo:
        if refresh or not self.planner.route:
            with contextlib.suppress(RouteUnavailable):  # the error is reported in the route info
                self.planner.plan(explore=False)
        return self.planner.info()

    async def add_peer(self, url: str) -> list[PeerSummary]:
        self.peers.add(url)
        if self._http is not None:
            await self.peers.refresh(self._http)  # polled at once: the console shows it up or down now
        return self.peers.summaries()

    def remove_peer(self, url: str) -> bool:
        return self.peers.remove(url)
