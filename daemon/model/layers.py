"""Decoder layers ``[start, end)`` of a causal LM, run the way the model's own ``forward`` runs them.

Read top to bottom, as a transformers modeling file:

- :data:`MASK_BUILDERS`: which attention mask each layer type gets.
- :meth:`DecoderLayers.run_layers`: one sequence, ``hidden [1, T, hidden]`` at positions ``past_len..``: one
  mask per hosted layer type, rotary embeddings once per call, then each hosted layer.
- :meth:`DecoderLayers.run_batch`: one new position of each of B sessions, ``hidden [1, B, hidden]``, each
  over its own cache (:mod:`daemon.model.batching`).
- :meth:`DecoderLayers.logits_last` and :meth:`DecoderLayers.logits_rows`: the tail's final norm and LM head.

A range is not the whole model: a cache has a layer for every layer of the model, and those the range does
not host stay empty. So each mask is built against the first hosted layer of its type, never layer 0.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence

import torch

from daemon.model.batching import (
    RECURRENT_LAYER_TYPES,
    SessionBatch,
    attention_configs,
    batched_attention,
    head_rows,
)
from daemon.model.decode import MAX_ROWS, REDUCED_DTYPES, FastDecoder, float_attention
from daemon.model.qwen_decode import QwenDecoder
from daemon.model.rotary import RotaryTable

# Which mask each attention type gets, as the models' own forwards build them.
MASK_BUILDERS = {
    "full_attention": "create_causal_mask",
    "sliding_attention": "create_sliding_window_causal_mask",
    "chunked_attention": "create_chunked_causal_mask",
    "linear_attention": "create_recurrent_attention_mask",
    "mamba": "create_recurrent_attention_mask",
    "conv": "create_recurrent_attention_mask",
}


class DecoderLayers:
    """Layers ``[start, end)`` of ``model`` (a causal LM with ``model.model.layers``), run as its ``forward`` runs them.

    ``config`` is the text model's config; ``layer_types[i]`` is layer ``i``'s attention type, a key of
    :data:`MASK_BUILDERS`. The layers are the model's own modules: loading weights into them later is seen here.
    """

    def __init__(self, model: torch.nn.Module, config, start: int, end: int, layer_types: list[str]) -> None:
        self.model = model
        self.config = config
        self.start, self.end = start, end
        self.layer_types = layer_types
        self._layers = tuple(model.model.layers)  # indexing a tuple, not a ModuleList, in the step loop
        # Gemma 3 has one rotary embedding per layer type
        self._rotary_per_type = "layer_type" in inspect.signature(model.model.rotary_emb.forward).parameters
        # Gemma 4 layers hand their keys and values to later layers
        self._layers_share_kv = "shared_kv_states" in inspect.signature(type(self._layers[0]).forward).parameters
        self._attention_configs = attention_configs(self._layers[start:end])  # switched for batched steps
        self._rotary_table = RotaryTable(model.model.rotary_emb, per_type=self._rotary_per_type)
        self._fast: FastDecoder | None = None  # bound at the first one-position step, after loading and plans
        # one-position steps of Llama-family layers in float32 run natively (decode.NativeSteps): set where the
        # node plans its kernels, as another kernel's arithmetic is within rounding of transformers' own
        self.native_steps = False

    def new_cache(self):
        """An empty cache for every layer of the model (the hosted ones fill), as the model's own forward makes it."""
        from transformers import DynamicCache

        from daemon.model.kvcache import grow_in_place

        # the same construction the model's own forward uses: per-layer types from the config
        cache = DynamicCache(config=self.config)
        grow_in_place(cache)  # full-attention layers append in place: a decode step's cost stays flat
        return cache

    # ---- one sequence ------------------------------------------------------------------------

    @torch.inference_mode()
    def run_layers(self, hidden: torch.Tensor, *, start_layer: int, past_len: int, cache) -> torch.Tensor:
        """Run layers ``[start_layer, end)`` over ``hidden [1, T, hidden]`` at positions ``past_len..``."""
        q_len = hidden.shape[1]
        if q_len == 1:
            fast = self.fast_decoder()
            if fast.fits(start_layer) and fast.cache_fits(cache, start_layer, past_len):
                # SDPA full-attention layers without a window (and the Qwen path's gated delta nets, whose states
                # the cache holds): one position attends to every one before it and to itself, for which the mask
                # builders answer None, so no mask is built
                rotary = self._rotary_at(hidden, past_len) if fast.attends else None
                return fast.run(hidden, rotary, cache, start_layer)
        position_ids = torch.arange(past_len, past_len + q_len, device=hidden.device).unsqueeze(0)  # [1, T]
        hosted = range(start_layer, self.end)
        types = self.layer_types
        masks = self._masks(hidden, position_ids, cache, hosted)
        position_embeddings = self._rotary(hidden, position_ids, {types[i] for i in hosted})
        layers = self._layers
        # stateless calls pass no cache arguments at all: layers that reject them still run
        cache_kwargs = {"cache": cache, "use_cache": True} if cache is not None else {}
        # Gemma 4 layers hand their keys and values to later layers through this dict, fresh for every call
        shared_kv = {"shared_kv_states": {}} if self._layers_share_kv else {}
        with self._one_position_attention(hidden) if q_len == 1 else contextlib.nullcontext():
            for i in hosted:
                hidden = layers[i](  # [1, T, hidden] in, [1, T, hidden] out
                    hidden,
                    attention_mask=masks[types[i]],
                    position_ids=position_ids,
                    position_embeddings=position_embeddings[types[i]],
                    **cache_kwargs,
                    **shared_kv,
                )
        return hidden

    @torch.inference_mode()
    def run_as_steps(self, hidden: torch.Tensor, *, start_layer: int, past_len: int, cache,
                     exact: bool = True) -> torch.Tensor:
        """Like :meth:`run_layers`, but each position's outputs (and what it leaves in ``cache``) exactly those of a
        one-position step of its own: a verify step's positions, and positions run again after one, so speculative
        decoding gives the very tokens of single steps. Natively in one call where these layers run native steps
        (up to :data:`MAX_ROWS` positions: the products read each weight once for all of them), else one position
        after another; or, not ``exact`` (a draft model's, whose rounding matters to nobody), as one forward."""
        q_len = hidden.shape[1]
        if 1 < q_len <= MAX_ROWS and cache is not None:
            fast = self.fast_decoder()
            if fast.fits(start_layer) and fast.cache_fits(cache, start_layer, past_len):
                position_ids = torch.arange(past_len, past_len + q_len, device=hidden.device).unsqueeze(0)
                rotary = self._rotary(hidden, position_ids, {"full_attention"})["full_attention"]
                out = fast.run_rows(hidden, rotary, cache, start_layer)
                if out is not None:
                    return out
        if q_len == 1 or not exact:
            return self.run_layers(hidden, start_layer=start_layer, past_len=past_len, cache=cache)
        return torch.cat([self.run_layers(hidden[:, i:i + 1], start_layer=start_layer, past_len=past_len + i,
                                          cache=cache) for i in range(q_len)], dim=1)

    def fast_decoder(self) -> FastDecoder | QwenDecoder:
        """The one-position path through these layers, bound on first use: Llama-family layers'
        (:mod:`daemon.model.decode`), else Qwen3, Qwen3-MoE and Qwen3.5 layers' (:mod:`daemon.model.qwen_decode`);
        one that fits no start layer where neither binds them all."""
        if self._fast is None:
            self._fast = FastDecoder(self._layers, self.config, self.layer_types, self.start, self.end,
                                     native_steps=self.native_steps)
            if not self._fast.fits(self.start):
                self._fast = QwenDecoder.bind(self._layers, self.config, self.layer_types, self.start, self.end,
                                              native_steps=self.native_steps) or self._fast
        return self._fast

    def forget_fast_decoder(self) -> None:
        """Bind the one-position path again at its next use: the layers' projections were replaced."""
        self._fast = None

    def _masks(self, hidden: torch.Tensor, position_ids: torch.Tensor, cache, hosted: range) -> dict:
        """One mask per hosted layer type, each built against the first hosted layer of that type (the cache's
        layer 0 is empty on a shard that does not host it), before the first layer runs."""
        from transformers import masking_utils

        masks = {}
        for i in hosted:
            layer_type = self.layer_types[i]
            if layer_type not in masks:
                build = getattr(masking_utils, MASK_BUILDERS[layer_type])
                masks[layer_type] = build(
                    config=self.config,
                    inputs_embeds=hidden,
                    attention_mask=None,
                    cache=cache,
                    position_ids=position_ids,
                    layer_idx=i,
                )
        return masks

    def _one_position_attention(self, hidden: torch.Tensor):
        """The attention one-position steps run, for a ``with`` block: a planned node's bfloat16 queries attend in
        float32 (:func:`daemon.model.decode.float_attention`); else the layers' own."""
        if self.native_steps and hidden.dtype in REDUCED_DTYPES and hidden.device.type == "cpu":
            return float_attention(self._attention_configs)
        return contextlib.nullcontext()

    def _rotary_at(self, hidden: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[1, 1, head_dim]``, for one position of the one rotary embedding."""
        found = self._rotary_table.at(hidden, position)
        if found is not None:
            return found
        position_ids = torch.tensor([[position]], device=hidden.device)
        return self._rotary(hidden, position_ids, {"full_attention"})["full_attention"]

    def _rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor, layer_types: set[str]) -> dict:
        """Rotary embeddings (cos, sin) once per call, per layer type where the model has one per type (Gemma 3)."""
        rotary = self.model.model.rotary_emb
        if self._rotary_per_type:
            return {t: rotary(hidden, position_ids, t) for t in layer_types}
        shared = rotary(hidden, position_ids)
        return dict.fromkeys(layer_types, shared)

    # ---- one position of several sessions --------------------------------------------------------

    @torch.inference_mode()
    def run_batch(self, hidden: torch.Tensor, *, start_layer: int, position_ids: torch.Tensor,
                  caches: Sequence) -> torch.Tensor:
        """Layers ``[start_layer, end)`` over ``hidden [1, B, hidden]``: row ``i`` is one new position of the
        session whose cache is ``caches[i]``, at ``position_ids[0, i]``: full-attention and sliding-window layers
        over the batch as one sequence with no mask, linear-attention layers over it as B sequences of one position
        (:mod:`daemon.model.batching`)."""
        hosted = range(start_layer, self.end)
        types = self.layer_types
        position_embeddings = self._rotary(hidden, position_ids, {types[i] for i in hosted})
        if self.native_steps and "full_attention" in position_embeddings:  # Llama-family layers in one call each
            out = self.fast_decoder().run_batch(hidden, position_embeddings["full_attention"], caches, start_layer)
            if out is not None:
                return out
        batch = SessionBatch(caches)
        layers = self._layers
        shared_kv = {"shared_kv_states": {}} if self._layers_share_kv else {}  # as in run_layers (Gemma 4)
        # each row through the attention a single step of its session runs
        with self._one_position_attention(hidden), batched_attention(self._attention_configs):
            for i in hosted:
                recurrent = types[i] in RECURRENT_LAYER_TYPES  # B sequences of one position: [B, 1, hidden]
                out = layers[i](hidden.transpose(0, 1) if recurrent else hidden, attention_mask=None,
                                position_ids=position_ids, position_embeddings=position_embeddings[types[i]],
                                cache=batch, use_cache=True, **shared_kv)
                if recurrent:
                    batch.store_states()
                    out = out.transpose(0, 1)
                hidden = out
        return hidden

    # ---- the tail's logits ---------------------------------------------------------------------

    @torch.inference_mode()
    def logits_last(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head on the last position only: logits ``[vocab]``."""
        return self.logits_rows(hidden[:, -1:, :])[0]

    @torch.inference_mode()
    def logits_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head on every position of ``hidden [1, B, hidden]``: logits ``[B, vocab]``."""
        logits = head_rows(self.model.lm_head, self.model.model.norm(hidden))[0]
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:  # Gemma-family models squash logits in their own forward, in the compute dtype: sampling sees the same
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
