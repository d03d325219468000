"""GGUF files into Hugging Face folders: by layer range, as nodes need them, or whole.

By range (:func:`write_gguf_range`): a node needs its own decoder layers, the token embeddings (any
node can act as head) and, on the tail, the final norm and LM head. Only those tensors are read from
the memory-mapped file and dequantized, one at a time, by the pieces transformers' own whole-model
GGUF loader runs, so each comes out bitwise as that loader gives it, and memory grows with the range,
not the file:

- the architectures of transformers' legacy GGUF loader (llama, mistral, qwen2, qwen3, gemma, phi3, ...):
  ``gguf.GGUFReader``, ``gguf.quants.dequantize``, the architecture's ``TensorProcessor`` (which undoes
  llama.cpp's Q/K permutation) and ``get_gguf_hf_weights_map`` for the Hugging Face names;
- the architectures of its newer loader (qwen35, qwen35moe, lfm2): its lazy state dict and per-architecture
  conversion mapping, given only this range's tensors.

The config and tokenizer come from the file's metadata as transformers builds them. config.json describes
the model, not the folder: the same bytes for every range and dtype (and as the whole conversion writes),
so every node of one file has the same model fingerprint.

Whole (:func:`write_gguf_whole`): transformers' loader on the whole file in one process, then
``save_pretrained``; the built-in model's folder is made this way.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from daemon.errors import ModelUnavailable

Progress = Callable[[str], None]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_BLOCK = re.compile(r"^blk\.(\d+)\.")


def read_gguf_metadata(gguf_path: Path) -> tuple[dict, tuple[str, ...]]:
    """The metadata and tensor names of a GGUF file (its header only, in milliseconds), or ModelUnavailable."""
    try:
        with open(gguf_path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError("it does not start with the GGUF magic bytes")
        from transformers.integrations.gguf.reader import read_gguf_metadata as read_header

        return read_header(str(gguf_path))
    except Exception as error:
        raise ModelUnavailable(
            f"{gguf_path} is not a valid GGUF file ({type(error).__name__}: {error}). It may be "
            "truncated or corrupt: download it again, or pass --model with another GGUF file or a "
            "Hugging Face folder."
        ) from error


def gguf_layer_count(gguf_path: Path) -> int:
    """How many decoder layers the GGUF file holds, from its header (no tensor is read)."""
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS, get_gguf_config

    metadata, tensor_names = read_gguf_metadata(gguf_path)
    architecture = metadata["general.architecture"]
    if architecture in GGUF_CONFIG_ARCHS:  # its config builder knows blocks that are no decoder layer (MTP)
        count = get_gguf_config(metadata, tensor_names).get("num_hidden_layers")
    else:
        count = metadata.get(f"{architecture}.block_count")
    if not isinstance(count, int) or count < 1:
        raise _unsupported(gguf_path, architecture, f"its metadata states no layer count ({architecture}.block_count)")
    return count


def write_gguf_range(gguf_path: Path, out_dir: Path, start: int, end: int, *, dtype: str = "float32",
                     progress: Progress = print) -> None:
    """Write layers ``[start, end)`` of ``gguf_path`` into ``out_dir`` as a Hugging Face folder.

    The folder holds config.json, generation_config.json, the tokenizer and ``model.safetensors`` with
    this range's decoder layers, the token embeddings and, when ``end`` is the last layer, the final norm
    and LM head, dequantized into ``dtype``. Raises ModelUnavailable for an architecture or a tensor
    type that cannot be converted.
    """
    if dtype not in DTYPES:
        raise ModelUnavailable(f"cannot dequantize into {dtype!r}: choose one of {', '.join(DTYPES)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    architecture = read_gguf_metadata(gguf_path)[0]["general.architecture"]
    config, skeleton = _config_and_skeleton(gguf_path, architecture)
    num_layers = config.get_text_config().num_hidden_layers
    if not 0 <= start < end <= num_layers:
        raise ModelUnavailable(f"layer range {start}-{end - 1} is outside {gguf_path.name}'s layers 0-{num_layers - 1}")
    progress(f"meshnet: converting layers {start}-{end - 1} of {gguf_path.name} into {dtype} "
             f"(once; only this range's tensors)...")

    def wanted(gguf_name: str) -> bool:
        if block := _BLOCK.match(gguf_name):
            return start <= int(block[1]) < end
        if gguf_name.startswith("output"):  # output_norm and an untied output (LM head): the tail's
            return end == num_layers
        return True  # the token embeddings (any node can head) and whatever else is model-wide

    from transformers.integrations.gguf import GGUF_ARCHS

    convert = _through_conversion_mapping if architecture in GGUF_ARCHS else _through_tensor_processor
    tensors = convert(gguf_path, architecture, config, skeleton, wanted, DTYPES[dtype])
    if not tensors:
        raise ModelUnavailable(f"{gguf_path}: none of its tensors maps to a {type(skeleton).__name__} weight")

    from safetensors.torch import save_file
    from transformers import AutoTokenizer, GenerationConfig

    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    del tensors
    # as the whole-model conversion saves them: the loading dtype on the config, its architecture class
    config.dtype = torch.float32
    config.architectures = [type(skeleton).__name__]
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                  local_files_only=True).save_pretrained(out_dir)
    progress(f"meshnet: converted layers {start}-{end - 1} of {gguf_path.name} in {time.monotonic() - started:.0f} s")


def write_gguf_whole(gguf_path: Path, out_dir: Path, progress: Progress = print) -> None:
    """Dequantize all of ``gguf_path`` with transformers' own loader and save it into ``out_dir`` as a float32
    Hugging Face folder, in one process (how the built-in model is converted)."""
    architecture = read_gguf_metadata(gguf_path)[0]["general.architecture"]
    progress(f"meshnet: converting {gguf_path.name} ({architecture}) to safetensors "
             "(once; this takes about a minute)...")
    started = time.monotonic()
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        # dequantize=True: unpack every weight into dense float32, which is what gets saved.
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, local_files_only=True,
            quantization_config=GgufConfig(dequantize=True),
        )
    except (ValueError, KeyError, NotImplementedError) as error:
        raise ModelUnavailable(
            f"{gguf_path}: transformers {transformers.__version__} cannot convert this GGUF file "
            f"of architecture {architecture!r} ({type(error).__name__}: {error}). Use a GGUF of an "
            "architecture it supports (llama, mistral, qwen2, ...) or a Hugging Face folder."
        ) from error
    _require_plain_float(model, gguf_path)
    _drop_quantization_marker(model)
    model.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if not any(out_dir.glob("*.safetensors")):
        raise ModelUnavailable(f"{gguf_path}: the conversion wrote no safetensors weights; please report this.")
    progress(f"meshnet: converted {name} in {time.monotonic() - started:.0f} s")


def _config_and_skeleton(gguf_path: Path, architecture: str):
    """The model config transformers builds from the file's metadata, and the model on ``meta`` (no memory)."""
    import transformers
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
        with init_empty_weights():
            skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError) as error:
        raise _unsupported(gguf_path, architecture, f"transformers {transformers.__version__}: "
                           f"{type(error).__name__}: {error}") from error
    return config, skeleton


