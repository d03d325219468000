"""What the console has learned about the mesh, as plain data: no Textual here, so it is testable alone.

Times are local clock seconds unless a name says otherwise. A node's own clock is reached through
:attr:`NodeState.clock_offset`, so TTL countdowns can tick locally between polls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from daemon.api import (
    GenerationStats,
    ModelSummary,
    NodeStatus,
    RouteEvent,
    RouteInfo,
    SessionInfo,
    SessionList,
    format_layers,
)
from meshtui.client import Usage

GRAPH_POINTS = 60  # samples kept for each tokens/s graph
LOADING_LINES = 4  # start-up lines kept per local node
ROUTE_EVENTS_SHOWN = 4


@dataclass
class NodeState:
    """One daemon as the poller last saw it. ``status`` survives a failed poll so a down node keeps its place."""

    url: str
    status: NodeStatus | None = None
    sessions: SessionList | None = None
    error: str | None = None
    http_status: int | None = None  # of the last failed poll, if the node answered one
    polled: bool = False
    last_seen: float | None = None
    clock_offset: float = 0.0  # the node's clock minus ours, measured when its session list arrived
    tokens_per_second: list[float] = field(default_factory=list)  # token positions run here, per poll interval
    steps_per_second: list[float] = field(default_factory=list)

    @property
    def up(self) -> bool:
        return self.polled and self.error is None

    @property
    def unauthorized(self) -> bool:
        """The node answered, but refused the console's mesh token (or its lack of one)."""
        return self.error is not None and self.http_status == 401

    @property
    def draining(self) -> bool:
        """Up, but shutting down: it finishes its generations and heads route nothing new through it."""
        return self.up and self.status is not None and self.status.draining

    @property
    def serving(self) -> bool:
        """Up and taking new work: what counts for coverage."""
        return self.up and not self.draining

    @property
    def live_sessions(self) -> list[SessionInfo]:
        """Sessions worth showing: a down node's list is stale, so none."""
        return self.sessions.sessions if self.up and self.sessions else []

    def record(self, status: NodeStatus | None, sessions: SessionList | None, error: str | None, now: float,
               http_status: int | None = None) -> None:
        self.polled = True
        self.error = error
        self.http_status = http_status if error is not None else None
        if error is None:
            self.last_seen = now
        if status is not None:
            self._record_rates(status)
            self.status = status
        if sessions is not None:
            self.sessions = sessions
            self.clock_offset = sessions.time - now

    def _record_rates(self, status: NodeStatus) -> None:
        previous = self.status
        if previous is None or previous.started_at != status.started_at or status.time <= previous.time:
            return  # first sight, or the daemon restarted: its counters started again from zero
        elapsed = status.time - previous.time
        tokens = max(0, status.tokens_served - previous.tokens_served) / elapsed
        steps = max(0, status.steps_served - previous.steps_served) / elapsed
        # new lists, never appended in place: a Sparkline only repaints when given a new object
        self.tokens_per_second = [*self.tokens_per_second, tokens][-GRAPH_POINTS:]
        self.steps_per_second = [*self.steps_per_second, steps][-GRAPH_POINTS:]

    def node_time(self, now: float) -> float:
        """What the node's clock reads when ours reads ``now``."""
        return now + self.clock_offset

    def ttl_left(self, session: SessionInfo, now: float) -> float:
        return max(0.0, session.expires_at - self.node_time(now))

    def idle_for(self, session: SessionInfo, now: float) -> float:
        return max(0.0, self.node_time(now) - session.last_used)

    def forget_session(self, session_id: str) -> None:
        if self.sessions is not None:
            self.sessions.sessions = [s for s in self.sessions.sessions if s.session_id != session_id]


@dataclass
class GenerationRecord:
    """One answer streamed from the head: its chunks as they arrived and the daemon's final statistics."""

    number: int
    prompt: str
    started_at: float
    text: str = ""
    chunk_times: list[float] = field(default_factory=list)  # local arrival time of each chunk with text
    stats: GenerationStats | None = None  # the daemon's ``meshnet`` block, once the last chunk came
    usage: Usage | None = None  # the OpenAI usage block, on the stream's last event
    outcome: str = "streaming"  # streaming | done | cancelled | failed
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.outcome != "streaming"

    @property
    def tokens(self) -> int:
        return (self.stats and self.stats.completion_tokens) or len(self.chunk_times)

    @property
    def prompt_reuse(self) -> tuple[int, int] | None:
        """``(cached, prompt)`` tokens: how many of the prompt's tokens the nodes held from an earlier answer.

        From the OpenAI usage block, else the ``meshnet`` one; None until either came."""
        if self.usage is not None:
            return self.usage.cached_tokens, self.usage.prompt_tokens
        if self.stats is not None:
            return self.stats.cached_tokens, self.stats.prompt_tokens
        return None

    def add_text(self, text: str, at: float) -> None:
        self.text += text
        self.chunk_times.append(at)

    def rates(self, window: int = 4) -> list[float]:
        """Tokens/s at each chunk's arrival, over the last ``window`` intervals (a chunk is about a token)."""
        times = self.chunk_times
        rates = []
        for i in range(1, len(times)):
            first = max(0, i - window)
            elapsed = times[i] - times[first]
            if elapsed > 0:
                rates.append((i - first) / elapsed)
        return rates[-GRAPH_POINTS:]

    @property
    def tokens_per_second(self) -> float | None:
        """The daemon's decode rate when it reported one, else what the chunk arrivals measured."""
        if self.stats is not None and self.stats.decode_tokens_per_second:
            return self.stats.decode_tokens_per_second
        times = self.chunk_times
        if len(times) > 1 and times[-1] > times[0]:
            return (len(times) - 1) / (times[-1] - times[0])
        return None


