"""Unit tests of ``daemon.mesh.routing.plan_route`` (pure planning, no daemons)."""

from __future__ import annotations

import itertools

import pytest

from daemon.errors import RouteUnavailable
from daemon.mesh.routing import Candidate, Hop, plan_route, route_cost

A = "http://127.0.0.1:7070"
B = "http://127.0.0.1:7071"
C = "http://127.0.0.1:7072"
D = "http://127.0.0.1:7073"


def spans(route: list[Hop]) -> list[tuple[str, int, int]]:
    return [(h.url, h.start_layer, h.end_layer) for h in route]


def assert_exact_cover(route: list[Hop], candidates: list[Candidate], num_layers: int) -> None:
    """Every layer runs exactly once, in order, each on a node that hosts it."""
    assert route, "an empty route covers nothing"
    assert route[0].start_layer == 0
    assert route[-1].end_layer == num_layers
    for prev, nxt in zip(route, route[1:]):
        assert nxt.start_layer == prev.end_layer  # no layer skipped, none run twice
    by_url = {c.url: c for c in candidates}
    for hop in route:
        c = by_url[hop.url]
        assert c.start <= hop.start_layer < hop.end_layer <= c.end
        # a hop runs through to the end of its node's range (the node cannot stop early)
        assert hop.end_layer == c.end


def test_disjoint_two_node_split():
    cands = [Candidate(A, 0, 15, local=True), Candidate(B, 15, 30)]
    route = plan_route(cands, 30)
    assert spans(route) == [(A, 0, 15), (B, 15, 30)]
    assert route[0].local is True and route[1].local is False
    assert_exact_cover(route, cands, 30)


def test_disjoint_split_independent_of_candidate_order():
    cands = [Candidate(B, 15, 30), Candidate(A, 0, 15)]
    assert spans(plan_route(cands, 30)) == [(A, 0, 15), (B, 15, 30)]


def test_one_node_with_all_layers_is_a_single_hop():
    cands = [Candidate(A, 0, 30, local=True)]
    route = plan_route(cands, 30)
    assert route == [Hop(A, 0, 30, kv_cache=True, local=True)]


def test_whole_model_node_beats_a_two_hop_split():
    cands = [Candidate(A, 0, 15), Candidate(B, 15, 30), Candidate(C, 0, 30)]
    assert spans(plan_route(cands, 30)) == [(C, 0, 30)]


def test_overlapping_ranges_start_where_previous_hop_stopped():
    # inclusive 0-19, 10-29, 20-29 -> half-open [0,20), [10,30), [20,30)
    cands = [Candidate(A, 0, 20), Candidate(B, 10, 30), Candidate(C, 20, 30)]
    route = plan_route(cands, 30)
    assert len(route) == 2
    assert route[0] == Hop(A, 0, 20)
    assert route[1].start_layer == 20 and route[1].end_layer == 30
    assert route[1].url in (B, C)
    assert_exact_cover(route, cands, 30)


def test_overlap_hop_starts_mid_range():
    # B hosts 10-29 but only has to run 20-29 after A ran 0-19
    cands = [Candidate(A, 0, 20), Candidate(B, 10, 30)]
    route = plan_route(cands, 30)
    assert spans(route) == [(A, 0, 20), (B, 20, 30)]


def test_fewest_hops_over_a_greedy_chain():
    # A short first hop leads to a 3-hop chain (A, B, C); the 2-hop chain (D, C) is better.
    cands = [
        Candidate(A, 0, 10),
        Candidate(B, 10, 20),
        Candidate(C, 18, 30),
        Candidate(D, 0, 19),
    ]
    route = plan_route(cands, 30)
    assert spans(route) == [(D, 0, 19), (C, 19, 30)]
    assert_exact_cover(route, cands, 30)


