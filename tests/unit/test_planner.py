"""Unit tests of ``daemon.mesh.planner``: latency estimates, exploration, reroutes and failover waits.

The clock is injected; the peer directory is a real one whose peers' statuses are set by hand.
"""

from __future__ import annotations

import random

import pytest

from daemon.errors import HopFailed, RouteUnavailable
from daemon.mesh import planner as planner_module
from daemon.mesh.peers import PeerDirectory
from daemon.mesh.planner import REROUTE_RATIO, STALE_SECONDS, UNMEASURED_OPTIMISM, LatencyModel, RoutePlanner
from daemon.mesh.routing import Candidate, Hop, route_cost

HEAD = "http://127.0.0.1:7070"
R1 = "http://127.0.0.1:7071"
R2 = "http://127.0.0.1:7072"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def status(start: int, end: int, *, busy: float = 0.0) -> dict:
    return {"start": start, "end": end, "kv_cache_enabled": True, "supports_kv_cache": True, "busy": busy,
            "model": {"fingerprint": "f"}}


def make_planner(clock: Clock, *, explore: float = 0.0, peers: dict[str, tuple[int, int]] | None = None,
                 failover_wait: float = 1.0) -> RoutePlanner:
    directory = PeerDirectory([], self_url=HEAD, fingerprint="f", clock=clock)
    for url, (start, end) in (peers or {R1: (15, 30), R2: (15, 30)}).items():
        directory.add(url)
        directory.peers[url].status, directory.peers[url].up = status(start, end), True
    own = Candidate(HEAD, 0, 15, local=True)
    return RoutePlanner(lambda: own, directory, 30, explore=explore, failover_wait=failover_wait,
                        rng=random.Random(7), clock=clock)


def decode(planner: RoutePlanner, url: str, total_ms: float, compute_ms: float, layers: int = 15) -> None:
    planner.observe(Hop(url, 30 - layers, 30), mode="decode", total_ms=total_ms, compute_ms=compute_ms)


def unreachable(url: str) -> HopFailed:
    return HopFailed(url, f"{url} is unreachable: cannot connect: Connection refused", reason="unreachable")


def test_observations_split_overhead_from_compute_per_layer():
    model = LatencyModel(clock=Clock())
    model.observe(R1, layers=10, total_ms=25.0, compute_ms=20.0)
    n = model.nodes[R1]
    assert (n.latency_ms, n.overhead_ms, n.layer_ms, n.samples) == (25.0, 5.0, 2.0, 1)
    # a hop of 5 layers on that node: overhead plus five layers
    assert model.cost(Candidate(R1, 0, 30), 5) == pytest.approx(5.0 + 5 * 2.0)
    # moving averages: the newest sample weighs 0.2
    model.observe(R1, layers=10, total_ms=35.0, compute_ms=30.0)
    assert n.latency_ms == pytest.approx(27.0) and n.layer_ms == pytest.approx(2.2)


def test_a_node_that_does_not_report_compute_counts_as_all_compute():
    model = LatencyModel(clock=Clock())
    model.observe(R1, layers=10, total_ms=30.0, compute_ms=None)
    model.observe(R2, layers=10, total_ms=30.0, compute_ms=45.0)  # nonsense: more compute than the whole hop
    for url in (R1, R2):
        assert model.nodes[url].overhead_ms == 0.0 and model.nodes[url].layer_ms == 3.0


def test_unmeasured_nodes_are_assumed_a_little_faster_than_the_best_measured():
    model = LatencyModel(clock=Clock())
    model.observe(R1, layers=15, total_ms=40.0, compute_ms=30.0)
    measured = model.cost(Candidate(R1, 15, 30), 15)
    unmeasured = model.cost(Candidate(R2, 15, 30), 15)
    assert unmeasured == pytest.approx(measured * UNMEASURED_OPTIMISM)


def test_busy_nodes_are_expected_slower():
    model = LatencyModel(clock=Clock())
    model.observe(R1, layers=15, total_ms=40.0, compute_ms=30.0)
    assert model.cost(Candidate(R1, 15, 30, busy=0.5), 15) == pytest.approx(1.5 * model.cost(Candidate(R1, 15, 30), 15))