@dataclass(frozen=True)
class ChatLimits:
    """The head's bounds on a chat request; None where it has not reported one."""

    max_tokens: int | None = None  # new tokens one answer may ask for
    context_length: int | None = None  # prompt and answer together


@dataclass
class MeshState:
    """Everything the views draw: nodes by URL (head first), the head's route, start-up lines, chat history."""

    head_url: str | None = None
    nodes: dict[str, NodeState] = field(default_factory=dict)
    route: RouteInfo | None = None
    route_error: str | None = None
    starting: bool = False  # a local mesh is being started for us
    loading: dict[str, list[str]] = field(default_factory=dict)  # local node label -> latest start-up lines
    loading_error: str | None = None
    generations: list[GenerationRecord] = field(default_factory=list)  # every answer since the console started
    conversation: list[dict] = field(default_factory=list)  # this conversation's finished turns, as sent to the head
    conversation_start: int = 0  # generations numbered above this belong to the conversation shown
    system_prompt: str = ""  # sent first, as the ``system`` message, when set

    def set_head(self, url: str) -> None:
        self.head_url = url
        self.nodes = {url: self.nodes.get(url) or NodeState(url)} | {u: n for u, n in self.nodes.items() if u != url}

    def add_node(self, url: str) -> bool:
        if url in self.nodes:
            return False
        self.nodes[url] = NodeState(url)
        return True

    def remove_node(self, url: str) -> bool:
        if url == self.head_url:
            return False
        return self.nodes.pop(url, None) is not None

    def node_urls(self) -> list[str]:
        return list(self.nodes)

    def record_poll(self, url: str, status: NodeStatus | None, sessions: SessionList | None,
                    error: str | None, now: float, *, http_status: int | None = None) -> None:
        """Apply one node's poll; the head's peer list adds nodes the console was not told about."""
        node = self.nodes.get(url)
        if node is None:
            return  # removed while its poll was in flight
        node.record(status, sessions, error, now, http_status)
        if url == self.head_url and status is not None:
            for peer in status.peers:
                self.add_node(peer.url)

    def record_route(self, route: RouteInfo | None, error: str | None) -> None:
        self.route_error = error
        if route is not None:
            self.route = route

    @property
    def current_route(self) -> RouteInfo | None:
        """The head's route, unless the head stopped answering: then the last one known is stale."""
        return self.route if self.route_error is None else None

    def recent_route_events(self, limit: int = ROUTE_EVENTS_SHOWN) -> list[RouteChange]:
        """The head's latest failovers, reroutes and failures to find a route, newest first."""
        route = self.current_route
        if route is None:
            return []
        return [RouteChange.from_event(e) for e in reversed(route.events[-limit:])]

    @property
    def draining(self) -> int:
        return sum(n.draining for n in self.nodes.values())

    @property
    def model(self) -> ModelSummary | None:
        """The model as the head reports it, else as any node does."""
        statuses = [n.status for n in self.nodes.values() if n.status is not None]
        head = self.nodes.get(self.head_url) if self.head_url else None
        if head is not None and head.status is not None:
            return head.status.model
        return statuses[0].model if statuses else None

    @property
    def chat_limits(self) -> ChatLimits:
        """What the head lets a chat ask for, as its last status said (old nodes do not say)."""
        head = self.nodes.get(self.head_url) if self.head_url else None
        status = head.status if head is not None else None
        if status is None:
            return ChatLimits()
        return ChatLimits(max_tokens=status.max_tokens_cap or None, context_length=status.context_length or None)

    def coverage(self) -> list[int]:
        """How many serving nodes (up, not draining) host each layer of the model: 0 is a gap, above 1 an overlap."""
        model = self.model
        ranges = [(n.status.start, n.status.end) for n in self.nodes.values() if n.serving and n.status is not None]
        return layer_coverage(model.num_layers if model else 0, ranges)

    def add_loading_line(self, label: str, line: str) -> None:
        self.loading[label] = [*self.loading.get(label, []), line][-LOADING_LINES:]

    def start_generation(self, prompt: str, now: float) -> GenerationRecord:
        record = GenerationRecord(number=len(self.generations) + 1, prompt=prompt, started_at=now)
        self.generations.append(record)
        return record

    def generation(self, number: int) -> GenerationRecord | None:
        return self.generations[number - 1] if 0 < number <= len(self.generations) else None

    def conversation_messages(self) -> list[dict]:
        """The conversation as the head is sent it: the system prompt first, when there is one."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt.strip() else []
        return [*system, *self.conversation]

    def request_messages(self, prompt: str) -> list[dict]:
        """The whole conversation plus the new prompt: the head keeps no chat history of its own."""
        return [*self.conversation_messages(), {"role": "user", "content": prompt}]

    def in_conversation(self, record: GenerationRecord) -> bool:
        """Whether ``record`` belongs to the conversation shown (not to one the operator has since left)."""
        return record.number > self.conversation_start

    @property
    def conversation_records(self) -> list[GenerationRecord]:
        """This conversation's answers, oldest first, however each ended."""
        return self.generations[self.conversation_start:]

    def new_conversation(self) -> None:
        """Forget the turns (the system prompt stays); the answers stay in the Throughput view's history."""
        self.conversation = []
        self.conversation_start = len(self.generations)

    def finish_generation(self, record: GenerationRecord, outcome: str, error: str | None = None) -> None:
        record.outcome, record.error = outcome, error
        # a cancelled answer stays in the history as far as it got: it is what the operator saw
        if record.text and outcome in ("done", "cancelled") and self.in_conversation(record):
            self.conversation += [{"role": "user", "content": record.prompt},
                                  {"role": "assistant", "content": record.text}]


