"""Real layer sizes: random-weight models shaped like the ones users split, a node's decode step against the
machine's read-bandwidth floor.

A decode step reads every active weight once, so the least time it can take is those bytes over the rate this
machine reads memory. :func:`read_bandwidth` measures that rate (a sum over a buffer far larger than any
cache); :func:`build` writes a few layers of a real model's shapes with random weights (once, into the meshnet
cache); :func:`measure` runs one ``meshd`` with all of them and sets its decode step against the floor.

A quantized node holds several times the layers of a bfloat16 one in the same memory, so a shape's quantized rows may
run a deeper sample (:attr:`Shape.deeper`, written by :func:`build_deeper`): its layers in the real model's order, about
the bytes its bfloat16 row holds. Its node's peak against its weights then says what a node that size holds, not
what the few hundred MiB of runtime weigh against a sample a quarter of that.
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
    deeper: Shape | None = None  # the sample its quantized rows run, if not this one: more of its layers


_QWEN35_MOE = {"model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_attention_heads": 16,
               "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
               "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
               "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
               "shared_expert_intermediate_size": 512}
_QWEN35_ORDER = ["linear_attention"] * 3 + ["full_attention"]  # the real model's 40 layers: this, ten times

SHAPES = {
    "llama-8b": Shape(
        "llama-8b", "4 layers shaped like Llama-3-8B (hidden 4096, intermediate 14336, 32 heads, 8 KV heads)",
        {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 4,
         "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0}),
    "qwen3.5-moe": Shape(
        "qwen3.5-moe", "2 layers shaped like Qwen3.5-35B-A3B (256 experts, 8 routed + 1 shared; one gated delta "
        "net layer, one gated attention layer)",
        {**_QWEN35_MOE, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]},
        deeper=Shape(
            "qwen3.5-moe-8", "8 layers shaped like Qwen3.5-35B-A3B in its order (3 gated delta net layers to each "
            "gated attention layer; 256 experts, 8 routed + 1 shared)",
            {**_QWEN35_MOE, "num_hidden_layers": 8, "layer_types": _QWEN35_ORDER * 2})),
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
    if folder.exists():
        shutil.rmtree(folder)
    model.save_pretrained(folder)
    _copy(tokenizer_from, folder, TOKENIZER_FILES)
    return _finish(shape, folder, ((name, p.shape[0], p.numel() * p.element_size())
                                   for name, p in model.named_parameters()))


def build_deeper(shape: Shape, source: Path, folder: Path) -> dict:
    """``shape.deeper`` saved in ``folder``, once, from ``shape``'s checkpoint in ``source`` (the one file
    :func:`build` writes). Each of its layers has random weights of its own, drawn with the mean and spread of the
    first layer of its kind in ``source`` (vectors such as a norm's weights copied); one file a layer, so no more
    than a layer is held while writing. Its record, as :func:`build`'s."""
    marker = folder / MARKER
    if marker.exists():
        return json.loads(marker.read_text())
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    deep = shape.deeper
    say(f"writing {deep.about} with random weights into {folder} (once)")
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    kinds = deep.config["layer_types"]
    first_of = {kind: shape.config["layer_types"].index(kind) for kind in kinds}
    generator = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    sizes: list[tuple[str, int, int]] = []  # each weight's name, rows and bytes

    def write(part: int, tensors: dict[str, torch.Tensor]) -> None:
        file = f"model-{part + 1:05d}-of-{len(kinds) + 1:05d}.safetensors"
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        sizes.extend((name, t.shape[0], t.numel() * t.element_size()) for name, t in tensors.items())

    with safe_open(str(source / "model.safetensors"), "pt") as checkpoint:
        names = list(checkpoint.keys())
        write(0, {name: checkpoint.get_tensor(name) for name in names if not name.startswith("model.layers.")})
        for layer, kind in enumerate(kinds):
            prefix = f"model.layers.{first_of[kind]}."
            write(layer + 1, {f"model.layers.{layer}.{name[len(prefix):]}": _redrawn(checkpoint.get_tensor(name),
                                                                                      generator)
                              for name in names if name.startswith(prefix)})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(size for *_, size in sizes)}, "weight_map": weight_map}, indent=2))
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": len(kinds), "layer_types": kinds},
                                                   indent=2))
    _copy(source, folder, (*TOKENIZER_FILES, "generation_config.json"))
    return _finish(deep, folder, sizes)


def _redrawn(tensor, generator):
    """Random values with ``tensor``'s shape, dtype, mean and spread; a vector (norms, gates' biases) as it is."""
    if tensor.dim() < 2:
        return tensor
    mean, spread = float(tensor.float().mean()), float(tensor.float().std())
    return tensor.new_empty(tensor.shape).normal_(mean, spread, generator=generator)


def _copy(source: Path, folder: Path, names) -> None:
    for name in names:
        if (source / name).exists():
            shutil.copy(source / name, folder / name)


def _finish(shape: Shape, folder: Path, weights) -> dict:
    """The record of ``shape`` in ``folder`` from its ``weights`` (``(name, rows, bytes)`` each):
    every weight's bytes, and those one decode step reads (every weight but only the routed share of the experts
    and one row of the embedding); written last, as the folder's marker."""
    routed = shape.config.get("num_experts_per_tok", 0) / max(shape.config.get("num_experts", 0) or 1, 1)
    total = active = 0
    for name, rows, size in weights:
        total += size
        if name.endswith("embed_tokens.weight"):
            active += size // rows  # one row per token
        elif ".experts." in name:
            active += round(size * routed)  # the routed experts' share (the shared expert is read whole)
        else:
            active += size
    record = {"shape": shape.name, "about": shape.about, "weights_bytes": total, "active_bytes": active}
    (folder / MARKER).write_text(json.dumps(record))
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
