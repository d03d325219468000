"""One meshd node: its shard, session store, torch worker, peers and head role, wired together.

Every piece of torch work runs on one dedicated worker thread, so the HTTP event
loop answers ``/health`` and ``/v1/status`` in milliseconds while a step runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from daemon import __version__, wire
from daemon.api import ModelSummary, NodeStatus, RouteHopInfo, RouteInfo, SessionInfo, SessionList
from daemon.config import NodeConfig
from daemon.errors import BadRequest
from daemon.kvstore import SessionCacheStore
from daemon.mesh.generation import HopReply
from daemon.mesh.peers import PeerDirectory
from daemon.mesh.planner import RoutePlanner
from daemon.mesh.routing import Candidate
from daemon.metrics import Metrics
from daemon.model.cores import CoreShare
from daemon.model.sampling import SamplingParams
from daemon.model.shard import ModelShard, StepResult
from daemon.model.tensors import as_sent, to_activation, to_tensor

log = logging.getLogger(__name__)

BUSY_WINDOW_SECONDS = 10.0  # the share of time spent computing is reported over this window


class Node:
    """A loaded shard plus everything a node does with it. Build with :meth:`load`."""

    def __init__(self, config: NodeConfig, shard: ModelShard, store: SessionCacheStore, threads: int) -> None:
        self.config = config
        self.shard = shard
        self.store = store
        self.threads = threads
        self.url = config.url
        self.hidden_size = shard.info.hidden_size
        self.context_length = getattr(shard.config, "max_position_embeddings", None) or wire.MAX_SEQUENCE
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")
        self.cores = _core_share() if config.threads is None else None  # None: --threads fixes the count
        self.node_id = uuid.uuid4().hex  # tells this node apart from others at any address, for this run
        self.peers = PeerDirectory(config.peers, self_url=self.url, fingerprint=shard.info.fingerprint,
                                   node_id=self.node_id)
        self.metrics = Metrics(store.stats)
        self.planner = RoutePlanner(
            self.own_candidate, self.peers, shard.info.num_layers,
            explore=config.route_explore, failover_wait=config.failover_wait_seconds,
            on_hop=lambda hop, mode, ms: self.metrics.hop_done(hop.url, mode, ms / 1000.0),
        )
        self.draining = False  # set on SIGTERM: finish what runs, take nothing new
        self.active_generations = 0
        self.active_steps = 0
        self.started_at = time.time()
        self.steps_served = 0
        self.tokens_served = 0
        self.generations = 0
        self.tokens_generated = 0
        self._compute_log: deque[tuple[float, float]] = deque()  # (finished, seconds) of recent steps

    @classmethod
    def load(cls, config: NodeConfig, folder: Path, start: int, end: int, threads: int) -> Node:
        """Load the shard (blocking). ``[start, end)`` is half-open."""
        torch.set_num_threads(threads)
        store = SessionCacheStore(
            ttl_seconds=config.kv_ttl_seconds,
            max_sessions=config.kv_max_sessions,
            max_bytes=config.kv_max_bytes,
        )
        shard = ModelShard(folder, start, end, head=start == 0, kv_cache=config.kv_cache, sessions=store)
        return cls(config, shard, store, threads)

    async def run(self, fn, *args):
        """Run torch work on the node's single worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.cores is not None:
            self.cores.close()

    # ---- the server side: one /forward step ------------------------------------------------

    def _step(self, request: wire.ForwardRequest,
              token_ids: list[int] | None) -> tuple[StepResult, wire.Activation | None, float]:
        """One step on the torch worker: the hidden states from the request's bytes, or embedded here."""
        if self.cores is not None:
            self.cores.adjust()
        started = time.perf_counter()
        if token_ids is None:
            hidden = to_tensor(request.activation, compute_dtype=self.shard.dtype)
        else:  # rounded as the wire would have rounded it, so a local first hop changes nothing
            hidden = as_sent(self.shard.embed(token_ids), wire_dtype=request.activation.dtype,
                             compute_dtype=self.shard.dtype)
        result = self.shard.step(
            hidden,
            mode=request.mode,
            session_id=request.session_id,
            past_len=request.past_len,
            start_layer=request.start_layer,
            sampling=SamplingParams(**request.sampling),
        )
        seconds = time.perf_counter() - started
        # the reply travels in the dtype the request came in, serialised here rather than on the event loop
        out = to_activation(result.hidden, dtype=request.activation.dtype) if result.hidden is not None else None
        return result, out, seconds

    async def forward(self, request: wire.ForwardRequest, *, token_ids: list[int] | None = None) -> HopReply:
        """One /forward step. ``token_ids``: the head's own first hop, embedded in the same worker call (one
        hand-off to the torch thread per step, not two); ``request.activation`` then only names dtype and shape."""
        positions = request.past_len + request.activation.shape[1]
        if positions > self.context_length:
            raise BadRequest(f"the step reaches position {positions}; the model's context is {self.context_length}",
                             param=wire.SHAPE)
        if request.mode == "prefill":  # once per generation (and re-prefill) per node: never per token
            log.info("session %s: prefill of %d tokens from layer %d", request.session_id,
                     request.activation.shape[1], request.start_layer)
        self.active_steps += 1
        try:
            result, out, seconds = await self.run(self._step, request, token_ids)
        finally:
            self.active_steps -= 1
        self.steps_served += 1
        self.tokens_served += request.activation.shape[1]
        self._compute_log.append((time.monotonic(), seconds))
        self.metrics.step_done(request.mode, seconds)
        compute_ms = seconds * 1000.0
        if out is not None:
            return HopReply(activation=out, compute_ms=compute_ms)
        return HopReply(token_id=result.token_id, text=result.text, compute_ms=compute_ms)

    def busy(self) -> float:
        """The share of the last few seconds this node spent computing steps, 0..1: its load."""
        horizon = time.monotonic() - BUSY_WINDOW_SECONDS
        while self._compute_log and self._compute_log[0][0] < horizon:
            self._compute_log.popleft()
        return min(1.0, sum(seconds for _, seconds in self._compute_log) / BUSY_WINDOW_SECONDS)

    # ---- the head side: what the generation loop needs (HeadBackend) -----------------------

    @property
    def eos_token_ids(self) -> set[int]:
        return self.shard.eos_token_ids

    @property
    def eos_texts(self) -> set[str]:
        tok = self.shard.tokenizer
        return {tok.decode([i]) for i in self.shard.eos_token_ids} if tok is not None else set()

    async def ensure_head(self) -> None:
        if not self.shard.is_head_loaded:
            await self.run(self.shard.ensure_head)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        encoded = self.shard.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)

    def encode_text(self, text: str) -> list[int]:
        return self.shard.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self.shard.tokenizer.decode(token_ids, skip_special_tokens=True)

    async def embed(self, token_ids: list[int]) -> wire.Activation:
        dtype = self.config.wire_dtype
        return await self.run(lambda: to_activation(self.shard.embed(token_ids), dtype=dtype))

    async def local_step(self, activation: wire.Activation | None, *, mode, session_id, past_len, start_layer,
                         hop_index, sampling, token_ids: list[int] | None = None) -> HopReply:
        if token_ids is not None:  # embedded in the step itself: the activation is only its dtype and shape
            activation = wire.Activation(self.config.wire_dtype, (1, len(token_ids), self.hidden_size), b"")
        request = wire.ForwardRequest(
            activation=activation, mode=mode, session_id=session_id, past_len=past_len,
            start_layer=start_layer, hop_index=hop_index, sampling=sampling,
        )
        return await self.forward(request, token_ids=token_ids)

    def drop_local_session(self, session_id: str) -> None:
        self.store.drop(session_id)

    # ---- routes ----------------------------------------------------------------------------

    def own_candidate(self) -> Candidate:
        return Candidate(
            url=self.url, start=self.shard.start, end=self.shard.end,
            kv_cache=self.shard.supports_kv_cache and self.config.kv_cache, local=True, busy=self.busy(),
        )

    # ---- what the console reads --------------------------------------------------------------

    def roles(self) -> list[str]:
        roles = ["head"]  # any node can serve chat; embeddings load on first use
        if self.shard.is_tail:
            roles.append("tail")
        return roles

    def status(self) -> NodeStatus:
        info = self.shard.info
        return NodeStatus(
            url=self.url,
            version=__version__,
            model=ModelSummary(info.name, info.model_type, info.num_layers, info.hidden_size, info.fingerprint),
            start=self.shard.start,
            end=self.shard.end,
            roles=self.roles(),
            kv_cache_enabled=self.config.kv_cache,
            supports_kv_cache=self.shard.supports_kv_cache,
            threads=(self.cores and self.cores.threads) or self.threads,  # the share, once a step has set it
            node_id=self.node_id,
            busy=round(self.busy(), 4),
            draining=self.draining,
            active_generations=self.active_generations,
            active_steps=self.active_steps,
            weights_bytes=self.shard.loaded_bytes(),
            store=self.store.stats().to_dict(),
            peers=self.peers.summaries(),
            time=time.time(),
            started_at=self.started_at,
            steps_served=self.steps_served,
            tokens_served=self.tokens_served,
            generations=self.generations,
            tokens_generated=self.tokens_generated,
        )

    def session_list(self) -> SessionList:
        entries = [
            SessionInfo(e.session_id, e.past_len, e.start_layer, e.nbytes, e.created_at, e.last_used, e.expires_at)
            for e in self.store.entries()
        ]
        return SessionList(time=time.time(), sessions=entries, store=self.store.stats().to_dict())

    def route_info(self) -> RouteInfo:
        planner = self.planner
        latency = planner.latency.snapshot()
        hops = []
        for h in planner.route:
            stats = latency.get(h.url, {})
            layer_ms = stats.get("layer_ms")
            hops.append(RouteHopInfo(
                h.url, h.start_layer, h.end_layer, h.kv_cache, h.local, stats.get("latency_ms"),
                overhead_ms=stats.get("overhead_ms"),
                compute_ms=layer_ms * (h.end_layer - h.start_layer) if layer_ms is not None else None,
                samples=stats.get("samples", 0),
            ))
        return RouteInfo(
            hops=hops, error=planner.error, planned_at=planner.planned_at, nodes=latency,
            events=list(planner.events), failovers=planner.failovers, reroutes=planner.reroutes,
        )


def _core_share() -> CoreShare | None:
    try:
        return CoreShare()
    except OSError as exc:  # no shared folder to meet the other daemons in: keep the fixed thread count
        log.warning("cannot share cores with the other daemons on this host (%s); threads stay fixed", exc)
        return None
