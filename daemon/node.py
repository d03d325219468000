"""One meshd node, wired together: its shard service, its head, its peers and its metrics.

The pieces do the work (``daemon.model.service`` runs ``/forward`` steps, ``daemon.mesh.head``
runs generations); :class:`~daemon.server.node_view.NodeView` is what the HTTP handlers see of
them. This module builds the pieces, connects them, and runs what a node does while it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from daemon.api import auth_headers
from daemon.api.tls import NodeTLS, client_context
from daemon.config import NodeConfig
from daemon.handover import Handover
from daemon.kvstore import SessionCacheStore
from daemon.mesh.channels import StepChannels, step_channels_enabled
from daemon.mesh.head import Head, HeadSettings
from daemon.mesh.peers import PeerDirectory
from daemon.mesh.planner import RoutePlanner
from daemon.mesh.routing import Candidate
from daemon.mesh.transport import HopTransport
from daemon.metrics import Metrics
from daemon.model.service import ShardService
from daemon.server.node_view import NodeView

log = logging.getLogger(__name__)

PEER_REFRESH_SECONDS = 2.0
ANNOUNCE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)  # telling a peer this node joins or leaves


class Node(NodeView):
    """A loaded shard service plus everything a node does with it. Build with :meth:`load`."""

    def __init__(self, config: NodeConfig, service: ShardService, metrics: Metrics, *,
                 tls: NodeTLS | None = None) -> None:
        self.config = config
        self.tls = tls or NodeTLS(server=None, client=client_context(config.ssl_ca_file))
        node_id = uuid.uuid4().hex  # tells this node apart from others at any address, for this run
        info = service.info
        peers = PeerDirectory(config.peers, self_url=config.url, fingerprint=info.fingerprint, node_id=node_id)
        planner = RoutePlanner(
            self._own_candidate, peers, info.num_layers,
            explore=config.route_explore, failover_wait=config.failover_wait_seconds,
            on_hop=lambda hop, mode, ms: metrics.hop_done(hop.url, mode, ms / 1000.0),
        )
        peers.on_change = self._peer_changed
        names = config.served_model_name or [info.name]
        head = Head(service, planner, metrics, model_name=names[0], aliases=names[1:], settings=HeadSettings(
            wire_dtype=config.wire_dtype or service.dtype, hop_timeout_seconds=config.hop_timeout_seconds,
            max_generations=config.max_generations, max_tokens_default=config.max_tokens_default,
            max_tokens_cap=config.max_tokens_cap, prefix_reuse=config.prefix_reuse,
            max_model_len=config.max_model_len, max_draft=config.draft_max,
        ))
        super().__init__(url=config.url, node_id=node_id, service=service, head=head, peers=peers, planner=planner,
                         metrics=metrics, quantize=config.quantize)
        self.handover = Handover(service, peers, lambda: self.forwards_in_flight)

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
            channels = StepChannels(headers=headers, enabled=step_channels_enabled())
            channels.wait = self.service.executor.wait_answer  # asleep while the next nodes compute
            self.http = self.planner.http = http
            self.head.connect(transport, http, channels)
            poll = asyncio.create_task(self._poll_peers(http))
            try:
                yield
            finally:
                channels.close()
                poll.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await poll
                self.http = self.planner.http = None
                await transport.close()
                self.service.close()

    async def _poll_peers(self, http: aiohttp.ClientSession) -> None:
        while True:
            # the next poll is scheduled only once this one finished: a slow peer stretches the cycle
            try:
                await self.peers.refresh(http)
                if not self.draining:
                    await asyncio.gather(*(self._announce(http, seed) for seed in self.peers.missing_from()))
            except Exception:  # noqa: BLE001 - polling must outlive any one bad answer
                log.exception("peer refresh failed")
            await asyncio.sleep(PEER_REFRESH_SECONDS)

    async def _announce(self, http: aiohttp.ClientSession, seed: str) -> None:
        """Tell a seed that answers but does not list this node that it serves here (it started, or the seed
        restarted); the seed's peers come back in the answer and are learned at once."""
        try:
            async with http.post(seed + "/v1/peers/announce", json={"url": self.url},
                                 timeout=ANNOUNCE_TIMEOUT) as resp:
                if resp.status != 200:
                    log.warning("announcing this node to %s: it answered %s", seed, resp.status)
                    return
                answer = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("announcing this node to %s failed: %s", seed, exc)
            return
        log.info("announced this node to %s", seed)
        self.peers.learn_listed(answer.get("peers") if isinstance(answer, dict) else None, source=seed)

    async def hand_over_sessions(self) -> dict[str, str]:
        """Draining: hand the live sessions of other heads' generations to nodes taking this one's layers over
        (:mod:`daemon.handover`); the sessions moved, by id."""
        if self.http is None:
            return {}
        return await self.handover.run(self.http, keep=set(self.head.own_sessions))

    async def session_moved_to(self, session_id: str | None) -> str | None:
        return await self.handover.moved_to(session_id)

    async def say_leaving(self, moved: dict[str, str] | None = None) -> None:
        """Tell every peer that answers that this node stops, so their routes leave it at once, and which node
        each handed-on session went to (``moved``); a peer that does not hear it finds out at its next poll."""
        http = self.http
        if http is None:
            return
        body = {"url": self.url, "leaving": True} | ({"moved": moved} if moved else {})

        async def tell(url: str) -> None:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.post(url + "/v1/peers/announce", json=body, timeout=ANNOUNCE_TIMEOUT) as resp:
                    await resp.read()

        await asyncio.gather(*(tell(url) for url in self.peers.up_urls()))

    def _peer_changed(self, kind: str, url: str, sentence: str, layers: tuple[int, int] | None) -> None:
        log.info("peer %s", sentence)
        self.planner.peer_changed(kind, url, sentence, layers)

    def _own_candidate(self) -> Candidate:
        service = self.service
        return Candidate(url=self.url, start=service.start, end=service.end, kv_cache=service.caches, local=True,
                         verifies=service.caches, busy=service.busy())
