"""Real layer sizes: random-weight models shaped like the ones users split, a node's decode step against the
machine's read-bandwidth floor.

A decode step reads every active weight once, so the least time it can take is those bytes over the rate this
machine reads memory. :func:`read_bandwidth` measures that rate (a sum over a buffer far larger than any
cache); :func:`build` writes a few layers of a real model's shapes with random weights (once, into the meshnet
cache); :func:`measure` runs one ``meshd`` with all of them and sets its decode step against the floor.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from daemon.bench.mesh import Mesh
from daemon.bench.progress import say

MARKER = "meshnet-bench-shape.json"  # written last: the folder is complete, with its byte counts
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class Shape:
    """A few decoder layers of a real model, at its real sizes, with the built-in model's tokenizer (vocab 49152)."""

    name: str
    about: str
    config: dict  # transformers config fields; "model_type" picks the class


SHAPES = {
    "llama-8b": Shape(
        "llama-8b", "4 layers shaped like Llama-3-8B (hidden 4096, intermediate 14336, 32 heads, 8 KV heads)",
        {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 4,
         "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0}),
    "qwen3.5-moe": Shape(
        "qwen3.5-moe", "2 layers shaped like Qwen3.5-35B-A3B (256 experts, 8 routed + 1 shared; one gated delta "
        "net layer, one gated attention layer)",
        {"model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 2,
         "layer_types": ["linear_attention", "full_attention"], "num_attention_heads": 16,
         "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
         "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
         "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
         "shared_expert_intermediate_size": 512}),
}


def read_bandwidth(threads: int, size_bytes: int = 2 << 30, rounds: int = 5) -> float:
    """Bytes per second this machine reads: a float32 sum over ``size_bytes`` on ``threads`` threads, the
    fastest of ``rounds`` (the first, which faults the pages in, not counted)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(size_bytes // 4)
        times = []
        for _ in range(rounds + 1):
            started = time.perf_counter()
            float(buffer.sum())
            times.append(time.perf_counter() - started)
        return size_bytes / min(times[1:])
    finally:
        torch.set_num_threads(before)


def build(shape: Shape, folder: Path, tokenizer_from: Path) -> dict:
    """``shape`` with random bfloat16 weights saved in ``folder`` (once: a complete folder is reused); its
    record: the weights' bytes and the bytes one decode step reads (every weight, only the routed share of
    the experts, one row of the embedding)."""
    marker = folder / MARKER
    if marker.exists():
        return json.loads(marker.read_text())
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    say(f"writing {shape.about} with random weights into {folder} (once)")
    fields = dict(shape.config)
    config = AutoConfig.for_model(fields.pop("model_type"), vocab_size=49152, bos_token_id=1, eos_token_id=2,
                                  pad_token_id=2, tie_word_embeddings=False, max_position_embeddings=4096, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    routed = getattr(config, "num_experts_per_tok", 0) / max(getattr(config, "num_experts", 0) or 1, 1)
    total = active = 0
    for name, parameter in model.named_parameters():
        size = parameter.numel() * parameter.element_size()
        total += size
        if name.endswith("embed_tokens.weight"):
            active += size // parameter.shape[0]  # one row per token
        elif ".experts." in name:
            active += round(size * routed)  # the routed experts' share (the shared expert is read whole)
        else:
            active += size
    if folder.exists():
        shutil.rmtree(folder)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, folder / name)
    record = {"shape": shape.name, "about": shape.about, "weights_bytes": total, "active_bytes": active}
    marker.write_text(json.dumps(record))
    return record


def quantized_active_bytes(shape: Shape, folder: Path, quantize: str) -> int:
    """The bytes one decode step reads from ``folder``'s weights quantized with ``quantize`` (bfloat16 compute), as
    sizing counts a node's weights (:mod:`daemon.model.footprint`): its layers but only the routed share of their
    fused experts, the final norm and LM head, one row of the embedding."""
    from daemon.model.footprint import INT4_BLOCK, Precision, read_footprint

    footprint = read_footprint(str(folder))
    precision = Precision("bfloat16", quantize)
    parts = footprint.weights_bytes(0, footprint.num_layers, precision)
    experts = sum(layer.experts for layer in footprint.layers)
    expert_bytes = experts // 2 + experts // INT4_BLOCK * 2 if quantize == "int4" else experts * 2
    routed = shape.config.get("num_experts_per_tok", 0) / max(shape.config.get("num_experts", 0) or 1, 1)
    return (parts["layers"] - round(expert_bytes * (1 - routed)) + parts["final_norm_and_lm_head"]
            + parts["embeddings"] // 49152)


def measure(shape: Shape, record: dict, folder: Path, tokens: int, threads: int | None,
            bandwidth_threads: int, rounds: int = 3, quantize: str | None = None) -> dict:
    """One ``meshd`` with every layer of ``folder`` in bfloat16 (its layers quantized with ``quantize`` if given):
    its decode steps against the floor, and its peak resident set against its weights.

    A shared host's read rate moves by as much as 2x from one minute to the next, so the step and the floor are
    measured side by side: ``rounds`` times, the machine's bandwidth (on ``bandwidth_threads``, the node idle), a
    generation of ``tokens``, the bandwidth again. Each round's floor is the active bytes at the faster of its two
    readings; the row's ratio is the median of the rounds' ratios (floor over the round's median step)."""
    name = shape.name + (f" {quantize}" if quantize else "")
    active = quantized_active_bytes(shape, folder, quantize) if quantize else record["active_bytes"]
    mesh = Mesh(f"real size, {name}", [(f"0-{shape.config['num_hidden_layers'] - 1}", [])], str(folder),
                threads, node_args=["--dtype", "bfloat16", *(["--quantize", quantize] if quantize else [])])
    steps: list[float] = []
    readings: list[list[float]] = []
    ratios: list[float] = []
    try:
        mesh.generate(4)  # warm-up
        for _ in range(rounds):
            before = read_bandwidth(bandwidth_threads)
            result = mesh.measure(tokens)
            after = read_bandwidth(bandwidth_threads)
            readings.append([before, after])
            steps.extend(result["step_ms"])
            ratios.append(active / max(before, after) * 1000.0 / statistics.median(result["step_ms"]))
        node = mesh.memory()[0]
    finally:
        mesh.stop()
    middle = sorted(range(rounds), key=lambda r: ratios[r])[rounds // 2]  # the round whose ratio is the median
    bandwidth = max(readings[middle])
    return {"shape": name, "about": shape.about, "quantize": quantize, "weights_bytes": node["weights_bytes"]
            if quantize else record["weights_bytes"], "active_bytes": active, "bandwidth_bytes_per_s": bandwidth,
            "bandwidth_readings": readings, "floor_ms": active / bandwidth * 1000.0,
            "step_ms_median": statistics.median(steps), "step_ms_best": min(steps), "of_floor": ratios[middle],
            "of_floor_rounds": ratios, "decode_tps": result["decode_tps"], "peak_rss_bytes": node["peak_rss_bytes"],
            "node_weights_bytes": node["weights_bytes"],
            "peak_over_weights": (node["peak_rss_bytes"] / node["weights_bytes"]
                                  if node["peak_rss_bytes"] and node["weights_bytes"] else None),
            "runtime_rss_bytes": node["runtime_rss_bytes"],
            # the peak less the process before its weights (Python, torch, transformers: the same few hundred MiB
            # whatever the model), over the weights: 1.0 where a node holds its weights once and nothing more
            "rest_over_weights": ((node["peak_rss_bytes"] - node["runtime_rss_bytes"]) / node["weights_bytes"]
                                  if node["peak_rss_bytes"] and node["runtime_rss_bytes"] and node["weights_bytes"]
                                  else None),
            "load": os.getloadavg()[0]}
