"""What a shard finds out about its checkpoint and layers as it loads (:class:`daemon.model.shard.ModelShard`).

- :func:`refuse_unsupported`: checkpoints a shard cannot run exactly, refused by name before anything loads;
- :func:`default_layer_type`: the layer type of configs that do not list one per layer;
- :func:`probe_kv_cache` and :func:`probe_batching`: a few steps through the loaded layers, once, to learn
  whether they take a cache and whether several sessions' decode steps may run as one forward.
"""

from __future__ import annotations

import copy
import logging

import torch

from daemon.errors import ModelUnavailable
from daemon.model.kvcache import cache_nbytes

log = logging.getLogger(__name__)

# Config settings under which a layer needs more than the hidden states that travel between nodes
_UNSHARDABLE_FEATURES = {
    # Gemma 3n, Gemma 4 E2B / E4B
    "hidden_size_per_layer_input": "its layers take per-layer embeddings of the token ids",
    "num_kv_shared_layers": "its last layers reuse keys and values computed by earlier layers",
}


def default_layer_type(text_config) -> str:
    # Mistral-style configs without layer_types use one sliding window on every layer
    return "sliding_attention" if getattr(text_config, "sliding_window", None) else "full_attention"


def refuse_unsupported(config, text_config, model_type: str) -> None:
    """Refuse by name what a shard cannot run exactly: quantized weights, layers needing more than hidden states."""
    quantization = getattr(config, "quantization_config", None)
    if quantization:  # FP8 or MXFP4 blocks read as plain floats would run, silently wrong
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization.quant_method
        raise ModelUnavailable(
            f"unsupported checkpoint of {model_type!r}: its weights are quantized ({method}); "
            "a shard loads unquantized weights only (bfloat16, float16 or float32)"
        )
    needs = [why for setting, why in _UNSHARDABLE_FEATURES.items() if getattr(text_config, setting, None)]
    if needs:
        raise ModelUnavailable(
            f"unsupported architecture {model_type!r}: {'; '.join(needs)}, but only hidden states travel "
            "between nodes"
        )


def probe_kv_cache(shard) -> bool:
    """Check once that the shard's layers take and fill a cache; models that ignore it run stateless."""
    hidden = torch.zeros(1, 2, shard.info.hidden_size, dtype=shard.dtype, device=shard.device)
    try:  # a failure without a cache is the architecture's, not the cache arguments'
        shard.run_layers(hidden, start_layer=shard.start, past_len=0, cache=None)
    except Exception as exc:  # noqa: BLE001 - whatever breaks, the user needs the same message
        raise ModelUnavailable(f"unsupported architecture {shard.info.model_type!r}: {exc}") from None
    cache = shard.new_cache()
    try:
        shard.run_layers(hidden, start_layer=shard.start, past_len=0, cache=cache)
        shard.run_layers(hidden[:, :1], start_layer=shard.start, past_len=2, cache=cache)
    except TypeError as exc:
        log.warning("cache probe failed: %s", exc)
        return False
    return cache_nbytes(cache) > 0


def probe_batching(shard) -> str | None:
    """Run two sessions' decode steps batched and alone; None when they agree, else why this shard must not
    batch (raised, or differing by more than float rounding)."""
    generator = torch.Generator().manual_seed(0)

    def states(tokens: int) -> torch.Tensor:
        return (torch.randn(1, tokens, shard.info.hidden_size, generator=generator) * 0.5).to(shard.dtype).to(
            shard.device)

    prompts, steps = [states(3), states(5)], [states(1), states(1)]
    try:
        caches = [shard.new_cache() for _ in prompts]
        for cache, prompt in zip(caches, prompts):
            shard.run_layers(prompt, start_layer=shard.start, past_len=0, cache=cache)
        alone = [shard.run_layers(step, start_layer=shard.start, past_len=prompt.shape[1], cache=copy.deepcopy(c))
                 for step, prompt, c in zip(steps, prompts, caches)]
        positions = torch.tensor([[prompt.shape[1] for prompt in prompts]], device=shard.device)
        together = shard.run_batch(torch.cat(steps, dim=1), start_layer=shard.start, position_ids=positions,
                                   caches=caches)
    except Exception as exc:  # noqa: BLE001 - any failure means: run its steps one at a time
        return f"a batched step failed on these layers ({type(exc).__name__}: {exc})"
    want = torch.cat(alone, dim=1).float()
    diff = (together.float() - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
    if not diff <= 5e-2:  # a broken batched path is off by the states themselves; rounding by far less
        return f"a batched step differs from single steps by {diff:.2g} of the hidden states' scale"
    return None
