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
drafts (a plain step, plus what each drafted position adds: drafting it and verifying it). The k with the
best ratio wins, 0 included, and drafting must beat a plain step by ``MARGIN``: on a fast route with poor
acceptance, or where verifying a position costs nearly a step of its own, the head drafts nothing and the
stream is as fast as without speculation. The plain step it is weighed against is measured again every
``REFRESH_EVERY`` verify steps (the first decode steps after a prompt run slower than the ones after them,
and a cost measured once and kept made drafting look better than it was).

Drafters (``--draft-model``): :class:`NgramDrafter` (prompt lookup, no model) here, and a small model in the
head's process (:mod:`daemon.model.draft`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Protocol

MAX_NGRAM = 4  # the longest suffix prompt lookup tries to find again
EXPLORE_EVERY = 16  # steps: with 0 drafts chosen, draft 1 this often, so a changed acceptance is seen
PLAIN_SAMPLES = 3  # plain steps measured before the first draft
REFRESH_EVERY = 16  # verify steps in a row after which one plain step measures the plain cost again
MARGIN = 1.05  # the expected tokens per ms drafting must reach, over a plain step's: not noise's gains
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
    plain_ms: float | None = None  # moving average of a step with no drafts
    per_draft_ms: float | None = None  # ... of what one drafted token adds to a step (drafting and verifying)
    steps: int = 0
    verified: int = 0  # verify steps so far
    plain_samples: int = 0
    verified_in_a_row: int = 0  # verify steps since the last plain one
    _first_plain: list[float] = field(default_factory=list, repr=False)

    @property
    def acceptance(self) -> float:
        """The chance the tail keeps a drafted token given it kept the ones before, with a prior of 0.5."""
        return (self.accepted + PRIOR_STEPS / 2) / (self.checked + PRIOR_STEPS)

    def choose(self, limit: int) -> int:
        """Drafts for the next step, at most ``limit`` (what is left of the answer and of the context)."""
        self.steps += 1
        most = min(self.max_draft, limit)
        if most <= 0 or self.plain_samples < PLAIN_SAMPLES:
            return 0  # plain steps first: their time is what every choice is weighed against
        a = self.acceptance
        extra = self.per_draft_ms if self.per_draft_ms is not None else 0.15 * self.plain_ms
        best, best_rate = 0, MARGIN / self.plain_ms
        expected = 1.0
        for k in range(1, most + 1):
            expected += a ** k
            rate = expected / (self.plain_ms + k * extra)
            if rate > best_rate:
                best, best_rate = k, rate
        if best == 0 and self.steps % EXPLORE_EVERY == 0:
            return 1
        if best > 0 and self.verified_in_a_row >= REFRESH_EVERY:
            return 0  # the plain step's time again
        return best

    def observe(self, drafted: int, kept: int, step_ms: float) -> None:
        """A step with ``drafted`` drafts (0: plain) of which the tail kept ``kept``, taking ``step_ms`` in all."""
        if drafted == 0:
            # the first few: their median (the first decode steps after a prompt run slower than the rest);
            # then a moving average weighting each new plain step half, as they are rare while drafting pays
            self._first_plain.append(step_ms)
            self.plain_samples += 1
            self.plain_ms = (statistics.median(self._first_plain) if self.plain_samples <= PLAIN_SAMPLES
                             else _ema(self.plain_ms, step_ms, weight=0.5))
            self.verified_in_a_row = 0
            return
        self.verified_in_a_row += 1
        # the tail checks drafts in order up to the first it rejects
        self.checked = self.checked * DECAY + min(kept + 1, drafted)
        self.accepted = self.accepted * DECAY + kept
        self.verified += 1
        if self.plain_ms is not None and self.verified > 1:  # the first also drafted after the whole prompt
            self.per_draft_ms = _ema(self.per_draft_ms, max(0.0, (step_ms - self.plain_ms) / drafted))


def _ema(old: float | None, new: float, weight: float = 0.2) -> float:
    return new if old is None else old + weight * (new - old)

