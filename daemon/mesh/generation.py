"""The head's generation loop: the client side of the mesh.

One session id per generation; a prefill of the whole prompt along the route, then one-token decode steps
(each step along the route: :func:`daemon.mesh.route_step.run_step`). A 409 cache miss on any hop costs one
re-prefill of the sequence so far under the same session id, never a failed answer. A hop that fails (refused
or reset connection, timeout, 5xx, a draining node) is a failover: where a live node can take exactly the
failed node's layers, only that node is prefilled, from the inputs the head kept (:mod:`daemon.mesh.replay`);
otherwise the router plans a route without the node and the sequence so far is re-prefilled there under the
same session id. Either way the client sees the same tokens and no error. A route with a node that does not
cache runs stateless (the full sequence every step); a tail that returns no ``token_id`` (an older node) makes
every step a prefill.

With a drafter (``--draft-model``, :mod:`daemon.mesh.speculation`) a decode step may carry drafted tokens
after the newest one: a verify step, which yields every drafted token the tail agrees with and one more.
The next step's ``past_len`` tells the nodes how many of the verify step's positions to keep.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from daemon import wire
from daemon.api import GenerationStats, Hop, Sampling
from daemon.errors import BadRequest, CacheMiss, HopFailed, UpstreamError
from daemon.mesh.hops import HopClient, HopReply
from daemon.mesh.prefix import PrefixIndex, Reuse
from daemon.mesh.replay import ReplayInputs, RetainedInputs
from daemon.mesh.route_step import HeadBackend, Router, run_step
from daemon.mesh.speculation import DraftSession, SpeculationMemory, SpeculationPolicy
from daemon.mesh.text import TextStream

REROUTE_CHECK_STEPS = 16  # how often a generation asks whether its route has become far slower

log = logging.getLogger(__name__)


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling  # sent to the tail
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # generate max_tokens whatever the model says (benchmarks, golden tests)
    reuse: Reuse | None = None  # start from a session the route's nodes hold (see daemon.mesh.prefix)
    drafter: DraftSession | None = None  # speculative decoding: proposes tokens to verify (closed at the end)
    max_draft: int = 0  # the most tokens one verify step carries
    speculation: SpeculationMemory | None = None  # the head's: what drafting cost on each route before
    retained: RetainedInputs | None = None  # the head's: the inputs of sessions kept as prefixes, for reuse


@dataclass
class TokenEvent:
    token_id: int  # -1: no token of the answer (text held back until the end, or an older tail's)
    text: str  # newly final text, maybe empty
    logprob: float | None = None  # the token's, when the request asked for logprobs
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, logprob), best first


class GenerationLoop:
    """One generation along a route: iterate :meth:`run` for text as it becomes final.

    Each step ends in one of a few outcomes, each handled by its own method: a token
    (:meth:`_took_token`), an older tail's text without a token id (:meth:`_took_older_tail_text`),
    a cache miss (:meth:`_cache_miss`: one re-prefill), a failed hop (:meth:`_failover`), and, every
    :data:`REROUTE_CHECK_STEPS` decode steps, a possible move to a far faster route (:meth:`_reroute`).

    ``stats`` (created by the caller so it can be read while streaming) is filled in as it goes;
    ``stats.finish_reason`` is ``"stop"`` or ``"length"`` at the end. When a hop fails, ``router``
    supplies a new route; if none covers every layer within its bound, its ``RouteUnavailable`` ends
    the generation.

    ``request.reuse``: the first step extends a session the route's nodes already hold instead of
    prefilling the prompt; if any node cannot (409), the whole prompt is prefilled, as cold. ``index``
    (where the caller registered this generation) is told what the nodes hold after every step; a
    generation that ends keeps its session on every node as a retained prefix, one that fails or is
    abandoned frees it. Nothing happens until :meth:`run` is first iterated.
    """

    def __init__(self, backend: HeadBackend, client: HopClient, router: Router, route: list[Hop],
                 request: GenerationRequest, *, stats: GenerationStats | None = None,
                 index: PrefixIndex | None = None) -> None:
        self.backend, self.client, self.router, self.request, self.index = backend, client, router, request, index
        self.session_id = stats.session_id if stats else uuid.uuid4().hex
        self.stats = stats or GenerationStats(session_id=self.session_id, prompt_tokens=len(request.prompt_ids))
        self.route = route
        self.cached = all(hop.kv_cache for hop in route)
        self.ids = list(request.prompt_ids)  # the prompt and the answer's tokens so far
        self.generated: list[int] = []  # the answer's token ids; -1 for each step of an older tail
        self.legacy_text = ""  # only for a tail that returns text without token ids
        self.past_len = 0  # tokens every node of the route holds for this session
        self.mode: str | None = "prefill" if self.cached else None  # the next step's: prefill, decode, None (stateless)
        self.reuse = request.reuse if self.cached else None
        if self.reuse is not None:
            self.mode, self.past_len = "decode", self.reuse.keep  # an extend step: only the prompt's new tokens
        self.stream = TextStream(backend.decode, request.stop)
        # a repetition penalty looks at the prompt too: its ids once, as a set; the answer's go with every step
        penalized = request.sampling.repetition_penalty != 1.0
        self.penalized_prompt = tuple(sorted(set(request.prompt_ids))) if penalized else ()
        self.started = 0.0
        self.decode_started = 0.0
        self.last_token_at = 0.0
        self.decode_steps = 0
        # speculative decoding needs caches that keep a verify step's positions
        self.policy: SpeculationPolicy | None = None
        if request.drafter is not None and self.cached:
            memory = request.speculation
            self.policy = memory.policy(route, request.max_draft) if memory else SpeculationPolicy(request.max_draft)
        self._verifying = False  # the step under way carries drafts
        # each remote hop's inputs so far, a reused prefix's included: a failover prefills only the replacement
        retained, reuse = request.retained, self.reuse
        self.replay = (retained.start(reuse.source, reuse.keep, route)
                       if retained is not None and reuse is not None else ReplayInputs())

    @property
    def speculating(self) -> bool:
        """Whether the next decode step may carry drafts: a drafter, and every node of the route verifies."""
        return self.policy is not None and self.mode == "decode" and self.reuse is None \
            and all(hop.verifies for hop in self.route)

    async def run(self) -> AsyncIterator[TokenEvent]:
        """Step until the answer ends (end of sequence, a stop string, ``max_tokens``), yielding its text."""
        request, stats = self.request, self.stats
        if not request.prompt_ids:
            raise BadRequest("the prompt is empty", param="messages")
        stats.route = list(self.route)
        if self.index is not None:
            self.index.follow(self.session_id, self.ids)
        self.started = time.perf_counter()
        self.progressed_at = self.router.clock()  # the last token's time, for giving up (see _failover)
        if request.retained is not None:  # until it ends: a generation reusing this one's prefix takes its inputs
            request.retained.follow(self.session_id, lambda: (self.route, self.replay))
        try:
            while len(self.generated) < request.max_tokens:
                if self.mode == "decode" and self.decode_steps and self.decode_steps % REROUTE_CHECK_STEPS == 0:
                    self._reroute()
                step_started = time.perf_counter()
                draft = await self._draft() if self.speculating else []
                feed = (self.ids[self.past_len:] if self.mode == "decode" else self.ids) + draft
                try:
                    reply = await self._step(feed, draft)
                except CacheMiss as miss:
                    self._cache_miss(miss)
                    continue
                except HopFailed as failure:
                    await self._failover(failure)
                    continue
                self._count_step(len(feed), step_started)
                if reply.token_id is None:
                    replies = [reply]
                elif draft:
                    replies = self._verified(reply, draft, step_started)
                else:
                    if self.policy is not None and self.mode == "decode" and self.generated:
                        self.policy.observe(0, 0, (time.perf_counter() - step_started) * 1000.0)
                    replies = [reply]
                for answer in replies:
                    event, done = (self._took_older_tail_text(answer) if answer.token_id is None
                                   else self._took_token(answer))
                    self._time_token()
                    if done or self.stream.stopped:
                        stats.finish_reason = "stop"
                        if event.text or event.logprob is not None:
                            yield event
                        return
                    yield event
                    if len(self.generated) >= request.max_tokens:
                        break
            stats.finish_reason = "length"
            tail = self.stream.finish()
            if tail:
                yield TokenEvent(-1, tail)
        finally:
            if request.drafter is not None:
                request.drafter.close()
            if self.policy is not None and request.speculation is not None:
                request.speculation.keep(self.route, self.policy)
            self._end()

    async def _step(self, feed: list[int], draft: list[int]) -> HopReply:
        sampling = self.request.sampling
        history = wire.History(self.penalized_prompt, tuple(self.stats.token_ids)) if sampling.penalized else None
        self._verifying = bool(draft)
        inputs: dict[int, wire.Activation] = {}
        step = dict(mode=self.mode, session_id=self.session_id, past_len=self.past_len, sampling=sampling,
                    prefix=self.reuse, on_hop=self._observe, history=history, draft=draft or None, inputs=inputs)
        resume, replaced = None, 0
        while True:  # a hop that fails is replaced and the step goes on from it: several may drain at once
            try:
                reply = await run_step(self.backend, self.client, self.route, feed, **step, resume=resume)
                break
            except HopFailed as failure:
                index = await self._replace_span(failure, inputs, history) if replaced < len(self.route) else None
                if index is None:
                    raise  # a failover of the whole route
                resume, replaced = (index, inputs[index]), replaced + 1
        if self.mode is not None:  # the positions every hop now holds, from where this step began
            self.replay.record(self.past_len if self.mode == "decode" else 0, inputs)
        return reply

    async def _replace_span(self, failure: HopFailed, inputs: dict[int, wire.Activation],
                            history: wire.History | None) -> int | None:
        """A remote hop failed a decode step: put live nodes that run exactly its layers in the route, and return
        the index of the hop to go on from; None where none can (then every node is prefilled again).

        Where the failed node handed the session to such a node as it drained (it said so in its answer, or when
        it left), the step simply goes on there. Otherwise, where the head holds the failed hop's inputs for every
        position, the node taking its place alone is prefilled from them first; where no one node runs exactly
        its layers, a chain of nodes that together do is, each from the one before it."""
        index = next((i for i, hop in enumerate(self.route) if hop.url == failure.url and not hop.local), None)
        if index is None or self.mode != "decode" or self.reuse is not None or index not in inputs:
            return None
        failed = self.route[index]
        moved_to = failure.moved_to or self.router.moved_to(failed.url, self.session_id)
        hop = self.router.replacement(failed, verifies=self._verifying, moved_to=moved_to)
        if hop is not None and hop.url == moved_to:
            hops = [hop]
            self.stats.moved_sessions += 1
        else:
            hops = [hop] if hop is not None else self.router.replacement_chain(failed, verifies=self._verifying)
            if not hops or not await self._replay_span(hops, index, history):
                return None
        route = [*self.route[:index], *hops, *self.route[index + 1:]]
        self.router.replaced(failed, failure, route, session_id=self.session_id, position=len(self.ids))
        self.client.release(failed.url, self.session_id)  # a node that answered (a 503) frees the session
        self.route = route
        self.stats.route = list(route)
        self.stats.failovers += 1
        if self.index is not None:
            self.index.moved(self.session_id, self.route)
        return index

    async def _replay_span(self, hops: list[Hop], index: int, history: wire.History | None) -> bool:
        """Prefill ``hops`` (in place of the route's hop ``index``) from the inputs the head holds for it, each from
        the one before it; whether they all took them. Their inputs are kept as the failed hop's were."""
        held = self.replay.inputs(index, self.past_len)
        if held is None:
            return False
        spans = []
        for k, hop in enumerate(hops):
            tail = index == len(self.route) - 1 and k == len(hops) - 1
            headers = wire.forward_headers(
                held, mode="prefill", session_id=self.session_id, past_len=0, start_layer=hop.start_layer,
                hop_index=index + k, sampling=self.request.sampling.to_wire() if tail else None,
                history=history if tail else None)
            try:
                reply = await self.client.step(hop, held, headers, history if tail else None)  # a tail's token: unused
            except HopFailed:
                return False  # a replacement failed too: a failover of the whole route
            spans.append(held)
            if not tail:
                if reply.activation is None:
                    return False
                held = reply.activation
        self.replay.splice(index, spans)
        self.stats.span_replays += 1
        return True

    async def _draft(self) -> list[int]:
        """Tokens to verify with the next step: as many as the policy chooses, none past the answer's or the
        context's end (a verify step yields up to one more than it drafts)."""
        left = self.request.max_tokens - len(self.generated) - 1
        k = self.policy.choose(min(left, wire.MAX_DRAFT))
        if k <= 0:
            return []
        return list(await self.request.drafter.propose(list(self.ids), k))[:k]

    def _observe(self, hop: Hop, total_ms: float, reply: HopReply) -> None:
        # an extend step computes the prompt's new tokens: measured as a prefill, not as a one-token decode;
        # a verify step is neither, and the route's cost is not measured on it
        mode = "prefill" if self.reuse is not None else "verify" if self._verifying else self.mode
        self.router.observe(hop, mode=mode, total_ms=total_ms, compute_ms=reply.compute_ms)
        if self.generated:  # a step after the first token: what each further token costs on each hop
            totals = self.stats.hop_totals(hop)
            totals.steps += 1
            totals.latency_ms += total_ms
            totals.compute_ms += reply.compute_ms or 0.0
            totals.payload_bytes += reply.payload_bytes
            totals.sent_bytes += reply.sent_bytes
            totals.received_bytes += reply.received_bytes

    def _count_step(self, fed: int, step_started: float) -> None:
        """A step answered: count it by what it was (an extend, a prefill, a decode or a stateless step)."""
        stats = self.stats
        if self.reuse is not None:  # the prompt's first step extended a held prefix
            stats.cached_tokens = self.reuse.keep
            stats.prompt_computed_tokens += fed
            stats.prefill_ms = (time.perf_counter() - step_started) * 1000.0
            self.reuse = None
        elif self.mode == "decode":
            self.decode_steps += 1
        if self.mode == "prefill":
            stats.prefills += 1
            stats.prompt_computed_tokens += fed
            if stats.prefill_ms is None:
                stats.prefill_ms = (time.perf_counter() - step_started) * 1000.0
        elif self.mode is None:
            stats.stateless_steps += 1

    def _took_token(self, reply: HopReply) -> tuple[TokenEvent, bool]:
        """The tail sampled a token: the next step decodes it alone. Returns its event and whether it ends."""
        token_id = reply.token_id
        self.progressed_at = self.router.clock()
        self.generated.append(token_id)
        self.stats.token_ids.append(token_id)
        self.past_len = len(self.ids)
        if self.index is not None and self.cached:
            self.index.advance(self.session_id, self.past_len)
        self.ids.append(token_id)
        self.mode = "decode" if self.cached else None
        done = token_id in self.backend.eos_token_ids and not self.request.ignore_eos
        if done:  # the end-of-sequence token is no part of the answer
            return TokenEvent(-1, self.stream.finish()), True
        return TokenEvent(token_id, self.stream.push(token_id), reply.logprob, reply.top_logprobs), False

    def _verified(self, reply: HopReply, draft: list[int], step_started: float) -> list[HopReply]:
        """A verify step's answer: the drafted tokens the tail kept and its own next token, each to be taken as a
        step's token; the nodes drop the rest of the step's positions when the next step says how many they keep."""
        tokens = reply.tokens
        if not tokens or len(tokens) > len(draft) + 1 or any(t.token_id != d for t, d in zip(tokens[:-1], draft)):
            raise UpstreamError(f"the tail ({self.route[-1].url}) answered a verify step of {len(draft)} drafts "
                                f"with {len(tokens or [])} tokens that do not follow them")
        kept = len(tokens) - 1
        stats = self.stats
        stats.verify_steps += 1
        stats.drafted_tokens += len(draft)
        stats.accepted_tokens += kept
        self.policy.observe(len(draft), kept, (time.perf_counter() - step_started) * 1000.0)
        return [HopReply(token_id=t.token_id, text=t.text, logprob=t.logprob, top_logprobs=t.top_logprobs)
                for t in tokens]

    def _took_older_tail_text(self, reply: HopReply) -> tuple[TokenEvent, bool]:
        """An older tail answered text without a token id: re-tokenize everything, and prefill every step."""
        text = reply.text or ""
        self.legacy_text += text
        self.ids = list(self.request.prompt_ids) + self.backend.encode_text(self.legacy_text)
        self.generated.append(-1)
        self.mode = "prefill" if self.cached else None
        done = text in self.backend.eos_texts
        return TokenEvent(-1, "" if done else text, reply.logprob, reply.top_logprobs), done

    def _time_token(self) -> None:
        stats = self.stats
        stats.completion_tokens = len(self.generated)
        now = time.perf_counter()
        if stats.first_token_ms is None:
            stats.first_token_ms = (now - self.started) * 1000.0
            self.decode_started = now
        else:
            stats.decode_seconds = now - self.decode_started
            stats.step_ms.append((now - self.last_token_at) * 1000.0)
        self.last_token_at = now

    def _cache_miss(self, miss: CacheMiss) -> None:
        """A node could not serve a decode step from its cache (409): prefill everything so far, once."""
        if self.mode != "decode":
            raise UpstreamError(f"a node answered a cache miss to a {self.mode or 'stateless'} step") from None
        self.stats.cache_misses += 1
        log.info("generation %s: cache miss at %d positions (%s): %s", self.session_id, self.past_len, miss.reason,
                 miss.message)
        if self.reuse is not None:  # the prefix could not be used: the whole prompt, as a cold request
            if self.index is not None:
                if miss.reason == "not_croppable":
                    self.index.cannot_crop(self.route)
                else:
                    self.index.forget(self.reuse.source)
            self.reuse, self.past_len = None, 0
        elif miss.reason != "cache_disabled":
            self.stats.reprefills += 1  # one re-prefill of everything so far, same session id
        if miss.reason == "cache_disabled":
            self.cached, self.mode = False, None  # a node that cannot cache: the rest runs stateless
            if self.index is not None:
                self.index.forget(self.session_id)
        else:
            self.mode = "prefill"
            self._prefilling_afresh()

    async def _failover(self, failure: HopFailed) -> None:
        """A hop failed: continue on a route without its node. Under churn a long answer may fail over many
        times; it gives up only when no route is found within ``failover_wait`` (the router raises), or when
        failovers have gone on that long without a token."""
        self.stats.failovers += 1
        stalled = self.router.clock() - self.progressed_at
        if stalled > self.router.failover_wait:
            raise UpstreamError(f"gave up: no token for {stalled:.0f} s of failovers ({self.stats.failovers} in "
                                f"all); the last: {failure.message}") from None
        failed = next((hop for hop in self.route if hop.url == failure.url), self.route[-1])
        self._move_to(await self.router.failover(failed, failure, session_id=self.session_id,
                                                 position=len(self.ids), patient=bool(self.generated)))

    def _reroute(self) -> None:
        """Every few decode steps: move to a far faster route if the router knows one."""
        faster = self.router.reroute(self.route, session_id=self.session_id, position=len(self.ids))
        if faster is not None:
            self.stats.reroutes += 1
            self._move_to(faster)

    def _move_to(self, new_route: list[Hop]) -> None:
        """Continue on ``new_route``: one prefill of everything so far there, under the same session id."""
        kept = {hop.url for hop in new_route}
        for hop in self.route:
            if hop.url not in kept and not hop.local:
                self.client.release(hop.url, self.session_id)
        self.route, self.cached = new_route, all(hop.kv_cache for hop in new_route)
        self.replay.clear()  # the next step prefills every hop of the new route, from position 0
        self.stats.route = list(self.route)
        if self.mode == "decode" and self.reuse is None:
            self.stats.reprefills += 1
        self.mode = "prefill" if self.cached else None
        self.reuse = None  # the prefix lives on the old route's nodes
        self._prefilling_afresh()

    def _prefilling_afresh(self) -> None:
        if self.index is not None:
            self.index.moved(self.session_id, self.route)

    def _end(self) -> None:
        """Keep the session on every node as a prefix (ended, with prefix reuse on), or free it on every node."""
        index, stats = self.index, self.stats
        if index is not None and self.cached and stats.finish_reason is not None \
                and index.get(self.session_id) is not None:
            # ended: every node keeps the session, as a prefix the next turn (or another client) starts from
            index.retain(self.session_id)
            if self.request.retained is not None:
                self.request.retained.keep(self.session_id)
            for hop in self.route:
                if hop.local:
                    self.backend.retain_local_session(self.session_id, self.past_len)
                else:
                    self.client.retain(hop.url, self.session_id, self.past_len)
        else:
            if index is not None:
                index.forget(self.session_id)
            if self.request.retained is not None:
                self.request.retained.drop(self.session_id)
            self.backend.drop_local_session(self.session_id)
            if self.cached or stats.finish_reason is None:
                # ended with nothing to reuse it, abandoned (the client left) or failed: free the session on every
                # node now, not at its TTL: its memory, and the node's batching, which waits a while for the next
                # step of every session that decoded there lately (daemon.model.steps)
                for hop in self.route:
                    if not hop.local:
                        self.client.release(hop.url, self.session_id)
