"""Planning a route: a chain of nodes whose layer ranges together cover every layer.

Ranges may overlap: a hop starts where the previous one stopped
(``start_layer``), so no layer runs twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from daemon.errors import RouteUnavailable


@dataclass(frozen=True)
class Candidate:
    """A live node that could serve part of a route. Ranges are half-open ``[start, end)``."""

    url: str
    start: int
    end: int
    kv_cache: bool = True
    local: bool = False


@dataclass(frozen=True)
class Hop:
    """One node on a route and the layers ``[start_layer, end_layer)`` it runs there."""

    url: str
    start_layer: int
    end_layer: int
    kv_cache: bool = True
    local: bool = False

    def to_dict(self) -> dict:
        return {
            "url": self.url,
            "start_layer": self.start_layer,
            "end_layer": self.end_layer,
            "kv_cache": self.kv_cache,
            "local": self.local,
        }


def plan_route(candidates: list[Candidate], num_layers: int) -> list[Hop]:
    """The route with the fewest hops covering layers ``0..num_layers-1``.

    Ties prefer the local node (no HTTP hop), then caching nodes. Raises :class:`RouteUnavailable` naming the first
    uncovered layer range.
    """
    # best[p]: the shortest chain of hops whose layers end exactly at p
    best: dict[int, list[Hop]] = {0: []}
    for position in range(num_layers):
        chain = best.get(position)
        if chain is None:
            continue
        for c in candidates:
            if c.start <= position < c.end:
                hop = Hop(c.url, position, c.end, c.kv_cache, c.local)
                new_chain = chain + [hop]
                current = best.get(c.end)
                if current is None or _better(new_chain, current):
                    best[c.end] = new_chain
    if num_layers in best:
        return best[num_layers]
    reached = max(p for p in best if p <= num_layers)
    covered_from = [c.start for c in candidates if c.start > reached]
    gap_end = min(covered_from, default=num_layers) - 1
    raise RouteUnavailable(
        f"no live node serves layers {reached}-{gap_end} of 0-{num_layers - 1}; "
        "start a node with --layers covering them or add it with --peer"
    )


def _better(a: list[Hop], b: list[Hop]) -> bool:
    def key(chain: list[Hop]) -> tuple:
        return (len(chain), -sum(h.local for h in chain), -sum(h.kv_cache for h in chain))

    return key(a) < key(b)
