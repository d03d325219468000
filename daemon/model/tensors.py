"""Activation bytes <-> torch tensors. The only place wire bytes become tensors, and tensors bytes.

The wire is host memory: bytes arrive on the CPU and go to the compute device here, and a reply
comes back to the CPU here, so a GPU node and a CPU node share a mesh.
"""

from __future__ import annotations

import torch

from daemon.model.device import DTYPES
from daemon.wire import Activation

_NUMPY_DTYPES = (torch.float32, torch.float16)  # numpy has these; bfloat16 goes through bytes


def to_tensor(activation: Activation, *, compute_dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """Reinterpret validated activation bytes as a ``[1, T, hidden]`` tensor (no unpickling, ever)."""
    # the one copy: the layers get memory of their own, not the read-only request bytes
    flat = torch.frombuffer(bytearray(activation.data), dtype=DTYPES[activation.dtype])
    return flat.view(activation.shape).to(device=device, dtype=compute_dtype)


def to_activation(tensor: torch.Tensor, *, dtype: str = "float32") -> Activation:
    """Raw little-endian bytes of ``tensor`` cast to the wire ``dtype``, in host memory, without copying them
    again. The bytes are a view of the (cast, contiguous, host) tensor, which the view keeps alive."""
    want = DTYPES[dtype]
    if tensor.dtype == want and tensor.device.type == "cpu" and tensor.is_contiguous() and want in _NUMPY_DTYPES:
        # a decode step's reply, already in its wire dtype: one call, not six (each costs microseconds when the
        # code runs cold after a step's layers, once per hop per token)
        data = memoryview(tensor.detach().numpy()).cast("B") if tensor.numel() else b""
        return Activation(dtype=dtype, shape=tuple(tensor.shape), data=data)
    wire = tensor.detach().to(want).cpu().contiguous()
    data = memoryview(wire.view(torch.uint8).reshape(-1).numpy()) if wire.numel() else b""
    return Activation(dtype=dtype, shape=tuple(wire.shape), data=data)


def as_sent(tensor: torch.Tensor, *, wire_dtype: str, compute_dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` as the next hop would see it after a trip over the wire in ``wire_dtype``, without the bytes."""
    if tensor.dtype == compute_dtype == DTYPES[wire_dtype]:  # nothing to round (each call costs, run cold)
        return tensor
    return tensor.to(DTYPES[wire_dtype]).to(compute_dtype)
