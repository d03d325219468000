"""The head's index of what the mesh's nodes hold: which token ids each session's caches cover.

A generation's session stays on every node of its route when it ends (a *retained prefix*), and
while it runs its tokens are indexed too. A new request whose prompt starts with tokens some
session holds starts from that session instead of prefilling everything: only the rest of the
prompt goes through the mesh, as one extend step per hop (see ``daemon.wire``).

Matching is on token ids, never on text: a chat template re-tokenises an assistant's answer and
adds end-of-turn tokens, so the longest common prefix of the ids the nodes hold and the new
prompt's ids is what can be reused. The rules, each chosen so no wrong token can come out:

- Only a session cached on exactly the new request's route (the same nodes from the same start
  layers) is used; after a reroute or failover its entry moves with it.
- A retained session that the prompt continues whole is *taken*: the nodes rename it, nothing is
  copied. Any other match is *forked*: the nodes copy the common prefix and the source stays.
- Layers that cannot be cut back (linear attention, a filled sliding window) continue only from
  exactly what they hold. The head learns that from the first ``not_croppable`` miss on a route and
  then offers that route only whole-session matches.
- A session still prefilling is waited for (a few seconds at most) when its prompt shares more with
  the new one than any ready session: concurrent clients with one system prompt compute it once.
- At least one prompt token is always computed: the last position's logits give the first token.
- Any doubt ends in a full prefill: a node that lost the session answers 409, as always.

``policy``: ``shared`` reuses across clients; ``client`` only within one client's own requests (the
OpenAI ``user`` field, else the client's address), since a client can time whether a prefix was
cached; ``off`` never reuses.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from daemon.api import Hop

POLICIES = ("shared", "client", "off")
MIN_REUSE_TOKENS = 16  # below this a copy and a possible 409 cost about what they save
MAX_ENTRIES = 512  # the nodes' stores bound the memory; this only bounds the head's bookkeeping
PREFILL_WAIT_SECONDS = 30.0

RouteKey = tuple[tuple[str, int], ...]


def route_key(route: Sequence[Hop]) -> RouteKey:
    """What identifies where a session's caches live: each hop's node and the layer it starts from."""
    return tuple((hop.url, hop.start_layer) for hop in route)


def common_prefix(held: Sequence[int], prompt: Sequence[int], limit: int) -> int:
    """How many leading ids ``held`` and ``prompt`` share, at most ``limit``."""
    n = min(len(held), len(prompt), limit)
    for i in range(n):
        if held[i] != prompt[i]:
            return i
    return n


@dataclass(frozen=True)
class Reuse:
    """Where a generation starts: the first ``keep`` prompt tokens of session ``source`` on every hop."""

    source: str
    keep: int
    take: bool  # the source is moved (a conversation's own next turn), not copied


@dataclass
class Held:
    """One session of the mesh as the head knows it: ``tokens[:held]`` are in every hop's cache."""

    session_id: str
    route: RouteKey
    scope: str | None
    tokens: list[int]  # the generation's ids; for a session still prefilling, the prompt it is computing
    held: int = 0
    live: bool = True  # False once retained
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # set after the first step succeeded


class PrefixIndex:
    """Sessions the head's generations left on (or are computing on) the mesh, by the token ids they hold."""

    def __init__(self, *, policy: str = "shared", min_tokens: int = MIN_REUSE_TOKENS,
                 max_entries: int = MAX_ENTRIES, wait_seconds: float = PREFILL_WAIT_SECONDS) -> None:
        if policy not in POLICIES:
            raise ValueError(f"prefix reuse policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.min_tokens = min_tokens
        self.max_entries = max_entries
        self.wait_seconds = wait_seconds
        self._entries: OrderedDict[str, Held] = OrderedDict()  # least recently used first
        self._uncroppable: set[RouteKey] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session_id: str) -> Held | None:
        return self._entries.get(session_id)

    # ---- finding a start ---------------------------------------------------------------------------

    async def find(self, prompt: Sequence[int], route: Sequence[Hop], scope: str | None) -> Reuse | None:
        """The best session to start ``prompt`` from on ``route``, claimed if it is to be taken; None: prefill."""
        if self.policy == "off":
            return None
        key = route_key(route)
        best, best_len = None, self.min_tokens - 1
        for entry in self._entries.values():
            if entry.route != key or (self.policy == "client" and entry.scope != scope):
                continue
            pending = entry.live and not entry.ready.is_set()
            held = len(entry.tokens) if pending else entry.held
            n = common_prefix(entry.tokens, prompt, min(held, len(prompt) - 1))
            if key in self._uncroppable and not (n == held and not pending):
                continue  # such layers continue only from all they hold
            if n > best_len:
                best, best_len = entry, n
        if best is None:
            return None
        if best.live and not best.ready.is_set():
            try:
                await asyncio.wait_for(best.ready.wait(), self.wait_seconds)
            except TimeoutError:
                return None
            if self._entries.get(best.session_id) is not best or best.route != key or best.held < best_len:
                return None  # it failed, moved or was re-prefilled meanwhile
        take = not best.live and best_len == best.held
        if take:
            del self._entries[best.session_id]  # claimed: nobody else may start from it now
        else:
            self._entries.move_to_end(best.session_id)
        return Reuse(best.session_id, best_len, take)

    # ---- what generations tell it ------------------------------------------------------------------

    def begin(self, session_id: str, route: Sequence[Hop], scope: str | None, tokens: list[int]) -> None:
        """A generation starts computing ``tokens`` (its prompt) on ``route``."""
        if self.policy == "off":
            return
        self._entries[session_id] = Held(session_id, route_key(route), scope, tokens)
        self._bound()

    def follow(self, session_id: str, tokens: list[int]) -> None:
        """Read the session's tokens from ``tokens`` from now on: the generation's own list, as it grows."""
        entry = self._entries.get(session_id)
        if entry is not None:
            entry.tokens = tokens

    def advance(self, session_id: str, held: int) -> None:
        """A step succeeded: every hop now holds the first ``held`` of the generation's tokens."""
        entry = self._entries.get(session_id)
        if entry is not None:
            entry.held = held
            entry.ready.set()

    def moved(self, session_id: str, route: Sequence[Hop]) -> None:
        """The session is being prefilled afresh (on a new route, or after a miss): it holds nothing yet."""
        entry = self._entries.get(session_id)
        if entry is not None:
            entry.route, entry.held = route_key(route), 0

    def retain(self, session_id: str) -> None:
        """The generation ended with its session kept on its nodes."""
        entry = self._entries.get(session_id)
        if entry is not None:
            entry.live = False
            entry.tokens = entry.tokens[:entry.held]  # the list was the generation's own, still growing
            self._entries.move_to_end(session_id)

    def forget(self, session_id: str) -> None:
        """The session is gone from some node (abandoned, failed, evicted): never start from it."""
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            entry.ready.set()  # anyone waiting on its prefill stops waiting

    def forget_if_live(self, session_id: str) -> None:
        """The generation is over: if it never said how it ended (it never ran), nothing of it is held."""
        entry = self._entries.get(session_id)
        if entry is not None and entry.live:
            self.forget(session_id)

    def cannot_crop(self, route: Sequence[Hop]) -> None:
        """A node of ``route`` keeps state that cannot be cut back: offer it whole-session matches only."""
        self._uncroppable.add(route_key(route))

    def _bound(self) -> None:
        while len(self._entries) > self.max_entries:
            victim = next((s for s, e in self._entries.items() if not e.live), None)
            if victim is None:
                break  # only live generations: each ends and is bounded by --max-generations
            del self._entries[victim]
