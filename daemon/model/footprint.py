"""What a model costs in memory, read from its config and checkpoint headers, never from its weights.

A node's weights are counted on the same skeleton a shard fills: the model built from its config
on the ``meta`` device (no memory), grouped the way :meth:`ModelShard.loaded_bytes` groups them
(each decoder layer, the embeddings, the final norm, the LM head). The checkpoint's headers (the
JSON header of each ``.safetensors`` file, or a GGUF file's tensor table) are read to check that
it holds every part the count includes. A folder with only ``config.json`` is counted from the
skeleton alone.

Counts are kept as numbers of values, so one reading prices the model in any dtype, with or without
weight-only int8 (:class:`Precision`). What a session's cache holds per layer comes from the same
per-layer cache types ``DynamicCache(config=...)`` builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from daemon.errors import ModelUnavailable
from daemon.model.checkpoint import check_checkpoint, gguf_values, safetensors_values

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# bytes per output channel besides the int8 values (daemon.model.quantize): the int8 method keeps a
# bfloat16 scale per row for its kernel; torchao's own layout a float32 scale and an int8 zero point
INT8_ROW_BYTES = {"int8": 2, "int8-torchao": 5}
INT4_BLOCK = 32  # int4 (daemon.model.int4): half a byte a value and a float16 scale per block of 32 values
QUANTIZATIONS = (*INT8_ROW_BYTES, "int4")
# the gated delta rule keeps its recurrent state in float32 whatever the model's dtype (Qwen3-Next, Qwen3.5)
RECURRENT_STATE_BYTES = 4
WINDOW_TENSOR_BYTES = 8  # DynamicSlidingWindowLayer keeps its window size as an int64 tensor
LINEAR_ATTENTION_MODELS = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


@dataclass(frozen=True)
class Precision:
    """How weights are held: a float dtype, optionally with the decoder layers' Linear weights in int8."""

    dtype: str = "float32"
    quantize: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.quantize not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZATIONS)}, got {self.quantize!r}")

    @property
    def value_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def __str__(self) -> str:
        return self.dtype + (f" + {self.quantize}" if self.quantize else "")


@dataclass(frozen=True)
class PartValues:
    """The parameters of one part of the model, as counts of values."""

    plain: int = 0  # values held in the chosen dtype
    linear: int = 0  # values of nn.Linear weights: the chosen dtype, or 1 byte each in int8 (half in int4)
    linear_rows: int = 0  # output channels of those weights: one int8 scale each
    experts: int = 0  # values of fused MoE experts (a layout int4 quantizes): the chosen dtype, or int4
    fixed_values: int = 0  # values of parameters the model keeps in their own dtype whatever is asked
    fixed_bytes: int = 0  # and their bytes

    @property
    def values(self) -> int:
        return self.plain + self.linear + self.experts + self.fixed_values

    def nbytes(self, precision: Precision, *, quantizable: bool = False) -> int:
        """Bytes held in ``precision``; ``quantizable``: this part is a decoder layer (int8 applies)."""
        size = precision.value_bytes
        int4 = quantizable and precision.quantize == "int4"
        experts = self.experts // 2 + self.experts // INT4_BLOCK * 2 if int4 else self.experts * size
        if int4:
            linear = self.linear // 2 + self.linear // INT4_BLOCK * 2
        elif quantizable and precision.quantize is not None:
            linear = self.linear + self.linear_rows * INT8_ROW_BYTES[precision.quantize]
        else:
            linear = self.linear * size
        return self.plain * size + linear + experts + self.fixed_bytes


