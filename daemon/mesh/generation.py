"""The head's generation loop: the client side of the mesh.

One session id per generation; a prefill of the whole prompt along the route,
then one-token decode steps. A 409 cache miss on any hop costs one re-prefill of
the sequence so far under the same session id, never a failed answer. A hop that
fails (refused or reset connection, timeout, 5xx, a draining node) is a
failover: the router plans a route without that node, and the sequence so far
is re-prefilled there under the same session id, so the client sees the same
tokens and no error. A route with a node that does not cache runs stateless
(the full sequence every step); a tail that returns no ``token_id`` (an older
node) makes every step a prefill.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from daemon import wire
from daemon.api import GenerationStats, Hop, Sampling
from daemon.errors import BadRequest, CacheMiss, HopFailed, UpstreamError
from daemon.mesh.hops import HopClient, HopReply
from daemon.mesh.prefix import PrefixIndex, Reuse
from daemon.mesh.text import TextStream


MAX_FAILOVERS = 8  # per generation: a mesh that keeps failing is an error, not a loop
REROUTE_CHECK_STEPS = 16  # how often a generation asks whether its route has become far slower


class Router(Protocol):
    """What the loop needs to change routes: see :class:`daemon.mesh.planner.RoutePlanner`."""

    def observe(self, hop: Hop, *, mode: str | None, total_ms: float, compute_ms: float | None) -> None: ...

    async def failover(self, failed: Hop, error: str, *, session_id: str, position: int,
                       patient: bool = True) -> list[Hop]: ...

    def reroute(self, route: list[Hop], *, session_id: str, position: int) -> list[Hop] | None: ...


class HeadBackend(Protocol):
    """What the loop needs from the head's own model: tokenizer, embeddings and local layers."""

    hidden_size: int
    eos_token_ids: set[int]
    eos_texts: set[str]  # for an older tail that answers text only

    async def embed(self, token_ids: list[int]) -> wire.Activation: ...

    async def local_step(self, activation: wire.Activation | None, *, mode: str | None, session_id: str,
                         past_len: int, start_layer: int, hop_index: int, sampling: Sampling | None,
                         token_ids: list[int] | None = None, prefix: Reuse | None = None,
                         history: wire.History | None = None) -> HopReply:
        """Run the head's own layers; with ``token_ids`` (a first hop) embed them in the same step."""

    def decode(self, token_ids: list[int]) -> str: ...

    def encode_text(self, text: str) -> list[int]: ...

    def drop_local_session(self, session_id: str) -> None: ...

    def retain_local_session(self, session_id: str) -> None: ...


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling  # sent to the tail
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # generate max_tokens whatever the model says (benchmarks, golden tests)
    reuse: Reuse | None = None  # start from a session the route's nodes hold (see daemon.mesh.prefix)


@dataclass
class TokenEvent:
    token_id: int  # -1: no token of the answer (text held back until the end, or an older tail's)
    text: str  # newly final text, maybe empty
    logprob: float | None = None  # the token's, when the request asked for logprobs
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, logprob), best first


async def run_step(
    backend: HeadBackend,
    client: HopClient,
    route: list[Hop],
    token_ids: list[int],
    *,
    mode: str | None,
    session_id: str,
    past_len: int,
    sampling: Sampling,
    prefix: Reuse | None = None,
    on_hop: Callable[[Hop, float, HopReply], None] | None = None,
    history: wire.History | None = None,
) -> HopReply:
    """Embed ``token_ids`` and pass the step along ``route``; the last hop answers with a token.

    The head's own first hop embeds inside its step (one hand-off to the torch thread, no bytes).
    ``prefix``: every hop first makes the session from that one (an extend step after a reused prefix).
    ``on_hop(hop, total_ms, reply)`` is told each hop's latency and answer. ``history`` goes to the tail.
    """
    reply = HopReply(activation=None if route[0].local else await backend.embed(token_ids))
    for index, hop in enumerate(route):
        if index and reply.activation is None:
            raise UpstreamError(f"hop {index - 1} ({route[index - 1].url}) answered a token before the last layer")
        tail = index == len(route) - 1
        tail_sampling = sampling if tail else None
        started = time.perf_counter()
        if hop.local:
            reply = await backend.local_step(
                reply.activation, mode=mode, session_id=session_id, past_len=past_len,
                start_layer=hop.start_layer, hop_index=index, sampling=tail_sampling,
                token_ids=None if index else token_ids, prefix=prefix, history=history if tail else None,
            )
        else:
            headers = wire.forward_headers(
                reply.activation, mode=mode, session_id=session_id, past_len=past_len,
                start_layer=hop.start_layer, hop_index=index,
                sampling=tail_sampling.to_wire() if tail_sampling else None,
                prefix=prefix.source if prefix else None, take_prefix=bool(prefix and prefix.take),
                history=history if tail else None,
            )
            reply = await client.step(hop, reply.activation, headers, history if tail else None)
        if on_hop is not None:
            on_hop(hop, (time.perf_counter() - started) * 1000.0, reply)
    if reply.activation is not None:
        raise UpstreamError(f"the last hop ({route[-1].url}) answered activations, not a token")
    return reply


