"""meshd plan: the proposed split fits, its byte counts match what real nodes load and cache, and bad input is
one line.

Weights are checked against running meshd nodes (``GET /v1/status``) and in-process shards in bfloat16; cache
bytes against ``GET /v1/sessions`` and against real caches of every tiny architecture, exactly, using the
cache's own growth rule (:func:`daemon.model.footprint.growing_capacity`).
"""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess

import pytest

from daemon.api import format_layers
from daemon.model.footprint import LayerCache, ModelFootprint, PartValues, Precision, read_footprint
from daemon.plan import parse_size, plan_mesh
from daemon.plan.split import GIB
from tests.support.http_client import http_json
from tests.support.meshd import Daemon, run_meshd_in_process, start_mesh

MIB = 1 << 20


def meshd_plan(*args: str) -> subprocess.CompletedProcess:
    """``meshd plan``, run in this process: the planner reads files and prints, it starts nothing."""
    return run_meshd_in_process("plan", *args)


def plan_of(*args: str) -> dict:
    result = meshd_plan(*args, "--json")
    assert result.returncode in (0, 1), result.stderr
    return json.loads(result.stdout)


# ---- sizes and usage --------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("16GiB", 16 << 30), ("8GB", 8 * 10**9), ("512MiB", 512 << 20), ("1.5GiB", 3 << 29), ("123456", 123456),
    ("2 gib", 2 << 30), ("64kB", 64000), ("1TiB", 1 << 40),
])
def test_sizes_in_binary_and_decimal_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("args, code, expected", [
    (["--node", "16G"], 2, "'16G' is not a size"),
    (["--node", "0GiB"], 2, "more than 0 bytes"),
    (["--node", "lots"], 2, "'lots' is not a size"),
    (["--node", "8GiB", "--dtype", "int4"], 2, "--dtype"),
    (["--node", "8GiB", "--quantize", "int3"], 2, "--quantize"),
    (["--node", "8GiB", "--context", "0"], 2, "--context"),
    (["--node", "8GiB", "--reserve", "half"], 2, "--reserve"),
    ([], 2, "--node SIZE"),
    (["--model", "/no/such/model", "--node", "8GiB"], 1, "no such file"),
])
def test_bad_input_is_one_line(args, code, expected):
    result = meshd_plan(*args)
    assert result.returncode == code, result.stderr
    assert result.stderr.startswith("meshd: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert expected in result.stderr and "Traceback" not in result.stderr


def test_dtype_auto_is_the_checkpoints_and_every_command_names_its_dtype(tiny_model, tmp_path, capsys):
    from daemon.plan.command import main

    # meshd's own --dtype auto depends on the machine it runs on: a planned command always says which dtype
    config = json.loads((tiny_model("llama") / "config.json").read_text())
    for saved in ("bfloat16", "float32"):
        (tmp_path / "config.json").write_text(json.dumps(config | {"dtype": saved}))
        assert main(["--model", str(tmp_path), "--node", "1GiB", "--node", "1GiB", "--reserve", "1MiB", "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["dtype"] == saved
        assert all(f"--dtype {saved} " in node["command"] for node in plan["nodes"])


@pytest.mark.slow
def test_more_nodes_than_layers_and_a_context_past_the_model_are_refused(tiny_model):
    model = str(tiny_model("llama"))  # 4 layers, 1024 positions
    for args, expected in ((["--node", "1GiB"] * 5, "5 nodes for a model of 4 layers"),
                           (["--node", "1GiB", "--context", "2048"], "longer than the model's context of 1024")):
        result = meshd_plan("--model", model, *args)
        assert result.returncode == 2 and expected in result.stderr, result.stderr
        assert result.stderr.count("\n") == 1


@pytest.mark.slow
def test_a_checkpoint_missing_a_layer_is_refused(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "broken"
    shutil.copytree(tiny_model("llama"), folder)
    tensors = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if ".layers.3." not in k}, folder / "model.safetensors")
    result = meshd_plan("--model", str(folder), "--node", "1GiB")
    assert result.returncode == 1 and "layer 3" in result.stderr and "do not match" in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1


# ---- reading a model without its weights ------------------------------------------------------------


def test_a_config_only_folder_counts_as_the_folder_with_weights(tiny_model, tmp_path):
    for arch in ("llama", "qwen3_next"):
        shutil.copy(tiny_model(arch) / "config.json", tmp_path / "config.json")
        alone, full = read_footprint(str(tmp_path)), read_footprint(str(tiny_model(arch)))
        assert alone.source == "config only" and full.source == "safetensors headers"
        assert (alone.layers, alone.embeddings, alone.final_norm, alone.lm_head, alone.caches) == \
               (full.layers, full.embeddings, full.final_norm, full.lm_head, full.caches)


def test_a_70b_llama_shape_counts_as_its_arithmetic(tmp_path):
    from transformers import LlamaConfig

    h, n, inter, heads, kv, vocab = 8192, 80, 28672, 64, 8, 128256
    LlamaConfig(hidden_size=h, num_hidden_layers=n, intermediate_size=inter, num_attention_heads=heads,
                num_key_value_heads=kv, vocab_size=vocab).save_pretrained(tmp_path)
    footprint = read_footprint(str(tmp_path))
    head_dim = h // heads
    per_layer = 2 * h * h + 2 * h * kv * head_dim + 3 * h * inter + 2 * h  # q, o; k, v; the MLP; two norms
    bf16 = Precision("bfloat16")
    assert footprint.layer_bytes(bf16) == [2 * per_layer] * n
    assert footprint.weights_bytes(70, 80, bf16) == {"layers": 10 * 2 * per_layer, "embeddings": 2 * vocab * h,
                                                     "final_norm_and_lm_head": 2 * h + 2 * vocab * h}
    linear_rows = 2 * h + 2 * kv * head_dim + 2 * inter + h  # output channels: q, o; k, v; gate, up; down
    # int8 values, a bfloat16 scale per row (the int8 method), the two norms in bfloat16
    assert footprint.layer_bytes(Precision("bfloat16", "int8")) == [per_layer - 2 * h + 2 * linear_rows + 2 * 2 * h] * n
    assert footprint.kv_bytes_per_token(0, 1, bf16) == 2 * kv * head_dim * 2


@pytest.mark.slow
def test_a_gguf_file_counts_as_its_conversion(default_model):
    from daemon.model.source import default_gguf_path

    gguf, converted = read_footprint(str(default_gguf_path())), read_footprint(str(default_model))
    assert gguf.source == "GGUF header"
    assert (gguf.layers, gguf.embeddings, gguf.final_norm, gguf.lm_head, gguf.caches, gguf.tied) == \
           (converted.layers, converted.embeddings, converted.final_norm, converted.lm_head, converted.caches,
            converted.tied)


@pytest.mark.slow
def test_a_cache_the_planner_does_not_understand_is_said_not_guessed(tmp_path):
    from transformers import DeepseekV3Config

    # latent attention (MLA): the planner knows its weights from the skeleton, not its cache's shape
    DeepseekV3Config(vocab_size=1000, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                     num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32,
                     qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16).save_pretrained(tmp_path)
    text = meshd_plan("--model", str(tmp_path), "--node", "1GiB", "--node", "1GiB")
    assert text.returncode == 0, text.stderr
    assert "Sessions not estimated: deepseek_v3: latent (MLA) attention caches are not understood" in text.stdout
    plan = plan_of("--model", str(tmp_path), "--node", "1GiB", "--node", "1GiB")
    assert plan["sessions"] is None and plan["kv_bytes_per_token_per_layer"] is None
    assert all(n["sessions"] is None and "--kv-max-sessions" not in n["command"] for n in plan["nodes"])
    dense, moe = plan["layer_bytes"][0], plan["layer_bytes"][1]
    assert dense != moe and plan["layer_bytes"][1:] == [moe, moe]  # layer 0 dense, then MoE


# ---- the split ---------------------------------------------------------------------------------------


def synthetic(layer_values: list[int], *, per_token: list[int] | None = None, embeddings: int = 1000,
              lm_head: int = 0) -> ModelFootprint:
    """A model of the given per-layer sizes (values of Linear weights with 100 inputs each; float32 bytes are
    4x), full attention everywhere."""
    per_token = per_token or [8] * len(layer_values)
    return ModelFootprint(
        name="synthetic", model_type="llama", source="config only",
        layers=tuple(PartValues(linear=v, linear_rows=v // 100) for v in layer_values),
        embeddings=PartValues(plain=embeddings),
        final_norm=PartValues(plain=10), lm_head=PartValues(plain=lm_head), tied=not lm_head, max_positions=4096,
        caches=tuple(LayerCache("full_attention", values_per_token=t) for t in per_token))


def test_alike_layers_go_in_proportion_to_memory_left_after_reserve_and_embeddings():
    footprint = synthetic([1000] * 40)
    fixed = 512 + 4 * 1000  # reserve and embeddings, float32
    usable = [400_000, 300_000, 200_000, 100_000]
    plan = plan_mesh(footprint, [u + fixed for u in usable], Precision(), context=64, reserve=512)
    assert [n.end - n.start for n in plan.nodes] == [16, 12, 8, 4]
    assert [(n.start, n.end) for n in plan.nodes] == [(0, 16), (16, 28), (28, 36), (36, 40)]


def test_the_split_holds_the_most_sessions_any_contiguous_split_could():
    footprint = synthetic([900, 300, 1200, 500, 800, 400, 1500, 600], per_token=[8, 40, 8, 16, 64, 8, 24, 8])
    memories, reserve, context = [600_000, 450_000, 300_000], 2_000, 32
    plan = plan_mesh(footprint, memories, Precision(), context=context, reserve=reserve)
    assert plan.fits and plan.sessions > 0
    best = 0
    for cuts in itertools.combinations(range(1, 8), 2):
        bounds = list(zip((0, *cuts), (*cuts, 8)))
        sessions = []
        for memory, (start, end) in zip(memories, bounds):
            room = memory - reserve - sum(footprint.weights_bytes(start, end, Precision()).values())
            sessions.append(room // footprint.session_bytes(start, end, Precision(), context) if room >= 0 else -1)
        best = max(best, min(sessions))
    assert plan.sessions == best
    for node in plan.nodes:  # what each node is told matches its own arithmetic
        assert node.kv_room == node.memory - reserve - node.weights_total >= 0
        assert node.sessions == node.kv_room // node.session_bytes


def test_a_model_that_does_not_fit_says_by_how_much_and_what_would():
    footprint = synthetic([250_000] * 20, lm_head=2000)  # 1 MB per layer in float32
    plan = plan_mesh(footprint, [6_000_000, 4_000_000], Precision(), context=64, reserve=100_000)
    assert not plan.fits
    needed = 20 * 1_000_000 + 2 * (100_000 + 4000) + 40 + 8000
    assert plan.shortfall == needed - 10_000_000 and "short" in plan.problem
    extra = plan.extra_node
    assert plan_mesh(footprint, [6_000_000, 4_000_000, extra], Precision(), context=64, reserve=100_000).fits
    assert not plan_mesh(footprint, [6_000_000, 4_000_000, extra - GIB], Precision(), context=64,
                         reserve=100_000).fits
    by_precision = {str(a.precision): a for a in plan.alternatives}
    assert set(by_precision) == {"bfloat16", "float32 + int8", "bfloat16 + int8", "float32 + int4"}
    for alternative in plan.alternatives:
        again = plan_mesh(footprint, [6_000_000, 4_000_000], alternative.precision, context=64, reserve=100_000)
        assert (again.fits, again.sessions) == (alternative.fits, alternative.sessions)
    assert not by_precision["bfloat16"].fits and by_precision["float32 + int8"].fits


def test_a_node_too_small_for_one_layer_is_named():
    plan = plan_mesh(synthetic([1000] * 8), [1 * MIB, 4000 + 512 + 100], Precision(), context=16, reserve=512)
    assert not plan.fits and plan.problem.startswith("node 1 ") and plan.extra_node is None


# ---- predictions against real nodes -----------------------------------------------------------------


def start_nodes(model, plan: dict) -> list[Daemon]:
    """A mesh of the planned nodes, each with the session cache budget its plan gives it."""
    return start_mesh(model, [(node["layers"], ["--kv-max-bytes", str(node["kv_max_bytes"])])
                              for node in plan["nodes"]])


@pytest.mark.slow
def test_tiny_untied_model_weights_match_three_running_nodes(tiny_model):
    model = tiny_model("llama")  # untied: the tail holds an LM head as large as the embeddings
    plan = plan_of("--model", str(model), "--node", "12.9MB", "--node", "12.8MB", "--node", "25.4MB",
                   "--reserve", "1", "--context", "16")
    assert plan["fits"] and [n["layers"] for n in plan["nodes"]] == ["0-1", "2-2", "3-3"]
    nodes = start_nodes(model, plan)
    try:
        # at start only the node with layer 0 has loaded the embeddings (any other loads them when it heads)
        for i, (node, planned) in enumerate(zip(nodes, plan["nodes"])):
            loaded = node.get("/v1/status")["weights_bytes"]
            assert loaded == planned["weights_bytes"] | ({} if i == 0 else {"embeddings": 0}), (i, loaded)
        for node in nodes[1:]:
            status, body = node.chat({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
            assert status == 200, body
        for node, planned in zip(nodes, plan["nodes"]):
            loaded = node.get("/v1/status")["weights_bytes"]
            assert abs(sum(loaded.values()) - planned["weights_total_bytes"]) <= 0.05 * planned["weights_total_bytes"]
            assert loaded == planned["weights_bytes"]
    finally:
        for node in nodes:
            node.stop()


@pytest.mark.slow
def test_builtin_model_weights_and_cache_match_two_running_nodes(default_model):
    plan = plan_of("--node", "1GiB", "--node", "768MiB", "--context", "512")
    assert plan["fits"] and plan["model"]["tied_embeddings"]
    tail, per_token = plan["nodes"][-1], plan["kv_bytes_per_token_per_layer"]
    assert tail["weights_bytes"]["final_norm_and_lm_head"] == plan["final_norm_bytes"]  # tied: no LM head of its own
    nodes = start_nodes(default_model, plan)
    try:
        for node, planned in zip(nodes, plan["nodes"]):  # the head has layer 0; the tied tail needs the embeddings
            loaded = node.get("/v1/status")["weights_bytes"]
            assert abs(sum(loaded.values()) - planned["weights_total_bytes"]) <= 0.05 * planned["weights_total_bytes"]
            assert sum(loaded.values()) == planned["weights_total_bytes"], (loaded, planned["weights_bytes"])
        footprint = read_footprint(str(default_model))
        start, end = tail["start"], tail["last"] + 1
        # a prefill alone: the cache is exactly the prompt's tokens times the per-token prediction
        status, body = nodes[0].chat({"messages": [{"role": "user", "content": "Name three rivers."}],
                                      "max_tokens": 1})
        assert status == 200, body
        prompt = body["usage"]["prompt_tokens"]
        (session,) = nodes[1].get("/v1/sessions")["sessions"]
        assert session["past_len"] == prompt
        assert session["bytes"] == prompt * sum(per_token[start:end]) == tail["kv_bytes_per_token"] * prompt
        for node in nodes:  # the next prompt must be prefilled, not forked from this one (a copy is exact-size)
            for kept in node.get("/v1/sessions")["sessions"]:
                http_json("DELETE", f"{node.url}/v1/sessions/{kept['session_id']}")
        # decoding on: the buffer grows once with room to spare, as the growth rule predicts
        status, body = nodes[0].chat({"messages": [{"role": "user", "content": "Name four lakes."}],
                                      "max_tokens": 5, "ignore_eos": True})
        assert status == 200, body
        prompt = body["usage"]["prompt_tokens"]
        session = next(s for s in nodes[1].get("/v1/sessions")["sessions"] if s["past_len"] == prompt + 4)
        assert session["bytes"] == footprint.cache_bytes_after(start, end, Precision(), prompt, prompt + 4)
        assert session["bytes"] > tail["kv_bytes_per_token"] * (prompt + 4)
        assert session["bytes"] <= tail["session_bytes"]  # within what the plan budgets per session
    finally:
        for node in nodes:
            node.stop()


# ---- predictions against in-process shards ----------------------------------------------------------

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_next", "mistral", "phi3", "gemma2", "gemma3_text")


@pytest.mark.parametrize("arch", [pytest.param(a, marks=() if a == "llama" else pytest.mark.slow) for a in ARCHS])
def test_bfloat16_weights_and_caches_match_real_shards(tiny_model, arch):
    import torch

    from daemon.model.kvcache import cache_nbytes
    from daemon.model.shard import ModelShard

    folder = tiny_model(arch)
    footprint = read_footprint(str(folder))
    bf16 = Precision("bfloat16")
    for start, end in ((0, 2), (1, 4)):
        shard = ModelShard(folder, start, end, dtype=torch.bfloat16)
        assert sum(shard.loaded_bytes().values()) == sum(footprint.weights_bytes(start, end, bf16).values())
        # a prefill of 6 tokens, then 6 steps: past the sliding windows (4) and the first growth of full layers
        cache = shard.new_cache()
        hidden = torch.randn(1, 6, shard.info.hidden_size, dtype=torch.bfloat16)
        shard.run_layers(hidden, start_layer=start, past_len=0, cache=cache)
        assert cache_nbytes(cache) == footprint.cache_bytes_after(start, end, bf16, 6, 6)
        for past in range(6, 12):
            shard.run_layers(hidden[:, :1], start_layer=start, past_len=past, cache=cache)
            assert cache_nbytes(cache) == footprint.cache_bytes_after(start, end, bf16, 6, past + 1), past
        assert cache_nbytes(cache) <= footprint.session_bytes(start, end, bf16, 12)


def test_builtin_model_in_bfloat16_matches_a_real_shard(default_model):
    import torch

    from daemon.model.shard import ModelShard

    footprint = read_footprint(str(default_model))
    shard = ModelShard(default_model, 20, 30, head=False, dtype=torch.bfloat16)  # the tied tail holds the embeddings
    assert sum(shard.loaded_bytes().values()) == sum(footprint.weights_bytes(20, 30, Precision("bfloat16")).values())


@pytest.mark.slow  # loads and quantizes the built-in model's tail: 5 s of the fast subset's 3 min
def test_builtin_model_int8_tail_matches_a_real_shard(default_model):
    """The int8 method's tail holds an int8 copy of the tied LM head (and lets the embeddings go until it heads)."""
    from daemon.model.shard import ModelShard

    want = read_footprint(str(default_model)).weights_bytes(20, 30, Precision("float32", "int8"))
    loaded = ModelShard(default_model, 20, 30, head=False, kv_cache=False, quantize="int8").loaded_bytes()
    assert loaded == want | {"embeddings": 0}
    assert want["final_norm_and_lm_head"] == 49152 * (576 + 2) + 576 * 4


@pytest.mark.parametrize("arch", [pytest.param(a, marks=() if a == "llama" else pytest.mark.slow)
                                  for a in ("llama", "qwen3_moe", "qwen3_next")])
def test_quantized_counts_are_the_linear_weights_of_the_loaded_layers(tiny_model, arch):
    import torch

    from daemon.model.quantize import parameter_bytes
    from daemon.model.shard import ModelShard

    folder = tiny_model(arch)
    for method in ("int8", "int8-torchao", "int4"):  # against the bytes real quantized shards hold, layer by layer
        shard = ModelShard(folder, 0, 4, head=False, dtype=torch.bfloat16, quantize=method)
        assert read_footprint(str(folder)).layer_bytes(Precision("bfloat16", method)) == [
            parameter_bytes([layer], set()) for layer in shard.model.model.layers]


# ---- the report ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_table_and_the_json_propose_the_same_commands(tiny_model):
    model = str(tiny_model("qwen3_next"))
    args = ["--model", model, "--node", "40MB", "--node", "40MB", "--dtype", "bfloat16", "--reserve", "10MB"]
    text = meshd_plan(*args)
    assert text.returncode == 0, text.stderr
    plan = plan_of(*args)
    assert [f"  node {i}: {n['command']}" for i, n in enumerate(plan["nodes"])] == \
           [line for line in text.stdout.splitlines() if line.startswith("  node ")]
    assert f"The mesh holds {plan['sessions']} sessions of 1024 tokens" in text.stdout
    assert "linear-attention" in text.stdout and "per session per layer" in text.stdout
    for node in plan["nodes"]:
        assert f"--layers {format_layers(node['start'], node['last'] + 1)} --dtype bfloat16" in node["command"]
        assert f"--kv-max-bytes {node['kv_max_bytes']}" in node["command"]


@pytest.mark.slow
def test_a_model_that_does_not_fit_exits_1_with_what_would(tmp_path):
    from transformers import LlamaConfig

    # 8 layers of 16.8 MB in float32, and small embeddings: 134 MB of layers on 112 MiB
    LlamaConfig(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=8, vocab_size=1000).save_pretrained(tmp_path)
    result = meshd_plan("--model", str(tmp_path), "--node", "64MiB", "--node", "48MiB", "--reserve", "1")
    assert result.returncode == 1, result.stderr
    assert "Does not fit:" in result.stdout and "short" in result.stdout
    assert "another node of 1 GiB" in result.stdout and "with --dtype bfloat16: fits" in result.stdout
