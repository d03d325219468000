"""A one-position step's rotary embedding, looked up rather than computed.

A decode step needs ``(cos, sin)`` for one position. The model's rotary module computes them with a dozen
small torch ops behind two Python wrappers: about 75 µs a step on a 2-core Xeon when that code runs cold, as it
does once per node per token after the other node's layers have run. :class:`RotaryTable` asks the module
once for a run of :data:`CHUNK` positions and hands out views of its rows.

Each row is the module's own output for that position alone, bit for bit: the module multiplies each inverse
frequency by one position (no sums) and takes cosines and sines element by element, so a longer run changes no
value. The first run a table makes is checked against one call per position all the same, and a table whose
rows differ (another CPU's kernels might) is not used. Rotary types whose frequencies change with the length
reached (``dynamic``, ``longrope``) and models with one rotary embedding per layer type are not tabled.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

CHUNK = 64  # positions one call of the module computes
KEPT = 32  # runs held (least recently used goes first): 2 MiB at most for a head of 128, in float32
STATIC_TYPES = ("default", "linear", "llama3", "yarn")  # frequencies fixed at load, whatever the position


class RotaryTable:
    """Runs of ``rotary``'s ``(cos, sin)`` by position, made on first use; ``at`` is None where not tabled."""

    def __init__(self, rotary: torch.nn.Module, *, per_type: bool = False) -> None:
        self._rotary = rotary
        self._runs: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.usable = not per_type and getattr(rotary, "rope_type", None) in STATIC_TYPES
        self._checked = False

    def at(self, hidden: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(cos, sin)`` ``[1, 1, head_dim]`` in ``hidden``'s dtype and device at ``position``, or None."""
        if not self.usable:
            return None
        first = position - position % CHUNK
        key = (first, hidden.dtype, hidden.device)
        run = self._runs.get(key)
        if run is None:
            run = self._make(hidden, first)
            if run is None:
                return None
            if len(self._runs) >= KEPT:
                self._runs.popitem(last=False)
            self._runs[key] = run
        else:
            self._runs.move_to_end(key)
        row = position - first
        return run[0][:, row:row + 1], run[1][:, row:row + 1]

    @torch.inference_mode()  # here, not on every lookup: a step already runs in it
    def _make(self, hidden: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        positions = torch.arange(first, first + CHUNK, device=hidden.device).unsqueeze(0)
        cos, sin = self._rotary(hidden, positions)
        if not self._checked:
            self._checked = True
            for row in range(CHUNK):
                one_cos, one_sin = self._rotary(hidden, positions[:, row:row + 1])
                if not (torch.equal(one_cos, cos[:, row:row + 1]) and torch.equal(one_sin, sin[:, row:row + 1])):
                    self.usable = False
                    self._runs.clear()
                    return None
        return cos, sin