async def generate(
    backend: HeadBackend,
    client: HopClient,
    router: Router,
    route: list[Hop],
    request: GenerationRequest,
    *,
    stats: GenerationStats | None = None,
    index: PrefixIndex | None = None,
) -> AsyncIterator[TokenEvent]:
    """Generate up to ``request.max_tokens`` tokens along ``route``, yielding text as it becomes final.

    ``stats`` (created by the caller so it can be read while streaming) is filled in as it goes;
    ``stats.finish_reason`` is ``"stop"`` or ``"length"`` at the end. When a hop fails, ``router``
    supplies a new route; if none covers every layer within its bound, its ``RouteUnavailable`` ends
    the generation.

    ``request.reuse``: the first step extends a session the route's nodes already hold instead of
    prefilling the prompt; if any node cannot (409), the whole prompt is prefilled, as cold. ``index``
    (where the caller registered this generation) is told what the nodes hold after every step; a
    generation that ends keeps its session on every node as a retained prefix, one that fails or is
    abandoned frees it.
    """
    if not request.prompt_ids:
        raise BadRequest("the prompt is empty", param="messages")
    session_id = stats.session_id if stats else uuid.uuid4().hex
    stats = stats or GenerationStats(session_id=session_id, prompt_tokens=len(request.prompt_ids))
    stats.route = list(route)
    cached = all(hop.kv_cache for hop in route)
    ids = list(request.prompt_ids)
    generated: list[int] = []
    legacy_text = ""  # only for a tail that returns text without token ids
    past_len = 0
    mode: str | None = "prefill" if cached else None
    reuse = request.reuse if cached else None
    if reuse is not None:
        mode, past_len = "decode", reuse.keep  # an extend step: only the prompt's new tokens
    if index is not None:
        index.follow(session_id, ids)
    stream = TextStream(backend.decode, request.stop)
    sampling = request.sampling
    # a repetition penalty looks at the prompt too: its ids once, as a set; the answer's go with every step
    penalized_prompt = tuple(sorted(set(request.prompt_ids))) if sampling.repetition_penalty != 1.0 else ()
    started = time.perf_counter()
    decode_started: float | None = None
    last_token_at = 0.0
    decode_steps = 0

    def observe(hop: Hop, total_ms: float, reply: HopReply) -> None:
        # an extend step computes the prompt's new tokens: measured as a prefill, not as a one-token decode
        router.observe(hop, mode="prefill" if reuse is not None else mode, total_ms=total_ms,
                       compute_ms=reply.compute_ms)
        if generated:  # a step after the first token: what each further token costs on each hop
            totals = stats.hop_totals(hop)
            totals.steps += 1
            totals.latency_ms += total_ms
            totals.compute_ms += reply.compute_ms or 0.0
            totals.payload_bytes += reply.payload_bytes
            totals.sent_bytes += reply.sent_bytes
            totals.received_bytes += reply.received_bytes

    def move_to(new_route: list[Hop]) -> None:
        """Continue on ``new_route``: one prefill of everything so far there, under the same session id."""
        nonlocal route, cached, mode, reuse
        kept = {hop.url for hop in new_route}
        for hop in route:
            if hop.url not in kept and not hop.local:
                client.release(hop.url, session_id)
        route, cached = new_route, all(hop.kv_cache for hop in new_route)
        stats.route = list(route)
        if mode == "decode" and reuse is None:
            stats.reprefills += 1
        mode = "prefill" if cached else None
        reuse = None  # the prefix lives on the old route's nodes
        prefilling_afresh()

    def prefilling_afresh() -> None:
        if index is not None:
            index.moved(session_id, route)

    try:
        while len(generated) < request.max_tokens:
            if mode == "decode" and decode_steps and decode_steps % REROUTE_CHECK_STEPS == 0:
                faster = router.reroute(route, session_id=session_id, position=len(ids))
                if faster is not None:
                    stats.reroutes += 1
                    move_to(faster)
            feed = ids[past_len:] if mode == "decode" else ids
            step_started = time.perf_counter()
            try:
                history = wire.History(penalized_prompt, tuple(stats.token_ids)) if sampling.penalized else None
                reply = await run_step(
                    backend, client, route, feed, mode=mode, session_id=session_id,
                    past_len=past_len, sampling=sampling, prefix=reuse, on_hop=observe, history=history,
                )
            except CacheMiss as miss:
                if mode != "decode":
                    raise UpstreamError(f"a node answered a cache miss to a {mode or 'stateless'} step") from None
                stats.cache_misses += 1
                if reuse is not None:  # the prefix could not be used: the whole prompt, as a cold request
                    if index is not None:
                        if miss.reason == "not_croppable":
                            index.cannot_crop(route)
                        else:
                            index.forget(reuse.source)
                    reuse, past_len = None, 0
                elif miss.reason != "cache_disabled":
                    stats.reprefills += 1  # one re-prefill of everything so far, same session id
                if miss.reason == "cache_disabled":
                    cached, mode = False, None  # a node that cannot cache: the rest runs stateless
                    if index is not None:
                        index.forget(session_id)
                else:
                    mode = "prefill"
                    prefilling_afresh()
                continue
            except HopFailed as failure:
                stats.failovers += 1
                if stats.failovers > MAX_FAILOVERS:
                    raise UpstreamError(f"gave up after {MAX_FAILOVERS} failovers; the last: {failure.message}") \
                        from None
                failed = next((hop for hop in route if hop.url == failure.url), route[-1])
                move_to(await router.failover(failed, failure.message, session_id=session_id, position=len(ids),
                                              patient=bool(generated)))
                continue
            if reuse is not None:  # the prompt's first step extended a held prefix
                stats.cached_tokens = reuse.keep
                stats.prompt_computed_tokens += len(feed)
                stats.prefill_ms = (time.perf_counter() - step_started) * 1000.0
                reuse = None
            elif mode == "decode":
                decode_steps += 1
            if mode == "prefill":
                stats.prefills += 1
                stats.prompt_computed_tokens += len(feed)
                if stats.prefill_ms is None:
                    stats.prefill_ms = (time.perf_counter() - step_started) * 1000.0
            elif mode is None:
                stats.stateless_steps += 1
            if reply.token_id is None:
                # an older tail: take its text, re-tokenize, and prefill every step
                legacy_text += reply.text or ""
                token_id = None
                ids = list(request.prompt_ids) + backend.encode_text(legacy_text)
                generated.append(-1)
                mode = "prefill" if cached else None
                done = (reply.text or "") in backend.eos_texts
                delta = "" if done else reply.text or ""
            else:
                token_id = reply.token_id
                generated.append(token_id)
                stats.token_ids.append(token_id)
                past_len = len(ids)
                if index is not None and cached:
                    index.advance(session_id, past_len)
                ids.append(token_id)
                mode = "decode" if cached else None
                done = token_id in backend.eos_token_ids and not request.ignore_eos
                delta = stream.finish() if done else stream.push(token_id)
            stats.completion_tokens = len(generated)
            now = time.perf_counter()
            if stats.first_token_ms is None:
                stats.first_token_ms = (now - started) * 1000.0
                decode_started = now
            else:
                stats.decode_seconds = now - decode_started
                stats.step_ms.append((now - last_token_at) * 1000.0)
            last_token_at = now
            if done and token_id is not None:  # the end-of-sequence token is no part of the answer
                event = TokenEvent(-1, delta)
            else:
                event = TokenEvent(token_id if token_id is not None else -1, delta, reply.logprob, reply.top_logprobs)
            if done or stream.stopped:
                stats.finish_reason = "stop"
                if delta or event.logprob is not None:
                    yield event
                return
            yield event
        stats.finish_reason = "length"
        tail = stream.finish()
        if tail:
            yield TokenEvent(-1, tail)
    finally:
        if index is not None and cached and stats.finish_reason is not None and index.get(session_id) is not None:
            # ended: every node keeps the session, as a prefix the next turn (or another client) starts from
            index.retain(session_id)
            for hop in route:
                if hop.local:
                    backend.retain_local_session(session_id)
                else:
                    client.retain(hop.url, session_id)
        else:
            if index is not None:
                index.forget(session_id)
            backend.drop_local_session(session_id)
            if stats.finish_reason is None:
                # abandoned (the client left) or failed: free this generation's sessions on every node now
                for hop in route:
                    if not hop.local:
                        client.release(hop.url, session_id)

