"""A one-position step's rotary embedding comes from a table (``daemon.model.rotary``): the module's own output
for that position alone, bit for bit, or no table at all."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from daemon.kvstore import SessionCacheStore
from daemon.model.rotary import CHUNK, KEPT, RotaryTable
from daemon.model.shard import ModelShard

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
}


def _module(rope: str, head_dim: int = 64) -> LlamaRotaryEmbedding:
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=1 << 16, rope_parameters=ROPES[rope])
    return LlamaRotaryEmbedding(config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rope, head_dim", [("default", 64), ("default", 80), ("llama3", 128), ("linear", 64)])
def test_a_tables_rows_are_the_modules_own_for_each_position_alone(rope, head_dim, dtype):
    module = _module(rope, head_dim)
    table = RotaryTable(module)
    hidden = torch.zeros(1, 1, 4 * head_dim, dtype=dtype)
    # across runs, back to evicted ones (more runs than are kept), and at positions far out
    positions = [*range(0, 3 * CHUNK + 5), *range((KEPT + 3) * CHUNK - 2, (KEPT + 3) * CHUNK + 2), 3, 40000]
    for position in positions:
        got = table.at(hidden, position)
        want = module(hidden, torch.tensor([[position]]))
        assert got is not None
        for g, w in zip(got, want):
            assert g.shape == w.shape == (1, 1, head_dim) and g.dtype == dtype and torch.equal(g, w), position
    assert len(table._runs) <= KEPT


def test_frequencies_that_change_with_the_length_are_not_tabled():
    module = _module("dynamic")
    assert RotaryTable(module).at(torch.zeros(1, 1, 256), 5) is None
    assert RotaryTable(_module("default"), per_type=True).at(torch.zeros(1, 1, 256), 5) is None


def test_a_table_whose_rows_differ_from_single_positions_is_not_used(monkeypatch):
    """Where a longer run of positions comes out other than each alone (another CPU's kernels might), no table."""
    module = _module("default")
    real = module.forward

    def off_when_long(x, position_ids):
        cos, sin = real(x, position_ids)
        return (cos + 1e-3, sin) if position_ids.shape[1] > 1 else (cos, sin)

    monkeypatch.setattr(module, "forward", off_when_long)
    table = RotaryTable(module)
    hidden = torch.zeros(1, 1, 256)
    assert table.at(hidden, 7) is None and not table.usable
    assert table.at(hidden, 8) is None


def test_decode_steps_ask_the_module_once_per_run_of_positions(tiny_model, monkeypatch):
    """A step costs the module nothing until its position leaves the run it is in (the first run a table makes
    is checked once, one call per position: here perhaps already at load)."""
    shard = ModelShard(tiny_model("llama"), 0, 4, sessions=SessionCacheStore())
    module = shard.model.model.rotary_emb
    calls = []
    real = module.forward
    monkeypatch.setattr(module, "forward", lambda x, ids: calls.append((ids.shape[1], int(ids[0, 0]))) or real(x, ids))
    cache = shard.new_cache()
    width = shard.config.hidden_size
    shard.run_layers(torch.randn(1, 5, width), start_layer=0, past_len=0, cache=cache)
    assert calls == [(5, 0)]  # a prompt: the module, for its positions
    calls.clear()
    for position in range(5, 2 * CHUNK + 3):
        shard.run_layers(torch.randn(1, 1, width), start_layer=0, past_len=position, cache=cache)
    runs = [first for count, first in calls if count > 1]
    assert runs in ([CHUNK, 2 * CHUNK], [0, CHUNK, 2 * CHUNK])
    assert len(calls) - len(runs) in (0, CHUNK)  # the first run's check, unless made before
