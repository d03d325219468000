"""The head's generation loop, one outcome at a time: tokens, a cache miss, a failover, a reroute, an older tail.

The head's own layers and the remote tails are stand-ins that answer by script; for failovers the
router is the real planner, so a failed hop's reason is seen to reach the head's route events.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from daemon import wire
from daemon.api import Hop, Sampling
from daemon.errors import CacheMiss, HopFailed, UpstreamError
from daemon.mesh.generation import REROUTE_CHECK_STEPS, GenerationLoop, GenerationRequest
from daemon.mesh.hops import HopReply
from daemon.mesh.peers import PeerDirectory
from daemon.mesh.planner import RoutePlanner
from daemon.mesh.routing import Candidate

HEAD = "http://127.0.0.1:7070"
R1 = "http://127.0.0.1:7071"
R2 = "http://127.0.0.1:7072"
PROMPT = [5, 6, 7]
ROUTE = [Hop(HEAD, 0, 15, local=True), Hop(R1, 15, 30)]


class OwnLayers:
    """The head's layers 0-14 (``HeadBackend``): they pass every step on; token ids decode to letters."""

    hidden_size = 4
    eos_token_ids = {0}
    eos_texts = {"<eos>"}

    async def local_step(self, activation, *, token_ids=None, **step) -> HopReply:
        positions = len(token_ids or [1])
        return HopReply(activation=wire.Activation("float32", (1, positions, 4), bytes(16 * positions)))

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(ord("a") + i % 26) for i in token_ids)

    def encode_text(self, text: str) -> list[int]:
        return [ord(c) - ord("a") for c in text]

    def drop_local_session(self, session_id: str) -> None:
        pass

    def retain_local_session(self, session_id: str, past_len: int) -> None:
        pass


class Tails:
    """The remote hops (``HopClient``): step ``n`` answers token ``n`` on a tail (its input on a middle hop), unless
    ``trouble`` has an error for it."""

    def __init__(self, trouble: dict[int, Exception] | None = None, *, older: bool = False) -> None:
        self.trouble = trouble or {}
        self.older = older  # answer text only, like a tail from before token ids
        self.steps: list[tuple[str, str | None, int]] = []  # (node, mode, tokens fed)
        self.released: list[str] = []
        self.channels = None  # no step channels: every remote hop goes through step()

    async def step(self, hop: Hop, activation: wire.Activation, headers: dict, history=None) -> HopReply:
        self.steps.append((hop.url, headers.get(wire.CACHE), activation.shape[1]))
        if len(self.steps) in self.trouble:
            raise self.trouble[len(self.steps)]
        if hop.end_layer < 30:  # a middle hop passes the step on
            return HopReply(activation=activation)
        if self.older:
            return HopReply(text="b")
        return HopReply(token_id=len(self.steps))

    def release(self, url: str, session_id: str) -> None:
        self.released.append(url)

    def retain(self, url: str, session_id: str, past_len: int) -> None:
        pass


class FixedRouter:
    """A router (``Router``) with a scripted answer: every failover, and the reroute at one position."""

    failover_wait = 30.0

    def __init__(self, route: list[Hop], *, reroute_at: int | None = None, failover_seconds: float = 1.0) -> None:
        self.route, self.reroute_at = route, reroute_at
        self.failures: list[HopFailed] = []
        self.now, self.failover_seconds = 100.0, failover_seconds  # each failover takes this long

    def clock(self) -> float:
        return self.now

    def observe(self, hop, *, mode, total_ms, compute_ms) -> None:
        pass

    async def failover(self, failed, failure, *, session_id, position, patient=True) -> list[Hop]:
        self.failures.append(failure)
        self.now += self.failover_seconds
        return self.route

    def reroute(self, route, *, session_id, position) -> list[Hop] | None:
        return self.route if position == self.reroute_at else None

    def replacement(self, failed, *, verifies, moved_to=None) -> Hop | None:
        return None  # every failover here moves the whole route

    def replacement_chain(self, failed, *, verifies) -> list[Hop] | None:
        return None

    def moved_to(self, url, session_id) -> str | None:
        return None

    def replaced(self, failed, failure, route, *, session_id, position) -> None:
        raise AssertionError("no replacement was offered")


