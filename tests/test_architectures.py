"""Architecture matrix: tiny random-weight models split across shards match ``model.generate``.

For each architecture (dense, sliding-window, mixture of experts, hybrid linear attention) and
several split points, greedy tokens through two shards are compared token for token with the
whole model's ``generate``, on both the cached path and the stateless path. The cached path starts
with a chunked prefill (5 prompt tokens, then the other 4 as one multi-token decode step on the
non-empty cache), the case that breaks when a shard builds masks or reads lengths from layer 0.
"""

from __future__ import annotations

import pytest
import torch

from daemon.api import Sampling  # noqa: E402
from daemon.errors import CacheMiss  # noqa: E402
from daemon.kvstore import SessionCacheStore  # noqa: E402
from daemon.model.shard import ModelShard  # noqa: E402

PROMPT = [1, 504, 3158, 1567, 4829, 28, 2117, 314, 17843]  # 9 ids in the 49152 vocab
FIRST_CHUNK = 5  # prefill these, then the other 4 prompt tokens as one multi-token decode step
NEW_TOKENS = 12
GREEDY = Sampling()
N_LAYERS = 4

# split point k: the head shard hosts layers [0, k), the tail [k, 4); comments show what each side holds
SPLITS = {
    # other splits of llama: the three-shard test below, and the built-in model's golden tests
    "llama": [2],
    # full, full | sliding, sliding at k=2; full | full, sliding, sliding at k=1
    "qwen2": [1, 2],
    # full | sliding, full, sliding at k=1 (the tail's first layer is sliding, its first full one is 2);
    # full, sliding, full | sliding at k=3
    "qwen3": [1, 3],
    # dense, MoE, dense, MoE: k=1 puts only a dense layer on the head, k=3 only an MoE layer on the tail
    "qwen3_moe": [1, 3],
    # linear, linear, full, linear: k=2 puts only linear attention on the head, k=3 on the tail
    # (a cache with no sequence axis: the past length must come from the store entry)
    "qwen3_next": [1, 2, 3],
    # sliding window on every layer, from `sliding_window` alone (no layer_types in the config)
    "mistral": [2],
    # fused qkv and gate/up projections in the checkpoint
    "phi3": [2],
    # sliding, full, sliding, full; attention logit soft-capping inside the layers
    "gemma2": [1],
    # per-layer-type rotary embeddings (one RoPE for sliding layers, one for full ones)
    "gemma3_text": [1, 2],
}
FAST_ARCH = "llama"  # the fast subset checks one architecture; the whole matrix is slow


def arch_param(*values, id: str | None = None):
    marks = () if values[0] == FAST_ARCH else (pytest.mark.slow,)
    return pytest.param(*values, id=id, marks=marks)


CASES = [arch_param(arch, k, id=f"{arch}-split{k}") for arch, ks in SPLITS.items() for k in ks]


@pytest.fixture(scope="module")
def reference(tiny_model):
    """``reference(arch)`` -> (folder, whole model, greedy continuation of PROMPT by its ``generate``)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    memo: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in memo:
            folder = tiny_model(arch)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            ids = torch.tensor([PROMPT])
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                     do_sample=False, eos_token_id=None, pad_token_id=2)
            tokens = out[0, len(PROMPT):].tolist()
            assert len(tokens) == NEW_TOKENS
            memo[arch] = (folder, model, tokens)
        return memo[arch]

    return get


def _route_step(route, token_ids, *, mode, session, past_len):
    """One step through ``route`` = [(shard, start_layer), ...]; returns the tail's token id."""
    head = route[0][0]
    hidden = head.embed(token_ids)
    for shard, start_layer in route:
        result = shard.step(hidden, mode=mode, session_id=session, past_len=past_len,
                            start_layer=start_layer, sampling=GREEDY)
        hidden = result.hidden
    assert hidden is None and result.token_id is not None, "the last hop must be a tail returning a token"
    return result.token_id


def generate_cached(route, session: str = "s1") -> list[int]:
    """Chunked prefill (5 tokens, then 4 as one decode step), then one-token decode steps."""
    _route_step(route, PROMPT[:FIRST_CHUNK], mode="prefill", session=session, past_len=0)
    token = _route_step(route, PROMPT[FIRST_CHUNK:], mode="decode", session=session, past_len=FIRST_CHUNK)
    tokens = [token]
    past = len(PROMPT)
    while len(tokens) < NEW_TOKENS:
        tokens.append(_route_step(route, [tokens[-1]], mode="decode", session=session, past_len=past))
        past += 1
    return tokens