def test_new_generations_try_an_unmeasured_replica_then_keep_the_faster():
    clock = Clock()
    planner = make_planner(clock)
    first = planner.plan()[1].url
    decode(planner, first, total_ms=300.0, compute_ms=20.0)  # slow: e.g. a congested link
    second = planner.plan()[1].url
    assert second != first  # the other replica has not been measured: try it
    decode(planner, second, total_ms=25.0, compute_ms=20.0)
    for _ in range(5):
        assert planner.plan()[1].url == second


def test_stale_measurements_are_forgotten_so_a_recovered_node_is_tried_again():
    clock = Clock()
    planner = make_planner(clock)
    decode(planner, R1, total_ms=300.0, compute_ms=20.0)
    decode(planner, R2, total_ms=25.0, compute_ms=20.0)
    assert planner.plan()[1].url == R2
    clock.now += STALE_SECONDS / 2
    decode(planner, R2, total_ms=25.0, compute_ms=20.0)
    clock.now += STALE_SECONDS / 2 + 1  # R1's measurement is now too old; R2's is fresh
    assert planner.latency.fresh(R1) is None
    assert planner.plan()[1].url == R1


def test_exploration_sometimes_picks_a_near_equal_route_but_never_a_far_worse_one():
    clock = Clock()
    planner = make_planner(clock, explore=0.5)
    decode(planner, R1, total_ms=22.0, compute_ms=20.0)
    decode(planner, R2, total_ms=23.0, compute_ms=20.0)  # near-equal
    picks = [planner.plan()[1].url for _ in range(200)]
    assert 0 < picks.count(R2) < 100  # explored now and then, not most of the time
    decode(planner, R2, total_ms=400.0, compute_ms=20.0)  # far worse: exploration must not pick it
    for _ in range(20):
        decode(planner, R2, total_ms=400.0, compute_ms=20.0)
    assert {planner.plan()[1].url for _ in range(200)} == {R1}


def test_reroute_only_to_a_measured_route_that_is_far_faster():
    clock = Clock()
    planner = make_planner(clock)
    route = [Hop(HEAD, 0, 15, local=True), Hop(R1, 15, 30)]
    decode(planner, R1, total_ms=30.0, compute_ms=20.0)
    # R2 is unmeasured: its optimistic prior must not move a running generation
    assert planner.reroute(route, session_id="s", position=10) is None
    decode(planner, R2, total_ms=30.0 / REROUTE_RATIO + 5, compute_ms=10.0)
    assert planner.reroute(route, session_id="s", position=10) is None  # faster, but not by the ratio
    for _ in range(30):
        decode(planner, R1, total_ms=200.0, compute_ms=20.0)  # R1 has become far slower
    better = planner.reroute(route, session_id="s", position=42)
    assert better is not None and better[1].url == R2
    assert planner.reroutes == 1
    event = planner.events[-1]
    assert event.kind == "reroute" and event.position == 42 and event.route[1].url == R2


async def test_failover_marks_the_node_down_and_plans_around_it():
    clock = Clock()
    planner = make_planner(clock)
    route = planner.plan()
    failed = route[1]
    new_route = await planner.failover(failed, unreachable(failed.url), session_id="s", position=7)
    assert new_route[1].url != failed.url
    assert planner.peers.peers[failed.url].up is False
    assert planner.failovers == 1
    event = planner.events[-1]
    assert (event.kind, event.failed, event.position) == ("failover", failed.url, 7)


async def test_failover_without_a_replica_waits_for_the_bound_then_names_the_missing_layers(monkeypatch):
    clock = Clock()
    planner = make_planner(clock, peers={R1: (15, 30)}, failover_wait=2.0)
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:  # the wall clock is mocked: advance it instead of waiting
        slept.append(seconds)
        clock.now += seconds

    monkeypatch.setattr(planner_module.asyncio, "sleep", fake_sleep)
    route = planner.plan()
    with pytest.raises(RouteUnavailable, match=r"layers 15-29 of 0-29"):
        await planner.failover(route[1], unreachable(route[1].url), session_id="s", position=3)
    assert sum(slept) == pytest.approx(2.0)
    assert planner.events[-1].kind == "no_route"


