"""Choosing routes from measured latency, and finding a new one when a hop fails.

The head measures every hop of every decode step: the time end to end, and the
time the node itself spent computing (``X-Meshnet-Compute-Ms``). From these it
keeps, per node, moving averages of the per-step overhead (wire, HTTP,
queueing) and of the compute time per layer, so it can estimate a hop of any
length on that node. A route's expected step latency is the sum over its hops,
each scaled up by how busy the node says it is. Measurements older than a
minute are forgotten, and an unmeasured node is assumed a little faster than
the best measured one, so new and recovered nodes get tried; a small share of
plans is also randomised among near-equal routes (exploration).

A generation keeps its route: changing it costs a re-prefill. It moves only
when a hop fails (failover) or when its route has become far slower than the
best fully measured alternative (reroute).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from daemon.api import NodeMeasurement, RouteEvent, RouteHopInfo, RouteInfo
from daemon.errors import HopFailed, RouteUnavailable
from daemon.mesh.peers import PeerDirectory
from daemon.mesh.routing import Candidate, Hop, plan_route, route_cost

EMA_WEIGHT = 0.2  # weight of the newest sample in the moving averages
STALE_SECONDS = 60.0  # a measurement older than this no longer counts
UNMEASURED_OPTIMISM = 0.9  # an unmeasured node is assumed this fraction of the best measured cost
DEFAULT_OVERHEAD_MS = 2.0  # a remote hop's overhead before anything is measured
DEFAULT_LAYER_MS = 1.0
EXPLORE_SPREAD = 0.5  # an exploring plan scales each node's cost by a random factor in [1 - s, 1 + s]
REROUTE_RATIO = 2.0  # a generation moves only to a route this many times faster
FAILOVER_POLL_SECONDS = 0.5
IMPATIENT_WAIT_SECONDS = 2.0  # the wait for a route when a generation has produced nothing yet
EVENTS_KEPT = 50
MOVES_KEPT = 4096  # sessions leaving nodes said they handed on, newest kept


@dataclass
class NodeLatency:
    """Moving averages of one node's decode hops, as the head measured them."""

    local: bool = False
    latency_ms: float | None = None  # end to end
    overhead_ms: float | None = None  # end to end minus the node's own compute
    layer_ms: float | None = None  # compute per layer
    last_ms: float | None = None
    samples: int = 0
    failures: int = 0
    updated: float | None = None  # monotonic clock

    def measurement(self, now: float) -> NodeMeasurement:
        return NodeMeasurement(
            local=self.local, latency_ms=self.latency_ms, overhead_ms=self.overhead_ms, layer_ms=self.layer_ms,
            last_ms=self.last_ms, samples=self.samples, failures=self.failures,
            age_seconds=None if self.updated is None else round(now - self.updated, 3),
        )


def _ema(previous: float | None, sample: float) -> float:
    return sample if previous is None else (1 - EMA_WEIGHT) * previous + EMA_WEIGHT * sample