def generate_stateless(route) -> list[int]:
    """The legacy path: the whole sequence through every hop on each step, no cache."""
    tokens: list[int] = []
    while len(tokens) < NEW_TOKENS:
        tokens.append(_route_step(route, PROMPT + tokens, mode=None, session=None, past_len=0))
    return tokens


def _on_meta(module: torch.nn.Module) -> list[bool]:
    return [p.device.type == "meta" for p in module.parameters()]


def assert_holds_only(shard: ModelShard, *, embed: bool, tail: bool) -> None:
    """The shard materialised its own layers (and embeddings / norm + LM head per role), nothing else."""
    base = shard.model.model
    for i, layer in enumerate(base.layers):
        flags = _on_meta(layer)
        if shard.start <= i < shard.end:
            assert not any(flags), f"layer {i} of shard {shard.start}-{shard.end - 1} was not loaded"
        else:
            assert all(flags), f"shard {shard.start}-{shard.end - 1} loaded weights of layer {i}"
    assert all(_on_meta(base.embed_tokens)) != embed
    assert all(_on_meta(base.norm)) != tail
    assert all(_on_meta(shard.model.lm_head)) != tail


@pytest.mark.parametrize(("arch", "split"), CASES)
def test_two_shards_match_generate(reference, arch, split):
    folder, _, expected = reference(arch)
    head = ModelShard(folder, 0, split, sessions=SessionCacheStore())
    tail = ModelShard(folder, split, N_LAYERS, head=False, sessions=SessionCacheStore())
    assert head.supports_kv_cache and tail.supports_kv_cache
    assert_holds_only(head, embed=True, tail=False)
    assert_holds_only(tail, embed=False, tail=True)
    route = [(head, 0), (tail, split)]

    assert generate_cached(route) == expected, f"{arch} split at {split}: cached path differs from generate"
    fed = len(PROMPT) + NEW_TOKENS - 1  # the last token is returned, never fed back
    for shard, start_layer in route:
        entry = shard.sessions.get("s1")
        assert entry is not None and entry.past_len == fed and entry.start_layer == start_layer

    assert generate_stateless(route) == expected, f"{arch} split at {split}: stateless path differs from generate"


@pytest.mark.parametrize("arch", [arch_param(a, id=a) for a in ("llama", "qwen2", "qwen3_next")])
def test_three_overlapping_shards_match_generate(reference, arch):
    """Shards 0-1, 1-2, 2-3 (inclusive); the route starts them at 0, 2, 3 so no layer runs twice."""
    folder, _, expected = reference(arch)
    a = ModelShard(folder, 0, 2, sessions=SessionCacheStore())
    b = ModelShard(folder, 1, 3, head=False, sessions=SessionCacheStore())
    c = ModelShard(folder, 2, 4, head=False, sessions=SessionCacheStore())
    route = [(a, 0), (b, 2), (c, 3)]

    assert generate_cached(route) == expected
    assert [s.sessions.get("s1").start_layer for s, _ in route] == [0, 2, 3]
    assert generate_stateless(route) == expected

    # a decode that starts at another layer than the cached prefill cannot reuse that cache
    with pytest.raises(CacheMiss):
        b.step(a.embed([5]), mode="decode", session_id="s1", past_len=len(PROMPT) + NEW_TOKENS - 1,
               start_layer=1, sampling=GREEDY)


# gemma2/gemma3 soft-cap their final logits: sampling must see the same
LOGIT_CASES = [arch_param(a, id=a) for a in SPLITS]


@pytest.mark.parametrize("arch", LOGIT_CASES)
def test_tail_logits_match_full_model(reference, arch):
    """The tail's last-position logits equal the whole model's, not just their argmax (sampling uses them)."""
    folder, model, _ = reference(arch)
    with torch.inference_mode():
        want = model(torch.tensor([PROMPT])).logits[0, -1]
    head = ModelShard(folder, 0, 2, kv_cache=False)
    tail = ModelShard(folder, 2, N_LAYERS, head=False, kv_cache=False)
    hidden = head.run_layers(head.embed(PROMPT), start_layer=0, past_len=0, cache=None)
    got = tail.logits_last(tail.run_layers(hidden, start_layer=2, past_len=0, cache=None))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
