"""One step of a generation along its route (:func:`run_step`), and what the generation loop needs from the head
and its router to take it (:class:`HeadBackend`, :class:`Router`); the loop itself is
:mod:`daemon.mesh.generation`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from daemon import wire
from daemon.api import Hop, Sampling
from daemon.channel import ChannelClosed
from daemon.errors import HopFailed, UpstreamError
from daemon.logs import REQUEST_ID_HEADER, request_id
from daemon.mesh import channels
from daemon.mesh.hops import HopClient, HopReply
from daemon.mesh.prefix import Reuse


class Router(Protocol):
    """What the loop needs to change routes: see :class:`daemon.mesh.planner.RoutePlanner`."""

    failover_wait: float  # seconds: a generation that produces no token for this long through failovers gives up
    clock: Callable[[], float]  # monotonic seconds

    def observe(self, hop: Hop, *, mode: str | None, total_ms: float, compute_ms: float | None) -> None: ...

    async def failover(self, failed: Hop, failure: HopFailed, *, session_id: str, position: int,
                       patient: bool = True) -> list[Hop]: ...

    def reroute(self, route: list[Hop], *, session_id: str, position: int) -> list[Hop] | None: ...

    def replacement(self, failed: Hop, *, verifies: bool, moved_to: str | None = None) -> Hop | None: ...

    def replacement_chain(self, failed: Hop, *, verifies: bool) -> list[Hop] | None: ...

    def moved_to(self, url: str, session_id: str) -> str | None: ...

    def replaced(self, failed: Hop, failure: HopFailed, route: list[Hop], *, session_id: str,
                 position: int) -> None: ...


class HeadBackend(Protocol):
    """What the loop needs from the head's own model: tokenizer, embeddings and local layers."""

    hidden_size: int
    eos_token_ids: set[int]
    eos_texts: set[str]  # for an older tail that answers text only

    async def embed(self, token_ids: list[int]) -> wire.Activation: ...

    async def local_step(self, activation: wire.Activation | None, *, mode: str | None, session_id: str,
                         past_len: int, start_layer: int, hop_index: int, sampling: Sampling | None,
                         token_ids: list[int] | None = None, prefix: Reuse | None = None,
                         history: wire.History | None = None, draft: list[int] | None = None,
                         then: Callable | None = None) -> HopReply:
        """Run the head's own layers; with ``token_ids`` (a first hop) embed them in the same step. ``then``
        goes on, on the torch thread, with the step's outcome; what it answers is the reply's ``then``."""

    def decode(self, token_ids: list[int]) -> str: ...

    def encode_text(self, text: str) -> list[int]: ...

    def drop_local_session(self, session_id: str) -> None: ...

    def retain_local_session(self, session_id: str, past_len: int) -> None: ...


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
    draft: list[int] | None = None,
    inputs: dict[int, wire.Activation] | None = None,
    resume: tuple[int, wire.Activation] | None = None,
) -> HopReply:
    """Embed ``token_ids`` and pass the step along ``route``; the last hop answers with a token.

    The head's own first hop embeds inside its step (one hand-off to the torch thread, no bytes).
    ``prefix``: every hop first makes the session from that one (an extend step after a reused prefix).
    ``on_hop(hop, total_ms, reply)`` is told each hop's latency and answer. ``history`` goes to the tail.
    ``draft``: a verify step, whose last ``len(draft)`` positions are these drafted tokens (every hop is told).
    ``inputs`` is filled with each remote hop's input activations as they are sent (by hop index); ``resume``
    ``(index, activation)`` runs the step from hop ``index`` on, with that input (the hops before it ran it).
    """
    if resume is not None:
        index, reply = resume[0], HopReply(activation=resume[1])
    else:
        index, reply = 0, HopReply(activation=None if route[0].local else await backend.embed(token_ids))
    while index < len(route):
        hop = route[index]
        if index and reply.activation is None:
            raise UpstreamError(f"hop {index - 1} ({route[index - 1].url}) answered a token before the last layer")
        tail = index == len(route) - 1
        tail_sampling = sampling if tail else None
        started = time.perf_counter()
        if hop.local:
            legs = None
            if mode == "decode" and draft is None and prefix is None and len(token_ids) == 1:
                legs = _legs(client, route, index, session_id=session_id, past_len=past_len, sampling=sampling,
                             history=history)
            walk = None
            if legs is not None:
                def walk(done, legs=legs) -> channels.Walked:  # on the torch thread, after the head's layers
                    return channels.walk(done.out, legs, client.reply_from, timeout=client.timeout,
                                         wait=client.channels.wait)
            try:
                reply = await backend.local_step(
                    reply.activation, mode=mode, session_id=session_id, past_len=past_len,
                    start_layer=hop.start_layer, hop_index=index, sampling=tail_sampling,
                    token_ids=None if index else token_ids, prefix=prefix, history=history if tail else None,
                    draft=draft, then=walk,
                )
            finally:
                if legs is not None:
                    client.channels.give_back([leg.chan for leg in legs])
            if on_hop is not None:  # the head's own hop ends where its walk began, if it walked
                ended = reply.then.started if reply.then is not None else time.perf_counter()
                on_hop(hop, (ended - started) * 1000.0, reply)
            if reply.then is not None:  # the torch thread went on along the route over step channels
                index, reply = _walked(reply.then, route, on_hop, inputs)
                continue
            index += 1
            continue
        if inputs is not None:
            inputs[index] = reply.activation
        headers = wire.forward_headers(
            reply.activation, mode=mode, session_id=session_id, past_len=past_len,
            start_layer=hop.start_layer, hop_index=index,
            sampling=tail_sampling.to_wire() if tail_sampling else None,
            prefix=prefix.source if prefix else None, take_prefix=bool(prefix and prefix.take),
            history=history if tail else None, draft=draft,
        )
        reply = await client.step(hop, reply.activation, headers, history if tail else None)
        if on_hop is not None:
            on_hop(hop, (time.perf_counter() - started) * 1000.0, reply)
        index += 1
    if reply.activation is not None:
        raise UpstreamError(f"the last hop ({route[-1].url}) answered activations, not a token")
    return reply


