"""Weight-only int8 (and int4): two quantized shards emit the tokens of one whole model with the same layers.

The reference is transformers' own ``generate`` on the whole model after ``quantize_layers`` on its
decoder layers; the shards quantize their own layers after loading. Both go cached (prefill, then
one-token decode steps), as ``generate`` does, over 32+ tokens. Byte counts are checked exactly
against what int8 weights and their scales must hold.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from daemon.api import Sampling
from daemon.errors import ModelUnavailable
from daemon.kvstore import SessionCacheStore
from daemon.model import native
from daemon.model.quantize import (
    METHODS,
    Int8WeightLinear,
    check_quantization,
    parameter_bytes,
    quantize_head,
    quantize_layers,
)
from daemon.model.shard import ModelShard
from tests.support.q8 import int8_product

TINY_PROMPT = [1, 504, 3158, 1567, 4829, 28, 2117, 314, 17843]
NEW_TOKENS = 40
GREEDY = Sampling()
# bytes per output row besides its int8 weights: a bfloat16 scale (int8); a float32 scale and an int8
# zero point (torchao's Int8Tensor keeps a zero point even when symmetric)
ROW_OVERHEAD = {"int8": 2, "int8-torchao": 4 + 1}
INT8_METHODS = tuple(ROW_OVERHEAD)


def whole_model_tokens(folder, method: str, prompt: list[int]) -> tuple[list[int], list[int]]:
    """Greedy tokens of transformers' ``generate`` on the whole model with ``method`` on its decoder
    layers, and the bytes each of those layers holds (checked against what int8 must hold)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    layers = list(model.model.layers)
    expected = [expected_layer_bytes(layer, method) for layer in layers]
    quantize_layers(layers, method)
    quantize_head(model, method)
    layer_bytes = [parameter_bytes([layer], set()) for layer in layers]
    assert layer_bytes == expected  # the reference really is int8: its tokens may equal float32's
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=model.config.eos_token_id)
    return out[0, len(prompt):].tolist(), layer_bytes


def shard_tokens(head: ModelShard, tail: ModelShard, prompt: list[int]) -> list[int]:
    """Greedy tokens through head then tail: the prompt as one prefill, then one-token decode steps."""
    tokens: list[int] = []
    fed, mode, past_len = prompt, "prefill", 0
    while len(tokens) < NEW_TOKENS:
        hidden = head.step(head.embed(fed), mode=mode, session_id="s", past_len=past_len, start_layer=head.start,
                           sampling=GREEDY).hidden
        token = tail.step(hidden, mode=mode, session_id="s", past_len=past_len, start_layer=tail.start,
                          sampling=GREEDY).token_id
        tokens.append(token)
        past_len += len(fed)
        fed, mode = [token], "decode"
    return tokens


def expected_layer_bytes(float_layer: nn.Module, method: str) -> int:
    """What a float layer holds once ``method`` quantized it: int8 weights plus per-row scale bytes for every
    ``nn.Linear`` (int4: half a byte a weight plus a float16 scale per 32), biases and everything else as loaded."""
    total = 0
    for module in float_layer.modules():
        for name, param in module.named_parameters(recurse=False):
            if isinstance(module, nn.Linear) and name == "weight" and method == "int4":
                total += param.numel() // 2 + param.numel() // 32 * 2
            elif isinstance(module, nn.Linear) and name == "weight":
                total += param.numel() + module.out_features * ROW_OVERHEAD[method]
            else:
                total += param.numel() * param.element_size()
    return total


def assert_split_matches_whole(folder, split: int, n_layers: int, method: str, prompt: list[int]) -> None:
    expected, layer_bytes = whole_model_tokens(folder, method, prompt)
    assert len(expected) == NEW_TOKENS
    head = ModelShard(folder, 0, split, sessions=SessionCacheStore(), quantize=method)
    tail = ModelShard(folder, split, n_layers, head=False, sessions=SessionCacheStore(), quantize=method)
    assert head.loaded_bytes()["layers"] == sum(layer_bytes[:split])
    assert tail.loaded_bytes()["layers"] == sum(layer_bytes[split:])
    # embeddings stay float; the int8 and int4 methods' tail has an int8 LM head (its own copy where it was tied)
    # and lets go of the embeddings it loaded to tie it
    assert type(head.model.model.embed_tokens.weight.data) is torch.Tensor
    lm_head, vocab, hidden = tail.model.lm_head, head.info.vocab_size, head.info.hidden_size
    if method in ("int8", "int4"):
        assert type(lm_head) is Int8WeightLinear and lm_head.weight_int8.shape == (vocab, hidden)
        assert tail.loaded_bytes()["final_norm_and_lm_head"] == vocab * (hidden + 2) + hidden * 4
        assert tail.model.model.embed_tokens.weight.device.type == "meta"
    else:
        assert lm_head.weight.dtype == torch.float32
    assert shard_tokens(head, tail, prompt) == expected, f"{method}: split at {split} differs from generate"


