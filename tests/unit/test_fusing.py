"""Experts stacked straight into their fused tensor (``daemon.model.fusing``): the tensor transformers' own
stack-then-join makes, bit for bit, and a node loading large MoE layers peaks at their bytes, not twice them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

from daemon.model.fusing import StackExperts, fuse_in_place

GATE, UP = "mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"


def _experts(count: int, shape: tuple[int, int], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).to(torch.bfloat16) for _ in range(count)]


def _transformers_way(ops, lists: dict[str, list[torch.Tensor]], target: str) -> torch.Tensor:
    collected = {k: list(v) for k, v in lists.items()}
    for op in ops:
        collected = op.convert(collected, source_patterns=list(lists), target_patterns=[target])
    return collected[target]


@pytest.mark.parametrize("concat_dim", [1, 2])
def test_gate_and_up_stack_as_merge_then_concatenate(concat_dim):
    lists = {GATE: _experts(5, (6, 4), seed=1), UP: _experts(5, (6, 4), seed=2)}
    want = _transformers_way([MergeModulelist(dim=0), Concatenate(dim=concat_dim)], lists,
                             "mlp.experts.gate_up_proj")
    got = StackExperts(concat_dim).convert({k: list(v) for k, v in lists.items()}, source_patterns=[GATE, UP],
                                           target_patterns=["mlp.experts.gate_up_proj"])
    assert list(got) == ["mlp.experts.gate_up_proj"]
    assert got["mlp.experts.gate_up_proj"].shape == want.shape
    assert torch.equal(got["mlp.experts.gate_up_proj"], want)


def test_a_lone_merge_stacks_the_same():
    down = "mlp.experts.*.down_proj.weight"
    lists = {down: _experts(3, (4, 6), seed=3)}
    want = _transformers_way([MergeModulelist(dim=0)], lists, "mlp.experts.down_proj")
    got = StackExperts().convert({down: list(lists[down])}, source_patterns=[down],
                                 target_patterns=["mlp.experts.down_proj"])["mlp.experts.down_proj"]
    assert torch.equal(got, want)


def test_experts_that_differ_are_refused():
    lists = {GATE: _experts(2, (6, 4), seed=1), UP: _experts(2, (6, 5), seed=2)}  # up has another input width
    with pytest.raises(ValueError, match="differ"):
        StackExperts(1).convert(lists, source_patterns=[GATE, UP], target_patterns=["mlp.experts.gate_up_proj"])


def test_only_expert_stacking_is_swapped():
    pair = WeightConverter([GATE, UP], "mlp.experts.gate_up_proj", [MergeModulelist(dim=0), Concatenate(dim=1)])
    lone = WeightConverter("mlp.experts.*.down_proj.weight", "mlp.experts.down_proj", [MergeModulelist(dim=0)])
    other = WeightConverter("attn.qkv.weight", ["attn.q.weight", "attn.k.weight"], [MergeModulelist(dim=1)])
    swapped = [fuse_in_place(t) for t in (pair, lone, other)]
    assert [type(op) for t in swapped[:2] for op in t.operations] == [StackExperts, StackExperts]
    assert [op.concat_dim for t in swapped[:2] for op in t.operations] == [1, None]
    assert swapped[2] is other
    assert [type(op) for op in pair.operations] == [MergeModulelist, Concatenate]  # the model's own mapping is kept


# A node process loading two large MoE layers: its resident set from just before the load (peak reset there) to
# the load's peak, against the bytes it holds. transformers' stack-then-join peaked near 1.75x here.
MOE = dict(hidden_size=1024, intermediate_size=1024, moe_intermediate_size=512, num_experts=64, num_experts_per_tok=2,
           num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=256,
           max_position_embeddings=512, tie_word_embeddings=True)

LOAD = """
import json, sys, torch
import transformers.models.qwen3_moe.modeling_qwen3_moe  # the model's code, imported before the peak is reset
from daemon.model.shard import ModelShard

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

torch.set_num_threads(1)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident set starts again from here
before = status("VmRSS")
# no session caches: no load-time probe runs a step, so what grows is what loading holds
shard = ModelShard(sys.argv[1], 0, 2, head=False, kv_cache=False, dtype=torch.bfloat16, quantize=sys.argv[2] or None)
held = sum(p.numel() * p.element_size() for p in shard.model.parameters() if p.device.type != "meta")
print(json.dumps({"growth": status("VmHWM") - before, "held": held}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("quantize", ["", "int4"])
def test_a_node_loading_large_moe_layers_peaks_at_their_bytes(tmp_path, quantize):
    """In bfloat16 the layers load in their own bytes; in 4 bits too, each expert quantized as it is stacked:
    a layer's float experts (4x its 4-bit stacks) are never whole in memory."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    Qwen3MoeForCausalLM._from_config(Qwen3MoeConfig(**MOE), dtype=torch.bfloat16).save_pretrained(tmp_path)
    out = subprocess.run([sys.executable, "-c", LOAD, str(tmp_path), quantize], capture_output=True, text=True,
                         check=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    ratio = measured["growth"] / measured["held"]
    print(f"2 MoE layers{' in ' + quantize if quantize else ''}, {measured['held'] / 2**20:.0f} MiB: load grew the "
          f"peak by {measured['growth'] / 2**20:.0f} MiB, {ratio:.2f}x")
    # the experts: 2 x 64 x 3 matrices of 1024 x 512, 1 MiB each in bfloat16 (192 MiB a layer), 0.28 in 4 bits
    if not quantize:
        assert measured["held"] > 350 << 20
        assert ratio <= 1.15
    else:  # 4-bit stacks, and at most a few matrices' float temporaries (and the heap they leave) beside them
        assert measured["held"] > 100 << 20
        assert measured["growth"] - measured["held"] < 64 << 20  # stacking whole in bfloat16 first: over 192
