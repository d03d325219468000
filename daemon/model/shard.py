"""A node's shard: decoder layers ``[start, end)`` of a causal LM, what its roles need, and the /forward step
protocol over them.

:class:`ModelShard` is the one object a node's service (:mod:`daemon.model.service`) uses. Built, it has
loaded only what it needs (:mod:`daemon.model.checkpoint`): its own decoder layers, the embeddings where it
acts as head, the final norm and LM head where it is the tail; and it has probed once what its layers allow
(whether they take a cache, whether several sessions' decode steps run as one forward). Its steps:

- :meth:`ModelShard.step`: prefill, decode (against the session's cache in the store) or stateless;
- :meth:`ModelShard.step_batch`: one-position decode steps of several sessions as one forward;
- on the tail, the token sampled from the last position's logits; after a verify step (speculative decoding,
  :mod:`daemon.model.speculation`) the tokens of its positions up to the first that differs from the draft.

The layer math itself (masks, rotary embeddings, the layers, logits) is :class:`daemon.model.layers.DecoderLayers`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from daemon.api import Sampling
from daemon.errors import BadRequest, CacheMiss, ModelUnavailable
from daemon.kvstore import SessionCacheStore
from daemon.model.batching import batching_refusal
from daemon.model.checkpoint import buffers_to_device, build_skeleton, context_length, load_parts, read_model_info
from daemon.model.experts import use_decode_experts
from daemon.model.kvcache import cache_nbytes, cut_back
from daemon.model.layers import MASK_BUILDERS, DecoderLayers
from daemon.model.probes import default_layer_type, probe_batching, probe_kv_cache, refuse_unsupported
from daemon.model.quantize import parameter_bytes
from daemon.model.sampling import choose_token, verify_draft
from daemon.model.speculation import Resumed, prepare_verify, resume
from daemon.model.tokenizer import ChatTokenizer
from daemon.wire import History

log = logging.getLogger(__name__)

@dataclass
class DecodeStep:
    """One session's one-position decode step, as a batch takes it."""

    hidden: torch.Tensor  # [1, 1, hidden]
    session_id: str
    past_len: int
    sampling: Sampling
    history: History | None = None  # the tokens so far, for a penalty
    prefix: str | None = None  # a session's first step: its cache is first made from this session's
    take_prefix: bool = False  # ... taken over rather than copied (see ``ModelShard.step``)


@dataclass
class StepResult:
    """The outcome of one /forward step on this shard: hidden states, or a token on the tail."""

    hidden: torch.Tensor | None = None
    token_id: int | None = None
    text: str | None = None
    logprob: float | None = None  # when the sampling asks for them
    top_logprobs: list[tuple[int, float]] | None = None
    tokens: list[StepResult] | None = None  # a verify step's: the drafted tokens the tail agrees with, and one more


