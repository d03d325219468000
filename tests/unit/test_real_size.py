"""The real-size bench's models and its floor: what a decode step reads, and how fast this machine reads."""

from __future__ import annotations

import json
import math

import pytest

from daemon.bench.real_size import MARKER, SHAPES, Shape, build, build_deeper, read_bandwidth

VOCAB = 49152


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_shapes_are_the_real_models_sizes(name):
    """The configs build (no weights) into the layer sizes the bench reports."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(SHAPES[name].config)
    config = AutoConfig.for_model(fields.pop("model_type"), vocab_size=VOCAB, **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    layer_bytes = sum(p.numel() * 2 for p in model.model.layers.parameters())
    if name == "llama-8b":  # 218M values a layer: attention 4096 x (4096 + 1024 + 1024 + 4096), MLP 3 x 4096 x 14336
        assert layer_bytes == 4 * 2 * (4096 * 10240 + 3 * 4096 * 14336 + 2 * 4096)
    else:  # 256 experts of 3 x 2048 x 512 values in each of the two layers
        experts = sum(p.numel() * 2 for n, p in model.model.layers.named_parameters() if ".experts." in n)
        assert experts == 2 * 256 * 3 * 2048 * 512 * 2
        assert config.layer_types == ["linear_attention", "full_attention"]


def test_the_deeper_moe_sample_is_the_real_models_order():
    """Its quantized rows run 8 layers of the same sizes, 3 gated delta net layers to each gated attention layer as in
    the real model (at 4 bits, about what its 2 bfloat16 layers hold)."""
    shape = SHAPES["qwen3.5-moe"]
    deep = shape.deeper
    assert deep.config["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert {k: v for k, v in deep.config.items() if k not in ("num_hidden_layers", "layer_types")} == \
        {k: v for k, v in shape.config.items() if k not in ("num_hidden_layers", "layer_types")}
    assert deep.config["num_hidden_layers"] == 8 and deep.deeper is None


def test_the_deeper_sample_draws_each_layer_after_the_first_of_its_kind(tmp_path, default_model):
    """Written once, a file a layer: it loads in transformers with its layers in the deeper order; two layers of
    one kind have weights of their own with the spread of the layer they were drawn after, a norm's weights are
    copied, and the record counts every weight and what a step reads."""
    import torch
    from transformers import AutoModelForCausalLM

    small = {"model_type": "qwen3_5_moe_text", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
             "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 8, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
    order = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
    deeper = Shape("small-hybrid-4", "four layers", {**small, "num_hidden_layers": 4, "layer_types": order})
    shape = Shape("small-hybrid", "two layers", {**small, "num_hidden_layers": 2,
                                                 "layer_types": ["linear_attention", "full_attention"]}, deeper)
    source, folder = tmp_path / "small-hybrid", tmp_path / "small-hybrid-4"
    build(shape, source, default_model)
    record = build_deeper(shape, source, folder)
    assert len(list(folder.glob("model-*.safetensors"))) == 5 and (folder / "tokenizer.json").exists()
    assert json.loads((folder / MARKER).read_text()) == record

    two = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    four = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert four.config.layer_types == order
    assert [type(layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn).__name__
            for layer in four.model.layers] == [type(two.model.layers[0].linear_attn).__name__] * 2 + \
        [type(two.model.layers[1].self_attn).__name__] + [type(two.model.layers[0].linear_attn).__name__]
    after = two.model.layers[0].linear_attn.in_proj_qkv.weight.detach().float()
    drawn = [four.model.layers[i].linear_attn.in_proj_qkv.weight.detach().float() for i in (0, 1, 3)]
    assert not torch.equal(drawn[0], drawn[1]) and not torch.equal(drawn[0], after)
    for weight in drawn:
        assert float(weight.std()) == pytest.approx(float(after.std()), rel=0.1)
    assert torch.equal(four.model.layers[2].input_layernorm.weight, two.model.layers[1].input_layernorm.weight)
    assert torch.equal(four.model.embed_tokens.weight, two.model.embed_tokens.weight)

    values = {name: p.numel() for name, p in four.named_parameters()}
    experts = sum(v for name, v in values.items() if ".experts." in name)
    embedding = values["model.embed_tokens.weight"]
    assert record["weights_bytes"] == 2 * sum(values.values())
    assert record["active_bytes"] == 2 * (sum(values.values()) - experts - embedding) + 2 * experts // 4 + 2 * 64
    assert build_deeper(shape, source, folder) == record  # reused, not written again


def test_a_model_is_written_once_with_what_a_decode_step_reads(tmp_path, default_model):
    """A small MoE of the same kind: every weight counts, but only the routed share of the experts and one
    row of the embedding are read in a step; the folder is complete (tokenizer, marker) and reused."""
    shape = Shape("small-moe", "a small MoE", {
        "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32})
    folder = tmp_path / "small-moe"
    record = build(shape, folder, default_model)
    assert json.loads((folder / MARKER).read_text()) == record
    assert (folder / "tokenizer.json").exists() and (folder / "config.json").exists()

    from safetensors import safe_open

    sizes = {}
    with safe_open(folder / "model.safetensors", "pt") as f:
        for key in f.keys():
            sizes[key] = f.get_slice(key).get_shape()
    values = {key: math.prod(shape) for key, shape in sizes.items()}
    experts = sum(v for k, v in values.items() if ".experts." in k)
    embedding = values["model.embed_tokens.weight"]
    assert record["weights_bytes"] == 2 * sum(values.values())  # bfloat16
    assert record["active_bytes"] == 2 * (sum(values.values()) - experts - embedding) + 2 * experts // 4 + 2 * 64
    assert build(shape, folder, default_model) == record  # reused, not written again


def test_read_bandwidth_is_bytes_over_the_fastest_pass():
    rate = read_bandwidth(1, size_bytes=64 << 20, rounds=2)
    assert 1e8 < rate < 1e13  # between 0.1 GB/s and 10 TB/s: a rate, not a time


@pytest.mark.slow
def test_each_round_sets_its_steps_against_the_bandwidth_read_around_it(tmp_path, default_model, monkeypatch):
    """A real node on a small model, three rounds, the machine's read rate scripted (it moves between rounds): each
    round's ratio is its floor (the faster reading around it) over its median step, and the row's is the median
    round's, with that round's rate and floor."""
    from daemon.bench import real_size

    shape = Shape("small", "a small Llama", {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2})
    folder = tmp_path / "small"
    record = build(shape, folder, default_model)
    rates = iter([10e9, 20e9, 40e9, 30e9, 5e9, 5e9])
    monkeypatch.setattr(real_size, "read_bandwidth", lambda threads: next(rates))
    row = real_size.measure(shape, record, folder, tokens=8, threads=1, bandwidth_threads=1, rounds=3)
    assert row["bandwidth_readings"] == [[10e9, 20e9], [40e9, 30e9], [5e9, 5e9]]
    ratios = row["of_floor_rounds"]
    assert len(ratios) == 3 and row["of_floor"] == sorted(ratios)[1]
    middle = ratios.index(row["of_floor"])
    assert row["bandwidth_bytes_per_s"] == (20e9, 40e9, 5e9)[middle]
    assert row["floor_ms"] == pytest.approx(record["active_bytes"] / row["bandwidth_bytes_per_s"] * 1000.0)
    assert row["peak_over_weights"] is not None and row["step_ms_median"] > 0
    assert 0 < row["runtime_rss_bytes"] < row["peak_rss_bytes"]  # the node's own reading, before its weights
    assert row["rest_over_weights"] == pytest.approx(
        (row["peak_rss_bytes"] - row["runtime_rss_bytes"]) / row["node_weights_bytes"])
