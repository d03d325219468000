"""The head: a chat request in, a generation along a route of nodes out.

It owns what a node needs to head generations: the tokenizer (through its own shard service,
which loads it on first use), the route planner, the hop client and the generation counters. Its
API is :meth:`Head.generate`, which admits a request, tokenizes it, plans a route and hands back a
:class:`Generation` to iterate; the OpenAI handlers only translate JSON to and from it.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp

from daemon import wire
from daemon.api import GenerationStats, Sampling
from daemon.errors import BadRequest, Draining, TooManyGenerations
from daemon.mesh.channels import StepChannels
from daemon.mesh.generation import GenerationLoop, GenerationRequest, TokenEvent
from daemon.mesh.hop_batches import batch_hops_enabled
from daemon.mesh.hops import HopClient, HopReply
from daemon.mesh.planner import RoutePlanner
from daemon.mesh.prefix import PrefixIndex, Reuse
from daemon.mesh.replay import RetainedInputs
from daemon.mesh.speculation import Drafter, SpeculationMemory
from daemon.mesh.transport import HopTransport
from daemon.metrics import Metrics

log = logging.getLogger(__name__)


class Tokenizer(Protocol):
    """The model's tokenizer as the head uses it (see ``daemon.model.tokenizer.ChatTokenizer``)."""

    eos_token_ids: set[int]
    eos_texts: set[str]

    def encode_chat(self, messages: list[dict]) -> list[int]: ...

    def encode_text(self, text: str) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def token_text(self, token_id: int) -> str: ...

    def default_sampling(self) -> dict: ...


class OwnLayers(Protocol):
    """The head's own node: its layers run as the route's local hop (see ``daemon.model.service.ShardService``)."""

    hidden_size: int
    context_length: int
    vocab_size: int

    async def ensure_head(self) -> Tokenizer: ...

    async def embed(self, token_ids: list[int], *, dtype: str) -> wire.Activation: ...

    async def forward(self, request: wire.ForwardRequest, *, token_ids: list[int] | None = None,
                      then=None) -> wire.ForwardReply: ...

    def drop_session(self, session_id: str) -> bool: ...

    def retain_session(self, session_id: str, past_len: int | None = None) -> bool: ...


@dataclass
class ChatRequest:
    """A chat (``messages``, through the chat template) or a raw ``prompt`` (text, tokenized as it is, or token
    ids), as a client asked for it; ``None`` leaves a choice to the model's defaults."""

    messages: list[dict] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None  # None: a random one, reported in the stats
    prompt: str | list[int] | None = None  # instead of messages: no template
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: none; N: each token's logprob and the N best alternatives'
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # generate max_tokens whatever the model says (benchmarks, golden tests)
    client: str | None = None  # who asks (the OpenAI "user", else the address): --prefix-reuse client's scope

    @property
    def prompt_param(self) -> str:
        """The request field a problem with the prompt is reported against."""
        return "messages" if self.prompt is None else "prompt"


class Generation:
    """One generation under way: iterate it for text as it becomes final; ``stats`` fill in as it goes."""

    def __init__(self, stats: GenerationStats, events: AsyncIterator[TokenEvent], *, model: str,
                 tokenizer: Tokenizer | None = None) -> None:
        self.stats = stats
        self.model = model
        self.tokenizer = tokenizer  # names the tokens of logprobs
        self.created = int(time.time())
        self._events = events

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._events


@dataclass
class HeadSettings:
    wire_dtype: str = "float32"  # activations the head sends
    hop_timeout_seconds: float = 10.0
    max_generations: int = 32  # at once; beyond: 429
    max_tokens_default: int = 256
    max_tokens_cap: int = 4096
    prefix_reuse: str = "shared"  # shared, client or off (see daemon.mesh.prefix)
    max_model_len: int | None = None  # --max-model-len: a context cap below the model's (None: the model's)
    max_draft: int = 4  # --draft-max: the most tokens one verify step carries