@dataclass(frozen=True)
class RouteChange:
    """One of the head's route changes as the console shows it: its reason cut to a few words, its route by node."""

    time: float  # the head's clock
    kind: str  # failover | reroute | no_route, or of the nodes: joined | left | down | forgotten
    failed: str | None  # the node whose hop failed
    reason: str
    position: int | None  # where the sequence was (prompt and answer tokens so far) when it happened
    route: tuple[str, ...] = ()  # the new route's nodes in order, the head's own hop as "local"
    node: str | None = None  # joined, left, down, forgotten: the node

    @classmethod
    def from_event(cls, event: RouteEvent) -> RouteChange:
        return cls(time=event.time, kind=event.kind, failed=event.failed, reason=short_reason(event),
                   position=event.position, route=tuple("local" if hop.local else hop.url for hop in event.route),
                   node=event.node)


SHORT_REASON_CHARS = 40  # an event without a code (an older head) shows this much of its sentence


def short_reason(event: RouteEvent) -> str:
    """A route event's reason in a few words, from its code: ``unreachable``, ``answered 503``, ...

    An event without a code (from an older head) shows its sentence, cut to :data:`SHORT_REASON_CHARS`.
    """
    match event.code:
        case "unreachable":
            return "unreachable"
        case "timed_out":
            return "timed out"
        case "http_status" if event.status is not None:
            return f"answered {event.status}"
        case "no_node_for_layers" if event.layers is not None:
            return f"no node for layers {format_layers(*event.layers)}"
        case "slower_route" if event.step_ms is not None:
            return f"old route {event.step_ms:.1f} ms/step"
        case "joined" if event.layers is not None:
            return f"layers {format_layers(*event.layers)}"
        case "left":
            return "stopped on its own"
        case "down":
            return "stopped answering"
        case "forgotten":
            return "down too long"
    reason = event.reason
    return reason if len(reason) <= SHORT_REASON_CHARS else reason[:SHORT_REASON_CHARS - 1] + "…"


def layer_coverage(num_layers: int, ranges: list[tuple[int, int]]) -> list[int]:
    """How many of the half-open ``ranges`` contain each layer ``0..num_layers-1``."""
    counts = [0] * num_layers
    for start, end in ranges:
        for layer in range(max(0, start), min(end, num_layers)):
            counts[layer] += 1
    return counts


def layer_runs(counts: list[int], want) -> list[tuple[int, int]]:
    """Inclusive ``(first, last)`` runs of layers whose count satisfies ``want``: gaps, overlaps."""
    runs: list[tuple[int, int]] = []
    for layer, count in enumerate(counts):
        if want(count):
            if runs and runs[-1][1] == layer - 1:
                runs[-1] = (runs[-1][0], layer)
            else:
                runs.append((layer, layer))
    return runs
