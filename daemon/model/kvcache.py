"""A full-attention KV cache layer that grows in place instead of by concatenation.

transformers' ``DynamicLayer`` appends each step's keys and values with
``torch.cat``, copying the whole cache every step: at 550 tokens that is 0.85 MB
per layer per step for the built-in model, and a decode step's cost creeps up
with the length of the generation. :class:`GrowingLayer` keeps keys and values
in buffers with room to spare and writes each step's positions in place; the
cache hands the layers views of the filled part, so attention sees exactly the
same values (only their buffer is longer), and a step's cost stays flat.

Beside it, what a node does with a session's cache as a whole: :func:`cut_back` keeps a prefix of it, and
:func:`cache_nbytes` measures the bytes it holds.
"""

from __future__ import annotations

from copy import deepcopy

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

MIN_GROWTH = 32  # positions added at least when a buffer is full; growth by half keeps copies amortised O(1)


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` with amortised O(1) appends. ``keys``/``values`` are views of the filled positions."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held = self.get_seq_length()
        needed = held + key_states.shape[-2]
        if self._key_buffer is None or needed > self._key_buffer.shape[-2]:
            # the first fill (a prefill) is exact; later ones leave room for half as much again
            capacity = needed if self._key_buffer is None else needed + max(MIN_GROWTH, needed // 2)
            self._key_buffer = self._grown(self.keys, key_states, held, capacity)
            self._value_buffer = self._grown(self.values, value_states, held, capacity)
        added = needed - held
        self._key_buffer.narrow(-2, held, added).copy_(key_states)  # narrow: cheaper than slicing, per layer
        self._value_buffer.narrow(-2, held, added).copy_(value_states)
        self.keys = self._key_buffer.narrow(-2, 0, needed)
        self.values = self._value_buffer.narrow(-2, 0, needed)
        return self.keys, self.values

    def reserve(self, added: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Room for ``added`` positions after those held, which the caller writes into the returned key and value
        buffers (``[batch, kv_heads, capacity, head_dim]``) itself; ``keys``/``values`` already view them.
        None while nothing is held (a first fill goes through :meth:`update`)."""
        if not self.is_initialized or self._key_buffer is None:
            return None
        held = self.get_seq_length()
        needed = held + added
        if needed > self._key_buffer.shape[-2]:
            capacity = needed + max(MIN_GROWTH, needed // 2)
            self._key_buffer = self._grown(self.keys, self.keys, held, capacity)
            self._value_buffer = self._grown(self.values, self.values, held, capacity)
        self.keys = self._key_buffer.narrow(-2, 0, needed)
        self.values = self._value_buffer.narrow(-2, 0, needed)
        return self._key_buffer, self._value_buffer

    def held_bytes(self) -> int:
        """Bytes of its buffers (the keys and values it hands out are views of them)."""
        keys, values = getattr(self, "_key_buffer", None), getattr(self, "_value_buffer", None)
        return (keys.nbytes if keys is not None else 0) + (values.nbytes if values is not None else 0)

    @staticmethod
    def _grown(old: torch.Tensor, new: torch.Tensor, held: int, capacity: int) -> torch.Tensor:
        buffer = new.new_empty((*new.shape[:-2], capacity, new.shape[-1]))
        if held:
            buffer.narrow(-2, 0, held).copy_(old)
        return buffer

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)  # views of the same buffers: the next update overwrites the dropped tail

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a meshnet session cache holds one sequence")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("a meshnet session cache holds one sequence")


def grow_in_place(cache) -> None:
    """Swap each plain full-attention layer of a fresh ``DynamicCache`` for a :class:`GrowingLayer`.

    Sliding-window, linear-attention and other layer types keep transformers' own classes.
    """
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and not layer.is_initialized:
            cache.layers[i] = GrowingLayer()


def cut_back(cache, keep: int, held: int, copy: bool):
    """The first ``keep`` of the ``held`` positions of ``cache``: a copy, or ``cache`` itself cropped in place.

    Returns None when a layer cannot be cut back: state that sums every position (linear attention's
    convolution and recurrent state) or a sliding window that has already let positions go can only
    continue from exactly what it holds, so for those ``keep`` must equal ``held``. A copy never shares a
    tensor with ``cache``: linear-attention states and :class:`GrowingLayer` buffers are written in place.
    """
    if not 0 < keep <= held:
        return None
    if keep == held:
        return deepcopy(cache) if copy else cache
    if not all(_croppable(layer) for layer in cache.layers if _holds_state(layer)):
        return None
    if not copy:
        cache.crop(keep - held)  # transformers' crop takes the count to remove, negative
        return cache
    forked = _shallow(cache)
    forked.layers = [_prefix_copy(layer, keep) if _holds_state(layer) else deepcopy(layer) for layer in cache.layers]
    return forked


def _holds_state(layer) -> bool:
    """Whether a cache layer holds anything: a shard's cache has a layer for every layer of the model."""
    if hasattr(layer, "is_initialized"):
        return layer.is_initialized
    # linear attention (transformers' LinearAttentionCacheLayerMixin) says so per state
    return any(getattr(layer, "is_conv_states_initialized", {0: True}).values()) or \
        any(getattr(layer, "is_recurrent_states_initialized", {}).values())


def _croppable(layer) -> bool:
    if type(layer) in (DynamicLayer, GrowingLayer):
        return True
    # a window layer that never filled still holds every position it was given
    return type(layer) is DynamicSlidingWindowLayer and layer.cumulative_length < layer.sliding_window


def _shallow(obj):
    new = obj.__class__.__new__(obj.__class__)
    new.__dict__.update(obj.__dict__)
    return new


def _prefix_copy(layer, keep: int):
    new = _shallow(layer)
    new.keys = layer.keys[..., :keep, :].clone()
    new.values = layer.values[..., :keep, :].clone()
    if isinstance(layer, GrowingLayer):  # the copy is exactly full: its next update grows it
        new._key_buffer, new._value_buffer = new.keys, new.values
    if isinstance(layer, DynamicSlidingWindowLayer):
        new.cumulative_length = keep
    return new


def cache_nbytes(cache) -> int:
    """Bytes held by a cache object, whatever its layer types keep (K/V, conv or recurrent state).

    Called after every step, so it looks only where caches keep tensors: in each layer's attributes,
    directly or in a list, tuple or dict one level down. Memory is counted once per storage, so a
    view (a growing layer's filled part, a sliding window) and its buffer are not counted twice.
    """
    seen: dict[int, int] = {}
    held = 0
    for layer in getattr(cache, "layers", ()):
        if type(layer) is GrowingLayer:  # its buffers, read directly: a tenth of the walk below, per step
            held += layer.held_bytes()
            continue
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor):
                _count_storage(value, seen)
            elif isinstance(value, (list, tuple)):
                for v in value:
                    if isinstance(v, torch.Tensor):
                        _count_storage(v, seen)
            elif isinstance(value, dict):
                for v in value.values():
                    if isinstance(v, torch.Tensor):
                        _count_storage(v, seen)
    return held + sum(seen.values())


def _count_storage(tensor: torch.Tensor, seen: dict[int, int]) -> None:
    if not tensor.is_meta:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
