"""JSON shapes of the endpoints the console reads. No torch, no aiohttp.

``GET /v1/status`` -> :class:`NodeStatus`, ``GET /v1/sessions`` -> :class:`SessionList`,
``GET /v1/route`` -> :class:`RouteInfo`. Layer ranges are half-open ``[start, end)``
here; people see them inclusive (``0-14``).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

# the mesh token: printable ASCII without spaces (it travels in an HTTP header), 16-256 characters
TOKEN_PATTERN = re.compile(r"[!-~]{16,256}")
TOKEN_RULE = "16-256 printable ASCII characters without spaces"


def auth_headers(token: str | None) -> dict[str, str]:
    """The header that carries the mesh token on every request (none without a token)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


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


def normalize_url(url: str) -> str:
    """``host:port`` or a URL -> ``http://host:port`` without a trailing slash; empty is a ValueError."""
    url = url.strip().rstrip("/")
    if not url:
        raise ValueError("an empty address")
    return url if "://" in url else f"http://{url}"


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
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


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
    store: dict[str, Any]
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

    @property
    def layers(self) -> str:
        return format_layers(self.start, self.end)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"layers": self.layers}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodeStatus:
        data = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        data["model"] = ModelSummary(**data["model"])
        data["peers"] = [PeerSummary.from_dict(p) for p in data.get("peers", [])]
        return cls(**data)


@dataclass
class SessionInfo:
    session_id: str
    past_len: int
    start_layer: int
    bytes: int
    created_at: float
    last_used: float
    expires_at: float


@dataclass
class SessionList:
    """A node's live KV sessions, with the node's clock so TTLs can count down locally."""

    time: float
    sessions: list[SessionInfo] = field(default_factory=list)
    store: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SessionList:
        return cls(
            time=data["time"],
            sessions=[SessionInfo(**s) for s in data.get("sessions", [])],
            store=data.get("store", {}),
        )


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


@dataclass
class RouteInfo:
    """The head's current route (or why there is none), its latency measurements and route changes.

    ``nodes`` maps each measured node's URL to its moving averages (``latency_ms``, ``overhead_ms``,
    ``layer_ms``, ``samples``, ``failures``, ``age_seconds``); ``events`` lists recent failovers,
    reroutes and failures to find a route, newest last.
    """

    hops: list[RouteHopInfo] = field(default_factory=list)
    error: str | None = None
    planned_at: float | None = None
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    failovers: int = 0
    reroutes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RouteInfo:
        fields = RouteHopInfo.__dataclass_fields__
        return cls(
            hops=[RouteHopInfo(**{k: v for k, v in h.items() if k in fields}) for h in data.get("hops", [])],
            error=data.get("error"),
            planned_at=data.get("planned_at"),
            nodes=data.get("nodes") or {},
            events=data.get("events") or [],
            failovers=data.get("failovers", 0),
            reroutes=data.get("reroutes", 0),
        )
