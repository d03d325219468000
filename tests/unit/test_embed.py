"""A head's embedding of one token (``ModelShard.embed``): a plain table's row read straight, every other
table (scaled, as Gemma's are) through its module; the same hidden states either way."""

from __future__ import annotations

import pytest
import torch

from daemon.model.shard import ModelShard


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_one_token_embeds_as_the_embedding_module_does(tiny_model, arch, dtype):
    shard = ModelShard(tiny_model(arch), 0, 1, dtype=dtype, kv_cache=False)
    module = shard.model.model.embed_tokens
    last = module.num_embeddings - 1
    for token in (0, 7, last):
        want = module(torch.tensor([[token]])).to(dtype)
        got = shard.embed([token])
        assert got.dtype == dtype and got.shape == want.shape and torch.equal(got, want)
    assert torch.equal(shard.embed([3, 4]), module(torch.tensor([[3, 4]])).to(dtype))
    plain = arch == "llama"  # Gemma scales its embeddings in the module: its row alone is not the hidden state
    assert (shard._rows[1] is not None) == plain
    if plain:  # and a row read straight is what the module's call gives, bit for bit
        row = torch.from_numpy(shard._rows[1][7].copy()).view(module.weight.dtype)
        assert torch.equal(row, module.weight[7])
    for outside in (last + 1, -1):  # refused as the module refuses it
        with pytest.raises(IndexError):
            shard.embed([outside])
