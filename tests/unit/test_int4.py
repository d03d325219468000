"""4-bit weights (``daemon.model.int4``): Q4_0's format, its products by the native kernel as defined, a prompt's by
torch over the dequantized weights (the native decode steps over 4-bit layers: tests/unit/test_decode.py; the products
built without AVX-512: tests/unit/test_native.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from daemon.errors import ModelUnavailable
from daemon.kvstore import SessionCacheStore
from daemon.model import int4, native
from daemon.model.footprint import Precision, read_footprint
from daemon.model.quantize import Int8WeightLinear, parameter_bytes, quantize_layers
from daemon.model.shard import ModelShard
from tests.support.q8 import quantized_rows

needs_library = pytest.mark.skipif(native.library() is None, reason="no C compiler here: no native kernels")
WIDTHS = (32, 64, 96, 128, 160, 192, 576, 1536)  # runs of 128, 64 and 32 in every combination


@pytest.mark.parametrize("columns", WIDTHS)
def test_values_pack_two_to_a_byte_and_come_back(columns):
    torch.manual_seed(columns)
    q = torch.randint(0, 16, (3, columns), dtype=torch.uint8)
    packed = int4.pack(q)
    assert packed.shape == (3, columns // 2) and packed.dtype == torch.uint8
    assert torch.equal(int4.unpack(packed, columns), q)
    # byte j of the first run holds value j and value j + half the run
    half = 64 if columns >= 128 else 32 if columns >= 64 else 16
    assert torch.equal(packed[:, :half], q[:, :half] | q[:, half:2 * half] << 4)


def test_quantize_holds_each_blocks_largest_magnitude_exactly_and_the_rest_within_a_step():
    torch.manual_seed(0)
    weight = torch.randn(8, 96)
    weight[1, :32] = 0  # a block of zeros: scale 0, every value 8
    weight[2, 32] = -40.0  # a block's largest magnitude is negative: it is -8 steps
    weight[3, 64] = 40.0  # and positive: -8 steps of a negative scale
    packed, scale = int4.quantize(weight)
    assert scale.dtype == torch.float16 and scale.shape == (8, 3)
    values = int4.dequantize(packed, scale, 96, torch.float32)
    blocks = weight.reshape(8, 3, 32)
    top = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
    step = (top / 8).abs()
    assert torch.equal(int4.unpack(packed, 96)[1, :32], torch.full((32,), 8, dtype=torch.uint8))
    assert values[2, 32] == -40.0 and values[3, 64] == 40.0
    error = (values.reshape(8, 3, 32) - blocks).abs()
    assert (error <= step * 1.001 + 1e-6).all()  # a value of the other sign beyond 7 steps clips to 7
    assert (error <= step * 0.5 * 1.01 + 1e-6).float().mean() > 0.95  # the rest round to the nearest step
    with pytest.raises(ValueError, match="whole blocks of 32"):
        int4.quantize(torch.randn(4, 48))


def int4_product(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, columns: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the native product defines, in float64: each input row quantized as for int8 weights, times the 4-bit
    weights d * (q - 8)."""
    weights = int4.dequantize(packed, scale, columns, torch.float32).double()
    return F.linear(quantized_rows(x), weights, bias.double() if bias is not None else None)


def assert_products_as_defined(dtype):
    """Rows by 4-bit weights give tests/support's products (runs of 128, 64 and 32; a block of zeros), each row the same
    alone as beside others; a prompt's rows (gemm_q4, in tiles of eight) too, each whatever rows are beside it."""
    torch.manual_seed(3)
    for out_features, in_features in ((300, 576), (64, 1536), (5, 96), (33, 160), (7, 32)):
        packed, scale = int4.quantize(torch.randn(out_features, in_features))
        bias = torch.randn(out_features)
        x = torch.randn(4, in_features).to(dtype)
        x[1, :32] = 0
        want = int4_product(x, packed, scale, in_features, bias)
        got = native.gemv_q4(x, packed, scale, in_features, bias)
        assert got.dtype == dtype and got.shape == (4, out_features)
        bound = 2e-6 if dtype == torch.float32 else 2 ** -8  # float32 sums of exact block sums; a bfloat16 output
        assert (got.double() - want).abs().max() <= bound * want.abs().max(), (out_features, in_features)
        alone = torch.cat([native.gemv_q4(x[m:m + 1], packed, scale, in_features, bias) for m in range(4)])
        assert torch.equal(got, alone)
        prompt = torch.randn(21, in_features).to(dtype)  # a prompt's rows: two tiles of eight and a short one
        prompt[3, 32:64] = 0
        tiled = native.gemm_q4(prompt, packed, scale, in_features, bias)
        want = int4_product(prompt, packed, scale, in_features, bias)
        assert tiled.dtype == dtype and tiled.shape == (21, out_features)
        assert (tiled.double() - want).abs().max() <= bound * want.abs().max(), (out_features, in_features)
        assert torch.equal(native.gemm_q4(prompt[5:16], packed, scale, in_features, bias), tiled[5:16])
    with pytest.raises(ValueError, match="gemm_q4"):
        native.gemm_q4(prompt[:, 1:], packed, scale, in_features)  # not the matrix's row length


