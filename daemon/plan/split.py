"""Splitting a model's layers over machines of given memory, and what is left for session caches.

Every node keeps back a reserve for the runtime and holds the embeddings (any node can head); the last
node (the tail) also holds the final norm and an untied LM head. Among the contiguous splits that fit,
the planner takes the one that lets the whole mesh hold the most sessions of the planned length (a
session needs cache room on every node of its route), and among those the most even: for layers that
are all alike, layers in proportion to the memory each node has left after its reserve and embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from daemon.model.footprint import ModelFootprint, Precision

GIB = 1 << 30
_BALANCE_STEPS = 40  # bisection steps on the fill ratio: far finer than one layer


@dataclass(frozen=True)
class NodePlan:
    """One machine's share: layers ``[start, end)``, its weights, and the room left for session caches."""

    memory: int
    start: int
    end: int
    weights: dict[str, int]
    kv_room: int  # memory - reserve - weights: the node's --kv-max-bytes
    kv_bytes_per_token: int | None
    session_bytes: int | None  # one session of the planned length, at most
    sessions: int | None

    @property
    def weights_total(self) -> int:
        return sum(self.weights.values())


@dataclass(frozen=True)
class Alternative:
    """Another precision, and whether the model fits in it."""

    precision: Precision
    fits: bool
    sessions: int | None


@dataclass
class MeshPlan:
    """The proposal for one precision: nodes when the model fits, else what is missing."""

    footprint: ModelFootprint
    precision: Precision
    context: int
    reserve: int
    memories: list[int]
    nodes: list[NodePlan] | None = None
    shortfall: int = 0  # bytes the machines lack in all (0 when the memory suffices in total)
    problem: str | None = None
    extra_node: int | None = None  # the smallest whole-GiB node that, added at the end, makes it fit
    alternatives: list[Alternative] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.nodes is not None

    @property
    def sessions(self) -> int | None:
        """Sessions of the planned length the whole mesh holds: the fewest of any node."""
        if not self.nodes or any(n.sessions is None for n in self.nodes):
            return None
        return min(n.sessions for n in self.nodes)


class _Costs:
    """Per-layer costs for one footprint and precision: weights, and cache room per session."""

    def __init__(self, footprint: ModelFootprint, precision: Precision, context: int, reserve: int,
                 memories: list[int]) -> None:
        n = footprint.num_layers
        self.weights = footprint.layer_bytes(precision)
        fixed = footprint.weights_bytes(n, n, precision)  # a node with no layers: embeddings, norm and LM head
        tail_extra = fixed["final_norm_and_lm_head"]
        self.capacity = [m - reserve - fixed["embeddings"] - (tail_extra if i == len(memories) - 1 else 0)
                         for i, m in enumerate(memories)]
        if footprint.caches is None:
            self.per_session, self.overhead = None, 0
        else:
            self.overhead = footprint.session_bytes(0, 0, precision, context)  # per node, whatever it hosts
            self.per_session = [footprint.session_bytes(j, j + 1, precision, context) - self.overhead
                                for j in range(n)]

    def split(self, sessions: int, ratio: float = 1.0) -> list[tuple[int, int]] | None:
        """The greedy contiguous split where node i's load stays within ``ratio`` of its capacity, holding
        ``sessions`` sessions, or None. Filling each node as far as it goes finds a split if any exists."""
        n, k = len(self.weights), len(self.capacity)
        ranges, start = [], 0
        for i, capacity in enumerate(self.capacity):
            limit = capacity * ratio
            load = sessions * self.overhead
            end = start
            last_allowed = n - (k - 1 - i)  # leave one layer for each node after this one
            while end < last_allowed:
                cost = self.weights[end] + (sessions * self.per_session[end] if self.per_session else 0)
                if load + cost > limit:
                    break
                load, end = load + cost, end + 1
            if end == start or (i == k - 1 and end < n):
                return None
            ranges.append((start, end))
            start = end
        return ranges

    def most_sessions(self) -> int:
        """The most sessions every node can hold at once with some split (0 when caches are not understood)."""
        if not self.per_session or not (any(self.per_session) or self.overhead):
            return 0
        low, high = 0, 1
        while self.split(high):
            low, high = high, high * 2
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if self.split(middle) else (low, middle)
        return low

    def balanced(self, sessions: int) -> list[tuple[int, int]]:
        """The split at ``sessions`` with the lowest highest fill ratio of any node."""
        low, high = 0.0, 1.0
        for _ in range(_BALANCE_STEPS):
            middle = (low + high) / 2
            low, high = (low, middle) if self.split(sessions, middle) else (middle, high)
        return self.split(sessions, high)


