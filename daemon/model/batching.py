"""Decode steps of several sessions as one forward over a node's layers.

At batch size 1 a decode step is a row of matrix-vector products: it reads every
weight of its layers to compute one token. Steps of B sessions waiting at a node
together run as one forward over ``[1, B, hidden]``: the projections and MLPs read
each weight once for all B rows. Attention is the one part that differs per row
(each session has its own past, of its own length), so it runs per session, over
that session's own cache, with transformers' own SDPA attention:

- :class:`SessionBatch` stands in for the layers' cache. Each layer hands it the
  new keys and values of all rows; it appends row ``i`` to session ``i``'s own
  ``DynamicCache`` (in place, :mod:`daemon.model.kvcache`) and leaves the
  per-session keys and values in the attention call's keyword arguments.
- :func:`session_attention` is registered with transformers' ``AttentionInterface``
  and selected for the batched forward only (:func:`batched_attention`): it runs
  SDPA for row ``i`` against session ``i``'s keys and values.

Each session's cache stays the ordinary one its single steps use, so sessions join
and leave a batch at any step with no copy, and a cache miss affects only its own
session. Rotary embeddings are applied per row from each row's own position.

Full-attention, sliding-window and linear-attention layers batch. A one-position
step needs no mask in an attention layer: a full layer's query sees every cached
position, and a sliding layer's cache hands back at most the window's positions
(``DynamicSlidingWindowLayer`` keeps the last ``window - 1`` and appends the new
one), which is exactly what that query may see. Each row's attention runs the
function the model's single steps run (SDPA, or the model's own eager attention
where it needs one: logit soft-capping, attention sinks). A linear-attention layer
(a gated delta net: a convolution and a recurrent state per sequence) reads the
positions of its input as one sequence in time, so it gets the batch as B
sequences of one position, with the sessions' states stacked (:class:`SessionBatch`).
Other recurrent layer types (Mamba, short convolutions) run their sessions one at
a time (:func:`batching_refusal`).

Exactness: rows of a batched matrix product are not bitwise those of single-row
products (kernel blocking differs with the row count), so a batched step's logits
can differ from a single step's by float rounding; ``tests/unit/test_batching.py``
measures the difference and holds it to a bound. ``--max-batch 1`` runs every step
alone.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence

import torch

BATCH_ATTENTION = "meshnet_sessions"
# layer types a batched forward runs; linear attention over ``[B, 1, hidden]``, the others over ``[1, B, hidden]``
RECURRENT_LAYER_TYPES = frozenset({"linear_attention"})
BATCHING_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"}) | RECURRENT_LAYER_TYPES


class SessionBatch:
    """The cache a batched forward passes its layers: row ``i`` of each update belongs to ``caches[i]``.

    Attention layers see the batch as one sequence ``[1, B, hidden]`` and hand it their new keys and values
    (:meth:`update`). A linear-attention layer sees it as B sequences of one position ``[B, 1, hidden]`` and
    reads and writes its convolution and recurrent states through the methods below: the sessions' states
    stacked along the batch axis (one copy in), and each row's new state copied back into its own session's
    cache, so the sessions' caches stay the ordinary single-sequence ones."""

    def __init__(self, caches: Sequence) -> None:
        self.caches = caches
        self._conv: dict[tuple[int, int], torch.Tensor] = {}  # states a layer may update in place, until stored

    # -- linear attention: transformers' Cache methods a gated-delta-net layer calls in a one-position step --

    def is_recording_past(self, layer_idx: int) -> bool:
        return any(cache.is_recording_past(layer_idx) for cache in self.caches)

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        stacked = self._stacked([cache.get_conv_state(layer_idx, state_idx) for cache in self.caches])
        if stacked is not None:  # the layer's one-position step updates it in place: stored back after the layer
            self._conv[layer_idx, state_idx] = stacked
        return stacked

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._stacked([cache.get_recurrent_state(layer_idx, state_idx) for cache in self.caches])

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        for cache, row in zip(self.caches, recurrent_states.split(1)):
            cache.update_recurrent_state(row, layer_idx, state_idx, **kwargs)
        return recurrent_states

    def update_conv_state(self, *args, **kwargs):
        raise RuntimeError("a batched step runs one position per session: no convolution window to rebuild")

    def store_states(self) -> None:
        """After a linear-attention layer: each session's row of the convolution states it updated in place."""
        for (layer_idx, state_idx), stacked in self._conv.items():
            for cache, row in zip(self.caches, stacked.split(1)):
                cache.layers[layer_idx].conv_states[state_idx].copy_(row)
        self._conv.clear()

    @staticmethod
    def _stacked(states: list[torch.Tensor | None]) -> torch.Tensor | None:
        if all(state is None for state in states):
            return None
        if any(state is None for state in states):
            raise RuntimeError("sessions of a batch differ in whether a linear layer holds state")
        return torch.cat(states)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               kwargs: dict | None = None, **more) -> tuple[torch.Tensor, torch.Tensor]:
        if kwargs is None:
            raise RuntimeError("the layer passes no attention keyword arguments to its cache: it cannot batch")
        # one split for every row's view (slicing costs a call per row); the attention call of the same layer
        # receives each session's keys and values through its keyword arguments
        rows = zip(self.caches, key_states.split(1, dim=2), value_states.split(1, dim=2))
        kwargs["session_kv"] = [cache.update(keys, values, layer_idx) for cache, keys, values in rows]
        return key_states, value_states


