"""The JSON shapes meshd serves and the console reads, as dataclasses both sides use.

``GET /v1/status`` -> :class:`NodeStatus`, ``GET /v1/sessions`` -> :class:`SessionList`; a head's
route and what a generation along it cost are in :mod:`daemon.api.routes`. Layer ranges are
half-open ``[start, end)`` here; people see them inclusive (``0-14``).

Each shape writes itself with ``to_dict`` and reads itself with ``from_dict``. Reading is
lenient: unknown keys are ignored and missing ones take their defaults, so a console can read
a node one version older or newer than itself.
"""

from __future__ import annotations

import functools
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
        """The tail's ``X-Meshnet-Sampling``: the first four always, the later ones only when set (a copy of what
        was worked out once per sampling: a head sends it with every step)."""
        return dict(_sampling_wire(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sampling:
        return _known(cls, data)


@functools.lru_cache(maxsize=64)
def _sampling_wire(sampling: Sampling) -> dict[str, Any]:
    later = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
             "logprobs": None}
    return {k: v for k, v in asdict(sampling).items() if k not in later or v != later[k]}


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
    learned_from: str | None = None  # None: a seed or added by the operator; "announced"; else who reported it
    node_id: str | None = None  # the run of the peer's process last seen: a restarted node has another

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PeerSummary:
        return _known(cls, data)


@dataclass
class MemoryInfo:
    """A node's memory as its process sees it: the peak of its resident set (``VmHWM``) is what sizing
    a machine must allow for; ``runtime_rss_bytes`` its resident set before its first weight was read (the
    Python runtime, torch and transformers: what the process costs beyond its weights); a GPU node also
    reports the peak its device allocated."""

    peak_rss_bytes: int | None = None
    rss_bytes: int | None = None
    device_peak_bytes: int | None = None
    runtime_rss_bytes: int | None = None

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
    step_channels: int = 0  # step channels heads hold open to this node now (GET /v1/steps)
    channel_steps: int = 0  # of steps_served, those taken over a step channel

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
