"""One new position through Qwen3, Qwen3-MoE and Qwen3.5 layers, with transformers' arithmetic and without its
plumbing.

Qwen3 and Qwen3-MoE layers normalise each head's queries and keys before rotary; Qwen3.5 (dense, and the MoE that
Qwen3.5-35B-A3B is) stacks gated delta net layers (linear attention) and gated attention layers, three to one, each
followed by an MLP or a mixture of experts with a shared expert. A decode step through transformers' modules pays
for their plumbing between the products: a mask per layer type, the rotary module, ``nn.Module.__call__`` for some
twenty modules a layer, keyword forwarding through deprecation and hub-kernel wrappers, the attention-interface
lookup, Qwen3.5's ``1 + weight`` made anew at every norm. On two Qwen3.5-MoE-shaped layers in bfloat16 that was
0.63 ms of a 10.4 ms step (one process, steps on and off the path taken in turn), the products being most of the
rest. :class:`QwenDecoder` runs the same layers for one position with the products and the ops between them alone.

It computes what the layers' own forward computes, op for op in the same order and dtype (so float32 and
bfloat16 nodes keep ``generate``'s tokens bit for bit), and each part the module would run it through:

- RMSNorm as the layer's own: to float32, ``x * rsqrt(x.pow(2).mean + eps)``, then Qwen3's ``weight * x.to(dtype)``
  or Qwen3.5's ``(x * (1 + weight)).type_as(x)`` (``1 + weight`` in float32 made once here: the same floats).
- Attention as ``Qwen3Attention`` and ``Qwen3_5Attention``: the query (and Qwen3.5's gate, from the same product),
  query and key norms, rotary on the first ``cos.shape[-1]`` dims of each head as ``apply_rotary_pos_emb``
  (``q * cos + rotate_half(q) * sin``), the key and value appended to a cache that grows in place, one query's
  SDPA with no mask (the mask builders answer None for it) and ``enable_gqa`` as transformers' SDPA call passes
  it, or the float32 attention a planned bfloat16 node takes (:func:`daemon.model.decode.attend_in_float32`); then
  Qwen3.5's ``* sigmoid(gate)``, and the output product.
- The gated delta net through the module's own ``forward``: its native one-position step where it has one
  (:mod:`daemon.model.linear_attention`), else transformers' reference step.
- A sparse MoE block as the model's: the router's forward (planned or not), the routed experts through the
  implementation the model is set to (:mod:`daemon.model.experts`, or a quantized stack's own forward), and
  Qwen3.5's shared expert ``sigmoid(shared_expert_gate) * shared`` added; a dense MLP as ``down(act(gate(x)) * up(x))``.

Products run as the modules would run them (:func:`daemon.model.decode._projection`: planned kernels and quantized
weights included). Only the layer classes it knows take this path (:data:`LAYER_CLASSES`), full attention without
a window (a sliding window's layers need their masks) over SDPA; anything else runs the layers' own forward.
``tests/unit/test_qwen_decode.py`` holds every output to be bitwise the layers' own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from daemon.model import decode
from daemon.model.decode import REDUCED_DTYPES, _projection
from daemon.model.experts import NAME as DECODE_EXPERTS
from daemon.model.experts import decode_experts_forward
from daemon.model.kvcache import GrowingLayer

LAYER_CLASSES = frozenset({"Qwen3DecoderLayer", "Qwen3MoeDecoderLayer", "Qwen3_5DecoderLayer",
                           "Qwen3_5MoeDecoderLayer"})
_NORM_CLASSES = frozenset({"Qwen3RMSNorm", "Qwen3MoeRMSNorm"})  # weight * x.to(dtype), as Llama's
_OFFSET_NORM_CLASSES = frozenset({"Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm"})  # (x * (1 + weight)).type_as(x)
_ATTENTION_CLASSES = frozenset({"Qwen3Attention", "Qwen3MoeAttention"})
_GATED_ATTENTION_CLASSES = frozenset({"Qwen3_5Attention", "Qwen3_5MoeAttention"})  # queries and gates interleaved
_DELTA_CLASSES = frozenset({"Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"})
_MLP_CLASSES = frozenset({"Qwen3MLP", "Qwen3MoeMLP", "Qwen3_5MLP", "Qwen3_5MoeMLP"})
_MOE_CLASSES = frozenset({"Qwen3MoeSparseMoeBlock", "Qwen3_5MoeSparseMoeBlock"})

Projection = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class _Norm:
    weight: torch.Tensor  # the weight, or 1 + weight in float32 where the layer scales by that (offset)
    eps: float
    offset: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight).type_as(x) if self.offset else self.weight * h.to(x.dtype)


@dataclass(frozen=True)
class _Attention:
    q: Projection  # the queries, and with ``gated`` each head's gate after its query
    k: Projection
    v: Projection
    o: Projection
    q_norm: _Norm
    k_norm: _Norm
    gated: bool
    heads: int
    head_dim: int
    scaling: float
    gqa: dict


@dataclass(frozen=True)
class _Mlp:
    gate: Projection
    up: Projection
    down: Projection
    act: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x)) * self.up(x))


@dataclass(frozen=True)
class _Moe:
    router: nn.Module
    experts: nn.Module
    shared: _Mlp | None  # Qwen3.5's shared expert, weighed by its gate
    shared_gate: Projection | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.view(-1, x.shape[-1])
        _, weights, chosen = self.router.forward(flat)
        experts = self.experts
        if "forward" not in experts.__dict__ and experts.config._experts_implementation == DECODE_EXPERTS:
            routed = decode_experts_forward(experts, flat, chosen, weights)
        else:  # a quantized stack's own forward, or transformers' dispatch to the implementation set
            routed = experts.forward(flat, chosen, weights)
        if self.shared is not None:
            routed = routed + torch.sigmoid(self.shared_gate(flat)) * self.shared(flat)
        return routed.reshape(x.shape)


@dataclass(frozen=True)
class _Layer:
    norm_in: _Norm
    norm_post: _Norm
    attention: _Attention | None  # an attention layer's, else
    delta: nn.Module | None  # a gated delta net's
    mlp: _Mlp | _Moe


def _norm(module: nn.Module) -> _Norm | None:
    name = type(module).__name__
    if name in _NORM_CLASSES:
        return _Norm(module.weight, module.variance_epsilon, offset=False)
    if name in _OFFSET_NORM_CLASSES:
        with torch.inference_mode():
            return _Norm(1.0 + module.weight.detach().float(), module.eps, offset=True)
    return None


def _bind_mlp(mlp: nn.Module) -> _Mlp | _Moe | None:
    name = type(mlp).__name__
    if name in _MLP_CLASSES:
        return _Mlp(_projection(mlp.gate_proj), _projection(mlp.up_proj), _projection(mlp.down_proj), mlp.act_fn)
    if name not in _MOE_CLASSES:
        return None
    if not hasattr(mlp, "shared_expert"):
        return _Moe(mlp.gate, mlp.experts, None, None)
    shared = _bind_mlp(mlp.shared_expert)
    return None if shared is None else _Moe(mlp.gate, mlp.experts, shared, _projection(mlp.shared_expert_gate))


def _bind_attention(attn: nn.Module, config) -> _Attention | None:
    name = type(attn).__name__
    if name not in _ATTENTION_CLASSES | _GATED_ATTENTION_CLASSES:
        return None
    q_norm, k_norm = _norm(attn.q_norm), _norm(attn.k_norm)
    if q_norm is None or k_norm is None or getattr(attn, "sliding_window", None) is not None or attn.head_dim > 256:
        return None  # a window needs its mask; beyond 256, transformers' SDPA call repeats keys and values
    return _Attention(q=_projection(attn.q_proj), k=_projection(attn.k_proj), v=_projection(attn.v_proj),
                      o=_projection(attn.o_proj), q_norm=q_norm, k_norm=k_norm,
                      gated=name in _GATED_ATTENTION_CLASSES, heads=config.num_attention_heads,
                      head_dim=attn.head_dim, scaling=attn.scaling,
                      gqa={"enable_gqa": True} if attn.num_key_value_groups > 1 else {})


def _bind(layer: nn.Module, layer_type: str, config) -> _Layer | None:
    """The layer's parts, or None where its one-position forward is not the one this module computes."""
    if type(layer).__name__ not in LAYER_CLASSES:
        return None
    norm_in, norm_post = _norm(layer.input_layernorm), _norm(layer.post_attention_layernorm)
    mlp = _bind_mlp(layer.mlp)
    if norm_in is None or norm_post is None or mlp is None:
        return None
    if layer_type == "full_attention" and hasattr(layer, "self_attn"):
        attention = _bind_attention(layer.self_attn, config)
        return None if attention is None else _Layer(norm_in, norm_post, attention, None, mlp)
    if layer_type == "linear_attention" and type(getattr(layer, "linear_attn", None)).__name__ in _DELTA_CLASSES:
        return _Layer(norm_in, norm_post, None, layer.linear_attn, mlp)
    return None


