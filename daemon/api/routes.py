"""What a head shows of its routing and its generations, as dataclasses both sides use.

``GET /v1/route`` -> :class:`RouteInfo` (the route, the head's measurements of each node, the route's
changes as :class:`RouteEvent`), and the ``meshnet`` block of a chat answer -> :class:`GenerationStats`.
They read and write themselves as the shapes of :mod:`daemon.api.shapes` do, leniently.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from daemon.api.shapes import Hop, Sampling, _known, _many


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class NodeMeasurement:
    """The head's moving averages of one node's decode hops (see ``daemon.mesh.planner``)."""

    local: bool = False
    latency_ms: float | None = None  # end to end
    overhead_ms: float | None = None  # end to end minus the node's own compute
    layer_ms: float | None = None  # compute per layer
    last_ms: float | None = None
    samples: int = 0
    failures: int = 0
    age_seconds: float | None = None  # since the last sample; None: nothing fresh (or it failed since)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodeMeasurement:
        return _known(cls, data)


# why a route changed, as a route event's ``code``; the fields each one fills beside ``reason``
ROUTE_EVENT_CODES: dict[str, tuple[str, ...]] = {
    "unreachable": (),  # failover: the node refused, reset or broke the exchange
    "timed_out": (),  # failover: the node did not answer in time
    "http_status": ("status",),  # failover: the node answered 5xx (a crash, a draining node)
    "no_node_for_layers": ("layers",),  # no_route: no live node serves these layers
    "slower_route": ("step_ms",),  # reroute: the old route had become far slower than another
    # the nodes this one knows (``node``): one came up (its layers), said it leaves, stopped answering, was dropped
    "joined": ("layers",),
    "left": (),
    "down": (),
    "forgotten": (),
}


@dataclass
class RouteEvent:
    """A change of a head's route: a ``failover``, a ``reroute``, or ``no_route`` (none covered every layer);
    or of the nodes it can route through (``node``): one ``joined``, ``left``, went ``down`` or was ``forgotten``.

    ``reason`` is a sentence for people and logs; ``code`` and the fields it names say it for programs.
    """

    time: float = 0.0  # the head's wall clock
    kind: str = "event"
    session_id: str = ""
    reason: str = ""
    position: int | None = None  # where the sequence was (prompt and answer tokens so far)
    failed: str | None = None  # the node whose hop failed
    route: list[Hop] = field(default_factory=list)  # the new route, if one was found
    code: str | None = None  # one of ROUTE_EVENT_CODES; None from an older head, which sends only the sentence
    status: int | None = None  # http_status: what the failed node answered
    layers: tuple[int, int] | None = None  # no_node_for_layers: the first uncovered range, half-open
    step_ms: float | None = None  # slower_route: the old route's expected milliseconds per decode step
    node: str | None = None  # joined, left, down, forgotten: the node

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RouteEvent:
        status, layers, step_ms = data.get("status"), data.get("layers"), data.get("step_ms")
        pair = layers if isinstance(layers, (list, tuple)) and len(layers) == 2 and all(map(_whole, layers)) else None
        number = _whole(step_ms) or isinstance(step_ms, float)
        checked = {
            "status": status if _whole(status) and 100 <= status <= 599 else None,
            "layers": (pair[0], pair[1]) if pair and 0 <= pair[0] < pair[1] else None,
            "step_ms": float(step_ms) if number and 0 <= step_ms < 1e9 else None,
        }
        code = data.get("code")
        needs = ROUTE_EVENT_CODES.get(code) if isinstance(code, str) else None
        # a code this reader does not know, or one without the fields it needs, reads as none: the sentence shows
        if needs is None or any(checked[name] is None for name in needs):
            code = None
        return _known(cls, data, route=_many(Hop, data.get("route")), code=code, **checked)


@dataclass
class RouteHopInfo:
    url: str
    start_layer: int
    end_layer: int
    kv_cache: bool
    local: bool
    latency_ms: float | None = None  # moving average of this hop's decode step, end to end
    overhead_ms: float | None = None  # of which wire, HTTP and queueing
    compute_ms: float | None = None  # of which the node's compute for this hop's layers
    samples: int = 0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RouteHopInfo:
        return _known(cls, data)


@dataclass
class RouteInfo:
    """The head's current route (or why there is none), its latency measurements and route changes.

    ``nodes`` maps each measured node's URL to its measurements; ``events`` lists recent failovers,
    reroutes and failures to find a route, newest last.
    """

    hops: list[RouteHopInfo] = field(default_factory=list)
    error: str | None = None
    planned_at: float | None = None
    nodes: dict[str, NodeMeasurement] = field(default_factory=dict)
    events: list[RouteEvent] = field(default_factory=list)
    failovers: int = 0
    reroutes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RouteInfo:
        nodes = data.get("nodes") or {}
        return _known(
            cls, data,
            hops=_many(RouteHopInfo, data.get("hops")),
            nodes={url: NodeMeasurement.from_dict(m) for url, m in nodes.items() if isinstance(m, dict)},
            events=_many(RouteEvent, data.get("events")),
        )


@dataclass
class HopTotals:
    """One node's share of a generation's decode steps (the steps after the first token), summed."""

    url: str
    local: bool = False
    steps: int = 0
    latency_ms: float = 0.0  # end to end, as the head measured it
    compute_ms: float = 0.0  # the node's own time, as it reported
    payload_bytes: int = 0  # activation bytes sent to a remote hop
    sent_bytes: int = 0  # whole requests on the wire: request line, headers, body
    received_bytes: int = 0  # whole responses

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HopTotals:
        return _known(cls, data)


@dataclass
class GenerationStats:
    """What one generation cost: the ``meshnet`` block of a chat answer, and the console's numbers."""

    session_id: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefills: int = 0
    reprefills: int = 0
    cache_misses: int = 0
    failovers: int = 0
    reroutes: int = 0
    span_replays: int = 0  # failovers that prefilled only the failed node's replacement, from its inputs so far
    moved_sessions: int = 0  # failovers to the node a draining node handed its session to: nothing computed again
    stateless_steps: int = 0
    cached_tokens: int = 0  # prompt tokens the nodes already held (a reused prefix), not computed again
    prompt_computed_tokens: int = 0  # positions prefilled or extended for the prompt, re-prefills included
    prefill_ms: float | None = None  # the prompt's first step: a prefill, or an extend after a reused prefix
    first_token_ms: float | None = None
    decode_seconds: float = 0.0
    finish_reason: str | None = None  # "stop", "length"; None while running or when abandoned
    sampling: Sampling | None = None  # what the tail was asked to do, with the seed it drew from
    route: list[Hop] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)  # wall time of each token after the first
    decode_hops: list[HopTotals] = field(default_factory=list)  # per node of the route
    drafted_tokens: int = 0  # speculative decoding: tokens drafted and sent to be verified
    accepted_tokens: int = 0  # ... of which the tail kept (each verify step also yields one token of its own)
    verify_steps: int = 0

    @property
    def decode_tokens_per_second(self) -> float | None:
        steps = self.completion_tokens - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else None

    def hop_totals(self, hop: Hop) -> HopTotals:
        """The running sums of ``hop``'s node, added on its first decode step."""
        for totals in self.decode_hops:
            if totals.url == hop.url:
                return totals
        totals = HopTotals(hop.url, local=hop.local)
        self.decode_hops.append(totals)
        return totals

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "decode_tokens_per_second": self.decode_tokens_per_second,
            "step_ms": [round(ms, 3) for ms in self.step_ms],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationStats:
        sampling = data.get("sampling")
        return _known(
            cls, data,
            sampling=Sampling.from_dict(sampling) if isinstance(sampling, dict) else None,
            route=_many(Hop, data.get("route")),
            decode_hops=_many(HopTotals, data.get("decode_hops")),
        )