def planner(peers: list[str], layers: dict[str, tuple[int, int]] | None = None) -> RoutePlanner:
    """A head of layers 0-14 and ``peers`` up (layers 15-29, or as ``layers`` says)."""
    directory = PeerDirectory([], self_url=HEAD, fingerprint="f")
    for url in peers:
        start, end = (layers or {}).get(url, (15, 30))
        directory.add(url)
        directory.peers[url].up = True
        directory.peers[url].status = {"start": start, "end": end, "kv_cache_enabled": True,
                                       "supports_kv_cache": True, "model": {"fingerprint": "f"}}
    own = Candidate(HEAD, 0, 15, local=True)
    return RoutePlanner(lambda: own, directory, 30, explore=0.0, failover_wait=0.5, rng=random.Random(1))


def generate(router, tails: Tails, route: list[Hop], max_tokens: int = 4):
    """Run one generation to its end: the events' token ids and texts, and its statistics."""
    request = GenerationRequest(PROMPT, max_tokens, Sampling(), ignore_eos=True)
    loop = GenerationLoop(OwnLayers(), tails, router, route, request)

    async def collect():
        return [(event.token_id, event.text) async for event in loop.run()]
    return asyncio.run(collect()), loop.stats


def test_a_token_each_step_prefill_once_then_one_at_a_time():
    tails = Tails()
    events, stats = generate(FixedRouter(ROUTE), tails, ROUTE)
    assert [token for token, _ in events] == [1, 2, 3, 4] and stats.finish_reason == "length"
    assert tails.steps == [(R1, "prefill", 3), (R1, "decode", 1), (R1, "decode", 1), (R1, "decode", 1)]
    assert (stats.prefills, stats.reprefills, stats.cache_misses, stats.failovers) == (1, 0, 0, 0)


def test_a_cache_miss_costs_one_reprefill_of_everything_so_far():
    tails = Tails({2: CacheMiss("unknown_session", "evicted")})  # the first decode step misses
    events, stats = generate(FixedRouter(ROUTE), tails, ROUTE)
    assert len(events) == 4 and (stats.cache_misses, stats.reprefills, stats.failovers) == (1, 1, 0)
    # the prompt and the first token again, under the same session, then decoding goes on
    assert tails.steps[:4] == [(R1, "prefill", 3), (R1, "decode", 1), (R1, "prefill", 4), (R1, "decode", 1)]


def test_a_cache_miss_to_a_prefill_is_the_nodes_error():
    tails = Tails({1: CacheMiss("unknown_session", "nonsense")})
    with pytest.raises(UpstreamError, match="a cache miss to a prefill step"):
        generate(FixedRouter(ROUTE), tails, ROUTE)


def test_a_failed_hop_moves_the_generation_and_its_event_says_how_it_failed():
    router = planner([R1, R2])
    route = router.plan()
    failed = route[1].url
    failure = HopFailed(failed, f"{failed} is unreachable: timed out after 10 s", reason="timed_out")
    tails = Tails({3: failure})
    events, stats = generate(router, tails, route)
    assert len(events) == 4 and stats.failovers == 1 and stats.reprefills == 0  # the replacement alone, below
    # the failed node's session at the failover, the replacement's when the answer ends (no prefix reuse here)
    assert stats.route[1].url != failed and tails.released == [failed, stats.route[1].url]
    event = router.events[-1]
    assert (event.kind, event.failed, event.reason) == ("failover", failed, failure.message)
    assert (event.code, event.status) == ("timed_out", None)


def test_a_failed_hop_is_replaced_by_a_node_of_its_layers_prefilled_alone_from_its_inputs():
    router = planner([R1, R2])
    route = router.plan()
    failed = route[1].url
    other = R2 if failed == R1 else R1
    tails = Tails({3: HopFailed(failed, f"{failed} is unreachable: connection reset", reason="unreachable")})
    events, stats = generate(router, tails, route, max_tokens=5)
    assert len(events) == 5 and (stats.failovers, stats.span_replays, stats.reprefills) == (1, 1, 0)
    # the prefill, a decode, the decode that failed; the replacement prefilled with the 4 positions the nodes
    # hold, from the inputs the head kept; the failed step again on it alone; then on as before
    assert tails.steps == [(failed, "prefill", 3), (failed, "decode", 1), (failed, "decode", 1), (other, "prefill", 4),
                           (other, "decode", 1), (other, "decode", 1), (other, "decode", 1)]
    assert stats.route[1].url == other and router.route == stats.route
    assert (router.events[-1].kind, router.events[-1].failed) == ("failover", failed)


