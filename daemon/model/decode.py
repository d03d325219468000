"""One new position through Llama-family layers, with transformers' arithmetic and without its plumbing.

A decode step on a CPU node multiplies one row by every weight; for the built-in model the products take
about 26 ms of a 38 ms step, and the rest was transformers' module plumbing around them: some 130 tensor
ops and a dozen Python calls per layer (keyword forwarding, deprecation wrappers, the attention-interface
lookup, ``rotate_half``'s slices and ``cat``), each a few microseconds on a small model. :class:`FastDecoder`
runs the same layers for one position with about 35 ops each.

It computes exactly what the layers' own forward computes, op for op in the same order and dtype, so float32
and bfloat16 nodes keep ``generate``'s tokens bit for bit:

- RMSNorm as ``LlamaRMSNorm``: to float32, ``pow(2).mean``, ``rsqrt(var + eps)``, back, times the weight.
- Rotary as ``apply_rotary_pos_emb``: ``q * cos + rotate_half(q) * sin``. ``rotate_half(q)`` is
  ``cat(-q2, q1)``; here it is ``roll(q) = cat(q2, q1)`` times ``sin`` with its first half negated, which is the
  same product exactly (negation is exact), for queries and keys in one pass.
- Attention as ``sdpa_attention_forward`` for one query: ``scaled_dot_product_attention`` with no mask, the
  layer's scale, and ``enable_gqa`` where key/value heads are shared.
- The MLP as ``LlamaMLP``: ``down(act(gate(x)) * up(x))``.

Where a node plans its kernels, a bfloat16 query attends in float32 instead (:func:`attend_in_float32`, in this
path and, through :func:`float_attention`, in any layer's own forward), within bfloat16 rounding of SDPA's
output (ADR-0045).

Only layers it knows run this way (:data:`LAYER_CLASSES`, full attention, SDPA, a cache layer that grows in
place or none); any other step, layer or mask falls back to the layers' own forward. ``tests/unit/test_decode.py``
holds every output to be bitwise the layers' own.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from daemon.model import native
from daemon.model.batching import PLAIN_KWARGS
from daemon.model.kvcache import GrowingLayer

MAX_ROWS = 16  # positions one native step takes (gemv.c's MAX_ROWS)

# decoder layers whose one-position forward is LlamaDecoderLayer's: pre-norm attention and gated MLP
LAYER_CLASSES = frozenset({"LlamaDecoderLayer", "Qwen2DecoderLayer"})
_NORM_CLASSES = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm"})


@dataclass(frozen=True)
class _Layer:
    """What one layer's step reads, bound once: its norms, projections (callables), heads and scale."""

    norm_in: tuple[torch.Tensor, float]
    norm_post: tuple[torch.Tensor, float]
    q: Callable[[torch.Tensor], torch.Tensor]
    k: Callable[[torch.Tensor], torch.Tensor]
    v: Callable[[torch.Tensor], torch.Tensor]
    o: Callable[[torch.Tensor], torch.Tensor]
    gate: Callable[[torch.Tensor], torch.Tensor]
    up: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]
    act: Callable[[torch.Tensor], torch.Tensor]
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    gqa: dict