def _through_tensor_processor(gguf_path, architecture, config, skeleton, wanted, dtype) -> dict[str, torch.Tensor]:
    """The wanted tensors as transformers' legacy loader (``load_gguf_checkpoint``) makes them, one at a time."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    try:
        hf_names = get_gguf_hf_weights_map(skeleton, processor)
    except NotImplementedError as error:  # gguf-py knows no tensor names for this architecture
        raise _unsupported(gguf_path, architecture, str(error)) from error
    parsed = {"tensors": {}}  # processors of fused MoE experts write their tensors in here themselves
    for tensor in GGUFReader(gguf_path).tensors:  # memory-mapped: only the tensors read here are paged in
        if not wanted(tensor.name):
            continue
        try:
            weights = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as error:
            raise _undequantizable(gguf_path, tensor.name, tensor.tensor_type.name) from error
        result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=hf_names,
                                   parsed_parameters=parsed)
        if result.name in hf_names:
            parsed["tensors"][hf_names[result.name]] = torch.from_numpy(np.copy(result.weights))
    return {name: tensor.to(dtype) for name, tensor in parsed["tensors"].items()}


def _through_conversion_mapping(gguf_path, architecture, config, skeleton, wanted, dtype) -> dict[str, torch.Tensor]:
    """The wanted tensors as transformers' newer GGUF loader makes them: the steps ``from_pretrained`` runs with
    its GGUF quantizer, set to unpack every block, on a state dict of only the wanted tensors."""
    from transformers import GgufConfig
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.quantizers.quantizer_gguf import GgufHfQuantizer

    quantizer = GgufHfQuantizer(GgufConfig(dequantize=True))
    try:
        quantizer.read_header(str(gguf_path))
    except ValueError as error:  # a ggml type its dequantizer does not know
        raise ModelUnavailable(f"{gguf_path}: cannot dequantize it: {error}") from error
    quantizer.update_dtype(dtype)
    quantizer.preprocess_model(model=skeleton, dtype=dtype)
    state_dict = {name: lazy for name, lazy in quantizer.get_state_dict(str(gguf_path), skeleton).items()
                  if wanted(name)}  # lazy: only these are ever read from the file
    load = LoadStateDictConfig(dtype=dtype, weight_mapping=get_model_conversion_mapping(skeleton, None, quantizer),
                               device_map={"": "cpu"}, hf_quantizer=quantizer)
    info, _ = convert_and_load_state_dict_in_model(skeleton, state_dict, load)
    if info.conversion_errors or info.error_msgs:
        problems = info.conversion_errors or info.error_msgs
        raise ModelUnavailable(f"{gguf_path}: converting its tensors failed: {problems}")
    return {name: tensor for name, tensor in skeleton.state_dict().items() if tensor.device.type != "meta"}


def _unsupported(gguf_path: Path, architecture: str, detail: str) -> ModelUnavailable:
    from transformers.integrations.gguf import GGUF_ARCHS
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    known = sorted({*GGUF_SUPPORTED_ARCHITECTURES, *GGUF_ARCHS} - {"general", "tokenizer"})
    return ModelUnavailable(
        f"{gguf_path}: cannot convert a GGUF file of architecture {architecture!r} ({detail}). "
        f"GGUF architectures transformers can convert: {', '.join(known)}; or pass a Hugging Face folder."
    )


def _undequantizable(gguf_path: Path, tensor_name: str, type_name: str) -> ModelUnavailable:
    from importlib.metadata import version

    return ModelUnavailable(
        f"{gguf_path}: tensor {tensor_name} is stored as {type_name}, which gguf {version('gguf')} cannot "
        "dequantize. Use a GGUF file of another quantization (Q4_K_M, Q8_0, ...) or a Hugging Face folder."
    )


def _require_plain_float(model, gguf_path: Path) -> None:
    """Refuse to save anything but plain dense float tensors (no packed or quantized blocks)."""
    # state_dict() is exactly what save_pretrained writes: every parameter and persistent buffer.
    for tensor_name, tensor in model.state_dict().items():
        plain = type(tensor) is torch.Tensor and not tensor.is_quantized and not tensor.is_meta
        if not (plain and tensor.dtype.is_floating_point):
            raise ModelUnavailable(
                f"{gguf_path}: after loading, {tensor_name} is {type(tensor).__name__} of {tensor.dtype}, "
                "not a plain float tensor, so it cannot be saved as plain safetensors. This "
                "transformers version keeps this GGUF's weights packed; convert it to a Hugging "
                "Face folder with another tool and pass that folder to --model."
            )


def _drop_quantization_marker(model) -> None:
    """Remove what marks a GGUF-loaded model as quantized, so ``save_pretrained`` accepts it.

    Only called once :func:`_require_plain_float` has checked that the weights are dense.
    """
    from transformers import PreTrainedModel

    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    for attribute in ("hf_quantizer", "quantization_method"):
        if attribute in vars(model):
            delattr(model, attribute)
    model.is_quantized = False
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            if hasattr(module.config, "quantization_config"):
                del module.config.quantization_config
            module.config._is_quantized = False