@pytest.mark.parametrize("told", ["in its answer", "when it left"])
def test_a_session_a_draining_node_handed_on_goes_on_there_with_nothing_computed_again(told):
    """A draining node sent the session's cache to another node of its layers: the failed step goes on there at
    once, told by the node's 503 (``moved_to``) or, once it is gone, by its leaving announcement."""
    router = planner([R1, R2])
    route = router.plan()
    failed = route[1].url
    other = R2 if failed == R1 else R1
    if told == "in its answer":
        failure = HopFailed(failed, f"{failed} answered 503", reason="http_status", status=503, moved_to=other)
    else:
        failure = HopFailed(failed, f"{failed} is unreachable: connection refused", reason="unreachable")

    class Told(Tails):
        async def step(self, hop, activation, headers, history=None):
            if told == "when it left" and len(self.steps) == 2:  # it left, naming the node it handed the session to
                router.sessions_moved(failed, {headers[wire.SESSION]: other})
            return await super().step(hop, activation, headers, history)

    tails = Told({3: failure})
    events, stats = generate(router, tails, route, max_tokens=5)
    assert len(events) == 5
    assert (stats.failovers, stats.moved_sessions, stats.span_replays, stats.reprefills) == (1, 1, 0, 0)
    assert tails.steps == [(failed, "prefill", 3), (failed, "decode", 1), (failed, "decode", 1), (other, "decode", 1),
                           (other, "decode", 1), (other, "decode", 1)]  # no prefill anywhere after the move
    assert stats.route[1].url == other


def test_hops_failing_one_after_another_in_one_step_are_each_replaced_and_the_step_goes_on():
    """Two nodes of one route drain at once: the step's second hop answers its 503 naming the node it handed the
    session to, then, resumed there, the third does the same; both are replaced within the step."""
    a1, a2, b1, b2 = (f"http://127.0.0.1:{port}" for port in (7081, 7082, 7083, 7084))
    router = planner([a1, a2, b1, b2], {a1: (15, 22), a2: (15, 22), b1: (22, 30), b2: (22, 30)})
    route = router.plan()
    (first, second), (other_first, other_second) = [h.url for h in route[1:]], \
        [a2 if route[1].url == a1 else a1, b2 if route[2].url == b1 else b1]
    tails = Tails({5: HopFailed(first, "503", reason="http_status", status=503, moved_to=other_first),
                   7: HopFailed(second, "503", reason="http_status", status=503, moved_to=other_second)})
    events, stats = generate(router, tails, route, max_tokens=4)
    assert len(events) == 4
    assert (stats.failovers, stats.moved_sessions, stats.span_replays, stats.reprefills) == (2, 2, 0, 0)
    assert [h.url for h in stats.route[1:]] == [other_first, other_second]
    assert [mode for _, mode, _ in tails.steps].count("prefill") == 2  # the prompt's, on each hop: no other


def test_a_failed_hop_no_one_node_can_replace_is_replaced_by_a_chain_each_prefilled_from_the_one_before():
    """The tail of layers 15-29 dies; the live nodes split those layers 15-21 and 22-29: both are prefilled, the
    first from the inputs the head kept and the second from the first's outputs, and the step goes on there."""
    a, b = "http://127.0.0.1:7081", "http://127.0.0.1:7082"
    router = planner([R1, a, b], {a: (15, 22), b: (22, 30)})
    decode_ms = {R1: 5.0, a: 50.0, b: 50.0}  # R1 measures fastest: the route takes it
    for url, ms in decode_ms.items():
        router.observe(Hop(url, 15, 30), mode="decode", total_ms=ms, compute_ms=ms / 2)
    route = router.plan()
    assert route[1].url == R1
    tails = Tails({3: HopFailed(R1, f"{R1} is unreachable: connection reset", reason="unreachable")})
    events, stats = generate(router, tails, route, max_tokens=5)
    assert len(events) == 5 and (stats.failovers, stats.span_replays, stats.reprefills) == (1, 1, 0)
    assert tails.steps[3:6] == [(a, "prefill", 4), (b, "prefill", 4), (a, "decode", 1)]
    assert [(h.url, h.start_layer, h.end_layer) for h in stats.route] == [(HEAD, 0, 15), (a, 15, 22), (b, 22, 30)]
    assert tails.steps[-2:] == [(a, "decode", 1), (b, "decode", 1)]