def _projection(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``module``'s product as a bare callable: ``F.linear`` on a plain ``nn.Linear``, else its own forward
    (planned kernels, quantized weights), without ``nn.Module.__call__``'s hooks machinery."""
    if type(module) is nn.Linear:  # by position: torchao's quantized weights read F.linear's arguments so
        weight, bias = module.weight, module.bias
        return lambda x: F.linear(x, weight, bias)
    return module.forward


def _norm(module: nn.Module) -> tuple[torch.Tensor, float] | None:
    if type(module).__name__ not in _NORM_CLASSES:
        return None
    return module.weight, module.variance_epsilon


def _bind(layer: nn.Module, config) -> _Layer | None:
    """The layer's parts, or None when its one-position forward is not the one this module computes."""
    if type(layer).__name__ not in LAYER_CLASSES:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    norm_in, norm_post = _norm(layer.input_layernorm), _norm(layer.post_attention_layernorm)
    if norm_in is None or norm_post is None or getattr(config, "pretraining_tp", 1) != 1:
        return None
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if attn.head_dim > 256:  # transformers then repeats keys and values instead of sharing heads in SDPA
        return None
    return _Layer(
        norm_in=norm_in, norm_post=norm_post,
        q=_projection(attn.q_proj), k=_projection(attn.k_proj), v=_projection(attn.v_proj),
        o=_projection(attn.o_proj), gate=_projection(mlp.gate_proj), up=_projection(mlp.up_proj),
        down=_projection(mlp.down_proj), act=mlp.act_fn,
        heads=heads, kv_heads=kv_heads, head_dim=attn.head_dim, scaling=attn.scaling,
        gqa={"enable_gqa": True} if attn.num_key_value_groups > 1 else {},
    )


def _rms_norm(x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    weight, eps = norm
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


# One query's attention over bfloat16 or float16 keys and values: PyTorch 2.13's CPU SDPA for these dtypes takes
# 10x its float32 time (Llama-8B-shaped heads, 150 positions, 2 threads: 576 against 95 us with the conversions;
# 1000 positions: 3.7 against 0.67 ms). Computed in float32 instead, the probabilities are not rounded to the
# activation dtype before they weigh the values, as that kernel rounds them: the output moves by about the
# dtype's rounding (measured up to 2e-3 of its scale), as another kernel's products do, so a node does it only
# where it plans its kernels (``--tune-kernels on``; tests/unit/test_decode.py bounds it).
REDUCED_DTYPES = (torch.bfloat16, torch.float16)
DECODE_ATTENTION = "meshnet_decode_sdpa"  # the attention implementation's name in transformers' registry
# what transformers' SDPA call may be handed for a plain one-query attention: a batched row's, and whether it is
# causal (for one query it attends to every held position either way)
_PLAIN_KWARGS = PLAIN_KWARGS | {"is_causal"}


def attend_in_float32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                      enable_gqa: bool = False) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v)`` without a mask, computed in float32, in ``q``'s dtype: bfloat16
    by ``gemv.c`` where it is built (reading each key and value once, where converting them wrote twice their
    bytes: 4000 Llama-8B-shaped positions 1.1 ms a layer against 3.7-7.2 that way), else by converting to float32."""
    out = native.attend_bf16(q, k, v, scale if scale is not None else q.shape[-1] ** -0.5)
    if out is not None:
        return out
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=scale,
                                          enable_gqa=enable_gqa).to(q.dtype)


def decode_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, with a one-position step's unmasked attention over bfloat16 or float16 on the
    CPU computed in float32 (:func:`attend_in_float32`); anything else as SDPA computes it."""
    if (query.shape[2] != 1 or attention_mask is not None or query.dtype not in REDUCED_DTYPES
            or query.device.type != "cpu" or key.shape[-1] != value.shape[-1] or key.shape[-1] > 256
            or not set(kwargs) <= _PLAIN_KWARGS or kwargs.get("dropout", 0.0)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out = attend_in_float32(query, key, value, kwargs.get("scaling"), enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def float_attention(configs: Sequence) -> Iterator[None]:
    """Layers reading ``configs`` that run SDPA take :func:`decode_attention_forward` for the ``with`` block (the
    node runs one forward at a time on its torch thread: no other step sees the switch)."""
    switched = [config for config in configs if config._attn_implementation == "sdpa"]
    try:
        for config in switched:
            config._attn_implementation = DECODE_ATTENTION
        yield
    finally:
        for config in switched:
            config._attn_implementation = "sdpa"


def _register() -> None:
    AttentionInterface.register(DECODE_ATTENTION, decode_attention_forward)


_register()


class FastDecoder:
    """One-position steps through layers ``[start, end)`` of ``layers`` where every one of them can take it.

    ``fits(start_layer)`` says whether a step from ``start_layer`` can run here; ``run`` runs it. The layers are
    bound once, to the modules' own tensors: after their projections are replaced or re-laid out, make a new one
    (``DecoderLayers.forget_fast_decoder``).
    """

    attends = True  # every layer it binds attends: a step needs its position's rotary (cos, sin)

    def __init__(self, layers: Sequence[nn.Module], config, layer_types: Sequence[str], start: int, end: int, *,
                 native_steps: bool = False) -> None:
        self.start, self.end = start, end
        self.float_attention = native_steps  # a bfloat16 or float16 query attends in float32 (attend_in_float32)
        self._bound: dict[int, _Layer] = {}  # every hosted layer, or none: a step runs all of them or none here
        self._native: NativeSteps | None = None
        if getattr(config, "_attn_implementation", None) != "sdpa":
            return
        bound = {i: _bind(layers[i], config) if layer_types[i] == "full_attention" else None for i in range(start, end)}
        if all(b is not None for b in bound.values()):
            self._bound = bound
            if native_steps:
                self._native = NativeSteps.bind(layers, config, start, end)

    def fits(self, start_layer: int) -> bool:
        return bool(self._bound) and start_layer in self._bound

    def run_rows(self, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor], cache,
                 start_layer: int) -> torch.Tensor | None:
        """A few new positions (``hidden [1, T, hidden]``, T up to :data:`MAX_ROWS`: a verify step) as native
        steps, or None where they cannot run natively (the caller then runs the layers' own forward)."""
        if self._native is None or cache is None or hidden.dtype != torch.float32 or hidden.shape[1] > MAX_ROWS:
            return None
        return self._native.run(hidden, position_embeddings, cache.layers, start_layer, self.end)

    def run_batch(self, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                  caches: Sequence, start_layer: int) -> torch.Tensor | None:
        """One new position of each of several sessions (``hidden [1, B, hidden]``, row ``i`` continuing
        ``caches[i]``) as native steps, or None where they cannot run natively (the caller then runs the batch
        through the layers' own forward)."""
        if (self._native is None or hidden.dtype != torch.float32 or not self.fits(start_layer)
                or not all(self.cache_fits(cache, start_layer, cache.layers[start_layer].get_seq_length())
                           for cache in caches)):
            return None
        return self._native.run_batch(hidden, position_embeddings, caches, start_layer, self.end)

    def cache_fits(self, cache, start_layer: int, past_len: int) -> bool:
        """Whether ``cache`` (None: stateless, from position 0) keeps every hosted layer in a :class:`GrowingLayer`
        holding exactly the ``past_len`` positions before this one (layers that ignored the cache filled none)."""
        if cache is None:
            return past_len == 0
        layers = cache.layers
        return all(type(layers[i]) is GrowingLayer and layers[i].get_seq_length() == past_len
                   for i in range(start_layer, self.end))

    @torch.inference_mode()
    def run(self, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor], cache,
            start_layer: int) -> torch.Tensor:
        """Layers ``[start_layer, end)`` over ``hidden [1, 1, hidden]`` with rotary ``(cos, sin)`` for its
        position, writing each layer's key and value into ``cache`` (None: the position attends to itself)."""
        if self._native is not None and cache is not None and hidden.dtype == torch.float32:
            out = self._native.run(hidden, position_embeddings, cache.layers, start_layer, self.end)
            if out is not None:
                return out
        cos, sin = position_embeddings  # [1, 1, head_dim]
        half = cos.shape[-1] // 2
        cos = cos.unsqueeze(2)  # [1, 1, 1, head_dim]: broadcast over heads, as apply_rotary_pos_emb's unsqueeze
        sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(2)
        cache_layers = cache.layers if cache is not None else None
        for i in range(start_layer, self.end):
            p = self._bound[i]
            residual = hidden
            x = _rms_norm(hidden, p.norm_in)
            q = p.q(x).view(1, 1, p.heads, p.head_dim)
            k = p.k(x).view(1, 1, p.kv_heads, p.head_dim)
            v = p.v(x).view(1, 1, p.kv_heads, p.head_dim).transpose(1, 2)
            qk = torch.cat((q, k), dim=2)  # queries and keys rotated in one pass
            qk = qk * cos + qk.roll(half, -1) * sin_signed
            q = qk[:, :, :p.heads].transpose(1, 2)  # [1, heads, 1, head_dim]
            k = qk[:, :, p.heads:].transpose(1, 2)
            if cache_layers is not None:
                k, v = cache_layers[i].update(k, v)
            if self.float_attention and q.dtype in REDUCED_DTYPES:
                out = attend_in_float32(q, k, v, p.scaling, **p.gqa)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, scale=p.scaling,
                                                     is_causal=False, **p.gqa)
            out = out.transpose(1, 2).reshape(1, 1, -1)
            hidden = residual + p.o(out)
            residual = hidden
            x = _rms_norm(hidden, p.norm_post)
            hidden = residual + p.down(p.act(p.gate(x)) * p.up(x))
        return hidden


