"""Stand-ins for the console's tests: fixed daemon answers (the shapes of ``daemon.api`` with fixed values and
times), a frozen clock, a local mesh that never finishes loading, and a fake node served by meshd's real
aiohttp application (its real handlers, middlewares and mesh token), so the console talks to the real HTTP
surface without a model."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from aiohttp import web

from daemon.api import (
    GenerationStats,
    Hop,
    MemoryInfo,
    ModelSummary,
    NodeMeasurement,
    NodeStatus,
    PeerSummary,
    RouteEvent,
    RouteHopInfo,
    RouteInfo,
    SessionInfo,
    SessionList,
    StoreStats,
)
from daemon.errors import BadRequest
from daemon.mesh.generation import TokenEvent
from daemon.mesh.head import ChatRequest, Generation
from daemon.metrics import Metrics
from daemon.server.app import create_app

NOW = 1_750_000_000.0  # the frozen clock of every console test
HEAD = "http://127.0.0.1:7070"
WORKER = "http://127.0.0.1:7071"
REPLICA = "http://127.0.0.1:7072"  # hosts the worker's layers too
TOKEN = "s3cret-mesh-token-0123"
MODEL = ModelSummary("SmolLM2-135M-Instruct", "llama", 30, 576, "9f3c2a")


class FrozenClock:
    """A clock that moves only when a test says so."""

    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def store(sessions: int, nbytes: int, *, hits: int = 0, misses: int = 0, evictions: dict | None = None) -> StoreStats:
    return StoreStats(
        sessions=sessions, bytes=nbytes, max_sessions=8, max_bytes=None, ttl_seconds=600.0,
        hits=hits, misses=misses, misses_by_reason={"unknown_session": misses},
        evictions={"ttl": 0, "lru": 0, "bytes": 0, "dropped": 0} | (evictions or {}),
    )


def node_status(url: str, start: int, end: int, *, peers: list[str] = (), time: float = NOW,
                tokens_served: int = 0, steps_served: int = 0, active_steps: int = 0,
                active_generations: int = 0, sessions: int = 0, kv_cache: bool = True,
                model: ModelSummary = MODEL, draining: bool = False, max_tokens_cap: int = 4096,
                context_length: int = 8192) -> NodeStatus:
    roles = ["head", "tail"] if end == model.num_layers else ["head"]
    weights = (end - start) * 7_000_000 + (56_623_104 if start == 0 else 0)  # bfloat16 layers, embeddings on the head
    return NodeStatus(
        url=url, version="0.1.0", model=model, start=start, end=end, roles=roles,
        kv_cache_enabled=kv_cache, supports_kv_cache=True, threads=1,
        active_generations=active_generations, active_steps=active_steps,
        weights_bytes={"layers": weights}, store=store(sessions, sessions * 1_400_000),
        peers=[PeerSummary(p, True, last_seen=time) for p in peers], time=time, started_at=NOW - 3600,
        steps_served=steps_served, tokens_served=tokens_served, draining=draining, dtype="bfloat16", device="cpu",
        memory=MemoryInfo(peak_rss_bytes=420 * 2**20 + weights, rss_bytes=400 * 2**20 + weights),
        max_tokens_cap=max_tokens_cap, context_length=context_length,
    )


def session(session_id: str, past_len: int, start_layer: int, *, idle: float, ttl_left: float,
            layers: int = 15, time: float = NOW, retained: bool = False) -> SessionInfo:
    last_used = time - idle
    return SessionInfo(session_id, past_len, start_layer, past_len * 1536 * layers, last_used - 30, last_used,
                       time + ttl_left, retained=retained)


def session_list(sessions: list[SessionInfo], *, time: float = NOW, hits: int = 0, misses: int = 0,
                 evictions: dict | None = None) -> SessionList:
    total = sum(s.bytes for s in sessions)
    return SessionList(time=time, sessions=sessions,
                       store=store(len(sessions), total, hits=hits, misses=misses, evictions=evictions))


def two_node_route(*, latency: tuple[float | None, float | None] = (1.8, 6.4),
                   overhead: tuple[float | None, float | None] = (0.2, 1.3)) -> RouteInfo:
    """The head's route over its own layers and the worker's, with each hop's decode-step latency and overhead."""
    hops = []
    for (url, start, end, local), total, wire in zip([(HEAD, 0, 15, True), (WORKER, 15, 30, False)], latency, overhead):
        compute = None if total is None or wire is None else total - wire
        hops.append(RouteHopInfo(url, start, end, True, local, total, overhead_ms=wire, compute_ms=compute,
                                 samples=120 if total is not None else 0))
    return RouteInfo(hops=hops, planned_at=NOW - 12)