def _legs(client: HopClient, route: list[Hop], index: int, *, session_id: str, past_len: int, sampling: Sampling,
          history: wire.History | None) -> list[channels.Leg] | None:
    """The rest of the route after the head's own hop at ``index``, as legs of a walk over step channels: None
    unless every hop after it is remote and has a free channel."""
    rest = route[index + 1:]
    if client.channels is None or not rest or any(hop.local for hop in rest):
        return None
    taken = client.channels.for_hops(rest)
    if taken is None:
        return None
    rid = request_id.get()
    legs = []
    for i, (hop, chan) in enumerate(zip(rest, taken), start=index + 1):
        tail = i == len(route) - 1

        def headers(activation: wire.Activation, hop=hop, i=i, tail=tail) -> dict[str, str]:
            return wire.forward_headers(
                activation, mode="decode", session_id=session_id, past_len=past_len, start_layer=hop.start_layer,
                hop_index=i, sampling=sampling.to_wire() if tail else None, history=history if tail else None,
            ) | {REQUEST_ID_HEADER: rid}

        legs.append(channels.Leg(i, hop, chan, headers, history if tail else None))
    return legs


def _walked(walked: channels.Walked, route: list[Hop], on_hop, inputs) -> tuple[int, HopReply]:
    """Where a walk leaves the step: past the route with the tail's reply, or at a hop whose channel closed (sent
    on ``POST /forward`` next, from its input). Anything else a hop raised is raised here, as it would have been."""
    reply = None
    for index, given, total_ms, reply in walked.answered:
        if inputs is not None:
            inputs[index] = given
        if on_hop is not None:
            on_hop(route[index], total_ms, reply)
    if walked.stopped is None:
        return len(route), reply
    index, given, error = walked.stopped
    if inputs is not None:
        inputs[index] = given
    if isinstance(error, ChannelClosed):
        return index, HopReply(activation=given)
    raise error
