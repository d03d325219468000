"""The Qwen one-position path (``daemon.model.qwen_decode``) computes bit for bit what the layers' own forward does.

Each case prefills a shard of a tiny model, then decodes with the path on and with it off, and holds every step's
hidden states, logits and the states left in the cache to be identical. The models: Qwen3.5, dense and MoE (three
gated delta net layers, then a gated attention layer with rotary on a quarter of each head, a shared expert);
Qwen3-MoE (query and key norms, MoE on every second layer); Qwen3's first layer (the next slides a window). In
float32 and bfloat16, a whole model and a shard of its later layers, with and without the plans a node makes
(native delta-net steps, planned products and experts, float32 attention for bfloat16 queries), quantized weights.
"""

from __future__ import annotations

import pytest
import torch

from daemon.kvstore import SessionCacheStore
from daemon.model import qwen_decode
from daemon.model.shard import ModelShard
from tests.support.decode_steps import decode_steps

STEPS = 6


def _decode(shard: ModelShard, start_layer: int, *, fast: bool, monkeypatch) -> tuple[list[torch.Tensor], int]:
    return decode_steps(shard, start_layer, path=qwen_decode.QwenDecoder, fast=fast, monkeypatch=monkeypatch,
                        steps=STEPS, held=True)


def _shard(folder, start: int, end: int, **kwargs) -> ModelShard:
    """A shard whose RMSNorm weights are random: a tiny model is made with them all 1 (Qwen3) or 0 (Qwen3.5, which
    scales by ``1 + weight``), which would hide how a norm rounds."""
    shard = ModelShard(folder, start, end, head=start == 0, sessions=SessionCacheStore(), **kwargs)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in shard.model.modules():
            if type(module).__name__ in qwen_decode._NORM_CLASSES | qwen_decode._OFFSET_NORM_CLASSES:
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator))
    shard.forget_fast_decoder()  # bound at load (with 1 + weight made once): bound again to the new weights
    return shard


def _same(fast: list[torch.Tensor], slow: list[torch.Tensor]) -> None:
    assert len(fast) == len(slow) > STEPS
    for got, want in zip(fast, slow):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize("planned", [False, True], ids=["own", "planned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch, start, end", [("qwen3_5_moe", 0, 4), ("qwen3_5_moe", 2, 4), ("qwen3_5", 0, 4),
                                             ("qwen3_moe", 0, 4), ("qwen3_moe", 1, 4), ("qwen3", 0, 1)])
def test_the_path_is_bitwise_the_layers_own_forward(tiny_model, monkeypatch, arch, start, end, dtype, planned):
    shard = _shard(tiny_model(arch), start, end, dtype=dtype)
    if planned:
        shard.plan_kernels(max_rows=1)
    assert isinstance(shard.fast_decoder(), qwen_decode.QwenDecoder)
    slow, slow_runs = _decode(shard, start, fast=False, monkeypatch=monkeypatch)
    fast, fast_runs = _decode(shard, start, fast=True, monkeypatch=monkeypatch)
    assert (slow_runs, fast_runs) == (0, STEPS)
    _same(fast, slow)


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_moe"])
@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_layers_and_experts_take_the_path_bitwise(tiny_model, monkeypatch, quantize, arch):
    """Quantized projections and 4-bit expert stacks run through their own products."""
    shard = _shard(tiny_model(arch), 0, 4, dtype=torch.bfloat16, quantize=quantize)
    slow, _ = _decode(shard, 0, fast=False, monkeypatch=monkeypatch)
    fast, fast_runs = _decode(shard, 0, fast=True, monkeypatch=monkeypatch)
    assert fast_runs == STEPS
    _same(fast, slow)


def test_a_shard_of_delta_nets_alone_needs_no_rotary(tiny_model, monkeypatch):
    """Layers 0-2 are gated delta nets only: no position's rotary is looked up, and the path still runs."""
    from daemon.model.layers import DecoderLayers

    shard = _shard(tiny_model("qwen3_5_moe"), 0, 3, dtype=torch.bfloat16)
    monkeypatch.setattr(DecoderLayers, "_rotary_at", lambda *args: pytest.fail("a rotary lookup"))
    assert not shard.fast_decoder().attends
    slow, _ = _decode(shard, 0, fast=False, monkeypatch=monkeypatch)
    fast, fast_runs = _decode(shard, 0, fast=True, monkeypatch=monkeypatch)
    assert fast_runs == STEPS
    _same(fast, slow)


def test_a_step_on_the_path_builds_no_mask(tiny_model, monkeypatch):
    """The prompt builds its masks; the path's one-position steps build none."""
    from daemon.model.layers import DecoderLayers

    shard = ModelShard(tiny_model("qwen3_5_moe"), 0, 4, sessions=SessionCacheStore())
    built = []
    real_masks = DecoderLayers._masks
    monkeypatch.setattr(DecoderLayers, "_masks", lambda self, *a, **k: built.append(1) or real_masks(self, *a, **k))
    _, runs = _decode(shard, 0, fast=True, monkeypatch=monkeypatch)
    assert runs == STEPS and len(built) == 1


@pytest.mark.parametrize("arch", ["qwen3_next", "llama", "qwen3"])
def test_other_layers_are_not_bound(tiny_model, arch):
    """Qwen3-Next lays its delta net's input product out otherwise; Llama takes its own path (decode.FastDecoder);
    the tiny Qwen3's second layer slides a window, which needs its mask."""
    shard = ModelShard(tiny_model(arch), 0, 4, sessions=SessionCacheStore())
    assert not isinstance(shard.fast_decoder(), qwen_decode.QwenDecoder)
    assert qwen_decode.QwenDecoder.bind(shard._layers, shard.config, shard.layer_types, 0, 4) is None


def test_a_stateless_step_takes_the_path_bitwise(tiny_model, monkeypatch):
    """A one-position step with no cache (a stateless node's, from position 0): the delta nets start from no state,
    the attention layer attends to the position itself."""
    shard = _shard(tiny_model("qwen3_5_moe"), 0, 4, dtype=torch.bfloat16)
    runs = []
    real_run = qwen_decode.QwenDecoder.run
    monkeypatch.setattr(qwen_decode.QwenDecoder, "run", lambda self, *a: runs.append(1) or real_run(self, *a))
    x = torch.randn(1, 1, shard.config.hidden_size, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    fast = shard.run_layers(x, start_layer=0, past_len=0, cache=None)
    monkeypatch.setattr(qwen_decode.QwenDecoder, "fits", lambda self, start: False)
    slow = shard.run_layers(x, start_layer=0, past_len=0, cache=None)
    assert runs == [1] and torch.equal(fast, slow)