async def test_failover_takes_a_node_that_comes_back_while_waiting(monkeypatch):
    clock = Clock()
    planner = make_planner(clock, peers={R1: (15, 30)}, failover_wait=10.0)

    async def fake_sleep(seconds: float) -> None:
        clock.now += seconds
        if clock.now > 1003:  # the node restarts three seconds later
            planner.peers.peers[R1].up = True

    monkeypatch.setattr(planner_module.asyncio, "sleep", fake_sleep)
    route = planner.plan()
    new_route = await planner.failover(route[1], unreachable(route[1].url), session_id="s", position=3)
    assert new_route[1].url == R1 and clock.now < 1000 + 10


# ---- every route event says why in a code, beside its sentence -------------------------------------------------

@pytest.mark.parametrize("failure", [
    HopFailed(R1, f"{R1} is unreachable: cannot connect: Connection refused", reason="unreachable"),
    HopFailed(R1, f"{R1} is unreachable: timed out after 10 s", reason="timed_out"),
    HopFailed(R1, f"{R1} answered 503: this node is draining", reason="http_status", status=503),
])
async def test_a_failover_event_carries_how_the_hop_failed(failure):
    planner = make_planner(Clock(), peers={R1: (15, 30), R2: (15, 30)})
    route = [Hop(HEAD, 0, 15, local=True), Hop(R1, 15, 30)]
    await planner.failover(route[1], failure, session_id="s", position=7)
    event = planner.events[-1]
    assert (event.kind, event.failed, event.reason) == ("failover", R1, failure.message)
    assert (event.code, event.status) == (failure.reason, failure.status)
    assert planner.peers.peers[R1].error == failure.message


async def test_a_failover_without_a_route_names_the_uncovered_layers_in_its_event(monkeypatch):
    clock = Clock()
    planner = make_planner(clock, peers={R1: (15, 30)}, failover_wait=1.0)

    async def fake_sleep(seconds: float) -> None:
        clock.now += seconds

    monkeypatch.setattr(planner_module.asyncio, "sleep", fake_sleep)
    with pytest.raises(RouteUnavailable):
        await planner.failover(planner.plan()[1], unreachable(R1), session_id="s", position=3)
    event = planner.events[-1]
    assert (event.kind, event.code, event.layers) == ("no_route", "no_node_for_layers", (15, 30))
    assert "layers 15-29 of 0-29" in event.reason


def test_a_reroute_event_carries_the_old_routes_expected_step():
    planner = make_planner(Clock())
    route = [Hop(HEAD, 0, 15, local=True), Hop(R1, 15, 30)]
    decode(planner, R2, total_ms=10.0, compute_ms=5.0)
    for _ in range(30):
        decode(planner, R1, total_ms=123.456, compute_ms=20.0)
    assert planner.reroute(route, session_id="s", position=42) is not None
    event = planner.events[-1]
    assert (event.kind, event.code) == ("reroute", "slower_route")
    assert event.step_ms == round(route_cost(route, planner.candidates(), planner.latency.cost), 1)
    assert event.reason == f"expected {event.step_ms:.1f} ms per step on the old route"


def test_a_replacement_is_the_node_a_session_was_handed_to_even_this_one():
    """A draining node names the node that took the session: the replacement is that node, where it fits, and the
    head's own layers (a local hop) when it was handed to the head itself."""
    planner = make_planner(Clock(), peers={R1: (15, 30), R2: (15, 30), "http://127.0.0.1:7073": (0, 15)})
    decode(planner, R1, 5.0, 4.0)  # R1 measures fastest: chosen unless told otherwise
    decode(planner, R2, 50.0, 40.0)
    failed = Hop("http://127.0.0.1:7079", 15, 30)
    assert planner.replacement(failed, verifies=False).url == R1
    assert planner.replacement(failed, verifies=False, moved_to=R2) == Hop(R2, 15, 30)
    assert planner.replacement(failed, verifies=False, moved_to="http://127.0.0.1:7078").url == R1  # unknown
    first = Hop("http://127.0.0.1:7073", 0, 15)
    assert planner.replacement(first, verifies=False, moved_to=HEAD) == Hop(HEAD, 0, 15, local=True)
    planner.sessions_moved("http://127.0.0.1:7073", {"s1": HEAD})
    assert planner.moved_to("http://127.0.0.1:7073", "s1") == HEAD and planner.moved_to(R1, "s1") is None
