"""What a head keeps to fail over by replaying only the lost span: each remote hop's inputs so far.

Every step sends each remote hop of the route its input activations (the hidden states after the layers before
it). The head keeps them, per hop, for every position the nodes hold, in the wire's dtype. When a node fails
mid-generation and a live node can run exactly its layers, that node alone is prefilled from the failed one's
inputs (where it takes several nodes, a chain of them, each from the one before it), and the step that failed goes
on from there; the nodes that did not fail keep their sessions and compute nothing again
(:meth:`daemon.mesh.generation.GenerationLoop._replace_span`).

Cost: a position's hidden state per remote hop, ``hidden_size x 4`` bytes on a float32 wire (2.3 KB for the
built-in model, 32 KB for a 70B model's 8192). A generation's inputs are bounded by ``REPLAY_BUDGET_BYTES``;
past it they are dropped and a failover prefills every node of the new route again, as without them. A
generation that starts from a reused prefix takes that prefix's inputs from the generation that made it
(:class:`RetainedInputs`), since the head never sent them itself.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from daemon import wire
from daemon.mesh.routing import route_key

REPLAY_BUDGET_BYTES = 256 << 20  # per generation: past this, failovers re-prefill every node


class SpanInputs:
    """One hop's inputs for positions ``0..positions-1``, as contiguous bytes."""

    def __init__(self, dtype: str, hidden: int, itemsize: int) -> None:
        self.dtype, self.hidden = dtype, hidden
        self.row = hidden * itemsize  # bytes of one position
        self.data = bytearray()

    @property
    def positions(self) -> int:
        return len(self.data) // self.row

    def keep(self, start: int, activation: wire.Activation) -> bool:
        """Hold ``activation``'s positions from ``start`` on, dropping any held past ``start`` (a verify step's
        rejected positions); False where that would leave a gap, or the activation is of another shape."""
        _, positions, hidden = activation.shape
        data = memoryview(activation.data).cast("B")
        if activation.dtype != self.dtype or hidden != self.hidden or start > self.positions \
                or len(data) != positions * self.row:
            return False
        del self.data[start * self.row:]
        self.data += data
        return True

    def activation(self, positions: int) -> wire.Activation | None:
        """The inputs of positions ``0..positions-1``, or None where not all of them are held."""
        if positions <= 0 or positions > self.positions:
            return None
        return wire.Activation(self.dtype, (1, positions, self.hidden), bytes(self.data[:positions * self.row]))


class ReplayInputs:
    """The inputs of every remote hop of a generation's route, by hop index, within a byte budget."""

    def __init__(self, budget: int | None = None) -> None:
        self.budget = REPLAY_BUDGET_BYTES if budget is None else budget
        self.spans: dict[int, SpanInputs | None] = {}  # None: this hop's inputs have a gap, or were dropped
        self.over_budget = False

    @property
    def nbytes(self) -> int:
        return sum(len(span.data) for span in self.spans.values() if span is not None)

    def record(self, start: int, inputs: dict[int, wire.Activation]) -> None:
        """A step succeeded: its positions from ``start`` on, sent to the hops ``inputs`` names."""
        if self.over_budget:
            return
        for index, activation in inputs.items():
            span = self.spans.get(index, ...)
            if span is ...:
                span = SpanInputs(activation.dtype, activation.shape[2], wire.DTYPE_SIZES[activation.dtype])
            if span is not None and not span.keep(start, activation):
                span = None
            self.spans[index] = span
        if self.nbytes > self.budget:
            self.spans.clear()
            self.over_budget = True

    def inputs(self, index: int, positions: int) -> wire.Activation | None:
        """Hop ``index``'s inputs for positions ``0..positions-1``, if all are held."""
        span = self.spans.get(index)
        return span.activation(positions) if span is not None else None

    def splice(self, index: int, inputs: list[wire.Activation]) -> None:
        """Hop ``index`` was replaced by ``len(inputs)`` hops whose inputs so far are ``inputs``: the hops after it
        move along."""
        if self.over_budget:
            return
        moved = {(i if i < index else i + len(inputs) - 1): span for i, span in self.spans.items() if i != index}
        for k, activation in enumerate(inputs):
            span = SpanInputs(activation.dtype, activation.shape[2], wire.DTYPE_SIZES[activation.dtype])
            moved[index + k] = span if span.keep(0, activation) else None
        self.spans = moved

    def clear(self) -> None:
        """The route changed under every hop (a full re-prefill): what is held no longer matches its hops."""
        self.spans.clear()


class RetainedInputs:
    """The inputs of the head's sessions other generations may start from (prefix reuse: the nodes hold the prefix,
    and the head could not replay it without its inputs): running generations', and those of generations whose
    sessions the nodes retained, the most recent ``sessions`` of these within ``REPLAY_BUDGET_BYTES`` in all.

    A generation registers ``current``, a function giving its route and inputs as they stand (both change as it
    goes), for as long as it runs; :meth:`keep` holds them on once it ends retained, :meth:`drop` when it does not.
    """

    def __init__(self, sessions: int = 16) -> None:
        self.sessions = sessions
        self._running: dict[str, Callable[[], tuple[Sequence, ReplayInputs]]] = {}
        self._retained: OrderedDict[str, tuple[tuple, ReplayInputs]] = OrderedDict()

    def follow(self, session_id: str, current: Callable[[], tuple[Sequence, ReplayInputs]]) -> None:
        self._running[session_id] = current

    def keep(self, session_id: str) -> None:
        current = self._running.pop(session_id, None)
        if current is None:
            return
        route, replay = current()
        if not replay.spans or replay.over_budget:
            return
        self._retained[session_id] = (route_key(route), replay)
        self._retained.move_to_end(session_id)
        while len(self._retained) > self.sessions \
                or sum(r.nbytes for _, r in self._retained.values()) > REPLAY_BUDGET_BYTES:
            self._retained.popitem(last=False)

    def drop(self, session_id: str) -> None:
        self._running.pop(session_id, None)
        self._retained.pop(session_id, None)

    def start(self, source: str, keep: int, route: Sequence) -> ReplayInputs:
        """A generation starting from the first ``keep`` positions of session ``source`` on ``route``: its inputs so
        far, copied (none where the head does not hold them all, or they were sent along another route)."""
        replay = ReplayInputs()
        if source in self._running:
            source_route, held = self._running[source]()
            key = route_key(source_route)
        elif source in self._retained:
            key, held = self._retained[source]
        else:
            return replay
        if key != route_key(route):
            return replay
        for index, span in held.spans.items():
            if span is not None and span.positions >= keep:
                copy = SpanInputs(span.dtype, span.hidden, span.row // span.hidden)
                copy.data = span.data[:keep * span.row]
                replay.spans[index] = copy
        return replay