@dataclass(frozen=True)
class LayerCache:
    """What one decoder layer keeps for a session: per token (K and V), and per session whatever its length."""

    kind: str
    values_per_token: int = 0  # K and V values per token, in the model's dtype
    window: int | None = None  # tokens kept at most once decoding (sliding and chunked attention)
    state_values: int = 0  # per session, in the model's dtype (the conv state of linear attention)
    state_bytes: int = 0  # per session in a fixed dtype (the float32 recurrent state of linear attention)

    def nbytes(self, precision: Precision, positions: int) -> int:
        """Bytes held with ``positions`` token positions of storage (already capped by the caller)."""
        return (self.values_per_token * positions + self.state_values) * precision.value_bytes + self.state_bytes

    def positions_after(self, prefill: int, total: int) -> int:
        """Token positions of storage after a prefill of ``prefill`` tokens, then decoding to ``total``."""
        if not self.values_per_token:
            return 0
        if self.window is None:
            return growing_capacity(prefill, total)
        # transformers keeps the window as a view of the last step's keys: a prefill's whole length until
        # the next step, then the window (the last window-1 positions and the new one)
        return prefill if total == prefill else min(total, self.window)

    def planned_positions(self, tokens: int) -> int:
        """Token positions a session of up to ``tokens`` tokens can hold once decoding, at most."""
        if not self.values_per_token:
            return 0
        if self.window is None:
            return tokens + growth_room(tokens)  # the worst case: the buffer grew at the last token
        return min(tokens, self.window)


