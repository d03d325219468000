"""The tail's names for its tokens (``ChatTokenizer.token_text``), on the built-in model's tokenizer."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from daemon.model.tokenizer import ChatTokenizer


def test_a_token_is_named_as_the_tokenizer_decodes_it_and_decoded_once(default_model, monkeypatch):
    """Every tail names every token it picks: each id is decoded once, then looked up, to the same text (special
    tokens included)."""
    tokenizer = ChatTokenizer.load(default_model, AutoConfig.from_pretrained(default_model))
    inner = tokenizer._tokenizer
    ids = [*tokenizer.encode_text("Hello, world! Ünïcödé ✓"), *sorted(tokenizer.eos_token_ids), 0]
    expected = [inner.decode([i]) for i in ids]
    decoded = []
    decode = inner.decode
    monkeypatch.setattr(inner, "decode", lambda token_ids, **kw: decoded.append(list(token_ids)) or decode(token_ids,
                                                                                                            **kw))
    assert [tokenizer.token_text(i) for i in ids] == expected
    assert [tokenizer.token_text(i) for i in reversed(ids)] == expected[::-1]
    assert sorted(map(tuple, decoded)) == sorted({(i,) for i in ids})  # once per distinct id, not per call
    assert any(tokenizer.token_text(i) == "<|im_end|>" for i in tokenizer.eos_token_ids)  # special tokens named


def test_a_model_without_a_chat_template_refuses_chats_in_one_line(default_model):
    from daemon.errors import BadRequest

    tokenizer = ChatTokenizer.load(default_model, AutoConfig.from_pretrained(default_model))
    assert tokenizer.encode_chat([{"role": "user", "content": "Hi"}])[-1] != tokenizer.encode_text("Hi")[-1]
    tokenizer._tokenizer.chat_template = None  # a base model's folder
    with pytest.raises(BadRequest) as info:
        tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert info.value.status == 400 and info.value.param == "messages" and "/v1/completions" in info.value.message
    assert tokenizer.encode_prompt("Hi")  # a completion prompt needs no template
