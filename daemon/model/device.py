"""Where a node computes and in which dtype: ``--device`` and ``--dtype`` resolved against this machine.

``--device auto`` takes a CUDA GPU if torch sees one, else Apple's MPS, else the CPU.

``--dtype auto`` keeps the checkpoint's own dtype where the device computes it natively, as
``from_pretrained(dtype="auto")`` does: loading then converts nothing, and a node holds each weight
in the bytes it was saved in. A dtype the device would emulate becomes bfloat16 where the device
computes that natively, else float32; a checkpoint without a float dtype (a GGUF file's quantized
tensors) becomes the same. Measured on this project's 2-core Xeon (AMX and AVX512-BF16), one
process, side by side: on a model 2048 wide, bfloat16 decoded 1.6x float32's tokens/s on one thread
and 1.16x on two, at half the bytes; on the built-in model (576 wide, a float32 checkpoint)
float32 and bfloat16 were within 15% of each other either way round, so its float32 checkpoint runs
in float32, which also gives ``generate``'s float32 tokens. float16 runs on emulated kernels on
that CPU. Whatever the dtype, a mesh emits the tokens ``generate`` gives in that dtype with the
same weights.
"""

from __future__ import annotations

import json
from pathlib import Path

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


def computes(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``device`` has arithmetic of its own in ``dtype`` rather than emulating it."""
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return computes_bfloat16(device)
    if device.type == "cpu":
        return torch.cpu._is_amx_fp16_supported()
    return device.type in ("cuda", "mps")


def resolve_dtype(name: str, device: torch.device, checkpoint: str | None = None) -> torch.dtype:
    """The compute dtype for ``--dtype`` on ``device``; ``checkpoint``: the dtype the weights were saved in
    (see the module's docstring for ``auto``)."""
    if name != "auto":
        if name not in DTYPES:
            raise ModelUnavailable(f"--dtype must be auto, {', '.join(DTYPES)}, got {name!r}")
        return DTYPES[name]
    if checkpoint in DTYPES and computes(DTYPES[checkpoint], device):
        return DTYPES[checkpoint]
    if computes_bfloat16(device):
        return torch.bfloat16
    return torch.float16 if device.type == "mps" else torch.float32


def checkpoint_dtype(folder: Path) -> str | None:
    """The dtype a model folder's weights were saved in, as its ``config.json`` says (None if it does not)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for part in (config, config.get("text_config") or {}):
        dtype = part.get("dtype") or part.get("torch_dtype")
        if dtype in DTYPES:
            return dtype
    return None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, as the wire and the status say it."""
    return next(name for name, value in DTYPES.items() if value == dtype)
