"""The one-position path (``daemon.model.decode``) computes bit for bit what the layers' own forward computes.

Each case prefills a shard, then decodes with the path on and with it off (the layers' own forward), and holds
every step's output hidden states and logits to be identical, in float32 and bfloat16, for a whole model and a
shard of its later layers. Layers the path does not know run their own forward.
"""

from __future__ import annotations

import pytest
import torch

from daemon.kvstore import SessionCacheStore
from daemon.model import decode, native
from daemon.model.shard import ModelShard
from tests.support.decode_steps import decode_steps

STEPS = 8


def _decode(shard: ModelShard, start_layer: int, *, fast: bool, monkeypatch) -> tuple[list[torch.Tensor], int]:
    """Hidden states after each of ``STEPS`` decode steps (and the tail's logits), and how many took the fast path."""
    return decode_steps(shard, start_layer, path=decode.FastDecoder, fast=fast, monkeypatch=monkeypatch, steps=STEPS)


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


@pytest.mark.parametrize("arch, end, masked", [("llama", 4, 0), ("qwen2", 4, STEPS)])
def test_a_step_on_the_path_builds_no_attention_mask(tiny_model, monkeypatch, arch, end, masked):
    """The path's one position attends to every position before it, which the mask builders answer with None: its
    steps skip building one. Layers off the path (the tiny Qwen2's sliding windows) still get theirs every step."""
    from daemon.model.layers import DecoderLayers

    shard = ModelShard(tiny_model(arch), 0, end, sessions=SessionCacheStore())
    built = []
    real_masks = DecoderLayers._masks

    def counted(self, *args, **kwargs):
        built.append(1)
        return real_masks(self, *args, **kwargs)

    monkeypatch.setattr(DecoderLayers, "_masks", counted)
    _, runs = _decode(shard, 0, fast=True, monkeypatch=monkeypatch)
    assert runs == (STEPS if arch == "llama" else 0)
    assert len(built) == 1 + masked  # the prompt's, then one per step off the path


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


@pytest.mark.parametrize("method", ["int8", pytest.param("int8-torchao", marks=pytest.mark.slow)])
def test_quantized_layers_take_the_path_bitwise(tiny_model, monkeypatch, method):
    """Quantized projections run through their own product (PyTorch's int8 kernel, torchao's tensor subclass)."""
    shard = ModelShard(tiny_model("llama"), 0, 4, sessions=SessionCacheStore(), dtype=torch.bfloat16, quantize=method)
    slow, slow_runs = _decode(shard, 0, fast=False, monkeypatch=monkeypatch)
    fast, fast_runs = _decode(shard, 0, fast=True, monkeypatch=monkeypatch)
    assert (slow_runs, fast_runs) == (0, STEPS)
    for got, want in zip(fast, slow):
        assert torch.equal(got, want)


