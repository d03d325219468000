"""A node's side of speculative decoding: taking back the positions of a verify step the head rejected.

A verify step runs k+1 positions through the session (the last accepted token and k drafted ones), and the
head's next step says how many of them to keep. What cutting back costs depends on the layers:

- **Full attention** (and a sliding window that has not filled) keeps one entry per position: the cache is
  cropped, nothing is computed again.
- **Linear attention** (Qwen3-Next, Qwen3.5) sums every position into one state, and a **filled sliding window**
  has let go of the positions it would need. Before the verify step the node keeps a copy of those layers'
  state (:class:`Undo`: kilobytes to a few megabytes a layer) and the step's input hidden states. Cutting back
  puts the copy in place, crops the other layers to the same position, and runs the kept positions again from
  their inputs, in front of the next step's own positions (one pass, a few rows wider): the head sees no
  difference but the time.

A step that follows a verify step without cutting anything back simply continues.
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from daemon.model.kvcache import GrowingLayer, _holds_state

MAX_HELD_INPUTS = 64  # positions of inputs an undo keeps before it runs them again apart and copies afresh


@dataclass
class Undo:
    """How to bring a session back to any length from ``rewind_from`` up to what it holds.

    ``states`` (layer index -> a copy of that cache layer) is the state at position ``base`` of the layers
    that cannot be cropped, and ``inputs`` the hidden states of positions ``base..``; both None where every
    layer crops.
    """

    base: int
    states: dict[int, object] | None = None
    inputs: torch.Tensor | None = None  # [1, positions, hidden], this node's inputs from ``base`` on

    @property
    def nbytes(self) -> int:
        """Bytes the copies and inputs hold, beside the session's cache."""
        from daemon.model.kvcache import cache_nbytes

        held = self.inputs.nbytes if self.inputs is not None else 0
        if self.states:
            held += cache_nbytes(SimpleNamespace(layers=list(self.states.values())))
        return held


@dataclass
class Resumed:
    """Where a step starts after its session was brought back: ``replay`` (None: nothing) runs first, from
    ``past_len``, and its outputs are not the step's."""

    past_len: int
    replay: torch.Tensor | None = None
    undo: Undo | None = None  # the undo the session kept, still good for a verify step that follows


def resume(cache, undo: Undo | None, *, held: int, past_len: int) -> Resumed:
    """Bring ``cache`` (holding ``held`` positions) back to ``past_len`` with ``undo``, before a step runs."""
    if past_len == held or undo is None:
        return Resumed(past_len, undo=undo)
    if undo.states is None:  # every layer crops
        _crop(cache, past_len)
        return Resumed(past_len)
    for index, copy in undo.states.items():
        cache.layers[index] = deepcopy(copy)  # the copy stays: a later verify may need it again
    _crop(cache, undo.base)
    kept = past_len - undo.base
    replay = undo.inputs[:, :kept] if kept else None
    return Resumed(undo.base, replay, undo)


def prepare_verify(cache, resumed: Resumed, hidden: torch.Tensor, run_replay) -> tuple[Resumed, Undo]:
    """Before a verify step of ``hidden``'s positions: what undoes it. ``run_replay(replay, past_len)`` runs held
    inputs through the layers on their own, when they grew too long to keep."""
    positions = hidden.shape[1]
    if not _needs_copies(cache, positions, resumed.replay):
        return resumed, Undo(resumed.past_len + _width(resumed.replay))
    if resumed.replay is not None and resumed.undo is not None:
        if _width(resumed.replay) + positions <= MAX_HELD_INPUTS:  # the copies at ``base`` still hold
            return resumed, Undo(resumed.undo.base, resumed.undo.states,
                                 torch.cat([resumed.replay, hidden], dim=1))
        run_replay(resumed.replay, resumed.past_len)
        resumed = Resumed(resumed.past_len + _width(resumed.replay))
    states = {i: deepcopy(layer) for i, layer in enumerate(cache.layers) if _holds_state(layer)
              and not _crops_after(layer, positions)}
    return resumed, Undo(resumed.past_len, states, hidden.detach().clone())


def _crop(cache, keep: int) -> None:
    """Every croppable layer holding more than ``keep`` positions cut back to them (not ``cache.crop``: layers a
    shard does not host are empty, and transformers' linear-attention layers refuse a crop even then)."""
    for layer in cache.layers:
        if _holds_state(layer) and type(layer) in (DynamicLayer, GrowingLayer, DynamicSlidingWindowLayer):
            held = layer.get_seq_length()
            if held > keep:
                layer.crop(keep - held)


def _width(replay: torch.Tensor | None) -> int:
    return 0 if replay is None else replay.shape[1]


def _needs_copies(cache, positions: int, replay: torch.Tensor | None) -> bool:
    added = positions + _width(replay)
    return any(_holds_state(layer) and not _crops_after(layer, added) for layer in cache.layers)


def _crops_after(layer, added: int) -> bool:
    """Whether ``layer`` can still be cropped after ``added`` more positions."""
    if type(layer) in (DynamicLayer, GrowingLayer):
        return True
    return type(layer) is DynamicSlidingWindowLayer and layer.cumulative_length + added < layer.sliding_window