class ModelShard(DecoderLayers):
    """Decoder layers ``[start, end)`` of the model in ``folder``, plus what its roles need.

    ``quantize`` names a weight-only method of :mod:`daemon.model.quantize` for its own layers (``"int8"``).
    Thread-compatible, not thread-safe: the daemon runs every step on one worker thread.
    """

    def __init__(
        self,
        folder: Path,
        start: int,
        end: int,
        *,
        head: bool = True,
        kv_cache: bool = True,
        sessions: SessionCacheStore | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        quantize: str | None = None,
    ) -> None:
        from transformers import AutoConfig

        self.folder = Path(folder)
        config = AutoConfig.from_pretrained(self.folder)
        self.info = read_model_info(self.folder, config)
        # a multimodal checkpoint (a text_config beside a vision tower) runs its text model: every setting the
        # shard reads (layer types, masks, cache, EOS, soft-capping) is the text model's
        text = config.get_text_config()
        n = self.info.num_layers
        if not (0 <= start < end <= n):
            raise ModelUnavailable(
                f"layer range {start}-{end - 1} is outside the model's layers 0-{n - 1}"
            )
        self.dtype, self.device = dtype, torch.device(device)
        self.is_tail = end == n
        self.context_length = context_length(text)  # the most positions a step may reach
        layer_types: list[str] = list(getattr(text, "layer_types", None) or [default_layer_type(text)] * n)
        unknown = sorted(set(layer_types[start:end]) - set(MASK_BUILDERS))
        if unknown:
            raise ModelUnavailable(
                f"unsupported architecture {self.info.model_type!r}: layer types {unknown} are not supported"
            )
        refuse_unsupported(config, text, self.info.model_type)
        self._head_lock = threading.Lock()
        self._rows: tuple = (None, None)  # the embedding weight and its rows as bytes (:meth:`_embedding_rows`)
        # the layer math runs the skeleton's own modules, which loading fills in place
        super().__init__(build_skeleton(text, dtype, self.info.model_type), text, start, end, layer_types)
        # with ``quantize``, the node's own layers only: embeddings and LM head stay as loaded
        self._load(self._wanted_parts(head=head), quantize=quantize)
        if not head:
            self._release_untied_embeddings()
        buffers_to_device(self.model, self.device)
        use_decode_experts(self.model)  # MoE layers: a step's few routed experts without grouped_mm's walk over all
        # the head turns chats into ids, the tail names its token
        self.tokenizer = ChatTokenizer.load(self.folder, self.config) if (head or self.is_tail) else None
        self._stats_store = sessions  # misses of a stateless node still show in its statistics
        self.sessions = sessions if kv_cache else None
        self.supports_kv_cache = probe_kv_cache(self) if kv_cache else False
        if kv_cache and not self.supports_kv_cache:
            log.warning("layers of %s reject the cache arguments; this node runs stateless", self.info.model_type)
            self.sessions = None
        # why decode steps of several sessions cannot run as one forward here; None when they can
        self.batch_refusal = batching_refusal(self.layer_types[start:end], caches=self.sessions is not None)
        if self.batch_refusal is None:
            self.batch_refusal = probe_batching(self)
        if self.batch_refusal:
            log.info("sessions' steps run one at a time on this node: %s", self.batch_refusal)

    # ---- loading ---------------------------------------------------------------------------

    def _wanted_parts(self, *, head: bool) -> set[str]:
        parts = {"layers"}
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        if head or (self.is_tail and tied):
            parts.add("embed")
        if self.is_tail:
            parts |= {"norm", "lm_head"}
        return parts

    def _load(self, parts: set[str], *, quantize: str | None = None) -> None:
        load_parts(self.model, self.folder, parts, layers=range(self.start, self.end), dtype=self.dtype,
                   device=self.device, quantize=quantize)

    def _release_untied_embeddings(self) -> None:
        """A tail that is not the head loads the embeddings only for an LM head tied to them: once that head has a
        weight of its own (an int8 copy), they go, until the node is first asked to be a head."""
        from daemon.host import return_freed_memory

        embed = self.model.model.embed_tokens
        if embed.weight.device.type == "meta" or getattr(self.model.lm_head, "weight", None) is embed.weight:
            return
        embed.weight = torch.nn.Parameter(torch.empty_like(embed.weight, device="meta"), requires_grad=False)
        return_freed_memory()

    def ensure_head(self) -> None:
        """Load the embeddings and tokenizer on first use as head (a no-op once loaded)."""
        with self._head_lock:
            if self.model.model.embed_tokens.weight.device.type == "meta":
                self._load({"embed"})
            if self.tokenizer is None:
                self.tokenizer = ChatTokenizer.load(self.folder, self.config)

    @property
    def is_head_loaded(self) -> bool:
        return self.model.model.embed_tokens.weight.device.type != "meta" and self.tokenizer is not None

    def loaded_bytes(self) -> dict[str, int]:
        """Bytes of materialised weights by part: the shard's footprint, measured, not estimated."""
        seen: set[int] = set()
        totals: dict[str, int] = {}
        groups = {  # a tied LM head counts once, as the tail's, ahead of the embeddings it shares
            "layers": [self.model.model.layers[i] for i in range(self.start, self.end)],
            "final_norm_and_lm_head": [self.model.model.norm, self.model.lm_head],
            "embeddings": [self.model.model.embed_tokens],
        }
        for name, modules in groups.items():
            totals[name] = parameter_bytes(modules, seen)  # quantized weights: their int8 data and scales
        return totals

    def plan_kernels(self, *, max_rows: int, store=None, progress=None) -> dict:
        """Lay out this node's float weights and choose their products' kernels by timing them on this CPU
        (:mod:`daemon.model.kernels`), for batches of up to ``max_rows`` rows: the decoder layers it hosts and, on
        the tail, the LM head; MoE experts get kernels for their shapes (:func:`daemon.model.experts.plan_experts`), and
        each kind of weight how far ahead the native kernels ask for it (:mod:`daemon.model.prefetch`). A no-op off
        the CPU. Returns the linear weights' plans by weight shape."""
        from daemon.model.experts import plan_experts
        from daemon.model.kernels import describe, plan_linears
        from daemon.model.linear_attention import use_native_delta_steps
        from daemon.model.prefetch import plan_prefetch

        if self.device.type != "cpu":
            return {}
        modules = [m for i in range(self.start, self.end) for m in self._layers[i].modules()]
        # first how gemv.c streams weights on this CPU: the plans below then time it as the steps will run it
        plan_prefetch(modules + ([self.model.lm_head] if self.is_tail else []), store=store, progress=progress)
        # where the layers take native steps (daemon.model.decode.NativeSteps), their one-position steps read the
        # weights as [out, in]: a transposed layout would save a product's time and lose the whole step's
        self.native_steps = True
        self.forget_fast_decoder()
        native = self.fast_decoder()._native is not None
        self.forget_fast_decoder()  # bound again after the plans, on the weights as laid out
        plans = plan_linears(modules, max_rows=max_rows, store=store, progress=progress, plain_only=native)
        if self.is_tail:
            plans |= plan_linears([self.model.lm_head], max_rows=max_rows, store=store, progress=progress)
        expert_plans = plan_experts(modules, max_rows=max_rows, store=store)  # MoE experts: kernels, no new layout
        if progress is not None and expert_plans:
            progress("expert " + describe(expert_plans))
        use_native_delta_steps(self.model)  # linear-attention layers' one-position steps, in one call each
        return plans

    # ---- steps -------------------------------------------------------------------------------

    @torch.inference_mode()
    def embed(self, token_ids: list[int]) -> torch.Tensor:
        """Hidden states ``[1, T, hidden]`` for ``token_ids`` (head only)."""
        self.ensure_head()
        module = self.model.model.embed_tokens
        if len(token_ids) == 1 and 0 <= token_ids[0] < module.num_embeddings:
            rows = self._embedding_rows(module)
            if rows is not None:
                # a decode step's token: its row's bytes copied straight, 0.08 ms where the module's call took 0.22
                # (torch's code runs cold after a step's layers, once per token; 0.12-0.16 ms in a step's time)
                return torch.from_numpy(rows[token_ids[0]].copy()).view(module.weight.dtype).view(1, 1, -1) \
                    .to(self.dtype)
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        return module(ids).to(self.dtype)

    def _embedding_rows(self, module: torch.nn.Module):
        """The embedding table as rows of bytes in host memory, for a plain table (none scaled or renormed, none
        on a device): None otherwise. Kept while the module keeps the same weight."""
        weight = module.weight
        if self._rows[0] is not weight:
            plain = (type(module) is torch.nn.Embedding and module.max_norm is None and weight.device.type == "cpu"
                     and weight.is_contiguous() and weight.dim() == 2)
            self._rows = weight, (weight.detach().view(torch.uint8).numpy() if plain else None)
        return self._rows[1]

    def step(
        self,
        hidden: torch.Tensor,
        *,
        mode: str | None,
        session_id: str | None,
        past_len: int,
        start_layer: int,
        sampling: Sampling,
        prefix: str | None = None,
        take_prefix: bool = False,
        history: History | None = None,
        draft: tuple[int, ...] | None = None,
    ) -> StepResult:
        """One /forward step: ``mode`` is ``"prefill"``, ``"decode"`` or ``None`` (stateless). A decode step
        over several positions extends the session; with ``prefix`` the session is first made from the first
        ``past_len`` positions of that session's cache (copied, or taken over with ``take_prefix``). With
        ``draft`` it is a verify step: its positions can be taken back by the next step's ``past_len``, and the
        tail answers the tokens of its positions up to the first that differs from ``draft``."""
        self._check_start_layer(start_layer)
        cache = None
        resumed = None
        if mode == "decode":
            entry = self._session_entry(session_id, past_len=past_len, start_layer=start_layer, prefix=prefix,
                                        take_prefix=take_prefix)
            cache = entry.cache
            try:
                resumed = resume(cache, entry.undo, held=entry.past_len, past_len=past_len)
            except BaseException:
                self.sessions.drop(session_id)  # half cut back: a later decode must miss
                raise
        elif mode == "prefill":
            past_len = 0
            if self.sessions is not None:
                cache = self.new_cache()
        else:
            past_len = 0
        return self._run_step(hidden, cache=cache, mode=mode, session_id=session_id, past_len=past_len,
                              start_layer=start_layer, sampling=sampling, history=history, draft=draft,
                              resumed=resumed)

    def settle(self, session_id: str, past_len: int) -> None:
        """Cut a session left by a verify step back to the ``past_len`` positions its generation kept (a crop, or
        copied states and a replay of the kept positions), so a later request can continue it whole. A session
        that holds exactly that, or cannot be cut back to it, is left as it is."""
        entry = self.sessions.get(session_id) if self.sessions is not None else None
        if entry is None or entry.past_len == past_len or not entry.can_rewind_to(past_len):
            return
        entry = self.sessions.checkout(session_id, past_len=past_len, start_layer=entry.start_layer)
        try:
            resumed = resume(entry.cache, entry.undo, held=entry.past_len, past_len=past_len)
            if resumed.replay is not None:
                self.run_as_steps(resumed.replay, start_layer=entry.start_layer, past_len=resumed.past_len,
                                  cache=entry.cache)
        except BaseException:
            self.sessions.drop(session_id)
            raise
        self.sessions.commit(session_id, past_len=past_len, nbytes=cache_nbytes(entry.cache))

    def _session_entry(self, session_id: str, *, past_len: int, start_layer: int, prefix: str | None = None,
                       take_prefix: bool = False):
        """The session entry a decode step of ``session_id`` continues, or :class:`CacheMiss` saying why there is
        none."""
        if self.sessions is None:
            if self._stats_store is not None:
                self._stats_store.record_miss("cache_disabled")
            raise CacheMiss("cache_disabled", "this node runs stateless; prefill instead")
        if prefix is not None:
            self.sessions.derive(session_id, prefix, keep=past_len, start_layer=start_layer, take=take_prefix,
                                 cut=cut_back, nbytes=cache_nbytes)
        return self.sessions.checkout(session_id, past_len=past_len, start_layer=start_layer)

    def _run_step(self, hidden: torch.Tensor, *, cache, mode: str | None, session_id: str | None, past_len: int,
                  start_layer: int, sampling: Sampling, history: History | None = None,
                  draft: tuple[int, ...] | None = None, resumed: Resumed | None = None) -> StepResult:
        new_len = past_len + hidden.shape[1]
        resumed = resumed or Resumed(past_len)
        undo = None
        try:
            if draft is not None:
                resumed, undo = prepare_verify(cache, resumed, hidden, lambda replay, at: self.run_as_steps(
                    replay, start_layer=start_layer, past_len=at, cache=cache))
            replayed = 0 if resumed.replay is None else resumed.replay.shape[1]
            if replayed:  # positions taken back and kept: run again from their inputs, ahead of the step's own
                hidden = torch.cat([resumed.replay, hidden], dim=1)
            # a verify step's positions, and those run again after one, each exactly as a step of its own
            run = self.run_as_steps if draft is not None or replayed else self.run_layers
            out = run(hidden, start_layer=start_layer, past_len=resumed.past_len, cache=cache)
            if replayed:
                out = out[:, replayed:]
            result = StepResult(hidden=out)
            if self.is_tail:
                # sampled on the host, whatever the device: the draw at a position is the same on every node
                if draft is None:
                    result = self._token(self.logits_last(out).cpu(), sampling, new_len, history)
                else:
                    result = self._verified(self.logits_rows(out).cpu(), sampling, past_len, history, draft)
        except BaseException:
            if mode == "decode":  # the cache may hold part of this step now: a later decode must miss
                self.sessions.drop(session_id)
            raise
        # only a step that fully succeeded advances the session (the head retries from what it knows)
        if cache is not None:
            if mode == "prefill":
                self.sessions.put(session_id, cache, past_len=new_len, start_layer=start_layer,
                                  nbytes=cache_nbytes(cache))
            else:
                self.sessions.commit(session_id, past_len=new_len,
                                     nbytes=cache_nbytes(cache) + (undo.nbytes if undo else 0),
                                     undo=undo, rewind_from=past_len)
        return result

    def _verified(self, logits: torch.Tensor, sampling: Sampling, past_len: int, history: History | None,
                  draft: tuple[int, ...]) -> StepResult:
        """A verify step's answer from ``logits [k+1, vocab]``: the drafted tokens the tail agrees with and one
        more (:func:`daemon.model.sampling.verify_draft`), the last also as the step's own token."""
        tokens = [StepResult(token_id=c.token_id, text=self.tokenizer.token_text(c.token_id), logprob=c.logprob,
                             top_logprobs=c.top_logprobs)
                  for c in verify_draft(logits, sampling, past_len, history, draft)]
        last = tokens[-1]
        return StepResult(token_id=last.token_id, text=last.text, logprob=last.logprob,
                          top_logprobs=last.top_logprobs, tokens=tokens)

    def step_batch(self, steps: Sequence[DecodeStep], *, start_layer: int) -> list[StepResult | Exception]:
        """One-position decode steps of several sessions as one forward (:mod:`daemon.model.batching`), each
        outcome in the order given: a result, or the error of that session alone (a cache miss, say)."""
        self._check_start_layer(start_layer)
        outcomes: list[StepResult | Exception | None] = [None] * len(steps)
        ready: list[tuple[int, object]] = []
        alone: list[tuple[int, object, Resumed]] = []  # sessions taken back that run kept positions again
        for i, step in enumerate(steps):
            try:
                entry = self._session_entry(step.session_id, past_len=step.past_len, start_layer=start_layer,
                                            prefix=step.prefix, take_prefix=step.take_prefix)
                resumed = resume(entry.cache, entry.undo, held=entry.past_len, past_len=step.past_len)
            except (CacheMiss, BadRequest) as exc:
                outcomes[i] = exc
                continue
            if resumed.replay is None:
                ready.append((i, entry.cache))
            else:
                alone.append((i, entry.cache, resumed))
        for i, cache, resumed in alone:
            step = steps[i]
            try:
                outcomes[i] = self._run_step(step.hidden, cache=cache, mode="decode", session_id=step.session_id,
                                             past_len=step.past_len, start_layer=start_layer,
                                             sampling=step.sampling, history=step.history, resumed=resumed)
            except Exception as exc:  # noqa: BLE001 - that session's error, reported to its request
                outcomes[i] = exc
        if len(ready) == 1:  # the others missed: a single step, exactly as one arriving alone runs
            (i, cache), = ready
            step = steps[i]
            try:
                outcomes[i] = self._run_step(step.hidden, cache=cache, mode="decode", session_id=step.session_id,
                                             past_len=step.past_len, start_layer=start_layer, sampling=step.sampling,
                                             history=step.history)
            except Exception as exc:  # noqa: BLE001 - that session's error, reported to its request
                outcomes[i] = exc
        elif ready:
            self._run_batch(steps, ready, start_layer, outcomes)
        return outcomes

    def _run_batch(self, steps: Sequence[DecodeStep], ready: list[tuple[int, object]], start_layer: int,
                   outcomes: list) -> None:
        rows = [steps[i] for i, _ in ready]
        hidden = torch.cat([step.hidden for step in rows], dim=1)  # [1, B, hidden]: one position per session
        positions = torch.tensor([[step.past_len for step in rows]], device=hidden.device)
        try:
            out = self.run_batch(hidden, start_layer=start_layer, position_ids=positions,
                                 caches=[cache for _, cache in ready])
            if self.is_tail:
                logits = self.logits_rows(out).cpu()
                results = []
                for row, step in enumerate(rows):
                    results.append(self._token(logits[row], step.sampling, step.past_len + 1, step.history))
            else:
                results = [StepResult(hidden=out[:, row:row + 1]) for row in range(len(rows))]
        except Exception as exc:  # noqa: BLE001 - every session of the batch gets it; their caches are dropped
            log.exception("a batched step of %d sessions failed", len(rows))
            for (i, _), step in zip(ready, rows):
                self.sessions.drop(step.session_id)  # the cache may hold part of this step now
                outcomes[i] = exc
            return
        for (i, cache), step, result in zip(ready, rows, results):
            self.sessions.commit(step.session_id, past_len=step.past_len + 1, nbytes=cache_nbytes(cache))
            outcomes[i] = result

    def _token(self, logits: torch.Tensor, sampling: Sampling, position: int, history: History | None) -> StepResult:
        """The tail's answer from ``logits [vocab]``: the token at ``position``, named, with its logprobs if asked."""
        choice = choose_token(logits, sampling, position, history)
        return StepResult(token_id=choice.token_id, text=self.tokenizer.token_text(choice.token_id),
                          logprob=choice.logprob, top_logprobs=choice.top_logprobs)

    def _check_start_layer(self, start_layer: int) -> None:
        if not (self.start <= start_layer < self.end):
            raise BadRequest(
                f"start layer {start_layer} is outside this node's layers {self.start}-{self.end - 1}",
                param="X-Meshnet-Start-Layer",
            )