def test_many_overlapping_ranges_always_exact_cover_and_minimal():
    cands = [
        Candidate("http://n0", 0, 7),
        Candidate("http://n1", 3, 12),
        Candidate("http://n2", 5, 9),
        Candidate("http://n3", 8, 20),
        Candidate("http://n4", 11, 24),
        Candidate("http://n5", 19, 24),
        Candidate("http://n6", 6, 16),
    ]
    route = plan_route(cands, 24)
    assert_exact_cover(route, cands, 24)
    # brute force: the smallest number of hops that can cover 0..23 exactly
    best = None
    for k in range(1, len(cands) + 1):
        for combo in itertools.permutations(cands, k):
            pos, ok = 0, True
            for c in combo:
                if not c.start <= pos < c.end:
                    ok = False
                    break
                pos = c.end
            if ok and pos == 24:
                best = k
                break
        if best is not None:
            break
    assert best == 3
    assert len(route) == best


def test_local_node_preferred_on_ties():
    # B and C both host 15-29: two hops either way, C is this node
    for order in ([Candidate(B, 15, 30), Candidate(C, 15, 30, local=True)],
                  [Candidate(C, 15, 30, local=True), Candidate(B, 15, 30)]):
        route = plan_route([Candidate(A, 0, 15)] + order, 30)
        assert spans(route) == [(A, 0, 15), (C, 15, 30)]
        assert route[1].local is True


def test_local_preferred_for_the_first_hop_too():
    for first in ([Candidate(A, 0, 15), Candidate(B, 0, 15, local=True)],
                  [Candidate(B, 0, 15, local=True), Candidate(A, 0, 15)]):
        route = plan_route(first + [Candidate(C, 15, 30)], 30)
        assert spans(route) == [(B, 0, 15), (C, 15, 30)]


def test_local_does_not_beat_fewer_hops():
    cands = [Candidate(A, 0, 15, local=True), Candidate(B, 15, 30), Candidate(C, 0, 30)]
    assert spans(plan_route(cands, 30)) == [(C, 0, 30)]


def test_caching_node_preferred_on_ties():
    for order in ([Candidate(B, 15, 30, kv_cache=False), Candidate(C, 15, 30, kv_cache=True)],
                  [Candidate(C, 15, 30, kv_cache=True), Candidate(B, 15, 30, kv_cache=False)]):
        route = plan_route([Candidate(A, 0, 15)] + order, 30)
        assert spans(route) == [(A, 0, 15), (C, 15, 30)]
        assert route[1].kv_cache is True


def test_caching_remote_beats_stateless_local():
    # a node without a cache makes every step rerun the whole sequence: far dearer than one HTTP hop
    cands = [
        Candidate(A, 0, 15),
        Candidate(B, 15, 30, kv_cache=True),
        Candidate(C, 15, 30, kv_cache=False, local=True),
    ]
    route = plan_route(cands, 30)
    assert spans(route) == [(A, 0, 15), (B, 15, 30)]
    assert route[1].kv_cache is True and route[1].local is False


def costs(per_layer: dict[str, float], overhead: float = 2.0):
    """A cost function from per-node milliseconds per layer, plus a fixed overhead per remote hop."""
    return lambda c, layers: layers * per_layer[c.url] + (0.0 if c.local else overhead)


def test_faster_replica_wins():
    cands = [Candidate(A, 0, 15, local=True), Candidate(B, 15, 30), Candidate(C, 15, 30)]
    assert spans(plan_route(cands, 30, costs({A: 1.0, B: 5.0, C: 1.0}))) == [(A, 0, 15), (C, 15, 30)]
    assert spans(plan_route(cands, 30, costs({A: 1.0, B: 1.0, C: 5.0}))) == [(A, 0, 15), (B, 15, 30)]


def test_more_hops_win_when_they_are_faster():
    # C hosts everything but is slow; A then B is two hops of fast nodes
    cands = [Candidate(A, 0, 15), Candidate(B, 15, 30), Candidate(C, 0, 30)]
    assert spans(plan_route(cands, 30, costs({A: 1.0, B: 1.0, C: 3.0}))) == [(A, 0, 15), (B, 15, 30)]
    # ...and when C is as fast, one hop's overhead beats two
    assert spans(plan_route(cands, 30, costs({A: 1.0, B: 1.0, C: 1.0}))) == [(C, 0, 30)]


