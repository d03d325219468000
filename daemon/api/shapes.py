"""The JSON shapes meshd serves and the console reads, as dataclasses both sides use.

``GET /v1/status`` -> :class:`NodeStatus`, ``GET /v1/sessions`` -> :class:`SessionList`,
``GET /v1/route`` -> :class:`RouteInfo`, and the ``meshnet`` block of a chat answer ->
:class:`GenerationStats`. Layer ranges are half-open ``[start, end)`` here; people see them
inclusive (``0-14``).

Each shape writes itself with ``to_dict`` and reads itself with ``from_dict``. Reading is
lenient: unknown keys are ignored and missing ones take their defaults, so a console can read
a node one version older or newer than itself.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

_Shape = TypeVar("_Shape")

MIN_TEMPERATURE = 1e-5  # below this, logits / temperature overflows: such a temperature means greedy


def format_layers(start: int, end: int) -> str:
    """Inclusive, as on the command line: ``[0, 15)`` -> ``"0-14"``."""
    return f"{start}-{end - 1}"


def parse_layers(text: str, *, num_layers: int | None = None) -> tuple[int, int]:
    """Parse an inclusive ``A-B`` (or a single ``A``) into a half-open ``(A, B + 1)``."""
    parts = text.strip().split("-")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"layer range must look like 0-14, got {text!r}")
    start, last = int(parts[0]), int(parts[-1])
    if last < start:
        raise ValueError(f"layer range {text!r} ends before it starts")
    if num_layers is not None and last >= num_layers:
        raise ValueError(f"layer range {text!r} goes past the model's last layer {num_layers - 1}")
    return start, last + 1


def _known(cls: type[_Shape], data: dict[str, Any], **converted: Any) -> _Shape:
    """``cls`` from the keys of ``data`` it knows, with ``converted`` values (nested shapes) replacing raw ones."""
    names = {f.name for f in fields(cls)}
    return cls(**({k: v for k, v in data.items() if k in names} | converted))


def _many(cls, items) -> list:
    return [cls.from_dict(item) for item in items or [] if isinstance(item, dict)]


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Sampling:
    """How the tail picks each token. ``temperature == 0`` (or ``top_k == 1``) is greedy.

    Sampling is seeded per position: the draw for the token at position ``p`` depends only on
    ``(seed, p)``, so a re-prefill reproduces the tokens an uninterrupted run would have.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    # added later: sent to a tail only when not at their defaults, so an older tail sees the old header
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # transformers': over the prompt's and the answer's tokens
    presence_penalty: float = 0.0  # OpenAI's: over the answer's tokens only, like frequency_penalty
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: none; N: the chosen token's log-probability and the N best

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether the tail needs the tokens so far (see ``daemon.wire.History``)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_wire(self) -> dict[str, Any]:
        """The tail's ``X-Meshnet-Sampling``: the first four always, the later ones only when set."""
        later = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                 "logprobs": None}
        return {k: v for k, v in asdict(self).items() if k not in later or v != later[k]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sampling:
        return _known(cls, data)


@dataclass(frozen=True)
class Hop:
    """One node on a route and the layers ``[start_layer, end_layer)`` it runs there."""

    url: str
    start_layer: int
    end_layer: int
    kv_cache: bool = True
    local: bool = False  # the head's own layers: no HTTP
    verifies: bool = False  # takes verify steps (speculative decoding): says "speculation" in its status

    @property
    def layers(self) -> int:
        return self.end_layer - self.start_layer

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Hop:
        return _known(cls, data)


@dataclass
class StoreStats:
    """A snapshot of a node's session cache store: its size, limits and counters."""

    sessions: int = 0
    bytes: int = 0
    max_sessions: int = 0
    max_bytes: int | None = None
    ttl_seconds: float = 0.0
    hits: int = 0
    misses: int = 0
    misses_by_reason: dict[str, int] = field(default_factory=dict)
    evictions: dict[str, int] = field(default_factory=dict)  # by reason: ttl, lru, bytes, dropped

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StoreStats:
        return _known(cls, data)


@dataclass
class ModelSummary:
    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    fingerprint: str


@dataclass
class PeerSummary:
    url: str
    up: bool
    start: int | None = None
    end: int | None = None
    last_seen: float | None = None
    error: str | None = None
    learned_from: str | None = None  # None: a seed or added by the operator; else the peer that reported it

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PeerSummary:
        return _known(cls, data)


@dataclass
class MemoryInfo:
    """A node's memory as its process sees it: the peak of its resident set (``VmHWM``) is what sizing
    a machine must allow for; a GPU node also reports the peak its device allocated."""

    peak_rss_bytes: int | None = None
    rss_bytes: int | None = None
    device_peak_bytes: int | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryInfo:
        return _known(cls, data)


@dataclass
class NodeStatus:
    url: str
    version: str
    model: ModelSummary
    start: int
    end: int
    roles: list[str]
    kv_cache_enabled: bool
    supports_kv_cache: bool
    threads: int
    active_generations: int
    active_steps: int
    weights_bytes: dict[str, int]
    store: StoreStats
    peers: list[PeerSummary]
    time: float
    started_at: float = 0.0
    steps_served: int = 0  # /forward steps run here, for any head: a node's load over time
    tokens_served: int = 0  # token positions those steps ran through this node's layers
    generations: int = 0  # generations this node ran as head
    tokens_generated: int = 0  # tokens those generations produced
    node_id: str = ""  # random per run: tells one node apart from its other addresses
    busy: float = 0.0  # share of the last 10 s spent computing steps, 0..1
    draining: bool = False  # shutting down: finishing its generations, taking no new work
    dtype: str = ""  # the compute dtype of its weights, caches and activations
    device: str = ""  # where they live: cpu, cuda:0, mps
    quantize: str | None = None  # the decoder layers' weights: int8, or as the dtype says
    memory: MemoryInfo = field(default_factory=MemoryInfo)
    context_length: int = 0  # tokens the model can attend to, prompt and answer together; 0: not reported
    max_tokens_cap: int = 0  # the most new tokens a chat request may ask this node (as head) for; 0: not reported
    speculation: bool = False  # takes verify steps of drafted tokens and cuts them back (X-Meshnet-Draft)

    @property
    def layers(self) -> str:
        return format_layers(self.start, self.end)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"layers": self.layers}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodeStatus:
        return _known(cls, data, model=ModelSummary(**data["model"]),
                      store=StoreStats.from_dict(data.get("store") or {}),
                      peers=_many(PeerSummary, data.get("peers")),
                      memory=MemoryInfo.from_dict(data.get("memory") or {}))


@dataclass
class SessionInfo:
    session_id: str
    past_len: int
    start_layer: int
    bytes: int
    created_at: float
    last_used: float
    expires_at: float
    retained: bool = False  # a finished generation's session kept as a prefix; past_len: the tokens it holds


@dataclass
class SessionList:
    """A node's live KV sessions, with the node's clock so TTLs can count down locally."""

    time: float
    sessions: list[SessionInfo] = field(default_factory=list)
    store: StoreStats = field(default_factory=StoreStats)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SessionList:
        return cls(
            time=data["time"],
            sessions=[SessionInfo(**s) for s in data.get("sessions", [])],
            store=StoreStats.from_dict(data.get("store") or {}),
        )


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
}


@dataclass
class RouteEvent:
    """A change of a head's route: a ``failover``, a ``reroute``, or ``no_route`` (none covered every layer).

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