def failover_route() -> RouteInfo:
    """The head's route after the replica on :7072 died mid-answer and :7071 took its layers over,
    with an earlier reroute and a failure to find a route that a restart then cured."""
    hops = [RouteHopInfo(HEAD, 0, 15, True, True, 1.9, overhead_ms=0.2, compute_ms=1.7, samples=212),
            RouteHopInfo(WORKER, 15, 30, True, False, 7.1, overhead_ms=1.4, compute_ms=5.7, samples=40)]
    local_hop = Hop(HEAD, 0, 15, kv_cache=True, local=True)
    worker_hop = Hop(WORKER, 15, 30, kv_cache=True, local=False)
    replica_hop = Hop(REPLICA, 15, 30, kv_cache=True, local=False)
    events = [
        RouteEvent(time=NOW - 700, kind="no_route", session_id="9e0d", failed=WORKER, position=12,
                   reason="no live node serves layers 15-29 of 0-29; start a node with --layers covering them or "
                          "add it with --peer", code="no_node_for_layers", layers=(15, 30)),
        RouteEvent(time=NOW - 310, kind="reroute", session_id="77ab", failed=None, position=131,
                   reason="expected 14.9 ms per step on the old route", route=[local_hop, replica_hop],
                   code="slower_route", step_ms=14.9),
        RouteEvent(time=NOW - 29, kind="failover", session_id="5d1e", failed=REPLICA, position=45,
                   reason=f"{REPLICA} is unreachable: ClientConnectorError: Cannot connect to host 127.0.0.1:7072 "
                          "ssl:default [Connect call failed ('127.0.0.1', 7072)]", route=[local_hop, worker_hop],
                   code="unreachable"),
    ]
    nodes = {HEAD: NodeMeasurement(local=True, latency_ms=1.9, overhead_ms=0.2, layer_ms=0.11, samples=212,
                                   failures=0, age_seconds=0.4),
             WORKER: NodeMeasurement(local=False, latency_ms=7.1, overhead_ms=1.4, layer_ms=0.38, samples=40,
                                     failures=1, age_seconds=0.4),
             REPLICA: NodeMeasurement(local=False, latency_ms=None, overhead_ms=None, layer_ms=None, samples=171,
                                      failures=1, age_seconds=None)}
    return RouteInfo(hops=hops, planned_at=NOW - 29, nodes=nodes, events=events, failovers=2, reroutes=1)


HEAD_SESSIONS = [
    session("5d1e0c9a7b3f2e4d6c8a0b1c", 48, 0, idle=3, ttl_left=597),
    session("a04f7e2d9c1b3a5e7f9d0c2b", 212, 0, idle=545, ttl_left=55, retained=True),  # an earlier answer's prefix
]
WORKER_SESSIONS = [
    session("5d1e0c9a7b3f2e4d6c8a0b1c", 48, 15, idle=3, ttl_left=597),
]


class StartingMesh:
    """A local mesh that is still loading: it reports start-up lines and never finishes."""

    head_url = HEAD
    urls = [HEAD, WORKER]

    def __init__(self, lines: list[tuple[str, str]]) -> None:
        self.lines = lines
        self.stopped = 0

    async def start(self, progress) -> None:
        for node, line in self.lines:
            progress(node, line)
        await asyncio.Event().wait()

    def stop(self) -> None:
        self.stopped += 1


