"""One new position through Qwen3.5's gated delta net (linear attention) in one native call.

transformers runs a linear-attention layer's decode step through its reference PyTorch functions when the CUDA
kernels (``causal-conv1d``, ``flash-linear-attention``) are not there, as on every CPU: the convolution update
as a ``cat``, a copy and a depthwise ``conv1d``; the delta rule as a dozen ops over the ``[heads, dk, dv]`` state;
the gated RMSNorm as eight more. On Qwen3.5-MoE-shaped layers (32 value heads of 128 by 128) they took about
1.5 ms of a layer's 3.5, beside its products' 1.9; 30 of Qwen3.5-35B-A3B's 40 layers are of this kind.

:func:`use_native_delta_steps` makes each such layer run ``meshnet_delta_step`` (``gemv.c``) between its own
input and output products (planned as every product is) for a one-position step of one sequence with a cache;
any other step (a prompt, a batch, a verify step that records the past) runs the layer's own forward. The
native step computes what the reference computes, with its roundings to the activation dtype where it rounds,
but its sums run in another order, so results agree to float rounding, not bit for bit: like the native
Llama-family step (:class:`daemon.model.decode.NativeSteps`) it is used only where weights are planned
(``--tune-kernels on``); ``tests/unit/test_linear_attention.py`` bounds it against the layer's own forward.
"""

from __future__ import annotations

import ctypes
import types

import torch
from torch import nn

from daemon.model import native

# the gated delta net classes whose forward is the one the native step follows (Qwen3-Next lays its input product
# out otherwise)
LAYER_CLASSES = frozenset({"Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"})
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_P, _L = ctypes.c_void_p, ctypes.c_long


class DeltaNet(ctypes.Structure):
    """``struct delta_net`` of ``gemv.c``."""

    _fields_ = [("conv_w", _P), ("neg_a", _P), ("dt_bias", _P), ("norm_w", _P), ("eps", ctypes.c_float),
                ("k_heads", _L), ("v_heads", _L), ("dk", _L), ("dv", _L), ("kernel", _L), ("state_len", _L)]


def use_native_delta_steps(model: nn.Module) -> int:
    """Give every gated delta net of ``model`` that the native step can run (CPU weights in float32 or bfloat16,
    SiLU, no convolution bias) its one-position step in ``gemv.c``. Returns how many layers took it (0 without
    the library)."""
    lib = native.library()
    if lib is None:
        return 0
    taken = 0
    for module in model.modules():
        if type(module).__name__ in LAYER_CLASSES and _bind(module, lib):
            taken += 1
    return taken


def _bind(module: nn.Module, lib) -> bool:
    weight = module.conv1d.weight
    dtype = weight.dtype
    if (dtype not in _DTYPES or weight.device.type != "cpu" or module.conv1d.bias is not None
            or module.activation not in ("silu", "swish") or module.norm.weight.dtype != dtype
            or module.num_v_heads % module.num_k_heads):
        return False
    with torch.no_grad():
        keep = {
            "conv_w": weight.detach().reshape(weight.shape[0], -1).contiguous(),
            "neg_a": (-module.A_log.detach().float().exp()).contiguous(),  # as the layer computes it every step
            "dt_bias": module.dt_bias.detach().float().contiguous(),
            "norm_w": module.norm.weight.detach().contiguous(),
        }
    layer = DeltaNet(conv_w=keep["conv_w"].data_ptr(), neg_a=keep["neg_a"].data_ptr(),
                     dt_bias=keep["dt_bias"].data_ptr(), norm_w=keep["norm_w"].data_ptr(),
                     eps=module.norm.variance_epsilon, k_heads=module.num_k_heads, v_heads=module.num_v_heads,
                     dk=module.head_k_dim, dv=module.head_v_dim, kernel=module.conv_kernel_size, state_len=0)
    module.meshnet_delta = (lib, layer, keep, dtype)
    if not hasattr(module, "meshnet_own_forward"):
        module.meshnet_own_forward = module.forward
        module.forward = types.MethodType(_forward, module)
    return True


def _forward(self: nn.Module, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
    """The layer's forward: a one-position cached step natively, anything else as the layer's own."""
    step = _native_step(self, hidden_states, cache)
    if step is None:
        return self.meshnet_own_forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    return step


def _native_step(self: nn.Module, hidden_states: torch.Tensor, cache) -> torch.Tensor | None:
    lib, layer, _, dtype = self.meshnet_delta
    if cache is None or hidden_states.shape[:2] != (1, 1) or hidden_states.dtype != dtype:
        return None
    index = self.layer_idx
    if cache.is_recording_past(index):
        return None
    conv_state = cache.get_conv_state(index, state_idx=0)
    state = cache.get_recurrent_state(index, state_idx=0)
    if (conv_state is None or state is None or conv_state.dtype != dtype or state.dtype != torch.float32
            or not conv_state.is_contiguous() or not state.is_contiguous() or conv_state.shape[0] != 1
            or state.shape != (1, self.num_v_heads, self.head_k_dim, self.head_v_dim)
            or conv_state.shape[-1] < self.conv_kernel_size - 1):
        return None
    qkv = self.in_proj_qkv(hidden_states).contiguous()
    z = self.in_proj_z(hidden_states).contiguous()
    b = self.in_proj_b(hidden_states).contiguous()
    a = self.in_proj_a(hidden_states).contiguous()
    out = torch.empty(1, 1, self.value_dim, dtype=dtype)
    layer.state_len = conv_state.shape[-1]
    scratch = native.scratch(qkv.shape[-1] + 2 * self.num_v_heads)
    lib.delta_step(ctypes.byref(layer), qkv.data_ptr(), z.data_ptr(), a.data_ptr(), b.data_ptr(),
                   conv_state.data_ptr(), state.data_ptr(), out.data_ptr(), _DTYPES[dtype], scratch)
    return self.out_proj(out)
