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
    if arch in ("qwen3_5", "qwen3_5_moe"):
        # the released Qwen3.5/3.6 layout: a ...ForConditionalGeneration checkpoint with a text_config and a
        # vision tower; the text model is linear, linear, linear, full attention (the 3:1 of the real ones),
        # with multimodal RoPE on a quarter of each head; the MoE one has 4 experts, top-2, and a shared expert
        text = dict(common, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_num_key_heads=2, linear_num_value_heads=4,
                    rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                                         mrope_section=[1, 1, 0], mrope_interleaved=True))
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                      out_hidden_size=64, num_position_embeddings=16)
        if arch == "qwen3_5":
            return transformers.Qwen3_5Config(text_config=text, vision_config=vision)
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
        return transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)
    if arch == "gpt_oss":
        # alternating sliding / full attention with learned attention sinks, 4 experts top-2 on every layer,
        # YaRN RoPE as released
        return transformers.GptOssConfig(**dict(common, max_position_embeddings=131072), **window, head_dim=16,
                                         num_local_experts=4, num_experts_per_tok=2,
                                         layer_types=["sliding_attention", "full_attention"] * 2)
    if arch == "deepseek_v3":
        # multi-head latent attention (low-rank q and compressed kv, interleaved RoPE on part of each head),
        # YaRN RoPE as released; dense MLP on layer 0, then 8 routed experts in 4 groups (top-2 of the best 2
        # groups) plus a shared expert
        yarn = dict(rope_type="yarn", rope_theta=10_000.0, factor=40.0, original_max_position_embeddings=4096,
                    beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
        return transformers.DeepseekV3Config(
            **dict(common, num_key_value_heads=4, max_position_embeddings=163840), rope_parameters=yarn,
            q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
            n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, n_shared_experts=1,
            moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=2.5)
    if arch == "gemma4_text":
        # sliding, full, sliding, full with a wider head on the full layers, proportional RoPE on a quarter of
        # it, keys reused as values there (attention_k_eq_v), and the MoE block beside the MLP (26B-A4B-style);
        # no per-layer input embeddings and no KV sharing (only the small E2B/E4B models have those)
        return transformers.Gemma4TextConfig(
            **common, **window, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
            attention_k_eq_v=True, hidden_size_per_layer_input=0, num_kv_shared_layers=0,
            enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
            final_logit_softcapping=30.0, layer_types=["sliding_attention", "full_attention"] * 2)
    if arch in ("gemma3", "gemma4"):
        # the released multimodal layout around the text configs above: Gemma 3 saves its text model under
        # "language_model.model.", Gemma 4 under "model.language_model.", and neither declares a renaming for a
        # causal LM of its own; the top level ties the LM head to the embeddings, the text config does not
        text = tiny_config(f"{arch}_text").to_dict()
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
        if arch == "gemma3":
            return transformers.Gemma3Config(text_config=text, mm_tokens_per_image=4,
                                             vision_config=dict(vision, image_size=32, patch_size=8))
        return transformers.Gemma4Config(text_config=text, audio_config=None,
                                         vision_config=dict(vision, num_key_value_heads=2, head_dim=16))
    if arch == "glm4_moe":
        # partial RoPE (half of each head), q/k norms, dense MLP on layer 0, then 8 routed experts top-2 with a
        # shared expert and sigmoid routing with a score-correction bias
        return transformers.Glm4MoeConfig(
            **common, head_dim=16, use_qk_norm=True, attention_bias=True, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=2.5)
    raise KeyError(f"no tiny config for {arch!r}")


def build_tiny_model(arch: str, dest: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """Save a random-weight ``arch`` model with the given tokenizer into ``dest``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    config = tiny_config(arch)
    # a config with a vision tower is saved whole, as released checkpoints are: text layers beside the tower
    model_class = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    model = model_class.from_config(config).eval()
    model.save_pretrained(dest)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, dest / name)
    return dest
