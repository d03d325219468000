"""What a batched decode step costs against the same sessions' steps one at a time, in one process.

    .venv/bin/python scripts/batch_cost.py [--sessions 4] [--rounds 20] [--window 64]

Runs the built-in model, and two random-weight models of the same size beside it: one whose every layer has a
sliding window (Mistral's layout, ``--window`` positions), one with three gated delta net (linear attention)
layers to each full-attention one (Qwen3.5's layout); each as one shard of all its layers on this process's
torch thread. Sessions of different prompt lengths (some past the window) are prefilled, then each round
times their decode steps alone, one after another, and as one batch (``ModelShard.step_batch``), in turns.
Prints per model the median of each and the ratio: how many times the throughput of single steps a batch gives.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def _saved(config, built_in: Path, dest: Path) -> Path:
    """A random-weight model of ``config`` saved in ``dest`` with the built-in model's tokenizer."""
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(dest)
    for name in TOKENIZER_FILES:
        if (built_in / name).exists():
            shutil.copy(built_in / name, dest / name)
    return dest


def sliding_twin(built_in: Path, window: int, dest: Path) -> Path:
    """A random-weight Mistral-layout model with the built-in model's sizes and tokenizer, every layer windowed."""
    import transformers

    base = transformers.AutoConfig.from_pretrained(built_in)
    config = transformers.MistralConfig(
        vocab_size=base.vocab_size, hidden_size=base.hidden_size, intermediate_size=base.intermediate_size,
        num_hidden_layers=base.num_hidden_layers, num_attention_heads=base.num_attention_heads,
        num_key_value_heads=base.num_key_value_heads, head_dim=base.hidden_size // base.num_attention_heads,
        max_position_embeddings=base.max_position_embeddings, rms_norm_eps=base.rms_norm_eps,
        rope_theta=base.rope_parameters["rope_theta"], tie_word_embeddings=base.tie_word_embeddings,
        sliding_window=window, bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id)
    return _saved(config, built_in, dest)


def hybrid_twin(built_in: Path, dest: Path) -> Path:
    """A random-weight Qwen3.5-layout text model with the built-in model's sizes and tokenizer: three gated delta
    net (linear attention) layers to one full-attention layer."""
    import transformers

    base = transformers.AutoConfig.from_pretrained(built_in)
    heads = base.num_attention_heads
    config = transformers.Qwen3_5TextConfig(
        vocab_size=base.vocab_size, hidden_size=base.hidden_size, intermediate_size=base.intermediate_size,
        num_hidden_layers=base.num_hidden_layers, num_attention_heads=heads,
        num_key_value_heads=base.num_key_value_heads, head_dim=base.hidden_size // heads,
        linear_num_key_heads=base.num_key_value_heads, linear_num_value_heads=heads, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_conv_kernel_dim=4, max_position_embeddings=base.max_position_embeddings,
        tie_word_embeddings=base.tie_word_embeddings, bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id)
    return _saved(config, built_in, dest)


def measure(folder: Path, sessions: int, rounds: int, dtype: str, quantize: str | None) -> dict:
    import torch

    from daemon.api import Sampling
    from daemon.kvstore import SessionCacheStore
    from daemon.model.shard import DecodeStep, ModelShard

    greedy = Sampling()  # greedy
    shard = ModelShard(folder, 0, _layers(folder), sessions=SessionCacheStore(max_sessions=4 * sessions),
                       dtype=getattr(torch, dtype), quantize=quantize)
    generator = torch.Generator().manual_seed(0)
    lengths = [40 + 30 * i for i in range(sessions)]
    prompts = [torch.randint(3, 40000, (n,), generator=generator).tolist() for n in lengths]
    state = {}
    for kind in ("alone", "batch"):
        for i, (n, prompt) in enumerate(zip(lengths, prompts)):
            token = shard.step(shard.embed(prompt), mode="prefill", session_id=f"{kind}{i}", past_len=0,
                               start_layer=0, sampling=greedy).token_id
            state[f"{kind}{i}"] = [n, token]
    times = {"alone": [], "batch": []}

    def steps(kind: str) -> list[DecodeStep]:
        return [DecodeStep(shard.embed([state[f"{kind}{i}"][1]]), f"{kind}{i}", state[f"{kind}{i}"][0], greedy)
                for i in range(sessions)]

    def advance(kind: str, results) -> None:
        for i, result in enumerate(results):
            assert not isinstance(result, Exception), result
            state[f"{kind}{i}"] = [state[f"{kind}{i}"][0] + 1, result.token_id]

    for _ in range(rounds):
        alone = steps("alone")
        started = time.perf_counter()
        results = [shard.step_batch([step], start_layer=0)[0] for step in alone]
        times["alone"].append(time.perf_counter() - started)
        advance("alone", results)
        together = steps("batch")
        started = time.perf_counter()
        results = shard.step_batch(together, start_layer=0)
        times["batch"].append(time.perf_counter() - started)
        advance("batch", results)
    same = all(state[f"alone{i}"][1] == state[f"batch{i}"][1] for i in range(sessions))
    alone_ms, batch_ms = (statistics.median(times[k]) * 1000.0 for k in ("alone", "batch"))
    return {"alone_ms": alone_ms, "batch_ms": batch_ms, "gain": alone_ms / batch_ms, "same": same,
            "refusal": shard.batch_refusal, "types": sorted(set(shard.layer_types))}


def _layers(folder: Path) -> int:
    from daemon.model.checkpoint import read_model_info

    return read_model_info(folder).num_layers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quantize", choices=["int8"], help="the layers' weights in int8 (bfloat16 compute)")
    args = parser.parse_args()
    import torch

    from daemon.model.source import resolve_model

    torch.set_num_threads(args.threads)
    built_in = resolve_model(None)
    with tempfile.TemporaryDirectory() as tmp:
        models = {"built-in (full attention)": built_in,
                  f"same size, sliding window {args.window}": sliding_twin(built_in, args.window, Path(tmp) / "w"),
                  "same size, Qwen3.5 hybrid": hybrid_twin(built_in, Path(tmp) / "h")}
        precision = args.dtype + (" int8" if args.quantize else "")
        print(f"{args.sessions} sessions, prompts {', '.join(str(40 + 30 * i) for i in range(args.sessions))} "
              f"tokens, {args.rounds} rounds, {precision}, {args.threads} threads, load {os.getloadavg()[0]:.2f}")
        print(f"{'model':34} {'layers':34} {'alone ms':>9} {'batch ms':>9} {'gain':>6}  same tokens")
        for name, folder in models.items():
            row = measure(folder, args.sessions, args.rounds, args.dtype, args.quantize)
            if row["refusal"]:
                print(f"{name:34} refused: {row['refusal']}")
                continue
            print(f"{name:34} {', '.join(row['types']):34} {row['alone_ms']:9.1f} {row['batch_ms']:9.1f} "
                  f"{row['gain']:5.2f}x  {'yes' if row['same'] else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
