"""The one-position path (``daemon.model.decode``) computes bit for bit what the layers' own forward computes.

Each case prefills a shard, then decodes with the path on and with it off (the layers' own forward), and holds
every step's output hidden states and logits to be identical, in float32 and bfloat16, for a whole model and a
shard of its later layers. Layers the path does not know run their own forward.
"""

from __future__ import annotations

import pytest
import torch

from daemon.kvstore import SessionCacheStore
from daemon.model import decode
from daemon.model.shard import ModelShard

PROMPT = [5, 17, 300, 4021, 77, 912, 13, 2048, 600]
STEPS = 8


def _decode(shard: ModelShard, start_layer: int, *, fast: bool, monkeypatch) -> tuple[list[torch.Tensor], int]:
    """Hidden states after each of ``STEPS`` greedy decode steps, and how many steps took the fast path."""
    runs = []
    real_run = decode.FastDecoder.run

    def counted(self, *args, **kwargs):
        runs.append(1)
        return real_run(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(decode.FastDecoder, "run", counted)
        if not fast:
            m.setattr(decode.FastDecoder, "fits", lambda self, start: False)
        generator = torch.Generator().manual_seed(0)
        width = shard.config.hidden_size
        cache = shard.new_cache()
        hidden = torch.randn(1, len(PROMPT), width, generator=generator).to(shard.dtype)
        shard.run_layers(hidden, start_layer=start_layer, past_len=0, cache=cache)
        outs = []
        for step in range(STEPS):
            hidden = torch.randn(1, 1, width, generator=generator).to(shard.dtype)
            out = shard.run_layers(hidden, start_layer=start_layer, past_len=len(PROMPT) + step, cache=cache)
            outs.append(out.clone())
            if shard.is_tail:
                outs.append(shard.logits_last(out))
    return outs, len(runs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch, start", [("llama", 0), ("llama", 2), ("qwen2", 0)])
def test_the_fast_path_is_bitwise_the_layers_own_forward(tiny_model, monkeypatch, arch, start, dtype):
    folder = tiny_model(arch)
    # the tiny Qwen2's layers 2-3 slide a window: the path takes layers 0-1 only
    end = 2 if arch == "qwen2" else 4
    shard = ModelShard(folder, start, end, head=start == 0, sessions=SessionCacheStore(), dtype=dtype)
    slow, slow_runs = _decode(shard, start, fast=False, monkeypatch=monkeypatch)
    fast, fast_runs = _decode(shard, start, fast=True, monkeypatch=monkeypatch)
    assert (slow_runs, fast_runs) == (0, STEPS)
    assert len(fast) == len(slow)
    for got, want in zip(fast, slow):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "gemma3_text"])
def test_layers_it_does_not_know_run_their_own_forward(tiny_model, monkeypatch, arch):
    """Qwen3 normalises queries and keys, Gemma 3 and the Qwen2 with windows slide: all their own forward."""
    folder = tiny_model(arch)
    shard = ModelShard(folder, 0, 4, sessions=SessionCacheStore())
    assert not shard.fast_decoder().fits(0)
    outs, runs = _decode(shard, 0, fast=True, monkeypatch=monkeypatch)
    assert runs == 0 and len(outs) == 2 * STEPS


def test_replaced_projections_are_bound_again(tiny_model, monkeypatch):
    """A plan re-lays weights out after the path was bound: the next step uses the new modules."""
    folder = tiny_model("llama")
    shard = ModelShard(folder, 0, 4, sessions=SessionCacheStore())
    before, _ = _decode(shard, 0, fast=True, monkeypatch=monkeypatch)
    bound = shard.fast_decoder()
    shard.plan_kernels(max_rows=1)
    assert shard.fast_decoder() is not bound
    after, runs = _decode(shard, 0, fast=True, monkeypatch=monkeypatch)
    assert runs == STEPS
    for got, want in zip(after, before):  # a plan changes only the order of each sum
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.parametrize("method", ["int8", "int8-torchao"])
def test_quantized_layers_take_the_path_bitwise(tiny_model, monkeypatch, method):
    """Quantized projections run through their own product (PyTorch's int8 kernel, torchao's tensor subclass)."""
    shard = ModelShard(tiny_model("llama"), 0, 4, sessions=SessionCacheStore(), dtype=torch.bfloat16, quantize=method)
    slow, slow_runs = _decode(shard, 0, fast=False, monkeypatch=monkeypatch)
    fast, fast_runs = _decode(shard, 0, fast=True, monkeypatch=monkeypatch)
    assert (slow_runs, fast_runs) == (0, STEPS)
    for got, want in zip(fast, slow):
        assert torch.equal(got, want)
