"""Planning a route: a chain of nodes whose layer ranges together cover every layer.

Ranges may overlap: a hop starts where the previous one stopped
(``start_layer``), so no layer runs twice. Among all chains that cover
``0..N-1`` the planner picks the one with the lowest expected step latency,
from a cost per hop (see :class:`daemon.mesh.planner.LatencyModel`); without
measurements every remote hop costs the same, so the fewest hops win.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from daemon.api import Hop
from daemon.errors import RouteUnavailable


@dataclass(frozen=True)
class Candidate:
    """A live node that could serve part of a route. Ranges are half-open ``[start, end)``."""

    url: str
    start: int
    end: int
    kv_cache: bool = True
    local: bool = False
    verifies: bool = False  # takes verify steps (speculative decoding)
    busy: float = 0.0  # the share of recent time the node spent computing, 0..1, as it reports

    def takes_over(self, start: int, end: int) -> bool:
        """Whether this node can hold a session of layers ``[start, end)`` in another's place: it keeps a cache and
        runs from ``start`` (whatever it hosts before) to exactly ``end``."""
        return self.kv_cache and self.start <= start and self.end == end


# expected milliseconds of one decode step of a hop running `layers` layers on a candidate
HopCost = Callable[[Candidate, int], float]

# a node that cannot cache turns the whole route stateless: every step reruns the whole sequence
STATELESS_FACTOR = 8.0


def uniform_cost(candidate: Candidate, layers: int) -> float:
    """With nothing measured: a layer costs the same everywhere, a remote hop adds a fixed overhead."""
    return layers * 1.0 + (0.0 if candidate.local else 2.0)


def plan_route(candidates: list[Candidate], num_layers: int, cost: HopCost = uniform_cost) -> list[Hop]:
    """The cheapest chain of hops covering layers ``0..num_layers-1``.

    Ties prefer fewer hops, then the local node (no HTTP hop), then caching nodes.
    Raises :class:`RouteUnavailable` naming the first uncovered layer range (and carrying it, half-open).
    """
    # best[p]: (sort key, chain) of the cheapest chain of hops whose layers end exactly at p
    best: dict[int, tuple[tuple, list[Hop]]] = {0: ((0.0, 0, 0, 0), [])}
    for position in range(num_layers):
        if position not in best:
            continue
        (total, hops, nonlocal_, stateless), chain = best[position]
        for c in candidates:
            if not c.start <= position < c.end:
                continue
            step = cost(c, c.end - position) * (1.0 if c.kv_cache else STATELESS_FACTOR)
            key = (total + step, hops + 1, nonlocal_ + (not c.local), stateless + (not c.kv_cache))
            current = best.get(c.end)
            if current is None or _rounded(key) < _rounded(current[0]):
                best[c.end] = (key, chain + [Hop(c.url, position, c.end, c.kv_cache, c.local, c.verifies)])
    if num_layers in best:
        return best[num_layers][1]
    reached = max(p for p in best if p <= num_layers)
    covered_from = [c.start for c in candidates if c.start > reached]
    gap_end = min(covered_from, default=num_layers) - 1
    raise RouteUnavailable(
        f"no live node serves layers {reached}-{gap_end} of 0-{num_layers - 1}; "
        "start a node with --layers covering them or add it with --peer",
        layers=(reached, gap_end + 1),
    )


def _rounded(key: tuple) -> tuple:
    # costs within a microsecond are a tie, so the other preferences decide rather than float noise
    return (round(key[0], 3),) + key[1:]


def route_key(route: Sequence[Hop]) -> tuple:
    """A route as a dictionary key: its hops' nodes and layers."""
    return tuple((hop.url, hop.start_layer, hop.end_layer) for hop in route)


def route_cost(route: list[Hop], candidates: list[Candidate], cost: HopCost) -> float | None:
    """Expected step latency of an existing route, or None when one of its nodes is no longer a candidate."""
    by_url = {c.url: c for c in candidates}
    total = 0.0
    for hop in route:
        c = by_url.get(hop.url)
        if c is None or not c.start <= hop.start_layer < c.end or c.end != hop.end_layer:
            return None
        total += cost(c, hop.layers) * (1.0 if c.kv_cache else STATELESS_FACTOR)
    return total