@pytest.mark.parametrize("method", [pytest.param(m, marks=pytest.mark.slow) if m == "int8-torchao" else m
                                    for m in METHODS])  # torchao's kernel: the full suite's
def test_tiny_llama_int8_shards_match_int8_generate(tiny_model, method):
    assert_split_matches_whole(tiny_model("llama"), 2, 4, method, TINY_PROMPT)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_builtin_model_int8_shards_match_int8_generate(default_model, method):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    messages = [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert_split_matches_whole(default_model, 15, 30, method, list(prompt))


@pytest.mark.parametrize("method", INT8_METHODS)
def test_int8_layers_hold_a_quarter_of_float32_bytes(default_model, method):
    """Layers 3-4 of the built-in model: per layer, 3,538,944 int8 weights in 7 projections of 5,184 rows
    in all, plus two float32 norms (4,608 B): 3,553,920 B for int8 (bfloat16 scales), 3,569,472 B for
    int8-torchao (float32 scales, int8 zero points), against 14,160,384 B in float32."""
    float_shard = ModelShard(default_model, 3, 5, head=False, kv_cache=False)
    int8_shard = ModelShard(default_model, 3, 5, head=False, kv_cache=False, quantize=method)
    float_bytes = float_shard.loaded_bytes()["layers"]
    int8_bytes = int8_shard.loaded_bytes()["layers"]
    assert float_bytes == 2 * 14_160_384
    assert int8_bytes == sum(expected_layer_bytes(float_shard.model.model.layers[i], method) for i in (3, 4))
    assert int8_bytes == 2 * {"int8": 3_553_920, "int8-torchao": 3_569_472}[method]
    assert 0.25 < int8_bytes / float_bytes < 0.253


# how far a quantized linear may be from the same int8 weights multiplied exactly in float32
# int8 quantizes a decode step's inputs to int8 (a prompt's to bfloat16) and its scales are bfloat16
DEQUANTIZED_TOLERANCE = {"int8": 1e-2, "int8-torchao": 1e-5}


@pytest.mark.parametrize("method", INT8_METHODS)
def test_int8_linear_computes_with_its_int8_weights(method):
    """A quantized linear (with a bias, over a few tokens and over many) computes with torchao's per-row int8
    weights."""
    from torchao.quantization import Int8Tensor, PerRow

    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(256, 384))
    x = torch.randn(1, 5 if method == "int8-torchao" else 40, 256)
    with torch.inference_mode():
        float_out = layer(x)
        dequantized = Int8Tensor.from_hp(layer[0].weight.detach(), PerRow()).dequantize()  # [384, 256]
        int8_out = nn.functional.linear(x, dequantized, layer[0].bias)
        quantize_layers([layer], method)
        got = layer(x)
    assert got.shape == float_out.shape and got.dtype == float_out.dtype

    def relative_error(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert relative_error(got, int8_out) < DEQUANTIZED_TOLERANCE[method]
    assert relative_error(got, float_out) > 1e-3  # really quantized


@pytest.mark.skipif(native.library() is None, reason="no C compiler here: every product runs PyTorch's kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_multiplies_rows_natively_and_without_the_library_with_pytorchs_kernel(dtype, monkeypatch):
    """Up to 16 rows (a session's decode step, or a batch of them): the native kernel, its int8 inputs as
    defined in tests/support/q8.py, each row as it comes alone; 17 rows or more (a prompt): the native prompt tiles,
    each row within float32 rounding of its decode step's product; without the native library, PyTorch's int8-weight
    kernel, bit for bit."""
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(256, 384)).to(dtype)
    quantize_layers([layer], "int8")
    linear = layer[0]
    with torch.inference_mode():
        rows = torch.randn(1, 16, 256).to(dtype)
        got = layer(rows)
        assert got.dtype == dtype and torch.equal(got, native.gemv_int8(rows, linear.weight_int8, linear.scale,
                                                                        linear.bias))
        want = int8_product(rows, linear.weight_int8, linear.scale, linear.bias)
        bound = 2e-6 if dtype == torch.float32 else 2 ** -8
        assert (got.double() - want).abs().max() <= bound * want.abs().max()
        assert torch.equal(layer(rows[:, 3:4]), got[:, 3:4])
        prompt = torch.randn(1, 37, 256).to(dtype)
        tiled, alone = layer(prompt), torch.cat([layer(prompt[:, r:r + 1]) for r in range(37)], dim=1)
        assert torch.equal(tiled, native.gemm_int8(prompt, linear.weight_int8, linear.scale, linear.bias))
        assert (tiled.double() - alone.double()).abs().max() <= bound * alone.double().abs().max()
        monkeypatch.setattr(native, "library", lambda: None)
        kernel = torch._weight_int8pack_mm(prompt[0].to(torch.bfloat16), linear.weight_int8, linear.scale)
        assert torch.equal(layer(prompt), (kernel.to(dtype) + linear.bias).unsqueeze(0))


def test_unknown_method_is_refused_in_one_line(default_model):
    with pytest.raises(ModelUnavailable) as refused:
        ModelShard(default_model, 0, 1, head=False, kv_cache=False, quantize="int3")
    assert str(refused.value) == "unknown quantization 'int3': choose one of int8, int8-torchao, int4"


@pytest.mark.parametrize("method", METHODS)
def test_float16_compute_is_refused(method):
    layer = nn.Sequential(nn.Linear(64, 64)).to(torch.float16)
    with pytest.raises(ModelUnavailable, match=f"^{method} weights run with float32 or bfloat16 compute, not float16$"):
        quantize_layers([layer], method)
    assert layer[0].weight.dtype == torch.float16  # refused before anything changed


def test_int8_is_refused_on_a_device_without_the_kernel():
    """PyTorch registers its int8-weight kernel for CPU; no stock build has one for Habana's HPU."""
    check_quantization("int8", torch.bfloat16, torch.device("cpu"))
    with pytest.raises(ModelUnavailable, match=r"no int8-weight kernel for hpu; use int8-torchao there$"):
        check_quantization("int8", torch.bfloat16, torch.device("hpu"))


def test_layers_without_linear_are_refused():
    with pytest.raises(ModelUnavailable, match="no nn.Linear to quantize"):
        quantize_layers([nn.Sequential(nn.LayerNorm(8))], "int8")


@pytest.mark.parametrize("method", ["int8", "int4", "int8-torchao"])
@pytest.mark.parametrize("arch", ["llama", "qwen3_5_moe"])
def test_the_float_weights_a_load_quantizes_are_freed_without_a_collection(tiny_model, monkeypatch, method, arch):
    """A node loads with the cyclic collector off (meshd) and collects nothing between layers: every float weight
    a quantizer replaces (and every linear, where it replaces the module: torchao's quantizes it in place) must go
    as it is dropped, not wait in a reference cycle."""
    import gc
    import weakref

    from daemon.model import quantize

    replaced: list[weakref.ref] = []
    real = quantize.quantize_layers

    def watched(layers, how, *rest):
        replaced.extend(weakref.ref(t) for layer in layers for m in layer.modules() if type(m) is nn.Linear
                        for t in ((m.weight,) if how == "int8-torchao" else (m, m.weight)))
        real(layers, how, *rest)

    monkeypatch.setattr(quantize, "quantize_layers", watched)
    monkeypatch.setattr(gc, "collect", lambda *args: pytest.fail("the load collected"))
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        shard = ModelShard(tiny_model(arch), 0, 2, head=True, kv_cache=False, dtype=torch.bfloat16, quantize=method)
        assert replaced and [r for r in replaced if r() is not None] == []
    finally:
        if was_enabled:
            gc.enable()
    if method != "int8-torchao":
        assert not any(type(m) is nn.Linear for layer in shard.model.model.layers[:2] for m in layer.modules())
