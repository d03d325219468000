"""A model checkpoint: which key belongs to which part of the model, what the model is, what each
part holds, and loading the parts a shard wants.

- Key rules: :data:`LAYER_KEY` and its siblings, and :func:`checkpoint_part`.
- Identity: :func:`read_model_info` and :func:`context_length` (or :func:`read_context_length`), from the config alone.
- Headers: values per part from the JSON header of each ``.safetensors`` file, or a GGUF file's tensor
  table, with no tensor data read; parts are named as :mod:`daemon.model.footprint` counts them
  (``layer N``, ``embeddings``, ``final norm``, ``LM head``).
- Loading: :func:`build_skeleton` makes the model with every parameter on the ``meta`` device (no memory),
  and :func:`load_parts` materialises only the wanted parts (``layers``, ``embed``, ``norm``, ``lm_head``)
  through transformers' own weight conversion, so checkpoints whose layout differs from the module layout
  (fused MoE experts in transformers 5) load exactly as ``from_pretrained`` would.

Anything else in the files (a vision tower, a multi-token-prediction head) is neither counted nor loaded.
torch and transformers are imported inside the functions that use them: a safetensors header needs neither.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from daemon.errors import ModelUnavailable
from daemon.host import WeightArena, return_freed_memory
from daemon.wire import MAX_SEQUENCE

if TYPE_CHECKING:
    import torch

# ---- key rules ---------------------------------------------------------------------------------

# Checkpoint keys of the text model, plain ("model.layers.3.") or beside a vision tower
# ("model.language_model.layers.3.", or "language_model.model.layers.3." as Gemma 3 saves it); a tower's
# own blocks and norms and a multi-token-prediction head ("mtp.layers.0.") are never read
_TEXT_MODEL = r"^(?:model\.)?(?:language_model\.)?(?:model\.)?"
LAYER_KEY = re.compile(_TEXT_MODEL + r"layers\.(\d+)\.")
EMBED_KEY = re.compile(_TEXT_MODEL + r"embed_tokens\.")
NORM_KEY = re.compile(_TEXT_MODEL + r"norm\.(?:weight|bias)$")
LM_HEAD_KEY = re.compile(r"^(?:language_model\.)?lm_head\.")
# the text model of a multimodal checkpoint loads as a causal LM's own model (Qwen 3.5 declares this renaming
# itself, Gemma 3 and 4 do not)
TEXT_MODEL_RENAMING = {
    r"^model\.language_model\.": "model.",
    r"^language_model\.model\.": "model.",
    r"^language_model\.lm_head\.": "lm_head.",
}


def checkpoint_part(key: str, layers: range) -> str | None:
    """The part checkpoint ``key`` belongs to for a shard hosting ``layers``: ``layers``, ``embed``, ``lm_head`` or
    ``norm``; None for a key such a shard never reads (another node's layer, a vision tower's weight)."""
    if m := LAYER_KEY.match(key):
        return "layers" if int(m.group(1)) in layers else None
    if EMBED_KEY.match(key):
        return "embed"
    if LM_HEAD_KEY.match(key):
        return "lm_head"
    if NORM_KEY.match(key):
        return "norm"
    return None


# ---- identity ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    """What peers must agree on to serve one model together."""

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    fingerprint: str


def read_model_info(folder: Path, config=None) -> ModelInfo:
    """Read the identity of the model in ``folder`` (whose parsed ``config`` may be given) without weights."""
    from transformers import AutoConfig

    config_bytes = (folder / "config.json").read_bytes()
    config = config or AutoConfig.from_pretrained(folder)
    text = getattr(config, "text_config", None) or config
    return ModelInfo(
        name=folder.name,
        model_type=config.model_type,
        num_layers=text.num_hidden_layers,
        hidden_size=text.hidden_size,
        vocab_size=text.vocab_size,
        fingerprint=hashlib.sha256(config_bytes).hexdigest()[:16],
    )


def context_length(text_config) -> int:
    """The most positions a model with this text config takes, as a node enforces it: the config's own, else the
    wire's bound."""
    return getattr(text_config, "max_position_embeddings", None) or MAX_SEQUENCE


def read_context_length(folder: Path) -> int:
    """The most positions the model in ``folder`` takes (:func:`context_length`), read from its config alone."""
    from transformers import AutoConfig

    return context_length(AutoConfig.from_pretrained(folder).get_text_config())


# ---- headers -----------------------------------------------------------------------------------


