"""A node's memory follows its layers in its compute dtype: real meshd processes on a synthetic bfloat16
Llama-shaped model large enough to tell (16 layers of 22.5 MB), their peak resident set (VmHWM) read
from /proc and from their own /v1/status.

Two nodes hosting 4 and 12 middle layers (no embeddings, no LM head) differ by 8 layers: the
difference of their peaks is what those 8 layers cost, the runtime's fixed baseline cancelling out.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.support.meshd import Daemon
from tests.support.tiny_models import TOKENIZER_FILES, VOCAB

SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
             num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=2048, tie_word_embeddings=True)
PEAK_PER_BYTE = 1.2  # a node's peak may exceed its layers' bytes in the compute dtype by a fifth, no more


@pytest.fixture(scope="module")
def synthetic_bfloat16(tmp_path_factory, default_model):
    """A random-weight Llama of ``SHAPE`` saved in bfloat16, with the built-in model's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _saved(LlamaForCausalLM, LlamaConfig(**SHAPE), tmp_path_factory.mktemp("synthetic-bf16"), default_model)


def _saved(model_class, config, dest, default_model):
    """``(dest, bytes of one layer)``: a random-weight ``model_class`` of ``config`` saved in bfloat16 into ``dest``
    with the built-in model's tokenizer."""
    import torch

    torch.manual_seed(0)
    model = model_class._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(dest)
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    del model
    for name in TOKENIZER_FILES:
        if (default_model / name).exists():
            shutil.copy(default_model / name, dest / name)
    return dest, layer_bytes


def peak_rss_bytes(daemon: Daemon) -> int:
    with open(f"/proc/{daemon.proc.pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def loaded(folder, layer_ranges: list[str], dtype: str, tmp_path) -> list[tuple[int, dict]]:
    """Start a node for each of ``layer_ranges`` in ``dtype`` (side by side: each peak is its own process's), and
    return each one's peak resident set and its status."""
    nodes = [Daemon(folder, layers, dtype=dtype, log_dir=tmp_path) for layers in layer_ranges]
    try:
        for node in nodes:
            node.wait_ready()
        statuses = [node.get("/v1/status") for node in nodes]  # first: serving the request may raise a peak
        return [(peak_rss_bytes(node), status) for node, status in zip(nodes, statuses)]
    finally:
        for node in nodes:
            node.stop()


@pytest.mark.slow
def test_a_node_peaks_at_its_layers_bytes_in_bfloat16(synthetic_bfloat16, tmp_path):
    folder, layer_bytes = synthetic_bfloat16
    (small_peak, small), (large_peak, large) = loaded(folder, ["1-4", "1-12"], "bfloat16", tmp_path)
    assert small["weights_bytes"] == {"layers": 4 * layer_bytes, "final_norm_and_lm_head": 0, "embeddings": 0}
    assert large["weights_bytes"]["layers"] == 12 * layer_bytes
    extra_bytes = 8 * layer_bytes
    print(f"8 more bfloat16 layers ({extra_bytes / 2**20:.0f} MiB): peak {small_peak / 2**20:.0f} -> "
          f"{large_peak / 2**20:.0f} MiB, {(large_peak - small_peak) / extra_bytes:.2f}x their bytes")
    assert large_peak - small_peak <= PEAK_PER_BYTE * extra_bytes
    # each node reports the same peak as /proc saw (its own reading came a moment earlier, so no higher)
    assert small["memory"]["peak_rss_bytes"] <= small_peak
    assert large["memory"]["peak_rss_bytes"] >= large["memory"]["rss_bytes"] > large["weights_bytes"]["layers"]
    # each reports its runtime, read before its first weight: the same whatever the layers, and its weights on top
    runtimes = [small["memory"]["runtime_rss_bytes"], large["memory"]["runtime_rss_bytes"]]
    assert max(runtimes) < 1.1 * min(runtimes)
    for peak, status in ((small_peak, small), (large_peak, large)):
        assert peak - status["memory"]["runtime_rss_bytes"] >= status["weights_bytes"]["layers"]


@pytest.mark.slow
def test_float32_on_the_same_checkpoint_costs_twice_the_bytes(synthetic_bfloat16, tmp_path):
    """The same bfloat16 checkpoint computed in float32 holds each weight in 4 bytes: twice the peak per layer."""
    folder, layer_bytes = synthetic_bfloat16
    (small_peak, small), (large_peak, large) = loaded(folder, ["1-4", "1-12"], "float32", tmp_path)
    assert large["weights_bytes"]["layers"] - small["weights_bytes"]["layers"] == 2 * 8 * layer_bytes
    assert large_peak - small_peak <= PEAK_PER_BYTE * 2 * 8 * layer_bytes


MOE_SHAPE = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=512, num_experts=16,
                 num_experts_per_tok=2, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                 head_dim=64, vocab_size=VOCAB, max_position_embeddings=2048, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def synthetic_moe(tmp_path_factory, default_model):
    """A random-weight Qwen3-MoE of ``MOE_SHAPE`` saved in bfloat16: its checkpoint holds each expert's matrices
    apart, which transformers' loader fuses into one tensor per layer (new memory, beside the file's pages)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return _saved(Qwen3MoeForCausalLM, Qwen3MoeConfig(**MOE_SHAPE), tmp_path_factory.mktemp("synthetic-moe"),
                  default_model)


@pytest.mark.slow
def test_a_node_of_fused_experts_holds_them_once(synthetic_moe, tmp_path):
    """Fused experts are new memory: the checkpoint's pages they came from are let go, not kept mapped beside them."""
    folder, layer_bytes = synthetic_moe
    (small_peak, small), (large_peak, large) = loaded(folder, ["1-2", "1-6"], "bfloat16", tmp_path)
    assert large["weights_bytes"]["layers"] - small["weights_bytes"]["layers"] == 4 * layer_bytes
    extra_bytes = 4 * layer_bytes
    print(f"4 more MoE layers ({extra_bytes / 2**20:.0f} MiB): peak {small_peak / 2**20:.0f} -> "
          f"{large_peak / 2**20:.0f} MiB, {(large_peak - small_peak) / extra_bytes:.2f}x their bytes")
    assert large_peak - small_peak <= PEAK_PER_BYTE * extra_bytes



@pytest.mark.slow  # two fresh processes loading a model: 12 s
@pytest.mark.parametrize("quantize, imported", [((), False), (("--quantize", "int8"), True)])
def test_only_an_int8_node_imports_torchao(tiny_model, quantize, imported):
    """transformers would import torchao as it loads any model wherever torchao is installed; a node tells it
    not to, and only the int8 methods import it, themselves. Loaded as meshd loads a node, in a fresh process."""
    program = ("import sys; from daemon.cli import load_node; "
               "load_node(sys.argv[1:]); print('torchao' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", program, "--model", str(tiny_model("llama")), *quantize],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == str(imported)
