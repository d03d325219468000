"""What a checkpoint holds, part by part, read from its headers only: the JSON header of each
``.safetensors`` file, or a GGUF file's tensor table. No tensor data is read.

Parts are named as :mod:`daemon.model.footprint` counts them: ``layer N``, ``embeddings``,
``final norm`` and ``LM head``, found by the shard's own key rules; anything else in the files (a vision
tower, say) is left out.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from daemon.errors import ModelUnavailable


def safetensors_values(folder: Path) -> dict[str, int]:
    """Values per part (``layer N``, ``embeddings``, ``final norm``, ``LM head``) from the safetensors headers."""
    from daemon.model.shard import _LAYER_KEY, _NORM_KEY  # the shard's own rules for which key is which part

    totals: dict[str, int] = {}
    for file in sorted(folder.glob("*.safetensors")):
        for key, info in _safetensors_header(file).items():
            if key == "__metadata__":
                continue
            if m := _LAYER_KEY.search(key):
                part = f"layer {int(m.group(1))}"
            elif "embed_tokens" in key:
                part = "embeddings"
            elif key.startswith("lm_head."):
                part = "LM head"
            elif _NORM_KEY.search(key):
                part = "final norm"
            else:
                continue
            totals[part] = totals.get(part, 0) + math.prod(info["shape"])
    return totals


def _safetensors_header(file: Path) -> dict:
    """The JSON header of a ``.safetensors`` file: each tensor's dtype, shape and offsets (no tensor data)."""
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100_000_000:  # the format caps headers at 100 MB
                raise ValueError(f"a header of {length} bytes")
            return json.loads(f.read(length))
    except (OSError, struct.error, ValueError) as exc:
        raise ModelUnavailable(f"{file}: not a readable safetensors file ({exc})") from None


def gguf_values(path: Path) -> dict[str, int]:
    """Values per part from a GGUF file's tensor table (no tensor data)."""
    from transformers.integrations.gguf.reader import GgufHeader

    try:
        header = GgufHeader.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - a damaged file fails in many ways, all the same to the user
        raise ModelUnavailable(f"--model {path}: not a valid GGUF file ({type(exc).__name__}: {exc})") from None
    totals: dict[str, int] = {}
    for tensor in header.tensors:
        prefix = tensor.name.split(".")
        if prefix[0] == "blk":
            part = f"layer {int(prefix[1])}"
        else:
            part = {"token_embd": "embeddings", "output_norm": "final norm", "output": "LM head"}.get(prefix[0])
            if part is None:
                continue
        totals[part] = totals.get(part, 0) + math.prod(tensor.shape)
    return totals


def check_checkpoint(wanted: dict[str, int], checkpoint: dict[str, int], name: str) -> None:
    """Refuse a checkpoint that holds fewer values for a part than ``wanted``, as a shard loading it would."""
    for part, values in wanted.items():
        held = checkpoint.get(part, 0)
        if held < values:
            raise ModelUnavailable(f"the checkpoint of {name} holds {held} values for {part}, its config "
                                   f"describes {values}: the files do not match the config")