def growth_room(needed: int) -> int:
    """Spare positions a growing full-attention buffer adds when ``needed`` positions overflow it."""
    from daemon.model.kvcache import MIN_GROWTH

    return max(MIN_GROWTH, needed // 2)  # as GrowingLayer.update grows


def growing_capacity(prefill: int, total: int) -> int:
    """Positions a :class:`~daemon.model.kvcache.GrowingLayer` holds after a prefill, then single-token
    steps up to ``total`` tokens: exact on the prefill, with room to spare after each growth."""
    capacity = prefill
    needed = prefill
    while needed < total:
        needed = min(total, capacity + 1)  # the first position that does not fit, or the end
        if needed > capacity:
            capacity = needed + growth_room(needed)
    return capacity


@dataclass(frozen=True)
class ModelFootprint:
    """A model's parts as counts of values, and what each layer caches per session."""

    name: str
    model_type: str
    source: str  # where the counts were checked: "safetensors headers", "GGUF header", "config only"
    layers: tuple[PartValues, ...]
    embeddings: PartValues
    final_norm: PartValues
    lm_head: PartValues  # beyond the embeddings: empty when the LM head is tied to them
    tied: bool
    max_positions: int | None
    caches: tuple[LayerCache, ...] | None  # None: not understood (see cache_unknown)
    cache_unknown: str | None = None
    saved_dtype: str | None = None  # the dtype the checkpoint's config names (None: a GGUF file, or none named)
    head: PartValues = PartValues()  # the LM head's own values, tied or not: the int8 method quantizes a copy

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_bytes(self, precision: Precision) -> list[int]:
        return [layer.nbytes(precision, quantizable=True) for layer in self.layers]

    def weights_bytes(self, start: int, end: int, precision: Precision) -> dict[str, int]:
        """Bytes of weights a node hosting layers ``[start, end)`` holds once it has headed a generation.

        Part names follow ``GET /v1/status`` ``weights_bytes``; every node holds the embeddings (any node
        can head), the tail the final norm and an untied LM head, or with the int8 and int4 methods an int8 LM head.
        """
        tail = end == self.num_layers
        if precision.quantize in ("int8", "int4"):  # daemon.model.quantize.quantize_head
            head = self.head.nbytes(Precision(precision.dtype, "int8"), quantizable=True)
        else:
            head = self.lm_head.nbytes(precision)
        return {
            "layers": sum(self.layer_bytes(precision)[start:end]),
            "final_norm_and_lm_head": self.final_norm.nbytes(precision) + head if tail else 0,
            "embeddings": self.embeddings.nbytes(precision),
        }

    def kv_bytes_per_token(self, start: int, end: int, precision: Precision) -> int | None:
        """K/V bytes one more token adds on layers ``[start, end)`` (windowed layers before their window fills)."""
        if self.caches is None:
            return None
        return sum(c.values_per_token for c in self.caches[start:end]) * precision.value_bytes

    def session_bytes(self, start: int, end: int, precision: Precision, tokens: int) -> int | None:
        """Bytes one session of up to ``tokens`` tokens can hold on layers ``[start, end)``, at most."""
        if self.caches is None:
            return None
        held = sum(c.nbytes(precision, c.planned_positions(tokens)) for c in self.caches[start:end])
        return held + self._cache_overhead_bytes()

    def cache_bytes_after(self, start: int, end: int, precision: Precision, prefill: int, total: int) -> int | None:
        """Bytes a node's session cache holds after a prefill of ``prefill`` tokens, then decoding to ``total``:
        what ``GET /v1/sessions`` reports for it."""
        if self.caches is None:
            return None
        held = sum(c.nbytes(precision, c.positions_after(prefill, total)) for c in self.caches[start:end])
        return held + self._cache_overhead_bytes()

    def _cache_overhead_bytes(self) -> int:
        # a session's cache has a layer object for every layer of the model, hosted or not, and each
        # windowed one holds its window size as a tensor from the start
        return WINDOW_TENSOR_BYTES * sum(c.window is not None for c in self.caches)


# ---- reading ------------------------------------------------------------------------------------


def read_footprint(model: str | None, *, progress=lambda line: None) -> ModelFootprint:
    """Count the model ``--model`` names: a Hugging Face folder (with or without weights), a ``.gguf``
    file, or the built-in default. Reads configs and headers only; raises :class:`ModelUnavailable`."""
    from daemon.model.source import resolve_model

    path = Path(model).expanduser() if model and model.strip() else None
    if path is not None and path.is_file() and path.suffix.lower() == ".gguf":
        config, checkpoint = _gguf_config(path), gguf_values(path)
        name, source = path.stem, "GGUF header"
    elif path is not None and path.is_dir() and not _has_weights(path):
        config, checkpoint = _folder_config(path), None
        name, source = path.name, "config only"
    else:
        folder = resolve_model(model, progress=progress)
        config, checkpoint = _folder_config(folder), safetensors_values(folder)
        name, source = folder.name, "safetensors headers"
    footprint = _count_skeleton(config, name, source)
    if checkpoint is not None:
        wanted = {f"layer {i}": layer.values for i, layer in enumerate(footprint.layers)}
        wanted |= {"embeddings": footprint.embeddings.values, "final norm": footprint.final_norm.values,
                   "LM head": footprint.lm_head.values}
        check_checkpoint(wanted, checkpoint, name)
    return footprint


def _has_weights(folder: Path) -> bool:
    return (folder / "model.safetensors.index.json").is_file() or any(folder.glob("*.safetensors"))


def _folder_config(folder: Path):
    from transformers import AutoConfig

    if not (folder / "config.json").is_file():
        raise ModelUnavailable(f"--model {folder}: this folder has no config.json")
    try:
        return AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelUnavailable(f"--model {folder}: its config.json cannot be read ({exc})") from None


def _gguf_config(path: Path):
    """The config transformers derives from a GGUF file's metadata (what its conversion will save)."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        values = dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
        return AutoConfig.for_model(values.pop("model_type"), **values)
    except Exception as exc:  # noqa: BLE001 - any failure to parse is the same to the user
        raise ModelUnavailable(f"--model {path}: not a GGUF file transformers can read "
                               f"({type(exc).__name__}: {exc})") from None


def _count_skeleton(config, name: str, source: str) -> ModelFootprint:
    """Count the parameters of the skeleton a shard would build from ``config``, part by part."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    saved_dtype = _saved_dtype(config) if source != "GGUF header" else None  # from_config overwrites it
    # built in bfloat16: a parameter still in float32 then is one the model keeps in float32 in any dtype
    try:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    except (ValueError, KeyError) as exc:
        raise ModelUnavailable(f"unsupported architecture {config.model_type!r}: not a causal language model "
                               f"({exc})") from None
    base = getattr(model, "model", None)
    missing = [a for a in ("embed_tokens", "layers", "norm") if not hasattr(base, a)]
    if missing or not hasattr(model, "lm_head"):
        raise ModelUnavailable(f"unsupported architecture {config.model_type!r}: its decoder lacks "
                               f"{missing or ['lm_head']}")
    tied = bool(getattr(config, "tie_word_embeddings", False))  # as the shard decides
    text = config.get_text_config(decoder=True)
    caches, unknown = _layer_caches(text)
    return ModelFootprint(
        name=name,
        model_type=config.model_type,
        source=source,
        layers=tuple(_count_module(layer) for layer in base.layers),
        embeddings=_count_module(base.embed_tokens),
        final_norm=_count_module(base.norm),
        lm_head=PartValues() if tied else _count_module(model.lm_head),
        tied=tied,
        head=_count_module(model.lm_head),
        max_positions=getattr(text, "max_position_embeddings", None),
        caches=caches,
        cache_unknown=unknown,
        saved_dtype=saved_dtype,
    )


def _saved_dtype(config) -> str | None:
    for part in (config, config.get_text_config(decoder=True)):
        dtype = getattr(part, "dtype", None)
        name = str(dtype).removeprefix("torch.") if dtype is not None else None
        if name in DTYPE_BYTES:
            return name
    return None


def _count_module(module) -> PartValues:
    import torch

    from daemon.model.experts import known_layout
    from daemon.model.int4 import EXPERT_STACKS

    linear_weights = {id(m.weight): m.weight.shape[0] for m in module.modules() if isinstance(m, torch.nn.Linear)}
    expert_stacks = {id(getattr(m, name)) for m in module.modules() if known_layout(m) for name in EXPERT_STACKS}
    plain = linear = rows = experts = fixed = fixed_bytes = 0
    for p in module.parameters():  # each shared parameter once
        if p.dtype != torch.bfloat16:
            fixed, fixed_bytes = fixed + p.numel(), fixed_bytes + p.numel() * p.element_size()
        elif id(p) in linear_weights:
            linear, rows = linear + p.numel(), rows + linear_weights[id(p)]
        elif id(p) in expert_stacks:
            experts += p.numel()
        else:
            plain += p.numel()
    return PartValues(plain=plain, linear=linear, linear_rows=rows, experts=experts, fixed_values=fixed,
                      fixed_bytes=fixed_bytes)


def _layer_caches(text) -> tuple[tuple[LayerCache, ...] | None, str | None]:
    """Each layer's cache layout as ``DynamicCache(config=...)`` builds it, or why it is not understood."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    if getattr(text, "kv_lora_rank", None):
        return None, f"{text.model_type}: latent (MLA) attention caches are not understood by the planner"
    kinds, kwargs = get_layer_types_and_kwargs(text)
    caches = []
    for kind, layer_kwargs, layer in zip(kinds, kwargs, text.per_layer_config):
        if kind in ("full_attention", "sliding_attention", "chunked_attention"):
            heads = getattr(layer, "num_key_value_heads", None) or layer.num_attention_heads
            head_dim = getattr(layer, "head_dim", None) or layer.hidden_size // layer.num_attention_heads
            window = layer_kwargs.get("sliding_window")
            caches.append(LayerCache(kind, values_per_token=2 * heads * head_dim, window=window))
        elif kind == "linear_attention" and text.model_type in LINEAR_ATTENTION_MODELS:
            key_dim = layer.linear_num_key_heads * layer.linear_key_head_dim
            value_dim = layer.linear_num_value_heads * layer.linear_value_head_dim
            conv = (2 * key_dim + value_dim) * layer.linear_conv_kernel_dim  # q, k and v through one conv
            recurrent = layer.linear_num_value_heads * layer.linear_key_head_dim * layer.linear_value_head_dim
            caches.append(LayerCache(kind, state_values=conv, state_bytes=recurrent * RECURRENT_STATE_BYTES))
        elif kind == "dummy":
            caches.append(LayerCache(kind))
        else:
            return None, f"{text.model_type}: the cache of {kind!r} layers is not understood by the planner"
    return tuple(caches), None