def test_overlap_lets_a_fast_node_take_more_layers():
    # A (slow) hosts 0-19, B (fast) 5-29, D (fast) 0-4: D then B from layer 5 keeps the slow node out
    cands = [Candidate(A, 0, 20), Candidate(B, 5, 30), Candidate(D, 0, 5)]
    route = plan_route(cands, 30, costs({A: 4.0, B: 1.0, D: 1.0}))
    assert spans(route) == [(D, 0, 5), (B, 5, 30)]
    assert_exact_cover(route, cands, 30)


def test_busy_nodes_cost_more():
    cands = [Candidate(A, 0, 15, local=True), Candidate(B, 15, 30, busy=0.9), Candidate(C, 15, 30, busy=0.0)]
    model = costs({A: 1.0, B: 1.0, C: 1.2})

    def loaded(c, layers):
        return model(c, layers) * (1 + c.busy)

    assert spans(plan_route(cands, 30, loaded))[1][0] == C


def test_route_cost_sums_hops_and_notices_vanished_nodes():
    cands = [Candidate(A, 0, 15, local=True), Candidate(B, 15, 30)]
    route = plan_route(cands, 30)
    model = costs({A: 1.0, B: 2.0})
    assert route_cost(route, cands, model) == 15 * 1.0 + 15 * 2.0 + 2.0
    assert route_cost(route, cands[:1], model) is None


def test_hop_carries_candidate_flags_and_to_dict():
    route = plan_route([Candidate(A, 0, 30, kv_cache=False, local=True, verifies=True)], 30)
    assert route[0].to_dict() == {
        "url": A, "start_layer": 0, "end_layer": 30, "kv_cache": False, "local": True, "verifies": True,
    }


def test_gap_raises_naming_missing_inclusive_range():
    # layers 15-19 are hosted by nobody
    cands = [Candidate(A, 0, 15), Candidate(B, 20, 30)]
    with pytest.raises(RouteUnavailable) as info:
        plan_route(cands, 30)
    message = str(info.value)
    assert "15-19" in message
    assert "0-29" in message  # the model's whole range, for context
    assert info.value.status == 503


def test_gap_with_overlaps_names_first_uncovered_layers():
    cands = [Candidate(A, 0, 10), Candidate(B, 5, 12), Candidate(C, 16, 24)]
    with pytest.raises(RouteUnavailable, match=r"layers 12-15 "):
        plan_route(cands, 24)


def test_missing_tail_names_range_to_last_layer():
    with pytest.raises(RouteUnavailable, match=r"layers 20-29 "):
        plan_route([Candidate(A, 0, 20)], 30)


def test_missing_head_names_range_from_zero():
    with pytest.raises(RouteUnavailable, match=r"layers 0-9 "):
        plan_route([Candidate(A, 10, 30)], 30)


def test_empty_candidates_raise_whole_range():
    with pytest.raises(RouteUnavailable, match=r"layers 0-29 of 0-29"):
        plan_route([], 30)


@pytest.mark.parametrize(("cands", "num_layers", "gap"), [
    ([Candidate(A, 0, 15), Candidate(B, 20, 30)], 30, (15, 20)),
    ([Candidate(A, 0, 10), Candidate(B, 5, 12), Candidate(C, 16, 24)], 24, (12, 16)),
    ([Candidate(A, 0, 20)], 30, (20, 30)),
    ([Candidate(A, 10, 30)], 30, (0, 10)),
    ([], 30, (0, 30)),
])
def test_the_error_carries_the_uncovered_range_half_open(cands, num_layers, gap):
    # what a route event reports as its layers: the same range the sentence names, inclusive there
    with pytest.raises(RouteUnavailable) as info:
        plan_route(cands, num_layers)
    assert info.value.layers == gap
    assert f"layers {gap[0]}-{gap[1] - 1} " in info.value.message