class QwenDecoder:
    """One-position steps through layers ``[start, end)`` of ``layers`` where every one of them can take it: the
    same interface as :class:`daemon.model.decode.FastDecoder` (``fits``, ``cache_fits``, ``run``, ``run_rows``).
    Bound once, to the modules' own tensors, after loading and plans: after they change, make a new one."""

    _native = None  # no native multi-position step (decode.FastDecoder's NativeSteps)

    def __init__(self, bound: dict[int, _Layer], start: int, end: int, *, float_attention: bool) -> None:
        self._bound = bound
        self.start, self.end = start, end
        self.float_attention = float_attention  # a bfloat16 or float16 query attends in float32 (planned nodes)

    @classmethod
    def bind(cls, layers: Sequence[nn.Module], config, layer_types: Sequence[str], start: int, end: int, *,
             native_steps: bool = False) -> QwenDecoder | None:
        """Layers ``[start, end)`` bound, or None where one of them (or the attention implementation) is not one
        this path computes."""
        if getattr(config, "_attn_implementation", None) != "sdpa":
            return None
        bound = {i: _bind(layers[i], layer_types[i], config) for i in range(start, end)}
        if not bound or any(b is None for b in bound.values()):
            return None
        return cls(bound, start, end, float_attention=native_steps)

    @property
    def attends(self) -> bool:
        """Whether a hosted layer attends (a step then needs its position's rotary ``(cos, sin)``)."""
        return any(p.attention is not None for p in self._bound.values())

    def fits(self, start_layer: int) -> bool:
        return start_layer in self._bound

    def cache_fits(self, cache, start_layer: int, past_len: int) -> bool:
        """Whether ``cache`` (None: stateless, from position 0) keeps every hosted attention layer in a
        :class:`GrowingLayer` holding exactly the ``past_len`` positions before this one (the delta nets read
        their states through the cache as their own forward does)."""
        if cache is None:
            return past_len == 0
        layers = cache.layers
        return all(type(layers[i]) is GrowingLayer and layers[i].get_seq_length() == past_len
                   for i in range(start_layer, self.end) if self._bound[i].attention is not None)

    def run_rows(self, hidden, position_embeddings, cache, start_layer: int) -> None:
        return None  # a verify step's positions run one by one, each through run

    def run_batch(self, hidden, position_embeddings, caches, start_layer: int) -> None:
        return None  # a batch of sessions runs the layers' own forward (daemon.model.batching)

    @torch.inference_mode()
    def run(self, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None, cache,
            start_layer: int) -> torch.Tensor:
        """Layers ``[start_layer, end)`` over ``hidden [1, 1, hidden]`` with rotary ``(cos, sin)`` for its position
        (None where no hosted layer attends), keys, values and states written into ``cache``."""
        for i in range(start_layer, self.end):
            p = self._bound[i]
            residual = hidden
            x = p.norm_in(hidden)
            if p.attention is not None:
                x = self._attend(p.attention, x, position_embeddings, cache, i)
            else:
                x = p.delta.forward(hidden_states=x, cache=cache, attention_mask=None, use_cache=cache is not None)
            hidden = residual + x
            residual = hidden
            hidden = residual + p.mlp(p.norm_post(hidden))
        return hidden

    def _attend(self, p: _Attention, x: torch.Tensor, position_embeddings, cache, index: int) -> torch.Tensor:
        if p.gated:
            query, gate = torch.chunk(p.q(x).view(1, 1, -1, p.head_dim * 2), 2, dim=-1)
            gate = gate.reshape(1, 1, -1)
        else:
            query, gate = p.q(x).view(1, 1, -1, p.head_dim), None
        query = p.q_norm(query)  # [1, 1, heads, head_dim]
        key = p.k_norm(p.k(x).view(1, 1, -1, p.head_dim))
        value = p.v(x).view(1, 1, -1, p.head_dim).transpose(1, 2)
        cos, sin = position_embeddings  # [1, 1, rotary dims]: broadcast over heads, as apply_rotary_pos_emb's
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        rotary, half = cos.shape[-1], cos.shape[-1] // 2
        qk = torch.cat((query, key), dim=2)  # queries and keys rotated in one pass
        turned = qk[..., :rotary] if rotary < p.head_dim else qk
        rotated = turned * cos + torch.cat((-turned[..., half:], turned[..., :half]), dim=-1) * sin  # rotate_half
        qk = torch.cat([rotated, qk[..., rotary:]], dim=-1) if rotary < p.head_dim else rotated
        query = qk[:, :, :p.heads].transpose(1, 2)  # [1, heads, 1, head_dim]
        key = qk[:, :, p.heads:].transpose(1, 2)
        if cache is not None:
            key, value = cache.layers[index].update(key, value)
        if self.float_attention and query.dtype in REDUCED_DTYPES and query.device.type == "cpu":
            out = decode.attend_in_float32(query, key, value, p.scaling, **p.gqa)
        else:
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, scale=p.scaling,
                                                 is_causal=False, **p.gqa)
        out = out.transpose(1, 2).reshape(1, 1, -1)
        return p.o(out if gate is None else out * torch.sigmoid(gate))
