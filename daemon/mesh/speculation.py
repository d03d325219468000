"""Speculative decoding on the head: draft a few tokens cheaply, verify them along the route in one pass.

A decode step through the mesh costs every node's layers and every hop's round trip, and checking k+1
positions costs a node about what one costs (its weights are read once either way). So the head drafts k
tokens, sends the last accepted token and the k drafts as one **verify** step (``X-Meshnet-Draft``), and the
tail samples position after position as single steps would, stopping at the first token that differs from
the draft: every step yields at least one token, and up to k+1.

**Exactness.** Drafts are deterministic (the draft model's greedy choice, or a lookup), and the tail samples
each position with that position's own seed: a drafted token is kept exactly when the tail would have
sampled it anyway. Greedy answers are the same tokens as without speculation, and with a temperature the
same tokens for the same seed. For a deterministic draft this *is* the standard accept/resample rule (accept
``d`` with probability ``p(d)/q(d) = p(d)``; on rejection sample from ``p`` without ``d``), so the output
distribution is the target's own.

**How many to draft** (:class:`SpeculationPolicy`): the expected tokens a pass yields with k drafts,
``1 + a + a^2 + ... + a^k`` at the measured acceptance ``a``, against the measured cost of a pass with k
drafts: a plain step, plus what each drafted position adds (drafting it and verifying it), measured on
runs of verify steps. The k with the best ratio wins, 0 included: on a fast route with poor acceptance, or
where verifying a position costs nearly a step of its own (a bfloat16 node verifies position after
position), the head drafts nothing and the stream is as fast as without speculation; a run of verify
steps starts only where it promises ``START_MARGIN`` over plain steps. A plain step is
priced at the fastest of the last few (one timed right after verify steps or a prompt reads slower, which
would make drafting look better than it is), and timed again every ``REFRESH_EVERY`` verify steps. While
nothing is drafted, a probe of one draft now and then watches the acceptance, within ``PROBE_SHARE`` of the
time (a probe costs more than a draft in a run: the draft model first catches up on the tokens since it
last drafted). What a generation learned about its route is where the next one on that route starts
(:class:`SpeculationMemory`, on the head).

Drafters (``--draft-model``): :class:`NgramDrafter` (prompt lookup, no model) here, and a small model in the
head's process (:mod:`daemon.model.draft`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from daemon.mesh.routing import route_key

MAX_NGRAM = 4  # the longest suffix prompt lookup tries to find again
EXPLORE_EVERY = 16  # steps: with 0 drafts chosen, draft 1 at most this often, so a changed acceptance is seen
PROBE_SHARE = 0.02  # ... and only while the probes' extra cost stays within this share of the plain steps' time
CARRIED_STEPS = 4.0  # a route's acceptance, handed to its next generation, weighs as this many checked drafts
PLAIN_SAMPLES = 3  # plain steps measured before the first draft
REFRESH_EVERY = 16  # verify steps in a row after which one plain step measures the plain cost again
PLAIN_WINDOW = 8  # plain steps: the fastest of the last this many is a plain step's cost
START_MARGIN = 1.1  # drafting, to start after plain steps, must promise this many times a plain step's tokens/ms
PRIOR_STEPS = 2.0  # pseudo-observations of acceptance 0.5 before any is measured
DECAY = 0.95  # each verify step's weight against the ones before: the acceptance follows the text


class DraftSession(Protocol):
    """One generation's drafter: proposes up to ``k`` tokens to follow ``ids`` (the prompt and answer so far)."""

    async def propose(self, ids: list[int], k: int) -> list[int]: ...

    def close(self) -> None: ...


class Drafter(Protocol):
    """What ``--draft-model`` made: a :class:`DraftSession` for each generation."""

    name: str

    def session(self) -> DraftSession: ...


class NgramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last few tokens.

    Answers that quote their prompt (code edits, summaries, retrieval) repeat long spans of it; a chat's free
    text rarely does, and then nothing is drafted (a plain step).
    """

    name = "ngram"

    def session(self) -> _NgramSession:
        return _NgramSession()


class _NgramSession:
    async def propose(self, ids: list[int], k: int) -> list[int]:
        return lookup(ids, k)

    def close(self) -> None:
        pass


def lookup(ids: list[int], k: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """Up to ``k`` tokens following the latest earlier occurrence of ``ids``'s last n tokens, the longest n
    (``max_ngram`` down to 1) that occurs; none if no suffix occurs earlier."""
    if k <= 0:
        return []
    size = len(ids)
    for n in range(min(max_ngram, size - 1), 0, -1):
        suffix = ids[size - n:]
        # latest occurrence first: the nearer context is the likelier to continue the same way
        for start in range(size - n - 1, -1, -1):
            if ids[start:start + n] == suffix:
                follows = ids[start + n:start + n + k]
                if follows:
                    return follows
    return []


@dataclass
class SpeculationPolicy:
    """How many tokens to draft next, from what the generation measured so far (see the module's doc)."""

    max_draft: int
    accepted: float = 0.0  # decayed counts of drafted positions the tail checked, and of those it kept
    checked: float = 0.0
    # a step with no drafts: the fastest of the last few (plain steps timed right after verify steps or a prompt
    # read slower than plain steps in a row, and a slow reading would make drafting look better than it is)
    plain_ms: float | None = None
    # ... of what one drafted token adds to a step (drafting and verifying), from verify steps that follow
    # verify steps: a draft model idle for a while first catches up on the tokens since, which drafting
    # step after step does not pay
    per_draft_ms: float | None = None
    probe_ms: float | None = None  # what the last probe (a verify step after plain ones) cost over a plain step
    plain_since_probe_ms: float = 0.0  # plain steps' time since the last probe
    steps_since_probe: int = 0
    verified: int = 0  # verify steps so far
    verified_in_a_row: int = 0  # verify steps since the last plain one
    recent_plain: deque[float] = field(default_factory=lambda: deque(maxlen=PLAIN_WINDOW), repr=False)

    @property
    def acceptance(self) -> float:
        """The chance the tail keeps a drafted token given it kept the ones before, with a prior of 0.5."""
        return (self.accepted + PRIOR_STEPS / 2) / (self.checked + PRIOR_STEPS)

    def carried(self, max_draft: int) -> SpeculationPolicy:
        """A new generation's policy on the route this one ran on: its costs as measured, its acceptance as a few
        steps' worth of evidence (the next text may draft better or worse), probes spaced on from here."""
        weight = min(1.0, CARRIED_STEPS / self.checked) if self.checked else 0.0
        return SpeculationPolicy(
            max_draft, accepted=self.accepted * weight, checked=self.checked * weight, plain_ms=self.plain_ms,
            per_draft_ms=self.per_draft_ms, probe_ms=self.probe_ms, plain_since_probe_ms=self.plain_since_probe_ms,
            steps_since_probe=self.steps_since_probe, recent_plain=deque(self.recent_plain, maxlen=PLAIN_WINDOW))

    def choose(self, limit: int) -> int:
        """Drafts for the next step, at most ``limit`` (what is left of the answer and of the context)."""
        self.steps_since_probe += 1
        most = min(self.max_draft, limit)
        if most <= 0 or len(self.recent_plain) < PLAIN_SAMPLES:
            return 0  # plain steps first: their time is what every choice is weighed against
        a = self.acceptance
        extra = self.per_draft_ms if self.per_draft_ms is not None else 0.15 * self.plain_ms
        # a run of verify steps starts only for a clear gain: its first step costs more (the draft model catches
        # up on the tokens since it last drafted), and a gain within the noise of a step's time is none
        best, best_rate = 0, (START_MARGIN if self.verified_in_a_row == 0 else 1.0) / self.plain_ms
        expected = 1.0
        for k in range(1, most + 1):
            expected += a ** k
            rate = expected / (self.plain_ms + k * extra)
            if rate > best_rate:
                best, best_rate = k, rate
        if best == 0:
            # a probe of one draft now and then sees a changed acceptance; it costs more than drafting step after
            # step does, so probes take at most PROBE_SHARE of the plain steps' time
            due = self.steps_since_probe >= EXPLORE_EVERY and (
                self.probe_ms is None or self.plain_since_probe_ms * PROBE_SHARE >= self.probe_ms)
            return 1 if due else 0
        if self.verified_in_a_row >= REFRESH_EVERY:
            return 0  # the plain step's time again
        return best

    def observe(self, drafted: int, kept: int, step_ms: float) -> None:
        """A step with ``drafted`` drafts (0: plain) of which the tail kept ``kept``, taking ``step_ms`` in all."""
        if drafted == 0:
            self.recent_plain.append(step_ms)
            self.plain_ms = min(self.recent_plain)
            self.plain_since_probe_ms += step_ms
            self.verified_in_a_row = 0
            return
        # the tail checks drafts in order up to the first it rejects
        self.checked = self.checked * DECAY + min(kept + 1, drafted)
        self.accepted = self.accepted * DECAY + kept
        self.verified += 1
        self.verified_in_a_row += 1
        after_plain = self.verified_in_a_row == 1  # a probe, or the first of a run of verify steps
        if after_plain:
            self.plain_since_probe_ms, self.steps_since_probe = 0.0, 0
        if self.plain_ms is None or self.verified == 1:
            return  # the first verify step also drafted after the whole prompt: no measure of either cost
        overhead = max(0.0, step_ms - self.plain_ms)
        if after_plain:
            self.probe_ms = overhead
        else:
            self.per_draft_ms = _ema(self.per_draft_ms, overhead / drafted)


class SpeculationMemory:
    """What a head's generations learned about drafting on each route, handed to the next one on it: a short
    answer then starts from the route's measured costs rather than trying, and probing, afresh."""

    def __init__(self, routes: int = 64) -> None:
        self._routes = routes
        self._policies: OrderedDict[tuple, SpeculationPolicy] = OrderedDict()

    def policy(self, route: Sequence, max_draft: int) -> SpeculationPolicy:
        before = self._policies.get(route_key(route))
        return SpeculationPolicy(max_draft) if before is None else before.carried(max_draft)

    def keep(self, route: Sequence, policy: SpeculationPolicy) -> None:
        key = route_key(route)
        self._policies[key] = policy
        self._policies.move_to_end(key)
        while len(self._policies) > self._routes:
            self._policies.popitem(last=False)



def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + 0.2 * (new - old)