class Head:
    """Generations headed by this node: admission, tokenizing, routing, and the loop's counters."""

    def __init__(self, own: OwnLayers, planner: RoutePlanner, metrics: Metrics, *, model_name: str,
                 settings: HeadSettings, aliases: list[str] = ()) -> None:
        self.own = own
        self.planner = planner
        self.metrics = metrics
        self.model_name = model_name  # what answers report
        self.model_names = [model_name, *(a for a in aliases if a != model_name)]  # what requests may name
        self.settings = settings
        self.active_generations = 0
        self.own_sessions: set[str] = set()  # the sessions of the generations running here (their first hop is local)
        self.generations = 0  # finished or abandoned
        self.tokens_generated = 0
        self.prefixes = PrefixIndex(policy=settings.prefix_reuse)
        self._hops: HopClient | None = None
        self._stopping = False
        self.drafter: Drafter | None = None  # --draft-model: speculative decoding (daemon.mesh.speculation)
        self.speculation = SpeculationMemory()  # what drafting cost on each route, for the next generation on it
        self.retained = RetainedInputs()  # the hops' inputs of sessions kept as prefixes (daemon.mesh.replay)

    @property
    def context_length(self) -> int:
        """The most tokens a generation may hold, prompt and answer: the model's context, or --max-model-len."""
        return min(self.own.context_length, self.settings.max_model_len or self.own.context_length)

    @property
    def max_tokens_cap(self) -> int:
        """The most new tokens a request may ask for."""
        return min(self.context_length, self.settings.max_tokens_cap)

    def connect(self, transport: HopTransport, session: aiohttp.ClientSession,
                channels: StepChannels | None = None) -> None:
        """Start sending hops: over ``transport`` and ``channels`` (see :mod:`daemon.mesh.channels`), with
        ``session`` for the rare requests off the hot path."""
        if channels is not None:  # a walk holds the torch thread: only while one generation could use it
            channels.allowed = lambda: self.active_generations <= 1
        self._hops = HopClient(transport, session, hidden_size=self.own.hidden_size,
                               timeout=self.settings.hop_timeout_seconds, channels=channels,
                               batches=batch_hops_enabled())
        if self._hops.batches is not None:
            self._hops.batches.wanted = lambda: self.active_generations > 1

    def stop_generations(self) -> None:
        """End every running generation at its next step (the node's shutdown grace is over)."""
        self._stopping = True

    @contextlib.asynccontextmanager
    async def generate(self, request: ChatRequest) -> AsyncIterator[Generation]:
        """Admit ``request`` and run it: the generation is abandoned (its sessions freed) when the block exits."""
        if self.active_generations >= self.settings.max_generations:
            raise TooManyGenerations(
                f"this node already runs {self.active_generations} generations, its limit (--max-generations); "
                "retry shortly or use another node"
            )
        self.active_generations += 1  # taken before any await: concurrent requests cannot all slip past the limit
        stats: GenerationStats | None = None
        try:
            started = time.perf_counter()
            tokenizer = await self.own.ensure_head()
            prompt_ids = self._prompt_ids(request, tokenizer)
            context = self.context_length
            if len(prompt_ids) >= context:
                limit = ("this node's --max-model-len is" if context < self.own.context_length
                         else "the model's context is")
                raise BadRequest(f"the prompt is {len(prompt_ids)} tokens; {limit} {context}",
                                 param=request.prompt_param)
            asked = request.max_tokens or min(self.settings.max_tokens_default, self.settings.max_tokens_cap)
            max_tokens = min(asked, context - len(prompt_ids))
            sampling = self._sampling(request, tokenizer.default_sampling())
            route = await self.planner.plan_for_request()
            stats = GenerationStats(session_id=secrets.token_hex(12), prompt_tokens=len(prompt_ids),
                                    sampling=sampling)
            self.own_sessions.add(stats.session_id)
            reuse: Reuse | None = None
            index = self.prefixes if all(hop.kv_cache for hop in route) else None
            if index is not None:
                reuse = await index.find(prompt_ids, route, request.client)
                # registered before any await: a request arriving during this prefill can wait for it
                index.begin(stats.session_id, route, request.client, prompt_ids)
            log.info("generation %s: %d prompt tokens%s, up to %d new, route %s", stats.session_id, len(prompt_ids),
                     f" ({reuse.keep} held by session {reuse.source})" if reuse else "", max_tokens,
                     " -> ".join(f"{h.url}@{h.start_layer}" for h in route))
            loop_request = GenerationRequest(prompt_ids, max_tokens, sampling, request.stop, request.ignore_eos,
                                             reuse=reuse, max_draft=self.settings.max_draft,
                                             drafter=self.drafter.session() if self.drafter else None,
                                             speculation=self.speculation, retained=self.retained)
            backend = _LocalBackend(self.own, tokenizer, wire_dtype=self.settings.wire_dtype)
            events = GenerationLoop(backend, self._hop_client(), self.planner, route, loop_request, stats=stats,
                                    index=index).run()
            # aclosing: a client that goes away mid-stream still ends the generation and frees its sessions now
            try:
                async with contextlib.aclosing(events):
                    try:
                        yield Generation(stats, self._timed(events, started), model=self.model_name,
                                         tokenizer=tokenizer)
                    finally:
                        self._finished(stats)
            finally:
                if index is not None:  # a generation never iterated never ran the loop that ends its entry
                    index.forget_if_live(stats.session_id)
        finally:
            self.active_generations -= 1
            if stats is not None:
                self.own_sessions.discard(stats.session_id)

    def _hop_client(self) -> HopClient:
        if self._hops is None:
            raise RuntimeError("the head sends no hops before connect()")
        return self._hops

    def _prompt_ids(self, request: ChatRequest, tokenizer: Tokenizer) -> list[int]:
        """The prompt's token ids: the chat template over the messages, or the raw prompt as it is."""
        if request.prompt is None:
            return tokenizer.encode_chat(request.messages or [])
        if isinstance(request.prompt, str):
            ids = tokenizer.encode_prompt(request.prompt)
        else:
            ids = list(request.prompt)
            vocab = self.own.vocab_size
            if any(not 0 <= i < vocab for i in ids):
                raise BadRequest(f"prompt token ids must be between 0 and {vocab - 1}", param="prompt")
        if not ids:
            raise BadRequest("the prompt is empty", param="prompt")
        return ids

    @staticmethod
    def _sampling(request: ChatRequest, defaults: dict) -> Sampling:
        def pick(name: str):
            asked = getattr(request, name)
            return defaults[name] if asked is None else asked

        seed = request.seed if request.seed is not None else secrets.randbits(63)
        return Sampling(float(pick("temperature")), float(pick("top_p")), int(pick("top_k")), seed,
                        min_p=float(request.min_p), repetition_penalty=float(request.repetition_penalty),
                        presence_penalty=float(request.presence_penalty),
                        frequency_penalty=float(request.frequency_penalty), logprobs=request.logprobs)

    async def _timed(self, events: AsyncIterator[TokenEvent], started: float) -> AsyncIterator[TokenEvent]:
        """Pass the events through, timing the first token and the gaps between tokens for /metrics,
        and stopping when the node's shutdown grace is over."""
        last = None
        async for event in events:
            now = time.perf_counter()
            if last is None:
                self.metrics.ttft.observe(now - started)
            else:
                self.metrics.itl.observe(now - last)
            last = now
            yield event
            if self._stopping:
                raise Draining("this node shut down before the answer was complete; ask again (another node, "
                               "or this one once it is back)")

    def _finished(self, stats: GenerationStats) -> None:
        self.generations += 1
        self.tokens_generated += stats.completion_tokens
        self.metrics.generation_done(stats)
        log.info("generation %s: %s after %d tokens (%s tok/s), %d re-prefills, %d failovers",
                 stats.session_id, stats.finish_reason or "abandoned", stats.completion_tokens,
                 f"{stats.decode_tokens_per_second:.1f}" if stats.decode_tokens_per_second else "-",
                 stats.reprefills, stats.failovers)