def session_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, *, session_kv: Sequence | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of row ``i`` of ``query [1, heads, B, dim]`` over session ``i``'s keys and values, each through
    the attention function a single step of this layer runs. Returns ``[1, B, heads, dim]`` as transformers'
    attention functions do."""
    if session_kv is None:
        raise RuntimeError("batched attention without the sessions' keys and values")
    # latent attention (DeepSeek-V3, GLM-4.5) caches compressed latents and expands them after the update
    expand = getattr(module, "expand_kv", None)
    held = [expand(*kv) if expand else kv for kv in session_kv]
    attend = _single_step_attention(module)
    if attend is None and _plain_decode(module, held, kwargs):
        # what sdpa_attention_forward calls for a one-position query with no mask, without its per-call checks:
        # the same kernel with the same arguments, so each row's numbers are a single step's
        gqa = {"enable_gqa": True} if getattr(module, "num_key_value_groups", 1) > 1 else {}
        scale, dropout = kwargs.get("scaling"), kwargs.get("dropout", 0.0)
        rows = [torch.nn.functional.scaled_dot_product_attention(
                    row, keys, values, attn_mask=None, dropout_p=dropout, scale=scale, is_causal=False, **gqa)
                for row, (keys, values) in zip(query.split(1, dim=2), held)]
        return torch.cat(rows, dim=2).transpose(1, 2).contiguous(), None
    if attend is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward as attend
    rows = [attend(module, row, keys, values, None, **kwargs)[0]
            for row, (keys, values) in zip(query.split(1, dim=2), held)]
    return torch.cat(rows, dim=1), None


_SINGLE_STEP: dict[int, str] = {}  # id(config) -> its attention implementation, inside batched_attention


def _single_step_attention(module: torch.nn.Module):
    """The attention function this layer's single steps run; None for SDPA. A model on eager attention (logit
    soft-capping in Gemma 2, attention sinks in gpt-oss) runs the eager function of its own modeling file."""
    implementation = _SINGLE_STEP.get(id(module.config), "sdpa")
    if implementation == "sdpa":
        return None
    if implementation == "eager":
        attend = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if attend is None:
            raise RuntimeError(f"{type(module).__name__} runs eager attention of its own: it cannot batch")
        return attend
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[implementation]


# ``sliding_window`` changes nothing for a one-position query: the sliding cache hands back the window only
PLAIN_KWARGS = frozenset({"dropout", "scaling", "position_ids", "cache", "use_cache", "cache_position",
                          "sliding_window"})


def _plain_decode(module: torch.nn.Module, held: Sequence, kwargs: dict) -> bool:
    """Whether transformers' SDPA would make one plain GQA call here: equal key and value head sizes up to 256
    (no query packing), nothing but dropout and scale among the options (no soft-capping, no position bias)."""
    keys, values = held[0]
    return keys.shape[-1] == values.shape[-1] <= 256 and set(kwargs) <= PLAIN_KWARGS


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(BATCH_ATTENTION, session_attention)


_register()


# MKL's float32 product of 4 to 15 rows by an LM head's tens of thousands of outputs takes a kernel that reads the
# weight no faster than 1-3 rows do, two to three times over (on the built-in model's tail with 2 threads, layers
# streamed between: 4 rows 14.8 ms, 8 rows 22.5, 12 rows 32.2, where 1 row takes 7.6 and 16 rows 15.8); the same
# rows against slices of 512 outputs take 11.3, 14.0 and 17.1 ms. Like any batched product, a slice's rows round
# differently from a single row's: tests/unit/test_batching.py holds the logits of 4, 8 and 15 rows to its bound.
SLICED_HEAD_ROWS = range(4, 16)
HEAD_SLICE = 512


def head_rows(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``head(hidden)`` over a batch's rows ``hidden [1, B, hidden]``: on the CPU in float32, a plain linear LM head
    over ``SLICED_HEAD_ROWS`` rows runs against slices of ``HEAD_SLICE`` outputs, concatenated."""
    if (type(head) is not torch.nn.Linear or head.bias is not None or hidden.shape[-2] not in SLICED_HEAD_ROWS
            or hidden.device.type != "cpu" or hidden.dtype != torch.float32 or head.weight.dtype != torch.float32):
        return head(hidden)
    weight, linear = head.weight, torch.nn.functional.linear
    return torch.cat([linear(hidden, weight[i:i + HEAD_SLICE]) for i in range(0, weight.shape[0], HEAD_SLICE)], dim=-1)


def attention_configs(layers: Sequence[torch.nn.Module]) -> list:
    """The config objects the attention modules of ``layers`` read their implementation from (once per shard)."""
    return list({id(m.config): m.config for layer in layers for m in layer.modules()
                 if hasattr(m, "layer_idx") and hasattr(m, "config")}.values())


@contextlib.contextmanager
def batched_attention(configs: Sequence) -> Iterator[None]:
    """Select :func:`session_attention` in the layers reading ``configs`` for the ``with`` block, then restore
    what they had.

    Layers read the attention implementation from their config at every call; the node runs one forward at a
    time on its torch thread, so switching it around a batched forward touches no other step."""
    before = [config._attn_implementation for config in configs]
    try:
        for config, implementation in zip(configs, before):
            _SINGLE_STEP[id(config)] = implementation
            config._attn_implementation = BATCH_ATTENTION
        yield
    finally:
        for config, implementation in zip(configs, before):
            config._attn_implementation = implementation
            _SINGLE_STEP.pop(id(config), None)


def batching_refusal(layer_types: Sequence[str], *, caches: bool) -> str | None:
    """Why a shard with these hosted layer types cannot batch sessions' steps; None when it can."""
    if not caches:
        return "the node keeps no session caches (stateless): every step carries its whole sequence"
    others = sorted(set(layer_types) - BATCHING_LAYER_TYPES)
    if others:
        return (f"its layers include {', '.join(others)}: batched steps run full-attention, sliding-window and "
                "linear-attention layers only")
    return None