@needs_library
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_products_are_as_defined_and_the_same_alone_or_together(dtype):
    assert_products_as_defined(dtype)


@needs_library
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_steps_expert_pairs_in_one_call_are_each_experts_own_products(dtype):
    """A decode step's (token, expert) pairs by a 4-bit stack in one call: each row what its expert's matrix alone
    gives it, bit for bit (a MoE layer's step through them: in the MoE shards' test below)."""
    torch.manual_seed(3)
    stack = torch.randn(6, 70, 608)  # 6 experts of [70, 608]: a last block of fewer than 4 rows, runs of 128, 64, 32
    packed, scale = int4.quantize_stack(iter(stack), 6, 70, 608, torch.device("cpu"))
    which = torch.tensor([5, 0, 5, 2, 3])
    x = torch.randn(5, 608).to(dtype)
    got = native.gemv_pairs_q4(x, packed, scale, which)
    alone = [native.gemv_q4(x[p:p + 1], packed[e], scale[e], 608) for p, e in enumerate(which.tolist())]
    assert torch.equal(got, torch.cat(alone))
    with pytest.raises(ValueError, match="gemv_pairs_q4"):
        native.gemv_pairs_q4(torch.randn(17, 608).to(dtype), packed, scale, torch.zeros(17, dtype=torch.long))


