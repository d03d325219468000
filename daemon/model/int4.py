"""Weight-only 4-bit for a node's own decoder layers: llama.cpp's Q4_0 format, an eighth of float32's bytes and a bit.

Each weight row is held as blocks of 32 values ``d * (q - 8)``, ``q`` in 0..15, with one float16 scale ``d`` per
block: 4.5 bits a value, the bytes of llama.cpp's Q4_0. A block's ``d`` is its value of largest magnitude over -8,
so that value is held exactly (as ``q = 0``) and the rest round to the nearest step, as llama.cpp's own quantizer
does. The LM head is quantized to int8 (:mod:`daemon.model.quantize`), as llama.cpp's Q4_0 files keep theirs in a
wider format. A mixture-of-experts layer's fused experts (in the layout :mod:`daemon.model.experts` knows) are
quantized too, expert by expert (:func:`quantize_experts`): in such models they are most of the bytes.

A decode step's rows (up to :data:`~daemon.model.native.MAX_ROWS`) are multiplied by the native kernel
(``meshnet_gemv_q4`` in ``gemv.c``): each row quantized to int8 in blocks of 64 as for int8 weights, exact integer
sums per block, each scaled in float32. Longer products (prompts) turn the weights back into the activations'
dtype a few megabytes of rows at a time (exactly, in float32) and multiply them with torch's own kernel; so do
machines without the native library, where the unpacking runs in torch.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.nn import functional as F

from daemon.host import file_mappings, release_tensor_pages
from daemon.model import native
from daemon.model.experts import pairs_by_expert, weigh_pairs

BLOCK = 32  # values per float16 scale
RUN = 128  # values per 64 bytes: byte j holds value j (low half) and j + 64 (high half); then runs of 64 and 32
CHUNK_BYTES = 16 << 20  # a prompt's product dequantizes at most this many bytes of weights at a time; a quantizer
# takes as many bytes of float32 rows at a time
TILED_ROWS = 64  # a prompt of up to this many rows goes through the native prompt tiles, a longer one dequantized


def quantize(weight: torch.Tensor, mappings: list[tuple[int, int]] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` (``in`` a multiple of 32) as 4-bit values packed two to a byte ``[out, in / 2]`` uint8
    and float16 scales ``[out, in / 32]``, a few megabytes of rows at a time (a whole matrix's float32 temporaries
    would be several times its bytes). Rows read from a checkpoint's file mapping (``mappings``, this process's
    own by default) leave the resident set once quantized: a node never holds a float matrix beside its copy."""
    rows, columns = weight.shape
    if columns % BLOCK:
        raise ValueError(f"4-bit rows are whole blocks of {BLOCK} values, not {columns}")
    packed = torch.empty(rows, columns // 2, dtype=torch.uint8, device=weight.device)
    scale = torch.empty(rows, columns // BLOCK, dtype=torch.float16, device=weight.device)
    step = max(1, CHUNK_BYTES // (columns * 4))
    if mappings is None:
        mappings = file_mappings() if weight.device.type == "cpu" else []
    for first in range(0, rows, step):
        part = weight[first:first + step].detach()
        packed[first:first + step], scale[first:first + step] = _quantize_rows(part)
        release_tensor_pages(part, mappings)
    return packed, scale


def _quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, columns = weight.shape
    blocks = weight.to(torch.float32).reshape(rows, columns // BLOCK, BLOCK)
    top = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))  # each block's value of largest magnitude
    scale = (top / -8).to(torch.float16)
    step = scale.to(torch.float32)
    inverse = torch.where(step != 0, 1 / step, torch.zeros_like(step))
    q = (blocks * inverse).round_().clamp_(-8, 7).add_(8).to(torch.uint8).reshape(rows, columns)
    return pack(q), scale.reshape(rows, columns // BLOCK).contiguous()


def _runs(columns: int) -> list[tuple[int, int, int]]:
    """A row's runs: ``(first value, run length, how many such runs)``: runs of 128 while they fit, then 64, then 32."""
    runs, start = [], 0
    for size in (RUN, RUN // 2, RUN // 4):
        count = (columns - start) // size
        if count:
            runs.append((start, size, count))
            start += size * count
    return runs


def pack(q: torch.Tensor) -> torch.Tensor:
    """Values ``q [out, in]`` in 0..15 two to a byte: byte j of a run holds its value j and j + half its length."""
    rows = q.shape[0]
    parts = []
    for start, size, count in _runs(q.shape[1]):
        halves = q[:, start:start + size * count].reshape(rows, count, 2, size // 2)
        parts.append((halves[:, :, 0] | halves[:, :, 1] << 4).reshape(rows, -1))
    return torch.cat(parts, dim=1).contiguous()


def unpack(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """The values ``q [out, in]`` (uint8, 0..15) that :func:`pack` packed."""
    rows = packed.shape[0]
    parts = []
    for start, size, count in _runs(columns):
        run = packed[:, start // 2:(start + size * count) // 2].reshape(rows, count, size // 2)
        parts.append(torch.stack((run & 15, run >> 4), dim=2).reshape(rows, size * count))
    return torch.cat(parts, dim=1)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, columns: int, dtype: torch.dtype) -> torch.Tensor:
    """The weights ``d * (q - 8)`` of rows ``packed`` in ``dtype``, by torch alone (exact in float32)."""
    q = unpack(packed, columns).to(torch.float32).sub_(8).reshape(packed.shape[0], -1, BLOCK)
    return (q * scale.to(torch.float32)[..., None]).reshape(packed.shape[0], columns).to(dtype)


class Int4WeightLinear(nn.Module):
    """An ``nn.Linear`` with 4-bit weights in blocks of 32 (Q4_0's format): a decode step's few rows (and a short
    prompt's) by the native kernel, more by torch's own product over the weights dequantized a few rows at a time.

    The weight is ``weight_q4`` (uint8, two values a byte), not ``weight``: code that reads ``proj.weight.dtype``
    to cast activations fails loudly instead of casting them to uint8.
    """

    def __init__(self, linear: nn.Linear, mappings: list[tuple[int, int]] | None = None) -> None:
        """``linear``'s weight quantized (:func:`quantize`, with ``mappings``)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed, scale = quantize(linear.weight, mappings)
        self.weight_q4 = nn.Parameter(packed, requires_grad=False)  # [out, in / 2] uint8
        self.scale = nn.Parameter(scale, requires_grad=False)  # [out, in / 32] float16
        self.bias = linear.bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weight_q4, self.scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``x [..., in]`` by the 4-bit matrix ``packed [out, in / 2]`` with ``scale [out, in / 32]``: up to
    :data:`~daemon.model.native.MAX_ROWS` rows natively (a decode step), up to :data:`TILED_ROWS` (a short prompt)
    by the native prompt tiles (:func:`~daemon.model.native.gemm_q4`), more by torch over the weights dequantized
    :data:`CHUNK_BYTES` at a time (natively where the library is built)."""
    columns, out_features = packed.shape[1] * 2, packed.shape[0]
    native_here = packed.device.type == "cpu" and native.library() is not None
    if native_here and x.numel() <= native.MAX_ROWS * columns:
        return native.gemv_q4(x, packed, scale, columns, bias)
    if native_here and x.numel() <= TILED_ROWS * columns:
        return native.gemm_q4(x, packed, scale, columns, bias)
    rows = x.reshape(-1, columns)
    out = torch.empty(rows.shape[0], out_features, dtype=x.dtype, device=x.device)
    step = max(1, CHUNK_BYTES // (columns * x.element_size()))
    for first in range(0, out_features, step):
        last = min(first + step, out_features)
        if native_here:
            weight = native.dequantize_q4(packed, scale, columns, first, last, x.dtype)
        else:
            weight = dequantize(packed[first:last], scale[first:last], columns, x.dtype)
        out[:, first:last] = F.linear(rows, weight)
    out = out.reshape(*x.shape[:-1], out_features)
    return out if bias is None else out + bias


EXPERT_STACKS = ("gate_up_proj", "down_proj")


def quantize_experts(experts: nn.Module) -> None:
    """Replace a fused experts module's ``gate_up_proj [experts, 2 * intermediate, hidden]`` and ``down_proj
    [experts, hidden, intermediate]`` by 4-bit stacks (``<name>_q4``, ``<name>_scale``), quantized one expert at a
    time (never a float32 copy of a whole stack), and multiply through them (:func:`experts_forward`). A node
    loading a checkpoint quantizes its experts as it fuses them instead (:mod:`daemon.model.fusing`)."""
    for name in EXPERT_STACKS:
        stack = getattr(experts, name).detach()
        # a fused stack is memory of its own, mapped from no file
        packed, scale = quantize_stack((stack[expert] for expert in range(len(stack))), *stack.shape, stack.device)
        del stack
        install_stack(experts, name, packed, scale)


def quantize_stack(matrices, count: int, rows: int, columns: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` expert matrices ``[rows, columns]``, given one at a time by ``matrices``, as one 4-bit stack:
    packed values ``[count, rows, columns / 2]`` and float16 scales ``[count, rows, columns / 32]``."""
    if columns % BLOCK:
        raise ValueError(f"4-bit rows are whole blocks of {BLOCK} values, not {columns}")
    packed = torch.empty(count, rows, columns // 2, dtype=torch.uint8, device=device)
    scale = torch.empty(count, rows, columns // BLOCK, dtype=torch.float16, device=device)
    for expert, matrix in enumerate(matrices):
        packed[expert], scale[expert] = quantize(matrix, mappings=[])
    return packed, scale


def install_stack(experts: nn.Module, name: str, packed: torch.Tensor, scale: torch.Tensor) -> None:
    """Hold the experts' stack ``name`` (``gate_up_proj`` or ``down_proj``) as ``packed`` and ``scale`` from
    :func:`quantize_stack`, in place of its float tensor, and multiply through the 4-bit stacks."""
    if name in experts._parameters:
        delattr(experts, name)
    experts.register_parameter(f"{name}_q4", nn.Parameter(packed, requires_grad=False))
    experts.register_parameter(f"{name}_scale", nn.Parameter(scale, requires_grad=False))
    experts.forward = types.MethodType(experts_forward, experts)


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' output for ``hidden_states [tokens, hidden]`` routed to ``top_k_index`` with ``top_k_weights``
    (``[tokens, top_k]``), over 4-bit stacks: each selected expert's tokens by its gate/up matrix, the model's own
    gate, its down matrix; each pair's output times its routing weight, summed over a token's pairs."""
    tokens, top_k = top_k_index.shape
    if (tokens * top_k <= native.MAX_ROWS and hidden_states.device.type == "cpu" and native.library() is not None
            and hidden_states.dtype in (torch.float32, torch.bfloat16)):
        # a decode step's pairs, each by its expert's matrices in one call a stack: the products one call per expert
        # makes, bit for bit, without a Python round per expert
        which = top_k_index.reshape(-1).to(torch.int64)
        x = hidden_states.repeat_interleave(top_k, dim=0)  # pair p's row: its token's
        h = self._apply_gate(native.gemv_pairs_q4(x, self.gate_up_proj_q4, self.gate_up_proj_scale, which))
        return weigh_pairs(native.gemv_pairs_q4(h, self.down_proj_q4, self.down_proj_scale, which), top_k_weights,
                           hidden_states.dtype)
    return experts_one_by_one(self, hidden_states, top_k_index, top_k_weights)


def experts_one_by_one(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """:func:`experts_forward`'s result one selected expert at a time, all its tokens together (a prompt's way)."""
    tokens, top_k = top_k_index.shape
    pairs_of = pairs_by_expert(top_k_index)
    out = torch.empty(tokens * top_k, hidden_states.shape[-1], dtype=hidden_states.dtype, device=hidden_states.device)
    for expert, pairs in pairs_of.items():
        x = hidden_states[[pair // top_k for pair in pairs]]
        h = self._apply_gate(linear(x, self.gate_up_proj_q4[expert], self.gate_up_proj_scale[expert]))
        out[pairs] = linear(h, self.down_proj_q4[expert], self.down_proj_scale[expert])
    return weigh_pairs(out, top_k_weights, hidden_states.dtype)