def plan_mesh(footprint: ModelFootprint, memories: list[int], precision: Precision, *, context: int,
              reserve: int, alternatives: bool = True) -> MeshPlan:
    """Propose a contiguous layer range for each machine of ``memories`` bytes (in route order)."""
    if len(memories) > footprint.num_layers:
        raise ValueError(f"{len(memories)} nodes for a model of {footprint.num_layers} layers: "
                         f"give at most {footprint.num_layers} --node")
    plan = MeshPlan(footprint, precision, context, reserve, list(memories))
    costs = _Costs(footprint, precision, context, reserve, memories)
    if costs.split(0) is None:
        _explain_misfit(plan, costs)
        if alternatives:
            plan.alternatives = _alternatives(plan)
        return plan
    sessions = costs.most_sessions()
    plan.nodes = [_node_plan(plan, memory, start, end)
                  for memory, (start, end) in zip(memories, costs.balanced(sessions))]
    return plan


def _node_plan(plan: MeshPlan, memory: int, start: int, end: int) -> NodePlan:
    footprint, precision = plan.footprint, plan.precision
    weights = footprint.weights_bytes(start, end, precision)
    room = memory - plan.reserve - sum(weights.values())
    per_session = footprint.session_bytes(start, end, precision, plan.context)
    return NodePlan(memory=memory, start=start, end=end, weights=weights, kv_room=room,
                    kv_bytes_per_token=footprint.kv_bytes_per_token(start, end, precision),
                    session_bytes=per_session, sessions=room // per_session if per_session else None)


def _explain_misfit(plan: MeshPlan, costs: _Costs) -> None:
    footprint, precision, k = plan.footprint, plan.precision, len(plan.memories)
    n = footprint.num_layers
    fixed = footprint.weights_bytes(n, n, precision)
    needed = sum(costs.weights) + k * (plan.reserve + fixed["embeddings"]) + fixed["final_norm_and_lm_head"]
    plan.shortfall = max(0, needed - sum(plan.memories))
    smallest = min(costs.weights)
    too_small = [i for i, capacity in enumerate(costs.capacity) if capacity < smallest]
    if too_small:
        i = too_small[0]
        plan.problem = (f"node {i} ({format_bytes(plan.memories[i])}) cannot hold even one layer "
                        f"({format_bytes(smallest)}) beside its reserve and the embeddings")
    elif plan.shortfall:
        plan.problem = f"the weights and reserves need {format_bytes(needed)}, the nodes have " \
                       f"{format_bytes(sum(plan.memories))}: {format_bytes(plan.shortfall)} short"
    else:
        plan.problem = "the layers do not divide onto these nodes in route order: a node is too small for its share"
    if not too_small:
        plan.extra_node = _extra_node(plan, needed)


def _extra_node(plan: MeshPlan, needed: int) -> int | None:
    """The smallest whole number of GiB a node added at the end of the route needs for the model to fit."""
    def fits(gib: int) -> bool:
        memories = [*plan.memories, gib * GIB]
        if len(memories) > plan.footprint.num_layers:
            return False
        costs = _Costs(plan.footprint, plan.precision, plan.context, plan.reserve, memories)
        return costs.split(0) is not None

    high = -(-needed // GIB)  # enough to hold the whole model alone
    if not fits(high):
        return None
    low = 0  # does not fit without the node
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    return high * GIB


def _alternatives(plan: MeshPlan) -> list[Alternative]:
    """bfloat16, int8, both, or int4, where the plan's own precision does not fit."""
    precision = plan.precision
    candidates = []
    if precision.dtype == "float32":
        candidates.append(Precision("bfloat16", precision.quantize))
    if precision.quantize is None:
        candidates.append(Precision(precision.dtype, "int8"))
        if precision.dtype == "float32":
            candidates.append(Precision("bfloat16", "int8"))
    if precision.quantize != "int4":
        candidates.append(Precision(precision.dtype, "int4"))
    found = []
    for candidate in candidates:
        other = plan_mesh(plan.footprint, plan.memories, candidate, context=plan.context, reserve=plan.reserve,
                          alternatives=False)
        found.append(Alternative(candidate, other.fits, other.sessions))
    return found


def format_bytes(n: int | float) -> str:
    """Bytes in binary units, three significant figures: ``1.50 GiB``, ``13.5 MiB``, ``768 B``."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"
    return f"{int(n)} B"
