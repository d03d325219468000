"""Tiny random-weight models built from configs, for architecture coverage without a model hub.

Each uses the built-in model's tokenizer (vocab 49152), so chat templates and
decoding work exactly as with the real model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
VOCAB = 49152


def tiny_config(arch: str):
    """A small config of architecture ``arch``; 4 layers unless the architecture needs more."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    # a sliding window shorter than the test sequences (9-token prompts), so the window really cuts
    window = dict(sliding_window=4)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen2":
        # layers 0-1 full attention, 2-3 sliding window (max_window_layers is where sliding starts)
        return transformers.Qwen2Config(**common, **window, use_sliding_window=True, max_window_layers=2)
    if arch == "qwen3":
        # alternating full / sliding attention, given explicitly
        return transformers.Qwen3Config(**common, **window, head_dim=16, use_sliding_window=True,
                                        layer_types=["full_attention", "sliding_attention"] * 2)
    if arch == "qwen3_moe":
        # 4 experts, top-2; MoE on every second layer (1, 3), dense MLP on 0 and 2
        return transformers.Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, decoder_sparse_step=2, norm_topk_prob=True)
    if arch == "qwen3_next":
        # hybrid: linear attention on 0, 1, 3 and full attention on 2; MoE (4 experts, top-2, shared
        # expert) on every layer but 0, which has a dense MLP
        return transformers.Qwen3NextConfig(
            **common, head_dim=16, full_attention_interval=3, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32, mlp_only_layers=[0],
            linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4)
    if arch == "mistral":
        # no layer_types: one sliding window on every layer
        return transformers.MistralConfig(**common, **window)
    if arch == "phi3":
        # fused qkv and gate/up projections in the checkpoint
        return transformers.Phi3Config(**common)
    if arch == "gemma2":
        # alternating sliding / full attention, scaled embeddings, attention and final logit soft-capping
        return transformers.Gemma2Config(**common, **window, head_dim=16, query_pre_attn_scalar=16)
    if arch == "gemma3_text":
        # per-layer-type rotary embeddings: 5 sliding layers to 1 full layer, cut down to 4 layers
        return transformers.Gemma3TextConfig(**common, **window, head_dim=16, query_pre_attn_scalar=16,
                                             layer_types=["sliding_attention", "full_attention"] * 2)
    raise KeyError(f"no tiny config for {arch!r}")


def build_tiny_model(arch: str, dest: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """Save a random-weight ``arch`` model with the given tokenizer into ``dest``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch)).eval()
    model.save_pretrained(dest)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, dest / name)
    return dest
