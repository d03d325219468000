"""Stand-ins for the console's tests: fixed daemon answers (the shapes of ``daemon.api`` with fixed values and
times), a frozen clock, a scripted chat stream, a local mesh that never finishes loading, and a stub daemon
(which can require the mesh token, as meshd with MESHNET_TOKEN does)."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from daemon.api import (
    ModelSummary,
    NodeStatus,
    PeerSummary,
    RouteHopInfo,
    RouteInfo,
    SessionInfo,
    SessionList,
)

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


def store(sessions: int, nbytes: int, *, hits: int = 0, misses: int = 0, evictions: dict | None = None) -> dict:
    return {
        "sessions": sessions, "bytes": nbytes, "max_sessions": 8, "max_bytes": None, "ttl_seconds": 600.0,
        "hits": hits, "misses": misses, "misses_by_reason": {"unknown_session": misses},
        "evictions": {"ttl": 0, "lru": 0, "bytes": 0, "dropped": 0} | (evictions or {}),
    }


def node_status(url: str, start: int, end: int, *, peers: list[str] = (), time: float = NOW,
                tokens_served: int = 0, steps_served: int = 0, active_steps: int = 0,
                active_generations: int = 0, sessions: int = 0, kv_cache: bool = True,
                model: ModelSummary = MODEL, draining: bool = False) -> NodeStatus:
    roles = ["head", "tail"] if end == model.num_layers else ["head"]
    return NodeStatus(
        url=url, version="0.1.0", model=model, start=start, end=end, roles=roles,
        kv_cache_enabled=kv_cache, supports_kv_cache=True, threads=1,
        active_generations=active_generations, active_steps=active_steps,
        weights_bytes={"layers": (end - start) * 14_000_000}, store=store(sessions, sessions * 1_400_000),
        peers=[PeerSummary(p, True, last_seen=time) for p in peers], time=time, started_at=NOW - 3600,
        steps_served=steps_served, tokens_served=tokens_served, draining=draining,
    )


def session(session_id: str, past_len: int, start_layer: int, *, idle: float, ttl_left: float,
            layers: int = 15, time: float = NOW) -> SessionInfo:
    last_used = time - idle
    return SessionInfo(session_id, past_len, start_layer, past_len * 1536 * layers, last_used - 30, last_used,
                       time + ttl_left)


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
    local_hop = {"url": HEAD, "start_layer": 0, "end_layer": 15, "kv_cache": True, "local": True}
    worker_hop = {"url": WORKER, "start_layer": 15, "end_layer": 30, "kv_cache": True, "local": False}
    replica_hop = worker_hop | {"url": REPLICA}
    events = [
        {"time": NOW - 700, "kind": "no_route", "session_id": "9e0d", "failed": WORKER, "position": 12,
         "reason": "no live node serves layers 15-29 of 0-29; start a node with --layers covering them or add it "
                   "with --peer", "route": []},
        {"time": NOW - 310, "kind": "reroute", "session_id": "77ab", "failed": None, "position": 131,
         "reason": "expected 14.9 ms per step on the old route", "route": [local_hop, replica_hop]},
        {"time": NOW - 29, "kind": "failover", "session_id": "5d1e", "failed": REPLICA, "position": 45,
         "reason": f"{REPLICA} is unreachable: ClientConnectorError: Cannot connect to host 127.0.0.1:7072 "
                   "ssl:default [Connect call failed ('127.0.0.1', 7072)]", "route": [local_hop, worker_hop]},
    ]
    nodes = {HEAD: {"local": True, "latency_ms": 1.9, "overhead_ms": 0.2, "layer_ms": 0.11, "samples": 212,
                    "failures": 0, "age_seconds": 0.4},
             WORKER: {"local": False, "latency_ms": 7.1, "overhead_ms": 1.4, "layer_ms": 0.38, "samples": 40,
                      "failures": 1, "age_seconds": 0.4},
             REPLICA: {"local": False, "latency_ms": None, "overhead_ms": None, "layer_ms": None, "samples": 171,
                       "failures": 1, "age_seconds": None}}
    return RouteInfo(hops=hops, planned_at=NOW - 29, nodes=nodes, events=events, failovers=2, reroutes=1)


HEAD_SESSIONS = [
    session("5d1e0c9a7b3f2e4d6c8a0b1c", 48, 0, idle=3, ttl_left=597),
    session("a04f7e2d9c1b3a5e7f9d0c2b", 212, 0, idle=545, ttl_left=55),
]
WORKER_SESSIONS = [
    session("5d1e0c9a7b3f2e4d6c8a0b1c", 48, 15, idle=3, ttl_left=597),
]


class ScriptedChat:
    """Stands in for the console's DaemonClient in the chat: streams the given chunks ``steps`` seconds
    of the frozen clock apart (cycling), then holds the stream open until :attr:`release` is set."""

    def __init__(self, chunks, clock: FrozenClock, *, steps=(0.1,), hold: bool = False) -> None:
        self.chunks = list(chunks)
        self.clock = clock
        self.steps = steps
        self.release = asyncio.Event()
        if not hold:
            self.release.set()
        self.requests: list[tuple[str, list[dict], dict]] = []

    async def chat_stream(self, url: str, messages: list[dict], **params):
        self.requests.append((url, messages, params))
        for i, chunk in enumerate(self.chunks):
            self.clock.advance(self.steps[i % len(self.steps)])
            yield chunk
        await self.release.wait()

    async def close(self) -> None:
        pass


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


class StubDaemon:
    """A stand-in meshd: fixed answers for the console's endpoints, and a record of what it was asked."""

    def __init__(self, start: int, end: int, *, peers: list[str] = (), sessions=(),
                 answer: list[str] = ("Hello", " from", " the", " **mesh**."), hold_after: int | None = None,
                 token: str | None = None, stats: dict | None = None) -> None:
        self.start_layer, self.end_layer = start, end
        self.token = token  # when set, every path but /health needs "Authorization: Bearer <token>"
        self.authorizations: list[tuple[str, str | None]] = []  # (path, Authorization header) of each request
        self.stats = stats or {}  # added to the final chunk's meshnet object
        self.peers = list(peers)
        self.sessions = list(sessions)
        self.answer = list(answer)
        self.hold_after = hold_after  # stop streaming after this many tokens until `release` is set
        self.release = asyncio.Event()
        self.client_left = asyncio.Event()  # a held stream noticed the console closing it
        self.port: int | None = None
        self.deleted: list[str] = []
        self.peer_requests: list[tuple[str, str]] = []
        self.chat_requests: list[dict] = []
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        """Listen (again) on 127.0.0.1; a restart keeps the port, as a restarted daemon would."""
        app = web.Application(middlewares=[self._check_token])
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/status", self._status)
        app.router.add_get("/v1/sessions", self._sessions)
        app.router.add_delete("/v1/sessions/{session_id}", self._drop)
        app.router.add_get("/v1/route", self._route)
        app.router.add_post("/v1/peers", self._add_peer)
        app.router.add_delete("/v1/peers", self._remove_peer)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port or 0).start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            self.release.set()
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _check_token(self, request: web.Request, handler):
        given = request.headers.get("Authorization")
        self.authorizations.append((request.path, given))
        if self.token and request.path != "/health" and given != f"Bearer {self.token}":
            return web.json_response({"error": {"message": "this mesh needs its token: send 'Authorization: "
                                                           "Bearer <token>'", "type": "invalid_request_error",
                                                "param": None, "code": "invalid_api_key"}}, status=401)
        return await handler(request)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _status(self, request: web.Request) -> web.Response:
        status = node_status(self.url, self.start_layer, self.end_layer, peers=self.peers, sessions=len(self.sessions))
        return web.json_response(status.to_dict())

    async def _sessions(self, request: web.Request) -> web.Response:
        return web.json_response(session_list(self.sessions).to_dict())

    async def _drop(self, request: web.Request) -> web.Response:
        session_id = request.match_info["session_id"]
        self.deleted.append(session_id)
        self.sessions = [s for s in self.sessions if s.session_id != session_id]
        return web.json_response({"dropped": session_id})

    async def _route(self, request: web.Request) -> web.Response:
        return web.json_response({"hops": [{"url": self.url, "start_layer": self.start_layer,
                                            "end_layer": self.end_layer, "kv_cache": True, "local": True,
                                            "latency_ms": 1.0}]})

    async def _add_peer(self, request: web.Request) -> web.Response:
        url = (await request.json())["url"]
        self.peer_requests.append(("add", url))
        return web.json_response({"peers": []})

    async def _remove_peer(self, request: web.Request) -> web.Response:
        self.peer_requests.append(("remove", request.query["url"]))
        return web.json_response({"removed": request.query["url"]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.chat_requests.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(payload: dict) -> None:
            await response.write(f"data: {json.dumps(payload)}\n\n".encode())

        await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        for i, token in enumerate(self.answer):
            if i == self.hold_after:
                while not self.release.is_set():
                    if request.transport is None or request.transport.is_closing():
                        self.client_left.set()
                        return response
                    await asyncio.sleep(0.02)
            await send({"choices": [{"index": 0, "delta": {"content": token}, "finish_reason": None}]})
        stats = {"completion_tokens": len(self.answer), "cache_misses": 0, "reprefills": 0, "prefill_ms": 12.0,
                 "first_token_ms": 15.0, "decode_tokens_per_second": 42.0} | self.stats
        await send({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "meshnet": stats})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