def test_after_a_chain_replaced_a_hop_each_of_its_hops_can_be_replaced_from_its_own_inputs():
    a, b, c = "http://127.0.0.1:7081", "http://127.0.0.1:7082", "http://127.0.0.1:7083"
    router = planner([R1, a, b, c], {a: (15, 22), b: (22, 30), c: (22, 30)})
    for url, ms in {R1: 5.0, a: 50.0, b: 50.0, c: 60.0}.items():
        router.observe(Hop(url, 15, 30), mode="decode", total_ms=ms, compute_ms=ms / 2)
    route = router.plan()
    tails = Tails({3: HopFailed(R1, f"{R1} is unreachable", reason="unreachable"),
                   9: HopFailed(b, f"{b} is unreachable", reason="unreachable")})  # b: the chain's second hop
    events, stats = generate(router, tails, route, max_tokens=6)
    assert len(events) == 6 and (stats.failovers, stats.span_replays, stats.reprefills) == (2, 2, 0)
    # 8: a decodes position 5; 9: b fails it; c is prefilled with b's inputs for positions 0-4 (a's outputs, kept
    # at the right index after the chain moved the hops along), then decodes from a's output of the failed step
    assert tails.steps[8:11] == [(b, "decode", 1), (c, "prefill", 5), (c, "decode", 1)]
    assert [h.url for h in stats.route] == [HEAD, a, c]


def test_past_the_inputs_budget_a_failover_prefills_the_whole_route(monkeypatch):
    import daemon.mesh.replay

    monkeypatch.setattr(daemon.mesh.replay, "REPLAY_BUDGET_BYTES", 16 * 3)  # the prompt's 3 positions, no more
    router = planner([R1, R2])
    route = router.plan()
    failed = route[1].url
    tails = Tails({3: HopFailed(failed, f"{failed} answered 503", reason="http_status", status=503)})
    events, stats = generate(router, tails, route, max_tokens=5)
    assert (stats.failovers, stats.span_replays, stats.reprefills) == (1, 0, 1)
    assert tails.steps[3][1:] == ("prefill", 5)  # every node again: the prompt and the answer so far


def test_a_mesh_that_keeps_failing_without_a_token_gives_up_after_the_failover_wait():
    failure = HopFailed(R1, f"{R1} answered 503: draining", reason="http_status", status=503)
    router = FixedRouter(ROUTE)  # each failover takes a second
    tails = Tails({n: failure for n in range(1, 100)})
    with pytest.raises(UpstreamError, match=r"gave up: no token for 31 s of failovers \(32 in all\); the last: "
                                            r".* answered 503"):
        generate(router, tails, ROUTE)
    assert len(router.failures) == 31


def test_failovers_between_tokens_never_give_up_however_many():
    """Churn: a node lost every other step for a long answer, each failover found a new route at once."""
    failure = HopFailed(R1, f"{R1} is unreachable: connection reset", reason="unreachable")
    tails = Tails({n: failure for n in range(2, 80, 2)})
    events, stats = generate(FixedRouter(ROUTE, failover_seconds=25.0), tails, ROUTE, max_tokens=40)
    assert len(events) == 40 and stats.failovers == 39 and stats.finish_reason == "length"


def test_a_reroute_is_checked_every_few_decode_steps_and_costs_one_prefill():
    faster = [Hop(HEAD, 0, 15, local=True), Hop(R2, 15, 30)]
    position = len(PROMPT) + REROUTE_CHECK_STEPS + 1  # after the prefill's token and 16 decode steps
    tails = Tails()
    events, stats = generate(FixedRouter(faster, reroute_at=position), tails, ROUTE, max_tokens=20)
    assert len(events) == 20 and (stats.reroutes, stats.reprefills) == (1, 1)
    assert tails.released == [R1, R2] and stats.route == faster  # the old route's at the move, the new at the end
    assert tails.steps[REROUTE_CHECK_STEPS + 1] == (R2, "prefill", position)


def test_an_older_tail_without_token_ids_is_prefilled_every_step():
    tails = Tails(older=True)
    events, stats = generate(FixedRouter(ROUTE), tails, ROUTE, max_tokens=3)
    assert events == [(-1, "b"), (-1, "b"), (-1, "b")]
    assert [mode for _, mode, _ in tails.steps] == ["prefill"] * 3
    assert [fed for _, _, fed in tails.steps] == [3, 4, 5]  # the prompt and the text so far, re-tokenized