# ---- a fake node behind meshd's real application ------------------------------------------------


def chat_tokens(messages: list[dict]) -> int:
    """What a chat's messages cost in tokens, as the fake head counts them: one a word, four more a message."""
    return sum(4 + len(m["content"].split()) for m in messages)


class ScriptedHead:
    """A head whose every generation streams the same scripted answer (``daemon.server.backend.ChatHead``).

    ``hold_after``: stop after that many tokens until :attr:`release` is set (it notices a client that left).
    ``clock`` and ``steps`` move a frozen clock before each chunk of the stream (the opening one, every token,
    the closing one), cycling through ``steps``.

    Like the real head it keeps a finished answer's conversation on the nodes (a retained prefix): a prompt
    that starts with it reports those tokens as cached. Tokens are counted by :func:`chat_tokens`.
    """

    model_name = MODEL.name
    model_names = [MODEL.name]
    max_tokens_cap = 4096

    def __init__(self, answer: list[str], *, hold_after: int | None = None, stats: dict | None = None,
                 clock: FrozenClock | None = None, steps: tuple[float, ...] = (0.1,)) -> None:
        self.answer = list(answer)
        self.hold_after = hold_after
        stats = dict(stats or {})
        self.rate = stats.pop("decode_tokens_per_second", 42.0)
        self.stats = {"prefill_ms": 12.0, "first_token_ms": 15.0} | stats  # set on the stats once all is sent
        self.clock, self.steps = clock, steps
        self.release = asyncio.Event()
        self.client_left = asyncio.Event()  # a held stream noticed the console closing it
        self.requests: list[ChatRequest] = []
        self.retained: list[dict] = []  # the messages and answer of the last answer that finished

    @contextlib.asynccontextmanager
    async def generate(self, request: ChatRequest) -> AsyncIterator[Generation]:
        self.requests.append(request)
        prompt = chat_tokens(request.messages)
        held = self.retained and request.messages[:len(self.retained)] == self.retained
        cached = chat_tokens(self.retained) if held else 0
        stats = GenerationStats(session_id="5d1e0c9a7b3f2e4d6c8a0b1c", prompt_tokens=prompt, cached_tokens=cached,
                                prompt_computed_tokens=prompt - cached)
        events = self._events(request, stats)
        async with contextlib.aclosing(events):
            yield Generation(stats, events, model=self.model_name)

    async def _events(self, request: ChatRequest, stats: GenerationStats) -> AsyncIterator[TokenEvent]:
        self._tick(0)  # the opening chunk
        try:
            for i, text in enumerate(self.answer):
                await self._next_chunk(i)
                stats.completion_tokens = i + 1
                yield TokenEvent(i, text)
            await self._next_chunk(len(self.answer))  # the closing chunk
        except (GeneratorExit, asyncio.CancelledError):
            self.client_left.set()
            raise
        for name, value in self.stats.items():
            setattr(stats, name, value)
        stats.decode_seconds = max(stats.completion_tokens - 1, 0) / self.rate
        stats.finish_reason = stats.finish_reason or "stop"
        self.retained = [*request.messages, {"role": "assistant", "content": "".join(self.answer)}]

    async def _next_chunk(self, tokens_sent: int) -> None:
        """Hold (if asked to here), then move the clock for the next chunk."""
        if tokens_sent == self.hold_after:
            await self.release.wait()
        self._tick(tokens_sent + 1)

    def _tick(self, chunk: int) -> None:
        if self.clock is not None:
            self.clock.advance(self.steps[chunk % len(self.steps)])


class NoLayers:
    """``/forward`` on a fake node: it hosts layer ranges for the console but runs none."""

    hidden_size = MODEL.hidden_size

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    async def forward(self, request):
        raise BadRequest("this fake node runs no layers")


