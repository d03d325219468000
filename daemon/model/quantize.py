"""Weight-only int8 for a node's own decoder layers: a quarter of float32's bytes, half of bfloat16's (and the
entry to ``int4``, llama.cpp's Q4_0 format, in :mod:`daemon.model.int4`).

The ``nn.Linear`` modules inside the decoder layers are quantized, with one symmetric scale per output
row, computed by torchao; with the ``int8`` method the tail's LM head too (:func:`quantize_head`), as
llama.cpp's Q8_0 files hold theirs. Embeddings never are. Two int8 methods:

- ``int8``: a decode step's rows (up to 16: one session's, or a batch's) are multiplied by the native
  kernel (:mod:`daemon.model.native`): it quantizes each row to int8 in blocks of 64 values and sums
  exact integer products, each block's scaled in float32, much as llama.cpp multiplies its Q8_0
  weights; a row's result is the same alone or in a batch. Longer products (prompts) take its prompt
  tiles (``meshnet_gemm_int8``: four weight rows by eight input rows, the same integer sums added in
  another order, within float32 rounding of a decode step's). Machines
  without the native kernel run PyTorch's own int8-weight kernel (``aten._weight_int8pack_mm``) in
  bfloat16, whatever the shard's compute dtype (float32 or bfloat16): a layer's inputs are rounded to
  bfloat16 for the kernel and its outputs cast back. Only on devices the kernel exists for (CPU). On a
  2-core AMD EPYC (Zen 4) one row by the built-in model's matrices, weights streamed from memory, took
  25-45% less time than with the kernel's earlier float32 sums (17-26 GB/s of int8 weights), and
  2-4x less than PyTorch's kernel (8-11 GB/s).
- ``int8-torchao``: torchao's ``Int8WeightOnlyConfig`` unchanged: its linear turns the whole int8
  weight back into the shard's dtype on every call, then multiplies. Any device, no bfloat16 rounding.

Why two (scripts/int8_matmul.py, three runs, one thread, batch 1, one token, on a shared 2-core x86
host at load 3-6, so ranges are wide): torchao's per-row path ran 2.5-15x slower than a float32
``nn.Linear`` at the built-in model's shapes and at 2048x8192, in float32 and bfloat16 alike, and
torchao 0.18 has no other int8 weight-only path for CPU (per-tensor is as slow, per-group and
``IntxWeightOnlyConfig`` slower still; version 1 of the config is gone). PyTorch's kernel took
0.1-1.1x float32's time in bfloat16 and 1.1-19x in float32, hence bfloat16 inside it. ``int8`` as a
whole (module call and casts included) took 0.1-1.2x float32's time, but 1.2-1.7x at 576x576, where
the call's overhead outweighs the 1 MB less it reads.
Float16 compute is not supported: it was not measured, and CPUs rarely run it well.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from daemon.errors import ModelUnavailable
from daemon.host import file_mappings, release_tensor_pages
from daemon.model import native

METHODS = ("int8", "int8-torchao", "int4")
COMPUTE_DTYPES = (torch.float32, torch.bfloat16)
KERNEL_DTYPE = torch.bfloat16  # the int8 method's matmul dtype: fast on CPU where float32 is not
_KERNEL = "aten::_weight_int8pack_mm"


def check_quantization(method: str, dtype: torch.dtype, device: torch.device) -> None:
    """Raise :class:`ModelUnavailable` (one line) unless ``method`` runs with ``dtype`` compute on ``device``."""
    if method not in METHODS:
        raise ModelUnavailable(f"unknown quantization {method!r}: choose one of {', '.join(METHODS)}")
    if dtype not in COMPUTE_DTYPES:
        names = " or ".join(str(d).removeprefix("torch.") for d in COMPUTE_DTYPES)
        raise ModelUnavailable(f"{method} weights run with {names} compute, not {str(dtype).removeprefix('torch.')}")
    if method == "int8":
        key = torch._C._dispatch_key_for_device(device.type)
        if not torch._C._dispatch_has_kernel_for_dispatch_key(_KERNEL, key):
            raise ModelUnavailable(
                f"int8 weights: torch {torch.__version__} has no int8-weight kernel for {device.type}; "
                f"use int8-torchao there"
            )


def quantize_model(model: nn.Module, method: str) -> None:
    """Quantize a whole ``...ForCausalLM`` as the nodes hosting all of it do: its decoder layers and its LM head."""
    quantize_layers(list(model.model.layers), method)
    quantize_head(model, method)


def quantize_head(model: nn.Module, method: str) -> None:
    """With the ``int8`` method, replace ``model.lm_head`` (loaded, plain ``nn.Linear``) by an int8 copy: a
    quarter of float32's bytes read every step. An LM head tied to the embeddings gets a copy of its own; the
    embeddings stay as loaded. ``int4`` does the same on a CPU (an int8 LM head, as llama.cpp's Q4_0 files keep
    theirs wider than their layers). ``int8-torchao`` leaves the LM head as it is (its linears would turn the
    whole matrix back into floats on every step)."""
    head = model.lm_head
    if method not in ("int8", "int4") or type(head) is not nn.Linear or head.weight.device.type == "meta":
        return
    if method == "int4" and head.weight.device.type != "cpu":
        return
    check_quantization(method, head.weight.dtype, head.weight.device)
    model.lm_head = Int8WeightLinear(head)


def quantize_layers(layers: list[nn.Module], method: str, mappings: list[tuple[int, int]] | None = None) -> None:
    """Quantize, in place, the weights of every ``nn.Linear`` inside ``layers`` with ``method``, letting go of the
    file pages (in ``mappings``, this process's file mappings read once by default) their rows were read from."""
    linears = [(layer, name) for layer in layers for name, m in layer.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ModelUnavailable(f"{method} weights: these layers have no nn.Linear to quantize")
    weight = linears[0][0].get_submodule(linears[0][1]).weight
    check_quantization(method, weight.dtype, weight.device)
    # read once, not once a linear (a read of /proc/self/maps took 4 ms on a 2-core Xeon VM, and a 30-layer node
    # has 210 linears)
    if mappings is None:
        mappings = file_mappings() if weight.device.type == "cpu" else []
    if method == "int4":
        _quantize_int4(layers, linears, mappings)
        return
    _import_torchao()
    if method == "int8-torchao":
        from torchao.quantization import Int8WeightOnlyConfig, PerRow, quantize_

        # no inductor settings: nothing here is compiled, and they are process-wide
        config = Int8WeightOnlyConfig(granularity=PerRow(), set_inductor_config=False)
        for layer in layers:
            quantize_(layer, config)
        return
    _replace_linears(linears, Int8WeightLinear, mappings)


def _replace_linears(linears: list[tuple[nn.Module, str]], quantized: type[nn.Module],
                     mappings: list[tuple[int, int]]) -> None:
    """Put ``quantized(linear, mappings)`` in place of each ``nn.Linear`` named in ``linears`` (layer, its name
    there)."""
    for layer, name in linears:
        parent_name, _, attribute = name.rpartition(".")
        parent = layer.get_submodule(parent_name)
        setattr(parent, attribute, quantized(getattr(parent, attribute), mappings))


def _quantize_int4(layers: list[nn.Module], linears: list[tuple[nn.Module, str]],
                   mappings: list[tuple[int, int]]) -> None:
    """int4 (:mod:`daemon.model.int4`): every ``nn.Linear``, and the fused experts of a layout
    :mod:`daemon.model.experts` knows; refused in one line, before anything changes, where a row is not whole
    blocks of 32."""
    from daemon.model.experts import known_layout
    from daemon.model.int4 import BLOCK, EXPERT_STACKS, Int4WeightLinear, quantize_experts

    experts = [(layer, name) for layer in layers for name, m in layer.named_modules() if known_layout(m)]
    widths = [(name, layer.get_submodule(name).in_features) for layer, name in linears]
    widths += [(f"{name}.{stack}", getattr(layer.get_submodule(name), stack).shape[-1])
               for layer, name in experts for stack in EXPERT_STACKS]
    odd = next(((what, width) for what, width in widths if width % BLOCK), None)
    if odd is not None:
        raise ModelUnavailable(f"int4 weights take rows of whole blocks of {BLOCK}, and {odd[0]} ({odd[1]} inputs) "
                               "is not: use int8")
    _replace_linears(linears, Int4WeightLinear, mappings)
    for layer, name in experts:
        quantize_experts(layer.get_submodule(name))


def keep_torchao_unloaded() -> None:
    """Tell transformers torchao is absent, before it loads any model: otherwise its quantizers import torchao
    wherever it is installed (for ``TorchAoConfig``, which no node uses): 11 MiB of every node's resident set
    and 0.25 s of its start, measured loading half the built-in model. The int8 methods import torchao
    themselves (:func:`_import_torchao`)."""
    import transformers.utils
    import transformers.utils.import_utils

    def absent(*args, **kwargs) -> bool:
        return False

    transformers.utils.is_torchao_available = transformers.utils.import_utils.is_torchao_available = absent


def _import_torchao() -> None:
    # at import torchao logs that its CUDA-only extensions fail to load on a CPU build: expected, not a fault
    torchao_log = logging.getLogger("torchao")
    level = torchao_log.level
    torchao_log.setLevel(logging.ERROR)
    try:
        import torchao  # noqa: F401
    finally:
        torchao_log.setLevel(level)


class Int8WeightLinear(nn.Module):
    """An ``nn.Linear`` with int8 weights and one scale per output row: a decode step's few rows by the native
    kernel, a prompt's by its prompt tiles; without the native kernel, by PyTorch's int8-weight kernel.

    The weight is called ``weight_int8``, not ``weight``: code that reads ``proj.weight.dtype`` to
    cast activations would silently cast them to int8; this way it fails loudly instead.
    """

    def __init__(self, linear: nn.Linear, mappings: list[tuple[int, int]] | None = None) -> None:
        """``linear``'s weight quantized; the file pages its rows lie in (``mappings``, this process's own file
        mappings by default) leave the resident set as they are quantized."""
        from torchao.quantization import Int8Tensor, PerRow

        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        qdata = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
        scale = torch.empty(weight.shape[0], dtype=KERNEL_DTYPE, device=weight.device)
        step = max(1, (16 << 20) // (self.in_features * 4))  # rows at a time (each its own scale): few MB of scratch
        # rows read from a checkpoint's file mapping leave the resident set once quantized (as in daemon.model.int4)
        if mappings is None:
            mappings = file_mappings() if weight.device.type == "cpu" else []
        for first in range(0, weight.shape[0], step):
            part = weight[first:first + step]
            quantized = Int8Tensor.from_hp(part, PerRow())  # symmetric, float32 scales
            qdata[first:first + step] = quantized.qdata
            scale[first:first + step] = quantized.scale.flatten().to(KERNEL_DTYPE)
            release_tensor_pages(part, mappings)
        self.weight_int8 = nn.Parameter(qdata, requires_grad=False)  # [out, in] int8
        self.scale = nn.Parameter(scale, requires_grad=False)  # [out]
        self.bias = linear.bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if native.library() is not None:  # a decode step's few rows, each as alone; a prompt's in tiles of its own
            if hidden.numel() <= native.MAX_ROWS * self.in_features:
                return native.gemv_int8(hidden, self.weight_int8, self.scale, self.bias)
            return native.gemm_int8(hidden, self.weight_int8, self.scale, self.bias)
        rows = hidden.reshape(-1, self.in_features).to(KERNEL_DTYPE).contiguous()  # [tokens, in]
        out = torch._weight_int8pack_mm(rows, self.weight_int8, self.scale)  # [tokens, out]
        out = out.reshape(*hidden.shape[:-1], self.out_features).to(hidden.dtype)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def parameter_bytes(modules: list[nn.Module], seen: set[int]) -> int:
    """Bytes the parameters of ``modules`` hold, counting each storage once across calls sharing ``seen``.

    torchao's quantized weights are tensor subclasses that report a float dtype and no storage of
    their own (``data_ptr()`` is 0): their bytes are those of the tensors inside (int8 data, scales,
    zero points), found through the subclass protocol ``__tensor_flatten__``.
    """
    total = 0
    for module in modules:
        for param in module.parameters():
            for tensor in _plain_tensors(param):
                if tensor.device.type != "meta" and tensor.data_ptr() not in seen:
                    seen.add(tensor.data_ptr())
                    total += tensor.numel() * tensor.element_size()
    return total


def _plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [plain for name in names for plain in _plain_tensors(getattr(tensor, name))]