class LatencyModel:
    """Per-node decode-step latency, and the expected cost of a hop from it."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, stale_after: float = STALE_SECONDS) -> None:
        self.nodes: dict[str, NodeLatency] = {}
        self._clock = clock
        self._stale_after = stale_after

    def observe(self, url: str, *, layers: int, total_ms: float, compute_ms: float | None,
                local: bool = False) -> None:
        n = self.nodes.setdefault(url, NodeLatency(local=local))
        if compute_ms is None or not 0.0 <= compute_ms <= total_ms:
            compute_ms = total_ms  # a node that does not say: count it all as compute
        n.latency_ms = _ema(n.latency_ms, total_ms)
        n.overhead_ms = _ema(n.overhead_ms, total_ms - compute_ms)
        n.layer_ms = _ema(n.layer_ms, compute_ms / max(layers, 1))
        n.last_ms, n.samples, n.updated = total_ms, n.samples + 1, self._clock()

    def failed(self, url: str) -> None:
        n = self.nodes.setdefault(url, NodeLatency())
        n.failures += 1
        n.updated = None  # what was measured before the failure says nothing about the node now

    def fresh(self, url: str) -> NodeLatency | None:
        n = self.nodes.get(url)
        if n is None or n.updated is None or self._clock() - n.updated > self._stale_after:
            return None
        return n

    def cost(self, candidate: Candidate, layers: int) -> float:
        """Expected milliseconds of one decode step running ``layers`` layers on ``candidate``."""
        n = self.fresh(candidate.url)
        if n is None:
            overhead, layer_ms = self._prior(local=candidate.local)
        else:
            overhead, layer_ms = n.overhead_ms, n.layer_ms
        return (overhead + layers * layer_ms) * (1.0 + candidate.busy)

    def _prior(self, *, local: bool) -> tuple[float, float]:
        fresh = [n for url in self.nodes if (n := self.fresh(url)) is not None]
        layer_ms = min((n.layer_ms for n in fresh), default=DEFAULT_LAYER_MS / UNMEASURED_OPTIMISM)
        overheads = [n.overhead_ms for n in fresh if not n.local]
        overhead = 0.0 if local else min(overheads, default=DEFAULT_OVERHEAD_MS / UNMEASURED_OPTIMISM)
        return overhead * UNMEASURED_OPTIMISM, layer_ms * UNMEASURED_OPTIMISM

    def measured(self, route: list[Hop], *, besides: set[str] = frozenset()) -> bool:
        """Whether every node of ``route`` has a fresh measurement (nodes in ``besides`` need none)."""
        return all(h.url in besides or self.fresh(h.url) is not None for h in route)

    def snapshot(self) -> dict[str, NodeMeasurement]:
        now = self._clock()
        return {url: n.measurement(now) for url, n in self.nodes.items()}


class RoutePlanner:
    """The head's routes: planning, exploring, and re-planning after a failure."""

    def __init__(self, local: Callable[[], Candidate], peers: PeerDirectory, num_layers: int, *,
                 explore: float = 0.1, failover_wait: float = 30.0, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_hop: Callable[[Hop, str | None, float], None] | None = None) -> None:
        self._local = local
        self.peers = peers
        self.num_layers = num_layers
        self.explore = explore
        self.failover_wait = failover_wait
        self.on_hop = on_hop  # told every hop's (mode, milliseconds): metrics
        self.latency = LatencyModel(clock=clock)
        self._rng = rng or random.Random()
        self.clock = clock
        self.events: deque[RouteEvent] = deque(maxlen=EVENTS_KEPT)
        self.failovers = 0
        self.reroutes = 0
        self.route: list[Hop] = []  # the route most recently planned, for /v1/route
        self.http: aiohttp.ClientSession | None = None  # for polling peers while a route is missing
        self.error: str | None = None
        self.planned_at: float | None = None
        self._moves: OrderedDict[tuple[str, str], str] = OrderedDict()  # (node, session id) -> the node it went to

    def candidates(self) -> list[Candidate]:
        return [self._local()] + self.peers.candidates()

    def plan(self, *, explore: bool = True) -> list[Hop]:
        """The best route from what is known now (maybe an exploring one); remembered for /v1/route."""
        cost = self.latency.cost
        if explore and self.explore > 0 and self._rng.random() < self.explore:
            factors: dict[str, float] = {}

            def cost(candidate: Candidate, layers: int) -> float:
                factor = factors.setdefault(candidate.url, 1 + self._rng.uniform(-EXPLORE_SPREAD, EXPLORE_SPREAD))
                return self.latency.cost(candidate, layers) * factor

        self.planned_at = time.time()
        try:
            self.route = plan_route(self.candidates(), self.num_layers, cost)
        except RouteUnavailable as exc:
            self.route, self.error = [], exc.message
            raise
        self.error = None
        return self.route

    async def plan_for_request(self) -> list[Hop]:
        """A route for a new generation: fails fast, after one fresh look at the peers, if none covers every layer."""
        try:
            return self.plan()
        except RouteUnavailable:
            await self._refresh_peers()  # perhaps a peer came up since the last poll
            return self.plan()

    async def _refresh_peers(self) -> None:
        if self.http is not None:
            await self.peers.refresh(self.http)

    def observe(self, hop: Hop, *, mode: str | None, total_ms: float, compute_ms: float | None) -> None:
        if self.on_hop is not None:
            self.on_hop(hop, mode, total_ms)
        # a route's cost is its decode step: prefills and stateless steps scale with the sequence instead
        if mode == "decode":
            self.latency.observe(hop.url, layers=hop.layers, total_ms=total_ms, compute_ms=compute_ms,
                                 local=hop.local)

    async def failover(self, failed: Hop, failure: HopFailed, *, session_id: str, position: int,
                       patient: bool = True) -> list[Hop]:
        """Leave out the node that failed (``failure`` says how) and find a route without it.

        When no live node covers the failed node's layers, wait for one (a restart) for up to
        ``failover_wait`` seconds if ``patient`` (a generation under way is worth waiting for), else
        only a couple of seconds (a client that has nothing yet gets its error quickly).
        """
        self.failovers += 1
        self.peers.mark_down(failed.url, failure.message)
        self.latency.failed(failed.url)
        wait = self.failover_wait if patient else min(self.failover_wait, IMPATIENT_WAIT_SECONDS)
        deadline = self.clock() + wait
        while True:
            try:
                route = self.plan(explore=False)
            except RouteUnavailable as exc:
                if self.clock() >= deadline:
                    self._event("no_route", session_id, failed=failed.url, reason=exc.message, position=position,
                                code=None if exc.layers is None else "no_node_for_layers", layers=exc.layers)
                    raise
                await asyncio.sleep(FAILOVER_POLL_SECONDS)
                await self._refresh_peers()
                continue
            self._event("failover", session_id, failed=failed.url, reason=failure.message, position=position,
                        route=route, code=failure.reason, status=failure.status)
            return route

    def sessions_moved(self, url: str, moved: dict[str, str]) -> None:
        """A leaving node handed these sessions (id -> node) on: generations whose hop it was go on there."""
        for session_id, to in moved.items():
            self._moves[(url, session_id)] = to
            self._moves.move_to_end((url, session_id))
        while len(self._moves) > MOVES_KEPT:
            self._moves.popitem(last=False)

    def moved_to(self, url: str, session_id: str) -> str | None:
        """Where the node at ``url`` said it handed ``session_id`` when it left, if it did."""
        return self._moves.get((url, session_id))

    def replacement(self, failed: Hop, *, verifies: bool, moved_to: str | None = None) -> Hop | None:
        """A live node other than ``failed``'s that can run exactly its layers in its place (from its start layer
        to its end, keeping a cache, taking verify steps where asked): ``moved_to``, the node the failed one
        handed the session to, where it can; else the fastest as measured; None if none."""
        def fits(c: Candidate) -> bool:
            return (c.url != failed.url and c.takes_over(failed.start_layer, failed.end_layer)
                    and (c.verifies or not verifies))

        own = self._local()
        if own.url == moved_to and fits(own):  # the session was handed to this very node: its hop becomes local
            return Hop(own.url, failed.start_layer, failed.end_layer, kv_cache=True, local=True,
                       verifies=own.verifies)
        options = [c for c in self.peers.candidates() if fits(c)]
        if not options:
            return None
        best = next((c for c in options if c.url == moved_to), None) or \
            min(options, key=lambda c: self.latency.cost(c, failed.layers))
        return Hop(best.url, failed.start_layer, failed.end_layer, kv_cache=True, verifies=best.verifies)

    def replacement_chain(self, failed: Hop, *, verifies: bool) -> list[Hop] | None:
        """Live nodes other than ``failed``'s that run exactly its layers in its place as a chain of several hops
        (where no one node can: the mesh is split otherwise there), the cheapest as measured; None if none."""
        start, end = failed.start_layer, failed.end_layer
        shifted = [Candidate(c.url, max(c.start, start) - start, c.end - start, kv_cache=True, verifies=c.verifies,
                             busy=c.busy)
                   for c in self.peers.candidates()
                   if c.url != failed.url and c.kv_cache and c.start < end and start < c.end <= end
                   and (c.verifies or not verifies)]
        try:
            chain = plan_route(shifted, end - start, self.latency.cost)
        except RouteUnavailable:
            return None
        return [Hop(h.url, h.start_layer + start, h.end_layer + start, kv_cache=True, verifies=h.verifies)
                for h in chain]

    def replaced(self, failed: Hop, failure: HopFailed, route: list[Hop], *, session_id: str,
                 position: int) -> None:
        """``failed``'s hop was given to another node, prefilled alone: a failover like any other."""
        self.failovers += 1
        self.peers.mark_down(failed.url, failure.message)
        self.latency.failed(failed.url)
        self.route = route
        self._event("failover", session_id, failed=failed.url, reason=failure.message, position=position,
                    route=route, code=failure.reason, status=failure.status)

    def reroute(self, route: list[Hop], *, session_id: str, position: int) -> list[Hop] | None:
        """A far faster, fully measured route than ``route``, or None to stay (a change costs a re-prefill)."""
        candidates = self.candidates()
        current = route_cost(route, candidates, self.latency.cost)
        try:
            best = plan_route(candidates, self.num_layers, self.latency.cost)
        except RouteUnavailable:
            return None
        if best == route or current is None or not self.latency.measured(best, besides={h.url for h in route}):
            return None
        if route_cost(best, candidates, self.latency.cost) * REROUTE_RATIO > current:
            return None
        self.reroutes += 1
        self.route = best
        self._event("reroute", session_id, reason=f"expected {current:.1f} ms per step on the old route",
                    position=position, route=best, code="slower_route", step_ms=round(current, 1))
        return best

    def _event(self, kind: str, session_id: str, *, reason: str, position: int, failed: str | None = None,
               route: list[Hop] | None = None, **detail: Any) -> None:
        """Record a route change; ``detail``: its ``code`` and the fields that code fills (see ``RouteEvent``)."""
        self.events.append(RouteEvent(time=time.time(), kind=kind, session_id=session_id, reason=reason,
                                      position=position, failed=failed, route=list(route or []), **detail))

    def peer_changed(self, kind: str, url: str, sentence: str, layers: tuple[int, int] | None = None) -> None:
        """A node joined, left, went down or was forgotten (``PeerDirectory.on_change``): kept with the route's
        events, as the nodes a route can take changed."""
        self.events.append(RouteEvent(time=time.time(), kind=kind, reason=sentence, node=url, code=kind,
                                      layers=layers))

    def info(self) -> RouteInfo:
        """The current route with each hop's measurements, every measured node, and the recent route changes."""
        latency = self.latency.snapshot()
        hops = []
        for h in self.route:
            m = latency.get(h.url) or NodeMeasurement()
            hops.append(RouteHopInfo(
                h.url, h.start_layer, h.end_layer, h.kv_cache, h.local, m.latency_ms, overhead_ms=m.overhead_ms,
                compute_ms=m.layer_ms * h.layers if m.layer_ms is not None else None, samples=m.samples,
            ))
        return RouteInfo(hops=hops, error=self.error, planned_at=self.planned_at, nodes=latency,
                         events=list(self.events), failovers=self.failovers, reroutes=self.reroutes)