class _LocalBackend:
    """What the generation loop needs from the head's own node (``HeadBackend``), for one generation."""

    def __init__(self, own: OwnLayers, tokenizer: Tokenizer, *, wire_dtype: str) -> None:
        self._own = own
        self._tokenizer = tokenizer
        self._wire_dtype = wire_dtype
        self.hidden_size = own.hidden_size
        self.eos_token_ids = tokenizer.eos_token_ids
        self.eos_texts = tokenizer.eos_texts

    async def embed(self, token_ids: list[int]) -> wire.Activation:
        return await self._own.embed(token_ids, dtype=self._wire_dtype)

    async def local_step(self, activation: wire.Activation | None, *, mode, session_id, past_len, start_layer,
                         hop_index, sampling: Sampling | None, token_ids: list[int] | None = None,
                         prefix: Reuse | None = None, history: wire.History | None = None,
                         draft: list[int] | None = None, then=None) -> HopReply:
        if token_ids is not None:  # embedded in the step itself: the activation is only its dtype and shape
            activation = wire.Activation(self._wire_dtype, (1, len(token_ids), self.hidden_size), b"")
        request = wire.ForwardRequest(
            activation=activation, mode=mode, session_id=session_id, past_len=past_len,
            start_layer=start_layer, hop_index=hop_index, sampling=sampling.to_wire() if sampling else {},
            prefix=prefix.source if prefix else None, take_prefix=bool(prefix and prefix.take), history=history,
            draft=tuple(draft) if draft else None,
        )
        reply = await self._own.forward(request, token_ids=token_ids, then=then)
        return HopReply(activation=reply.activation, token_id=reply.token_id, text=reply.text,
                        compute_ms=reply.compute_ms, logprob=reply.logprob, top_logprobs=reply.top_logprobs,
                        tokens=reply.tokens, then=reply.then)

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids)

    def encode_text(self, text: str) -> list[int]:
        return self._tokenizer.encode_text(text)

    def drop_local_session(self, session_id: str) -> None:
        self._own.drop_session(session_id)

    def retain_local_session(self, session_id: str, past_len: int) -> None:
        self._own.retain_session(session_id, past_len)
