"""A model whose layers reject (or ignore) the cache arguments runs stateless, correctly."""

from __future__ import annotations

import pytest
import torch

from daemon.api import Sampling
from daemon.errors import CacheMiss
from daemon.kvstore import SessionCacheStore
from daemon.model.shard import ModelShard

PROMPT = [5, 17, 42, 7, 99, 3, 11]


@pytest.fixture(scope="module")
def expected(tiny_model):
    """generate's tokens, computed before any layer is patched."""
    from transformers import AutoModelForCausalLM

    folder, n = tiny_model("llama"), 8
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([PROMPT])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None)
    return out[0, len(PROMPT):].tolist()


@pytest.fixture(params=["rejects", "ignores"])
def cacheless_layers(request, monkeypatch):
    """Patch Llama's decoder layer to reject the cache kwargs, or to silently drop them."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    original = LlamaDecoderLayer.forward

    def old_style_forward(self, hidden_states, attention_mask=None, position_ids=None,
                          position_embeddings=None, **kwargs):
        if request.param == "rejects" and ("cache" in kwargs or "use_cache" in kwargs):
            raise TypeError("forward() got an unexpected keyword argument 'cache'")
        return original(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                        position_embeddings=position_embeddings)

    monkeypatch.setattr(LlamaDecoderLayer, "forward", old_style_forward)
    return request.param


def test_layers_without_cache_support_fall_back_to_stateless(tiny_model, expected, cacheless_layers):
    folder = tiny_model("llama")
    store = SessionCacheStore()
    head = ModelShard(folder, 0, 2, sessions=store)
    tail = ModelShard(folder, 2, 4, head=False, sessions=SessionCacheStore())
    assert head.supports_kv_cache is False and tail.supports_kv_cache is False
    greedy = Sampling()

    # a decode step is a cache miss, never a silently wrong single-token run
    with pytest.raises(CacheMiss) as miss:
        head.step(head.embed([1]), mode="decode", session_id="s", past_len=3, start_layer=0, sampling=greedy)
    assert miss.value.reason == "cache_disabled"
    assert store.stats().misses_by_reason["cache_disabled"] == 1

    # a prefill runs stateless and keeps nothing
    head.step(head.embed(PROMPT), mode="prefill", session_id="s", past_len=0, start_layer=0, sampling=greedy)
    assert len(store) == 0

    tokens, seq = [], list(PROMPT)
    while len(tokens) < 8:
        hidden = head.step(head.embed(seq), mode=None, session_id=None, past_len=0, start_layer=0,
                           sampling=greedy).hidden
        token = tail.step(hidden, mode=None, session_id=None, past_len=0, start_layer=2, sampling=greedy).token_id
        tokens.append(token)
        seq.append(token)
    assert tokens == expected