def safetensors_values(folder: Path) -> dict[str, int]:
    """Values per part (``layer N``, ``embeddings``, ``final norm``, ``LM head``) from the safetensors headers."""
    totals: dict[str, int] = {}
    for file in sorted(folder.glob("*.safetensors")):
        for key, info in _safetensors_header(file).items():
            if key == "__metadata__":
                continue
            if m := LAYER_KEY.search(key):
                part = f"layer {int(m.group(1))}"
            elif "embed_tokens" in key:
                part = "embeddings"
            elif key.startswith("lm_head."):
                part = "LM head"
            elif NORM_KEY.search(key):
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


# ---- loading -----------------------------------------------------------------------------------


def build_skeleton(config, dtype: torch.dtype, model_type: str) -> torch.nn.Module:
    """The causal LM of text ``config`` with every parameter on ``meta`` (no memory) and its buffers (rotary
    frequencies) real, in eval mode; :class:`ModelUnavailable` when it is no decoder a shard can run."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    try:
        with init_empty_weights():  # parameters on meta, buffers (rotary inv_freq) real
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except ValueError:  # transformers' message lists every causal LM config class, over several lines
        raise ModelUnavailable(
            f"unsupported architecture {model_type!r}: not a causal language model "
            f"(transformers has no causal LM class for {type(config).__name__})"
        ) from None
    base = getattr(model, "model", None)
    missing = [a for a in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(base, a)]
    if missing or not hasattr(model, "lm_head"):
        raise ModelUnavailable(
            f"unsupported architecture {model_type!r}: its decoder lacks {missing or ['lm_head']}"
        )
    return model.eval()


def load_parts(model: torch.nn.Module, folder: Path, parts: set[str], *, layers: range, dtype: torch.dtype,
               device: torch.device, quantize: str | None = None) -> None:
    """Materialise ``parts`` of ``model`` (from :func:`build_skeleton`) from the safetensors files in ``folder``, in
    ``dtype`` on ``device``: of the decoder layers, those in ``layers`` only, each quantized with ``quantize``
    (:mod:`daemon.model.quantize`) as soon as it is in. A wanted LM head the files lack is tied to the embeddings.
    :class:`ModelUnavailable` when the files lack a wanted weight."""
    from safetensors import safe_open
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    from daemon.host import file_mappings, huge_pages_preferred
    from daemon.model.fusing import fuse_in_place
    from daemon.model.quantize import quantize_head, quantize_layers

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelUnavailable(f"no *.safetensors weights in {folder}")
    groups: dict[str, dict[Path, list[str]]] = {}  # a layer ("7") or another part -> file -> its keys
    for file in files:
        for key in safe_open(str(file), framework="pt", device=str(device)).keys():
            part = checkpoint_part(key, layers)
            if part in parts:
                layer = LAYER_KEY.search(key)
                groups.setdefault(layer.group(1) if layer else part, {}).setdefault(file, []).append(key)
    config = LoadStateDictConfig(
        dtype=dtype,
        # experts are stacked straight into their fused tensor (daemon.model.fusing), not stacked then joined; in
        # 4 bits they are quantized as they are stacked
        weight_mapping=[fuse_in_place(t, quantize)
                        for t in get_model_conversion_mapping(model, TEXT_MODEL_RENAMING, None)],
        device_map={"": str(device)},
    )
    # A layer at a time, from files mapped for it alone, quantized as soon as it is in: a mapped file's pages
    # count in this process's memory while mapped, so a node converting float32 weights to bfloat16 or int8
    # would otherwise peak at the float32 bytes of all its layers on top of what it keeps.
    # a node's small weights packed onto huge pages (ADR-0056), where torch puts its large ones there
    arena = WeightArena() if huge_pages_preferred() and device.type == "cpu" else None
    for group, keys_by_file in _quiet_progress(groups.items()):
        handles = {file: safe_open(str(file), framework="pt", device=str(device)) for file in keys_by_file}
        state_dict = {key: handles[file].get_slice(key) for file, keys in keys_by_file.items() for key in keys}
        # transformers' own loader: renames and fuses checkpoint tensors (MoE experts, qkv) as
        # from_pretrained does; a slice is read (and cast) only here
        info, _ = convert_and_load_state_dict_in_model(model, state_dict, config)
        if info.conversion_errors or info.error_msgs:
            problems = info.conversion_errors or info.error_msgs
            raise ModelUnavailable(f"could not load weights from {folder}: {problems}")
        del handles, state_dict
        layer = model.model.layers[int(group)] if group.isdigit() else None
        mappings = None  # the files' mappings, read once for this layer's quantizers and own_memory below
        if layer is not None and quantize:
            mappings = file_mappings()
            quantize_layers([layer], quantize, mappings)
        # A layer whose checkpoint tensors were fused (MoE experts, qkv) or quantized holds new memory: its other
        # weights still in the file are copied too, so nothing keeps this group's file mapped, and the pages the
        # new tensors were read from leave the resident set (else they stay counted beside them until the node
        # exits). Where torch allocates on huge pages, every weight of a layer is copied, the ones under 8 MiB into
        # the arena: read from the file's mapping, or from allocations under 2 MiB, they would stream through 4 KiB
        # pages at every step (ADR-0047, ADR-0056).
        fused = layer is not None and sum(len(k) for k in keys_by_file.values()) > sum(1 for _ in layer.parameters())
        if layer is not None and (quantize or fused or arena is not None):
            own_memory(layer.parameters(), mappings if mappings is not None else file_mappings(), arena=arena)
            # the float weights a quantizer replaced are freed as it drops them (no reference cycle holds them,
            # tests/unit/test_quantize.py): no collection here, which took 0.15-0.9 s a layer
            return_freed_memory()  # what fusing and casting left in the C heap
    if "lm_head" in parts and model.lm_head.weight.device.type == "meta":
        # no LM head in the checkpoint: it is tied to the embeddings, even where a multimodal checkpoint's
        # text config does not say so (Gemma 4 ties in its top-level config only)
        if model.model.embed_tokens.weight.device.type == "meta":
            load_parts(model, folder, {"embed"}, layers=layers, dtype=dtype, device=device)
        model.lm_head.weight = model.model.embed_tokens.weight
    if "lm_head" in parts and quantize:
        quantize_head(model, quantize)
        return_freed_memory()
    _check_loaded(model, folder, parts, layers)


COPY_BYTES = 16 << 20  # a weight is copied out of its file this much at a time


def own_memory(parameters, mappings: list[tuple[int, int]], *, arena: WeightArena | None = None) -> None:
    """Copy each of ``parameters`` still read from a checkpoint's file mapping (``mappings``) into memory of its own,
    a few MiB at a time, letting go of each part's file pages once copied: the resident set holds a weight twice for
    one part at most, not for a whole layer. With an ``arena``, each weight it takes (:meth:`WeightArena.takes`) is
    copied into it, from a file or from memory of its own; others not in a file mapping are left as they are."""
    import torch

    from daemon.host import copy_out_of_file, in_file_mapping

    for parameter in parameters:
        data = parameter.data
        if type(data) is not torch.Tensor:  # a tensor subclass keeps its own storage
            continue
        mapped = in_file_mapping(data.data_ptr(), data.numel() * data.element_size(), mappings)
        if arena is not None and arena.takes(data) and not arena.holds(data):
            copy = arena.empty_like(data)
        elif mapped:
            copy = torch.empty_like(data)
        else:
            continue
        if mapped:
            copy_out_of_file(data, copy, mappings, block_bytes=COPY_BYTES)
        else:
            copy.copy_(data)
        parameter.data = copy


def buffers_to_device(model: torch.nn.Module, device: torch.device) -> None:
    """Buffers the skeleton made for real (rotary frequencies) join the weights on ``device``."""
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.device.type != "meta" and buffer.device != device:
                setattr(module, name, buffer.to(device))  # stays a buffer, persistent or not


def _check_loaded(model: torch.nn.Module, folder: Path, parts: set[str], layers: range) -> None:
    base = model.model
    modules: dict[str, torch.nn.Module] = {}
    if "layers" in parts:
        modules.update({f"layer {i}": base.layers[i] for i in layers})
    if "embed" in parts:
        modules["embeddings"] = base.embed_tokens
    if "norm" in parts:
        modules["final norm"] = base.norm
    if "lm_head" in parts:
        modules["LM head"] = model.lm_head
    for what, module in modules.items():
        on_meta = [n for n, p in module.named_parameters() if p.device.type == "meta"]
        if on_meta:
            raise ModelUnavailable(f"the checkpoint in {folder} lacks weights of {what}: {on_meta[:4]}")


def _quiet_progress(items):
    """Iterate with transformers' per-call "Loading weights" bar switched off: one bar per layer is noise in a
    node's log; the node says itself what it loaded and how long it took."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield from items
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
