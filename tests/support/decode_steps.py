"""Decode steps of random inputs through a shard, with a one-position path on or off: what its tests compare."""

from __future__ import annotations

import torch

PROMPT = [5, 17, 300, 4021, 77, 912, 13, 2048, 600]


def decode_steps(shard, start_layer: int, *, path: type, fast: bool, monkeypatch, steps: int,
                 held: bool = False) -> tuple[list[torch.Tensor], int]:
    """Prefill ``shard`` with a random prompt of ``len(PROMPT)`` positions, then ``steps`` one-position decode steps
    with the one-position path ``path`` (``FastDecoder``, ``QwenDecoder``) taken where it fits (``fast``) or never.
    Returns each step's hidden states (and the tail's logits), with ``held`` then every tensor the cache holds
    (keys and values, delta-net states); and how many steps ran ``path``."""
    runs = []
    real_run = path.run

    def counted(self, *args, **kwargs):
        runs.append(1)
        return real_run(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(path, "run", counted)
        if not fast:
            m.setattr(path, "fits", lambda self, start: False)
        generator = torch.Generator().manual_seed(0)
        width = shard.config.hidden_size
        cache = shard.new_cache()
        hidden = torch.randn(1, len(PROMPT), width, generator=generator).to(shard.dtype)
        shard.run_layers(hidden, start_layer=start_layer, past_len=0, cache=cache)
        outs = []
        for step in range(steps):
            hidden = torch.randn(1, 1, width, generator=generator).to(shard.dtype)
            out = shard.run_layers(hidden, start_layer=start_layer, past_len=len(PROMPT) + step, cache=cache)
            outs.append(out.clone())
            if shard.is_tail:
                outs.append(shard.logits_last(out))
        if held:  # a growing layer's buffers past its positions are unwritten: its keys and values, not those
            for layer in cache.layers[start_layer:]:
                tensors = [getattr(layer, "keys", None), getattr(layer, "values", None),
                           *getattr(layer, "conv_states", {}).values(),
                           *getattr(layer, "recurrent_states", {}).values()]
                outs.extend(t for t in tensors if t is not None)
    return outs, len(runs)
