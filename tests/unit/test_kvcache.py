"""The KV cache layer that grows in place (``daemon.model.kvcache``) against transformers' own."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from daemon.model.kvcache import MIN_GROWTH, GrowingLayer


def states(tokens: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 3, tokens, 8, generator=generator), torch.randn(1, 3, tokens, 8, generator=generator))


def test_a_growing_layer_holds_exactly_what_transformers_layer_holds_through_growth_and_crops():
    ours, theirs = GrowingLayer(), DynamicLayer()
    steps = [30] + [1] * (4 * MIN_GROWTH + 40) + [5]  # a prefill, decode steps through several growths, a chunk
    for i, tokens in enumerate(steps):
        key, value = states(tokens, seed=i)
        got, want = ours.update(key, value), theirs.update(key, value)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"step {i}"
        if i == 100:  # a crop, as a re-prefill after a rejected step would do, then more appends
            ours.crop(-3)
            theirs.crop(-3)
    assert ours.get_seq_length() == theirs.get_seq_length() == sum(steps) - 3


def test_decode_steps_write_into_the_same_buffer_instead_of_copying_the_cache():
    layer = GrowingLayer()
    layer.update(*states(30, seed=0))
    layer.update(*states(1, seed=1))  # the first decode step makes room
    buffer = layer.keys.untyped_storage().data_ptr()
    for i in range(MIN_GROWTH - 1):
        layer.update(*states(1, seed=2 + i))
        assert layer.keys.untyped_storage().data_ptr() == buffer, f"copied at decode step {i}"
    layer.update(*states(MIN_GROWTH, seed=999))  # more than the room left: one copy into a bigger buffer
    assert layer.keys.untyped_storage().data_ptr() != buffer


def test_a_reset_layer_starts_again_from_nothing():
    layer = GrowingLayer()
    layer.update(*states(10, seed=0))
    layer.reset()
    key, value = states(4, seed=1)
    keys, values = layer.update(key, value)
    assert torch.equal(keys, key) and torch.equal(values, value)