@needs_library
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_dequantization_is_torchs_bit_for_bit(dtype):
    torch.manual_seed(4)
    packed, scale = int4.quantize(torch.randn(70, 608))
    assert torch.equal(native.dequantize_q4(packed, scale, 608, 0, 70, dtype),
                       int4.dequantize(packed, scale, 608, dtype))
    assert torch.equal(native.dequantize_q4(packed, scale, 608, 20, 33, dtype),
                       int4.dequantize(packed[20:33], scale[20:33], 608, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_prompt_multiplies_the_dequantized_weights_and_a_short_one_takes_the_prompt_tiles(dtype, monkeypatch):
    """More than TILED_ROWS rows: torch's product over the weights dequantized a chunk of rows at a time (chunks
    made small here), the same with the native dequantization as with torch's; up to TILED_ROWS: the native prompt
    tiles, each row within float32 rounding of what a decode step gives it alone."""
    torch.manual_seed(5)
    linear = int4.Int4WeightLinear(nn.Linear(256, 384).to(dtype))
    monkeypatch.setattr(int4, "CHUNK_BYTES", 100 * 256 * 4)  # four chunks of 100 rows or fewer
    prompt = torch.randn(1, int4.TILED_ROWS + 12, 256).to(dtype)
    weights = int4.dequantize(linear.weight_q4, linear.scale, 256, dtype)
    with torch.inference_mode():
        got = linear(prompt)
        assert got.dtype == dtype and got.shape == (1, int4.TILED_ROWS + 12, 384)
        want = F.linear(prompt, weights, linear.bias)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max() if dtype == torch.float32 else \
            (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()
        if native.library() is not None:
            short = prompt[:, :int4.TILED_ROWS - 23]  # 41 rows: tiles of 8, the last one short
            tiled = linear(short)
            assert torch.equal(tiled, native.gemm_q4(short, linear.weight_q4, linear.scale, 256, linear.bias))
            alone = torch.cat([native.gemv_q4(short[:, r:r + 1], linear.weight_q4, linear.scale, 256, linear.bias)
                               for r in range(short.shape[1])], dim=1)
            bound = 2e-6 if dtype == torch.float32 else 2 ** -8
            assert (tiled.float() - alone.float()).abs().max() <= bound * alone.float().abs().max()
            assert (alone.float() - want[:, :short.shape[1]].float()).abs().max() <= \
                2 ** -5 * want.float().abs().max()  # the inputs quantized to 8 bits, as in a decode step
            monkeypatch.setattr(native, "library", lambda: None)
            assert torch.equal(linear(prompt), got)


def test_layers_hold_q4_0s_bytes_and_the_head_is_int8(default_model):
    """Layers 3-4 of the built-in model: 3,538,944 weights a layer at 4.5 bits (1,990,656 B) plus two float32 norms
    (4,608 B), against 14,160,384 B in float32; the footprint counts the same; the tail's LM head is int8."""
    shard = ModelShard(default_model, 3, 5, head=False, kv_cache=False, quantize="int4")
    assert shard.loaded_bytes()["layers"] == 2 * (1_990_656 + 4_608)
    assert read_footprint(str(default_model)).layer_bytes(Precision("float32", "int4"))[3:5] == [1_995_264] * 2
    assert isinstance(shard.model.model.layers[3].mlp.down_proj, int4.Int4WeightLinear)
    tail = ModelShard(default_model, 29, 30, head=False, kv_cache=False, quantize="int4")
    assert type(tail.model.lm_head) is Int8WeightLinear
    footprint = read_footprint(str(default_model)).weights_bytes(29, 30, Precision("float32", "int4"))
    assert footprint["final_norm_and_lm_head"] == tail.loaded_bytes()["final_norm_and_lm_head"]


def test_rows_of_odd_widths_are_refused_before_anything_changes():
    layers = [nn.Sequential(nn.Linear(64, 64), nn.Linear(48, 64))]
    with pytest.raises(ModelUnavailable, match=r"^int4 weights take rows of whole blocks of 32, and 1 \(48 inputs\)"):
        quantize_layers(layers, "int4")
    assert type(layers[0][0]) is nn.Linear and parameter_bytes(layers, set()) == (64 * 64 + 64 + 48 * 64 + 64) * 4



def test_a_q4_0_files_weights_come_through_unchanged():
    """A GGUF's Q4_0 matrices load dequantized; quantized again they are the very same values and scales (each
    block's largest magnitude is -8 of its steps in Q4_0 as here), so a Q4_0 file loses nothing more as int4."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(6)
    weights = rng.standard_normal((24, 576)).astype(np.float32)
    weights[3, :32] = 0
    loaded = torch.from_numpy(dequantize(quantize(weights, GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0))
    packed, scale = int4.quantize(loaded)
    assert torch.equal(int4.dequantize(packed, scale, 576, torch.float32), loaded)
    assert not torch.equal(loaded, torch.from_numpy(weights))


# the fast subset checks the MoE int4 product in test_a_steps_expert_pairs_in_one_call_are_each_experts_own_products
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_moe_shards_with_int4_experts_match_the_whole_int4_model(tiny_model, arch):
    """A mixture-of-experts model's fused experts are quantized too, expert by expert: two int4 shards emit the
    tokens transformers' generate gives on the whole model quantized the same way, hold the 4-bit stacks' bytes
    (as the footprint counts them), and answer as the float experts would, within 4-bit rounding."""
    from transformers import AutoModelForCausalLM

    from daemon.model.quantize import quantize_model
    from tests.unit.test_quantize import NEW_TOKENS, TINY_PROMPT, shard_tokens

    folder = tiny_model(arch)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    quantize_model(model, "int4")
    layers = list(model.model.layers)
    quantized = [m for layer in layers for m in layer.modules() if hasattr(m, "gate_up_proj_q4")]
    assert quantized and not any(hasattr(m, "gate_up_proj") for m in quantized)
    ids = torch.tensor([TINY_PROMPT])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=model.config.eos_token_id)
    expected = out[0, len(TINY_PROMPT):].tolist()
    total = model.config.get_text_config().num_hidden_layers
    head = ModelShard(folder, 0, 2, sessions=SessionCacheStore(), quantize="int4")
    tail = ModelShard(folder, 2, total, head=False, sessions=SessionCacheStore(), quantize="int4")
    assert shard_tokens(head, tail, TINY_PROMPT) == expected
    counted = read_footprint(str(folder)).layer_bytes(Precision("float32", "int4"))
    assert [parameter_bytes([layer], set()) for layer in layers] == counted
    float_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    experts = next(m for m in float_model.model.layers.modules() if hasattr(m, "gate_up_proj"))
    index = experts.gate_up_proj.shape[0] - 1
    x = torch.randn(3, experts.gate_up_proj.shape[-1])
    routes, weights = torch.tensor([[0, index]] * 3), torch.full((3, 2), 0.5)
    with torch.inference_mode():
        want = experts(x, routes, weights)
        int4.quantize_experts(experts)
        got = experts(x, routes, weights)
        one_by_one = int4.experts_one_by_one(experts, x, routes, weights)
    assert 0 < (got - want).norm() / want.norm() < 0.2
    assert torch.equal(got, one_by_one)  # 6 pairs: a step's, in one call a stack where the library is built


def test_quantizing_a_few_rows_at_a_time_changes_nothing(monkeypatch):
    """Both quantizers go a few megabytes of rows at a time (their float32 scratch of a whole LM head would be
    gigabytes): the same values and scales as in one piece."""
    from torchao.quantization import Int8Tensor, PerRow

    torch.manual_seed(7)
    weight = torch.randn(100, 96).to(torch.bfloat16)
    whole = int4.quantize(weight)
    monkeypatch.setattr(int4, "CHUNK_BYTES", 7 * 96 * 4)  # 7 rows at a time, the last chunk short
    assert all(torch.equal(a, b) for a, b in zip(int4.quantize(weight), whole))
    linear = nn.Linear(96, 100000, bias=False).to(torch.bfloat16)  # longer than one chunk of int8 rows
    reference = Int8Tensor.from_hp(linear.weight.detach(), PerRow())
    chunked = Int8WeightLinear(linear)
    assert torch.equal(chunked.weight_int8, reference.qdata)
    assert torch.equal(chunked.scale, reference.scale.flatten().to(torch.bfloat16))