def _native_decode(shard: ModelShard, start_layer: int, monkeypatch) -> tuple[list[torch.Tensor], int, object]:
    """As ``_decode`` with the path on, counting the steps the native library took; and the cache it filled."""
    taken = []
    real_run = decode.NativeSteps.run

    def counted(self, *args, **kwargs):
        out = real_run(self, *args, **kwargs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(decode.NativeSteps, "run", counted)
    outs, _ = _decode(shard, start_layer, fast=True, monkeypatch=monkeypatch)
    monkeypatch.undo()
    return outs, sum(taken)


needs_native = pytest.mark.skipif(native.library() is None, reason="no C compiler here: no native steps to take")


@needs_native
@pytest.mark.parametrize("arch, start, quantize", [  # quantized weights past a head's first layers: the full suite's
    pytest.param(arch, start, quantize, id=f"{arch}-{start}-{quantize or 'fp32'}",
                 marks=pytest.mark.slow if quantize and (arch, start) != ("llama", 0) else ())
    for arch, start in [("llama", 0), ("llama", 2), ("qwen2", 0)] for quantize in (None, "int8", "int4")])
def test_native_steps_are_the_layers_own_forward_within_float_rounding(tiny_model, monkeypatch, arch, start,
                                                                       quantize):
    """The whole layer in one native call (RMSNorm, q/k/v with Qwen2's biases, rotary, the cache write, attention,
    the gated MLP), float32, int8 or 4-bit weights: every step's hidden states and logits within float32 rounding of the
    layers' own forward through the same weights, and the caches grown past their first capacity alike."""
    end = 2 if arch == "qwen2" else 4
    shard = ModelShard(tiny_model(arch), start, end, head=start == 0, sessions=SessionCacheStore(), quantize=quantize)
    want, _ = _decode(shard, start, fast=False, monkeypatch=monkeypatch)
    shard.native_steps = True
    shard.forget_fast_decoder()
    got, native_runs = _native_decode(shard, start, monkeypatch)
    assert native_runs == STEPS
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert (g - w).abs().max() <= 1e-5 * w.abs().max()


@needs_native
def test_native_steps_write_the_same_keys_and_values(tiny_model):
    shards = [ModelShard(tiny_model("llama"), 0, 4, sessions=SessionCacheStore()) for _ in range(2)]
    shards[1].native_steps = True
    shards[1].forget_fast_decoder()
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randn(1, 5, shards[0].config.hidden_size, generator=generator)
    caches = [s.new_cache() for s in shards]
    for s, c in zip(shards, caches):
        s.run_layers(prompt, start_layer=0, past_len=0, cache=c)
    for step in range(40):  # past the first growth of every buffer
        x = torch.randn(1, 1, shards[0].config.hidden_size, generator=generator)
        for s, c in zip(shards, caches):
            s.run_layers(x, start_layer=0, past_len=5 + step, cache=c)
    assert shards[1].fast_decoder()._native is not None
    for want, got in zip(caches[0].layers[:4], caches[1].layers[:4]):
        assert got.get_seq_length() == want.get_seq_length() == 45
        for a, b in ((got.keys, want.keys), (got.values, want.values)):
            assert (a - b).abs().max() <= 1e-5 * b.abs().max()


@needs_native
def test_native_steps_are_taken_only_where_they_apply(tiny_model, monkeypatch):
    """Off unless the node plans its kernels; never for bfloat16 activations; a first position (nothing cached to
    grow from) goes through the layers' own path and leaves every cache as it was."""
    folder = tiny_model("llama")
    assert ModelShard(folder, 0, 4, sessions=SessionCacheStore()).fast_decoder()._native is None  # not planned
    planned = ModelShard(folder, 0, 4, sessions=SessionCacheStore())
    planned.plan_kernels(max_rows=1)
    assert planned.native_steps and planned.fast_decoder()._native is not None
    bf16 = ModelShard(folder, 0, 4, sessions=SessionCacheStore(), dtype=torch.bfloat16)
    bf16.native_steps = True
    bf16.forget_fast_decoder()
    assert bf16.fast_decoder()._native is None  # bfloat16 norms and weights: its own arithmetic
    cache = planned.new_cache()
    x = torch.randn(1, 1, planned.config.hidden_size)
    assert planned.fast_decoder()._native.run(x, (torch.ones(1, 1, 16), torch.zeros(1, 1, 16)), cache.layers,
                                              0, 4) is None
    assert all(layer.get_seq_length() == 0 for layer in cache.layers[:4])


@needs_native
def test_layers_that_take_native_steps_keep_the_layout_those_steps_read(tiny_model, monkeypatch):
    """A timing that favours the transposed layout (a busy host can skew one) lays out the LM head anew, never the
    weights of layers that take native steps: those steps read ``[out, in]``, and would be lost."""
    from daemon.model import kernels

    monkeypatch.setattr(kernels, "_time", lambda weights, x, kernel: 1.0 if weights[0].is_contiguous() else 0.1)
    shard = ModelShard(tiny_model("llama"), 0, 4, sessions=SessionCacheStore())
    assert shard.is_tail
    plans = shard.plan_kernels(max_rows=1)
    head = shard.model.lm_head.weight
    assert plans[kernels.weight_shape(head)].transposed and not head.is_contiguous()
    layer_weights = [m.weight for layer in shard._layers[:4] for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    assert layer_weights and all(w.is_contiguous() for w in layer_weights)
    assert not any(plans[kernels.weight_shape(w)].transposed for w in layer_weights)
    assert shard.fast_decoder()._native is not None


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5"])
def test_planned_bfloat16_steps_attend_in_float32_within_rounding(tiny_model, monkeypatch, arch):
    """Where a node plans its kernels, a one-position bfloat16 step's attention runs in float32 (through the fast
    path, or as the attention implementation of the layers' own forward): every output within bfloat16 rounding of
    SDPA's own, and the layers read "sdpa" again after the step."""
    shard = ModelShard(tiny_model(arch), 0, 4, sessions=SessionCacheStore(), dtype=torch.bfloat16)
    want, _ = _decode(shard, 0, fast=True, monkeypatch=monkeypatch)
    taken = []
    real = decode.attend_in_float32
    monkeypatch.setattr(decode, "attend_in_float32", lambda *args, **kwargs: taken.append(1) or real(*args, **kwargs))
    shard.native_steps = True
    shard.forget_fast_decoder()
    got, _ = _decode(shard, 0, fast=True, monkeypatch=monkeypatch)
    # the sliding-window layers' steps come with a mask once the window cuts (9 prompt tokens, a window of 4): SDPA
    assert len(taken) == STEPS * sum(t == "full_attention" for t in shard.layer_types[:4])
    assert all(c._attn_implementation == "sdpa" for c in shard._attention_configs)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        assert (g.float() - w.float()).abs().max() <= 0.02 * w.float().abs().max()


def test_other_steps_attend_as_sdpa_does():
    """A float32 query, a prompt, or a mask: transformers' SDPA itself, bit for bit."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    generator = torch.Generator().manual_seed(4)
    for dtype, positions, mask in ((torch.float32, 1, None), (torch.bfloat16, 3, None),
                                   (torch.bfloat16, 1, torch.ones(1, 1, 1, 6, dtype=torch.bool))):
        q = torch.randn(1, 4, positions, 16, generator=generator).to(dtype)
        k, v = (torch.randn(1, 2, 6, 16, generator=generator).to(dtype) for _ in range(2))
        want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
        got, _ = decode.decode_attention_forward(module, q, k, v, mask, scaling=0.25)
        assert torch.equal(got, want)
    q = torch.randn(1, 4, 1, 16, generator=generator).to(torch.bfloat16)
    got, _ = decode.decode_attention_forward(module, q, k, v, None, scaling=0.25)
    want, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.25)
    assert got.shape == want.shape and (got.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max()


@needs_native
@pytest.mark.parametrize("quantize", [None, "int4"])
def test_a_native_batch_of_sessions_is_each_sessions_own_native_steps_bitwise(tiny_model, monkeypatch, quantize):
    """Sessions of different lengths decoding together: one native call a layer for the batch, each row attending to
    its own session's cache, gives every session the hidden states and cache of its own single native steps, bit
    for bit (the products read each weight once for the batch and sum each row as alone)."""
    shard = ModelShard(tiny_model("llama"), 0, 4, sessions=SessionCacheStore(), quantize=quantize)
    shard.native_steps = True
    shard.forget_fast_decoder()
    batched = []
    real = decode.NativeSteps.run_batch
    monkeypatch.setattr(decode.NativeSteps, "run_batch", lambda self, *a: batched.append(1) or real(self, *a))
    generator = torch.Generator().manual_seed(5)
    width = shard.config.hidden_size
    lengths = (3, 9, 40)  # the last grows its buffers during the steps
    prompts = [torch.randn(1, n, width, generator=generator) for n in lengths]
    steps = [[torch.randn(1, 1, width, generator=generator) for _ in range(4)] for _ in lengths]
    alone, together = [shard.new_cache() for _ in lengths], [shard.new_cache() for _ in lengths]
    for caches in (alone, together):
        for prompt, cache in zip(prompts, caches):
            shard.run_layers(prompt, start_layer=0, past_len=0, cache=cache)
    for step in range(4):
        want = [shard.run_layers(steps[s][step], start_layer=0, past_len=n + step, cache=alone[s])
                for s, n in enumerate(lengths)]
        hidden = torch.cat([steps[s][step] for s in range(len(lengths))], dim=1)
        positions = torch.tensor([[n + step for n in lengths]])
        got = shard.run_batch(hidden, start_layer=0, position_ids=positions, caches=together)
        for s in range(len(lengths)):
            assert torch.equal(got[:, s:s + 1], want[s])
    assert len(batched) == 4
    for a, b in zip(alone, together):
        for want_layer, got_layer in zip(a.layers[:4], b.layers[:4]):
            assert got_layer.get_seq_length() == want_layer.get_seq_length()
            assert torch.equal(got_layer.keys, want_layer.keys) and torch.equal(got_layer.values, want_layer.values)
