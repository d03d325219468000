"""Activation bytes <-> torch tensors. The only place wire bytes become tensors."""

from __future__ import annotations

import torch

from daemon.wire import Activation

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def to_tensor(activation: Activation, *, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reinterpret validated activation bytes as a ``[1, T, hidden]`` tensor (no unpickling, ever)."""
    flat = torch.frombuffer(bytearray(activation.data), dtype=TORCH_DTYPES[activation.dtype])
    return flat.view(activation.shape).to(compute_dtype)


def to_activation(tensor: torch.Tensor, *, dtype: str = "float32") -> Activation:
    """Raw little-endian bytes of ``tensor`` cast to the wire ``dtype``."""
    wire = tensor.detach().to(TORCH_DTYPES[dtype]).contiguous()
    data = wire.view(torch.uint8).numpy().tobytes() if wire.numel() else b""
    return Activation(dtype=dtype, shape=tuple(wire.shape), data=data)