class NativeSteps:
    """The same one-position step, each layer in one call of the native library (``meshnet_llama_layer`` in
    ``gemv.c``): float32 activations, weights in float32, int8 or 4-bit, caches that grow in place.

    What it saves is the per-op cost between the products: about 35 torch ops a layer at a few microseconds
    each, over 1000 a step for the built-in model. Its sums run in another order than torch's (RMSNorm's mean,
    the products, the softmax), so its outputs are within float32 rounding of the layers' own, not bit for bit:
    a node runs it only where its weights are planned (``--tune-kernels on``), as it runs another kernel's
    products (``tests/unit/test_decode.py`` holds it to the layers' own forward and the built-in model's tokens
    to ``generate``'s).
    """

    def __init__(self, lib, layers: dict[int, object], keep: list[torch.Tensor], sizes: tuple[int, ...]) -> None:
        self._lib, self._layers, self._keep = lib, layers, keep  # keep: tensors the structs point into
        self._sizes = sizes  # hidden, heads, kv heads, head dim, intermediate
        hidden_size, heads, kv_heads, head_dim, inter = sizes
        # the floats of work each position of a step needs besides its attention scores (heads * positions)
        self._row_work = (hidden_size + 2 * heads * head_dim + 2 * kv_heads * head_dim + 2 * inter
                          + lib.q8_floats(max(hidden_size, inter)))
        self._work = torch.empty(0)

    @classmethod
    def bind(cls, layers: Sequence[nn.Module], config, start: int, end: int) -> NativeSteps | None:
        """The layers ``[start, end)`` bound for native steps, or None where one of them cannot run there (another
        activation, weights of another kind or layout, bfloat16 norms) or the library is not built here."""
        lib = native.library()
        if lib is None or getattr(config, "hidden_act", None) != "silu":
            return None
        keep: list[torch.Tensor] = []
        bound: dict[int, native.Layer] = {}
        sizes: set[tuple[int, ...]] = set()
        for i in range(start, end):
            layer = layers[i]
            attn, mlp = layer.self_attn, layer.mlp
            matrices = [_native_matrix(m, keep) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                                                            mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(m is None for m in matrices) or any(n.weight.dtype != torch.float32 for n in norms):
                return None
            keep.extend(n.weight.detach() for n in norms)
            heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, attn.head_dim
            shape = (matrices[4].cols, heads, kv_heads, head_dim, matrices[4].rows)
            sizes.add(shape)
            bound[i] = native.Layer(*matrices, norms[0].weight.data_ptr(), norms[1].weight.data_ptr(),
                                    norms[0].variance_epsilon, norms[1].variance_epsilon, attn.scaling, *shape)
        if len(sizes) != 1:
            return None
        return cls(lib, bound, keep, sizes.pop())

    def run(self, hidden: torch.Tensor, position_embeddings, cache_layers, start_layer: int,
            end: int) -> torch.Tensor | None:
        """Layers ``[start_layer, end)`` over ``hidden [1, T, hidden]`` (T up to :data:`MAX_ROWS`: the positions
        after those cached, each attending to those before it and itself), keys and values written into the
        caches; None (nothing done) where a layer's cache holds nothing yet to grow from. Each position's outputs
        are the ones it would have alone: a verify step's rows are its one-position steps' exactly."""
        rows = hidden.shape[1]
        rooms = self._reserve([[cache_layers[i]] for i in range(start_layer, end)], rows)
        if rooms is None:
            return None
        position = cache_layers[start_layer].get_seq_length() - rows  # the first new position's index
        out, (cos, sin), work_ptr = self._prepare(hidden, position_embeddings, position + rows)
        for i, [(keys, values)] in zip(range(start_layer, end), rooms):
            self._lib.llama_layer(ctypes.byref(self._layers[i]), out.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                  keys.data_ptr(), values.data_ptr(), keys.shape[-2], position, rows, work_ptr)
        return out.view(1, rows, self._sizes[0])

    def run_batch(self, hidden: torch.Tensor, position_embeddings, caches: Sequence, start_layer: int,
                  end: int) -> torch.Tensor | None:
        """One new position of each of B sessions through layers ``[start_layer, end)``: row ``i`` of ``hidden
        [1, B, hidden]`` continues the session whose cache is ``caches[i]`` (its rotary ``(cos, sin)`` row ``i`` of
        ``[1, B, head_dim]``), its key and value written there; None (nothing done) where a session's layer holds
        nothing to grow from. Each product reads a weight once for the batch, each row attends to its own session,
        and each row's outputs are the ones its session's single step gives."""
        rows = hidden.shape[1]
        if rows > MAX_ROWS:
            return None
        rooms = self._reserve([[cache.layers[i] for cache in caches] for i in range(start_layer, end)], 1)
        if rooms is None:
            return None
        positions = [cache.layers[start_layer].get_seq_length() - 1 for cache in caches]  # each row's own
        out, (cos, sin), work_ptr = self._prepare(hidden, position_embeddings, max(positions) + 1)
        pos = (ctypes.c_long * rows)(*positions)
        pointers = ctypes.c_void_p * rows
        for i, layer_rooms in zip(range(start_layer, end), rooms):
            keys = pointers(*(room[0].data_ptr() for room in layer_rooms))
            values = pointers(*(room[1].data_ptr() for room in layer_rooms))
            capacity = (ctypes.c_long * rows)(*(room[0].shape[-2] for room in layer_rooms))
            self._lib.llama_layer_batch(ctypes.byref(self._layers[i]), out.data_ptr(), cos.data_ptr(),
                                        sin.data_ptr(), keys, values, capacity, pos, rows, work_ptr)
        return out.view(1, rows, self._sizes[0])

    @staticmethod
    def _reserve(layers: list[list], rows: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """Room for ``rows`` new positions in every cache layer of ``layers`` (per model layer, its sessions' cache
        layers): their key and value buffers, where the library writes each new key and value at [head, position]
        of a contiguous float32 buffer. Else None, with nothing left reserved: a layer with nothing cached yet to
        grow from goes the layers' own way."""
        reserved, rooms = [], []
        for layer_caches in layers:
            found = []
            for layer in layer_caches:
                room = layer.reserve(rows)
                if room is not None:
                    reserved.append(layer)
                if room is None or not all(b.is_contiguous() and b.dtype == torch.float32 for b in room):
                    for held in reserved:
                        held.crop(-rows)
                    return None
                found.append(room)
            rooms.append(found)
        return rooms

    def _prepare(self, hidden: torch.Tensor, position_embeddings, span: int):
        """A step's output buffer (``hidden``'s copy: the layers write into it, layer after layer), its rotary
        tables flat, and the work buffer's address, grown for ``hidden``'s rows each attending up to ``span``
        positions (each row's heads their own scores)."""
        rows, heads = hidden.shape[1], self._sizes[1]
        work = rows * (self._row_work + heads * span)
        if self._work.numel() < work:
            self._work = torch.empty(work + rows * 1024 * heads)  # room to grow: reallocated every 1024 positions
        cos_sin = tuple(t.reshape(-1).contiguous() for t in position_embeddings)
        return hidden.reshape(-1).clone(), cos_sin, self._work.data_ptr()


def _native_matrix(module: nn.Module, keep: list[torch.Tensor]):
    """``module``'s weight as a ``struct matrix``, or None where the native step cannot read it."""
    from daemon.model.int4 import Int4WeightLinear
    from daemon.model.quantize import Int8WeightLinear

    bias = getattr(module, "bias", None)
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    if type(module) in (Int8WeightLinear, Int4WeightLinear):
        weight = module.weight_int8 if type(module) is Int8WeightLinear else module.weight_q4
        weight, scale = weight.detach(), module.scale.detach()
        if not (weight.is_contiguous() and scale.is_contiguous() and weight.device.type == "cpu"):
            return None
    elif isinstance(module, nn.Linear) and type(module.weight.data) is torch.Tensor:
        weight, scale = module.weight.detach(), None
        if weight.dtype != torch.float32 or not weight.is_contiguous() or weight.device.type != "cpu":
            return None
    else:
        return None
    keep.extend(t for t in (weight, scale, bias) if t is not None)
    return native.Matrix(weight.data_ptr(), scale.data_ptr() if scale is not None else None,
                         bias.data_ptr() if bias is not None else None, weight.shape[0], module.in_features,
                         native.MATRIX_KINDS[weight.dtype])
