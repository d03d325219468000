"""A session's cache handed from a node that stops to a node that takes its layers over (a drain), as bytes.

The bytes are a safetensors file: ``keys.L`` and ``values.L`` (``[1, kv_heads, positions, head_dim]`` in the
node's compute dtype) for each layer ``L`` from the session's first layer to the sender's last, and metadata
saying what they are (:data:`FORMAT`, the model's fingerprint, the dtype, the positions held, the first layer,
the end, and from which position a verify step's rejected drafts may still be cut off).

Only sessions whose layers are all full attention move: the entries crop and append, so the receiver continues
exactly where the sender was. Linear-attention states and sliding windows (and a session a verify step left
needing a replay) stay where they are, and the head's failover replays that node's span as before.

Everything received is checked before a byte of it becomes a session: the format, the model, the dtype, every
tensor's name, dtype and shape, and that the receiver's layers take the session from its first layer and end
where the sender's ended. A refusal is one line (:class:`~daemon.errors.BadRequest`) and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save
from transformers.cache_utils import DynamicLayer

from daemon.errors import BadRequest
from daemon.kvstore import SessionEntry
from daemon.model.kvcache import GrowingLayer, cache_nbytes
from daemon.model.speculation import Undo

FORMAT = "meshnet-session/1"


@dataclass(frozen=True)
class Imported:
    """A received session, ready for the store."""

    cache: object
    past_len: int
    start_layer: int
    nbytes: int
    undo: Undo | None
    rewind_from: int


def movable(shard, entry: SessionEntry) -> bool:
    """Whether ``entry``'s cache can be sent: every layer it holds is full attention, at its length, and nothing
    waits to be replayed."""
    if entry.undo is not None and entry.undo.states is not None:
        return False
    layers = entry.cache.layers[entry.start_layer:shard.end]
    return all(type(layer) in (DynamicLayer, GrowingLayer) and layer.is_initialized
               and layer.get_seq_length() == entry.past_len for layer in layers)


def export_session(shard, entry: SessionEntry) -> bytes:
    """``entry``'s cache as bytes (the caller checked :func:`movable`; on the torch thread, between steps)."""
    tensors = {}
    for index in range(entry.start_layer, shard.end):
        layer = entry.cache.layers[index]
        tensors[f"keys.{index}"] = layer.keys.contiguous().cpu()
        tensors[f"values.{index}"] = layer.values.contiguous().cpu()
    rewind_from = entry.rewind_from if entry.undo is not None else entry.past_len
    return save(tensors, metadata={
        "format": FORMAT, "fingerprint": shard.info.fingerprint, "dtype": _dtype_name(shard.dtype),
        "past_len": str(entry.past_len), "start_layer": str(entry.start_layer), "end": str(shard.end),
        "rewind_from": str(rewind_from),
    })


def import_session(shard, data: bytes) -> Imported:
    """The session in ``data``, checked against this node's model and layers; :class:`BadRequest` naming what is
    wrong otherwise."""
    try:
        tensors = load(data)
        metadata = _metadata(data)
    except (SafetensorError, ValueError, OverflowError) as exc:
        raise BadRequest(f"the session transfer is not a safetensors file: {_first_line(exc)}") from None
    if metadata.get("format") != FORMAT:
        raise BadRequest(f"the session transfer's format is {metadata.get('format')!r}, not {FORMAT!r}")
    if metadata.get("fingerprint") != shard.info.fingerprint:
        raise BadRequest("the session transfer is of another model (its fingerprint differs from this node's)")
    if metadata.get("dtype") != _dtype_name(shard.dtype):
        raise BadRequest(f"the session transfer holds {metadata.get('dtype')}; this node computes in "
                         f"{_dtype_name(shard.dtype)}")
    past_len, start, end, rewind_from = (_count(metadata, name) for name in
                                         ("past_len", "start_layer", "end", "rewind_from"))
    if end != shard.end or not shard.start <= start < shard.end:
        raise BadRequest(f"the session transfer covers layers {start}-{end - 1}; this node's layers "
                         f"{shard.start}-{shard.end - 1} do not end where they end")
    if not 0 < past_len <= shard.context_length or not 0 < rewind_from <= past_len:
        raise BadRequest(f"the session transfer holds {past_len} positions (rewind from {rewind_from}); "
                         f"the model's context is {shard.context_length}")
    expected = {f"{kind}.{index}" for index in range(start, end) for kind in ("keys", "values")}
    if set(tensors) != expected:
        extra, missing = sorted(set(tensors) - expected), sorted(expected - set(tensors))
        raise BadRequest(f"the session transfer's tensors are not layers {start}-{end - 1}'s keys and values "
                         f"(unexpected {extra[:3]}, missing {missing[:3]})")
    cache = shard.new_cache()
    shape = _kv_shape(shard.config, past_len)
    for index in range(start, end):
        layer = cache.layers[index]
        keys, values = tensors[f"keys.{index}"], tensors[f"values.{index}"]
        for name, tensor in ((f"keys.{index}", keys), (f"values.{index}", values)):
            if tensor.dtype != shard.dtype or tuple(tensor.shape) != shape:
                raise BadRequest(f"the session transfer's {name} is {_dtype_name(tensor.dtype)} "
                                 f"{list(tensor.shape)}; this node's is {_dtype_name(shard.dtype)} {list(shape)}")
        if type(layer) not in (DynamicLayer, GrowingLayer):
            raise BadRequest(f"layer {index} here is not full attention: its session cannot be taken over")
        layer.update(keys.to(shard.device), values.to(shard.device))
    undo = Undo(rewind_from) if rewind_from < past_len else None
    return Imported(cache, past_len, start, cache_nbytes(cache), undo, rewind_from if undo else 0)


def _kv_shape(config, positions: int) -> tuple[int, int, int, int]:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return (1, kv_heads, positions, head_dim)


def _metadata(data: bytes) -> dict[str, str]:
    """The file's ``__metadata__`` (safetensors' ``load`` checks the header and gives the tensors only)."""
    import json

    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise ValueError("its metadata is not a table")
    return metadata


def _count(metadata: dict[str, str], name: str) -> int:
    raw = metadata.get(name)
    if not isinstance(raw, str) or not raw.isdigit() or len(raw) > 12:
        raise BadRequest(f"the session transfer's {name} is {str(raw)[:20]!r}, not a count")
    return int(raw)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