class FakeNode:
    """Fixed answers for the console's endpoints (``daemon.server.backend.NodeBackend``), and a record of
    what it was asked to change."""

    def __init__(self, start: int, end: int, *, peers: list[str] = (), sessions=(), head: ScriptedHead) -> None:
        self.url = ""  # known once served
        self.service = NoLayers(start, end)
        self.head = head
        self.peers = list(peers)
        self.session_infos = list(sessions)
        self.metrics = Metrics(lambda: session_list(self.session_infos).store)
        self.draining = False
        self.forwards_in_flight = 0
        self.deleted: list[str] = []
        self.peer_requests: list[tuple[str, str]] = []

    def status(self) -> NodeStatus:
        return node_status(self.url, self.service.start, self.service.end, peers=self.peers,
                           sessions=len(self.session_infos))

    def sessions(self) -> SessionList:
        return session_list(self.session_infos)

    def drop_session(self, session_id: str) -> bool:
        self.deleted.append(session_id)
        before = len(self.session_infos)
        self.session_infos = [s for s in self.session_infos if s.session_id != session_id]
        return len(self.session_infos) < before

    def retain_session(self, session_id: str, past_len: int | None = None) -> bool:
        found = [s for s in self.session_infos if s.session_id == session_id]
        for info in found:
            info.retained = True
        return bool(found)

    def route(self, *, refresh: bool) -> RouteInfo:
        return RouteInfo(hops=[RouteHopInfo(self.url, self.service.start, self.service.end, True, True, 1.0)])

    async def add_peer(self, url: str) -> list[PeerSummary]:
        self.peer_requests.append(("add", url))
        self.peers.append(url)
        return [PeerSummary(p, True) for p in self.peers]

    def remove_peer(self, url: str) -> bool:
        self.peer_requests.append(("remove", url))
        if url not in self.peers:
            return False
        self.peers.remove(url)
        return True

    async def session_moved_to(self, session_id: str | None) -> str | None:
        return None  # it holds no sessions to hand on

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        yield


class FakeDaemon:
    """A :class:`FakeNode` served by meshd's own ``create_app`` on 127.0.0.1 (with the mesh token when given),
    recording the Authorization header of every request and the body of every chat request it accepted."""

    def __init__(self, start: int, end: int, *, peers: list[str] = (), sessions=(),
                 answer: list[str] = ("Hello", " from", " the", " **mesh**."), hold_after: int | None = None,
                 token: str | None = None, stats: dict | None = None) -> None:
        self.head = ScriptedHead(list(answer), hold_after=hold_after, stats=stats)
        self.node = FakeNode(start, end, peers=peers, sessions=sessions, head=self.head)
        self.token = token
        self.authorizations: list[tuple[str, str | None]] = []  # (path, Authorization header) of each request
        self.chat_requests: list[dict] = []
        self.port: int | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def deleted(self) -> list[str]:
        return self.node.deleted

    @property
    def peer_requests(self) -> list[tuple[str, str]]:
        return self.node.peer_requests

    @property
    def release(self) -> asyncio.Event:
        return self.head.release

    @property
    def client_left(self) -> asyncio.Event:
        return self.head.client_left

    async def start(self) -> None:
        """Listen (again) on 127.0.0.1; a restart keeps the port, as a restarted daemon would."""
        app = create_app(self.node, token=self.token)
        app.middlewares.insert(0, self._record_authorization)  # outermost: refused requests count too
        app.middlewares.append(self._record_chat)  # innermost: only what the real middlewares let through
        # a held stream sends nothing, so only a cancelled handler tells it that the console left
        self._runner = web.AppRunner(app, shutdown_timeout=0.5, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port or 0).start()
        self.port = self._runner.addresses[0][1]
        self.node.url = self.url

    async def stop(self) -> None:
        if self._runner is not None:
            self.head.release.set()
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _record_authorization(self, request: web.Request, handler):
        self.authorizations.append((request.path, request.headers.get("Authorization")))
        return await handler(request)

    @web.middleware
    async def _record_chat(self, request: web.Request, handler):
        if request.path == "/v1/chat/completions":
            self.chat_requests.append(json.loads(await request.read()))
        return await handler(request)

