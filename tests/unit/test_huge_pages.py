"""Weights on huge pages: a node whose torch allocates on them (``THP_MEM_ALLOC_ENABLE``, which meshd sets) copies its
layers' weights out of the checkpoint's file mapping, a part at a time, the small ones packed into an arena's chunks
(``WeightArena``), and holds them once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from daemon.host import (
    HUGE_PAGE,
    TORCH_HUGE_PAGES,
    WEIGHT_ALIGN,
    WeightArena,
    copy_out_of_file,
    file_mappings,
    huge_pages_preferred,
    in_file_mapping,
    prefer_huge_pages,
)
from daemon.model.checkpoint import COPY_BYTES, own_memory
from tests.support.tiny_models import TOKENIZER_FILES


def _mapped(tensor: torch.Tensor) -> bool:
    return in_file_mapping(tensor.data_ptr(), tensor.numel() * tensor.element_size(), file_mappings())


def test_own_memory_copies_a_mapped_weight_and_leaves_others(tmp_path):
    from safetensors import safe_open

    torch.manual_seed(0)
    weights = {"w": torch.randn(3 * COPY_BYTES // 4 + 5, dtype=torch.float32), "b": torch.randn(7)}  # parts of 16 MiB
    save_file(weights, tmp_path / "w.safetensors")
    handle = safe_open(str(tmp_path / "w.safetensors"), framework="pt")
    mapped = torch.nn.Parameter(handle.get_tensor("w"), requires_grad=False)
    small = torch.nn.Parameter(handle.get_tensor("b"), requires_grad=False)
    own = torch.nn.Parameter(torch.randn(4, 4), requires_grad=False)
    kept = own.data_ptr()
    assert _mapped(mapped.data) and _mapped(small.data)  # safetensors hands out the file's pages as they are
    own_memory([mapped, own, small], file_mappings())
    assert not _mapped(mapped.data) and torch.equal(mapped.data, weights["w"])
    assert not _mapped(small.data) and torch.equal(small.data, weights["b"])
    assert own.data_ptr() == kept  # already its own: without an arena, left where it is


def test_an_arena_packs_small_weights_onto_huge_page_chunks_from_a_file_or_memory(tmp_path):
    """Small weights, mapped or not, are copied exactly into chunks that begin on a huge page, one after another at
    cache-line boundaries; a large weight in memory of its own, and one copied already, stay where they are."""
    from safetensors import safe_open

    torch.manual_seed(0)
    weights = {"q": torch.randn(576, 576), "norm": torch.randn(576), "down": torch.randn(576, 1536)}
    save_file(weights, tmp_path / "w.safetensors")
    handle = safe_open(str(tmp_path / "w.safetensors"), framework="pt")
    mapped = [torch.nn.Parameter(handle.get_tensor(name), requires_grad=False) for name in weights]
    quantized = torch.nn.Parameter(torch.randint(-127, 128, (192, 577), dtype=torch.int8), requires_grad=False)
    scale = torch.nn.Parameter(torch.rand(192, dtype=torch.float16), requires_grad=False)
    large = torch.nn.Parameter(torch.randn(1 << 20), requires_grad=False)  # 4 MiB: the arena's largest here
    values = [p.data.clone() for p in (*mapped, quantized, scale, large)]
    arena = WeightArena(chunk_bytes=4 << 20, largest=4 << 20)
    large_at = large.data_ptr()
    own_memory([*mapped, quantized, scale, large], file_mappings(), arena=arena)
    packed = [*mapped, quantized, scale]
    for parameter, value in zip([*packed, large], values):
        assert parameter.dtype == value.dtype and torch.equal(parameter.data, value)
    assert not any(_mapped(p.data) for p in mapped)
    assert large.data_ptr() == large_at  # in memory of its own, and not small: left where it is
    assert not arena.takes(large.data) and all(arena.holds(p.data) for p in packed)
    chunks = {p.data.untyped_storage().data_ptr() for p in packed}
    assert len(chunks) == 2  # 1.3 + 0.002 + 3.4 MiB: the matrix that does not fit begins a second chunk
    starts = sorted(p.data_ptr() for p in packed)
    assert all(start % WEIGHT_ALIGN == 0 for start in starts)
    assert any(start % HUGE_PAGE == 0 for start in starts)  # a chunk's first weight begins on a huge page
    before = [p.data_ptr() for p in packed]
    own_memory(packed, file_mappings(), arena=arena)  # held already: not copied again
    assert [p.data_ptr() for p in packed] == before


def _file_resident() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssFile:"))


@pytest.mark.parametrize("transposed", [False, True])
def test_a_weight_copied_out_of_its_file_into_the_other_layout_is_exact_and_held_once(tmp_path, transposed):
    """The copy a relayout makes, either way round, is exact; a plain weight's file pages leave the resident set
    as its blocks are copied (a transposed view's blocks are no single range of memory: its pages are kept)."""
    from safetensors import safe_open

    torch.manual_seed(0)
    weight = torch.randn(768, 4096)  # 12 MiB
    save_file({"w": weight}, tmp_path / "w.safetensors")
    source = safe_open(str(tmp_path / "w.safetensors"), framework="pt").get_tensor("w")
    source = source.t() if transposed else source
    target = torch.empty(source.shape[::-1]).t()  # the other layout
    assert _mapped(source) and float(source.sum()) == pytest.approx(float(weight.sum()), rel=1e-4)  # pages read in
    before = _file_resident()
    copy_out_of_file(source, target, file_mappings(), block_bytes=1 << 20)
    assert torch.equal(target, weight.t() if transposed else weight)
    if not transposed:
        assert before - _file_resident() >= 0.95 * weight.numel() * 4


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_linears_let_go_of_their_file_pages_reading_the_mappings_once(tmp_path, monkeypatch, method):
    """A layer's linears read from a checkpoint's mapping, quantized: each one's file pages leave the resident set,
    and the process's mappings are read once for the layer, not once a linear (4 ms a read on a 2-core Xeon VM)."""
    from safetensors import safe_open

    from daemon.model import quantize

    torch.manual_seed(0)
    weights = {f"w{i}": torch.randn(512, 2048) for i in range(3)}  # 4 MiB each
    save_file(weights, tmp_path / "w.safetensors")
    handle = safe_open(str(tmp_path / "w.safetensors"), framework="pt")
    layer = torch.nn.Sequential(*(torch.nn.Linear(2048, 512, bias=False) for _ in weights))
    for linear, name in zip(layer, weights):
        linear.weight = torch.nn.Parameter(handle.get_tensor(name), requires_grad=False)
        assert _mapped(linear.weight) and float(linear.weight.sum()) == pytest.approx(float(weights[name].sum()))
    quantize.quantize_layers([torch.nn.Sequential(torch.nn.Linear(64, 32))], method)  # its imports read in before
    reads = []
    monkeypatch.setattr(quantize, "file_mappings", lambda: reads.append(1) or file_mappings())
    before = _file_resident()
    quantize.quantize_layers([layer], method)
    assert len(reads) == 1
    assert before - _file_resident() >= 0.95 * sum(w.numel() * 4 for w in weights.values())
    assert all(type(m) is not torch.nn.Linear for m in layer)


def test_huge_pages_are_preferred_unless_the_environment_says_otherwise(monkeypatch):
    monkeypatch.delenv(TORCH_HUGE_PAGES, raising=False)
    assert not huge_pages_preferred()
    prefer_huge_pages()
    assert os.environ[TORCH_HUGE_PAGES] == "1" and huge_pages_preferred()
    monkeypatch.setenv(TORCH_HUGE_PAGES, "0")
    prefer_huge_pages()
    assert os.environ[TORCH_HUGE_PAGES] == "0" and not huge_pages_preferred()


# A node process loading a tail (two large dense layers and an LM head) the way meshd does: its resident set from
# just before the load to the load's peak, the bytes of its layers' large weights, where they sit.
LOAD = """
import json, sys, torch
from daemon.host import file_mappings, in_file_mapping, prefer_huge_pages
prefer_huge_pages()  # as meshd's main does, before torch allocates anything large
import transformers.models.llama.modeling_llama  # the model's code, imported before the peak is reset
from daemon.model.shard import ModelShard

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

def anon_huge():
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("AnonHugePages:"))

torch.set_num_threads(1)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident set starts again from here
before, huge_before = status("VmRSS"), anon_huge()
shard = ModelShard(sys.argv[1], 1, 3, head=False, kv_cache=False, dtype=torch.bfloat16)
layers = shard.model.model.layers[1:3]
weights = [p for layer in layers for p in layer.parameters()]
mappings = file_mappings()
print(json.dumps({
    "growth": status("VmHWM") - before, "held": sum(p.numel() * p.element_size() for p in weights),
    "mapped": sum(in_file_mapping(p.data_ptr(), p.numel() * p.element_size(), mappings) for p in weights),
    "weights": len(weights), "huge": anon_huge() - huge_before}))
"""


def _load(folder: Path, huge_pages: str) -> dict:
    env = os.environ | {TORCH_HUGE_PAGES: huge_pages}
    out = subprocess.run([sys.executable, "-c", LOAD, str(folder)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _host_offers_huge_pages() -> bool:
    try:
        setting = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in setting


@pytest.mark.slow
def test_a_node_on_huge_pages_holds_its_weights_once_outside_the_file(tmp_path, default_model):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=1024, intermediate_size=8192, num_hidden_layers=3, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path)
    for name in TOKENIZER_FILES:  # the tail answers tokens as text
        if (default_model / name).exists():
            shutil.copy(default_model / name, tmp_path / name)
    # off, the weights stay in the file's mapping, untouched until a step reads them: what the load grows by is the
    # rest (the tokenizer, the model's skeleton)
    off, on = _load(tmp_path, "0"), _load(tmp_path, "1")
    copies = (on["growth"] - off["growth"]) / on["held"]
    print(f"a tail of 2 layers and an LM head, {on['held'] / 2**20:.0f} MiB of layer weights: the load grew "
          f"the peak by {off['growth'] / 2**20:.0f} MiB with them in the file, {on['growth'] / 2**20:.0f} MiB on huge "
          f"pages ({copies:.2f}x the weights more), {on['huge'] / 2**20:.0f} MiB of them huge")
    per_layer = 2 * (1024 * 1024) + 2 * (256 * 1024) + 3 * (8192 * 1024) + 2 * 1024  # q, o; k, v; the MLP; norms
    assert on["held"] == 2 * 2 * per_layer and on["weights"] == 2 * 9  # bfloat16, 2 layers
    assert off["mapped"] == off["weights"] and on["mapped"] == 0, (off, on)
    assert copies <= 1.1  # each part's file pages let go once copied: kept, they count beside the copies (1.98x)
    if _host_offers_huge_pages():
        assert on["huge"] >= 0.9 * on["held"]  # every weight, the small ones packed into an arena's chunks
