"""Where a node computes and in which dtype: ``--device`` and ``--dtype`` resolved against this machine.

``--device auto`` takes a CUDA GPU if torch sees one, else Apple's MPS, else the CPU. ``--dtype auto``
takes bfloat16 where the device computes it natively and float32 elsewhere: measured on a 2-core
Xeon with AMX and AVX512-BF16, the built-in model decodes about twice as fast in bfloat16 as in
float32 with half the memory (float16 runs on emulated kernels there, slower than bfloat16); a CPU
without native bfloat16 emulates it, so float32 stays the default there. float32 is the exact mode:
the tokens of ``generate`` in float32. Any dtype a mesh runs in emits the tokens ``generate`` gives
in that dtype with the same weights.
"""

from __future__ import annotations

import torch

from daemon.config import DEVICE_PATTERN
from daemon.errors import ModelUnavailable

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """The torch device for ``--device``; a device this machine lacks is a clear error."""
    if not DEVICE_PATTERN.fullmatch(name):
        raise ModelUnavailable(f"--device must be auto, cpu, cuda, cuda:N or mps, got {name!r}")
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps" if torch.backends.mps.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ModelUnavailable(f"--device {name}: torch sees no CUDA device on this machine "
                                   f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'})")
        if device.index is not None and device.index >= count:
            raise ModelUnavailable(f"--device {name}: this machine has {count} CUDA device(s), cuda:0 to "
                                   f"cuda:{count - 1}")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ModelUnavailable(f"--device {name}: MPS is not available on this machine")
    return device


def computes_bfloat16(device: torch.device) -> bool:
    """Whether ``device`` has bfloat16 arithmetic of its own rather than emulating it."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return False


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The compute dtype for ``--dtype`` on ``device`` (see the module's docstring for ``auto``)."""
    if name != "auto":
        if name not in DTYPES:
            raise ModelUnavailable(f"--dtype must be auto, {', '.join(DTYPES)}, got {name!r}")
        return DTYPES[name]
    if computes_bfloat16(device):
        return torch.bfloat16
    return torch.float16 if device.type == "mps" else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, as the wire and the status say it."""
    return next(name for name, value in DTYPES.items() if value == dtype)
