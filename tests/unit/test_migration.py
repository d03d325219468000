"""A session's cache handed to another node as bytes (``daemon.model.migration``): what a drain sends.

The receiver goes on exactly where the sender was (bit for bit), and anything malformed, of another model or
of layers it does not end with is refused in one line with nothing stored.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load, save

from daemon.errors import BadRequest
from daemon.kvstore import SessionCacheStore
from daemon.model.checkpoint import read_model_info
from daemon.model.migration import export_session, import_session, movable
from daemon.model.sampling import Sampling
from daemon.model.shard import ModelShard

PROMPT = 9


@pytest.fixture(scope="module")
def llama(tiny_model):
    folder = tiny_model("llama")
    n = read_model_info(folder).num_layers

    def shard(start: int, end: int = n - 1) -> ModelShard:  # not the tail: its outputs are hidden states
        return ModelShard(folder, start, end, head=False, sessions=SessionCacheStore(), dtype=torch.float32)
    return shard


def prefill_and_step(shard: ModelShard, session: str, hidden: torch.Tensor, *, start_layer: int) -> None:
    greedy = Sampling()
    shard.step(hidden[:, :PROMPT], mode="prefill", session_id=session, past_len=0, start_layer=start_layer,
               sampling=greedy)
    shard.step(hidden[:, PROMPT:PROMPT + 1], mode="decode", session_id=session, past_len=PROMPT,
               start_layer=start_layer, sampling=greedy)


def decode(shard: ModelShard, session: str, hidden: torch.Tensor, past_len: int, *, start_layer: int):
    return shard.step(hidden, mode="decode", session_id=session, past_len=past_len, start_layer=start_layer,
                      sampling=Sampling()).hidden


@pytest.mark.parametrize("receiver_start", [1, 0], ids=["same layers", "a wider node"])
def test_the_receiver_goes_on_exactly_where_the_sender_was(llama, receiver_start):
    sender, receiver = llama(1), llama(receiver_start)
    torch.manual_seed(0)
    hidden = torch.randn(1, PROMPT + 4, sender.info.hidden_size)
    prefill_and_step(sender, "s", hidden, start_layer=1)
    entry = sender.sessions.get("s")
    assert movable(sender, entry)

    imported = import_session(receiver, export_session(sender, entry))
    assert (imported.past_len, imported.start_layer) == (PROMPT + 1, 1)
    receiver.sessions.put("s", imported.cache, past_len=imported.past_len, start_layer=imported.start_layer,
                          nbytes=imported.nbytes)
    for i in range(PROMPT + 1, PROMPT + 4):
        here = decode(sender, "s", hidden[:, i:i + 1], i, start_layer=1)
        there = decode(receiver, "s", hidden[:, i:i + 1], i, start_layer=1)
        assert torch.equal(here, there)


def test_a_verify_steps_rejected_drafts_can_still_be_cut_off_after_the_move(llama):
    sender, receiver = llama(1), llama(1)
    torch.manual_seed(1)
    hidden = torch.randn(1, PROMPT + 6, sender.info.hidden_size)
    prefill_and_step(sender, "v", hidden, start_layer=1)
    sender.step(hidden[:, PROMPT + 1:PROMPT + 4], mode="decode", session_id="v", past_len=PROMPT + 1,
                start_layer=1, sampling=Sampling(), draft=(5, 6))  # three positions: the head may keep fewer
    imported = import_session(receiver, export_session(sender, sender.sessions.get("v")))
    assert (imported.past_len, imported.rewind_from) == (PROMPT + 4, PROMPT + 1)
    receiver.sessions.put("v", imported.cache, past_len=imported.past_len, start_layer=1, nbytes=imported.nbytes)
    receiver.sessions.commit("v", past_len=imported.past_len, nbytes=imported.nbytes, undo=imported.undo,
                             rewind_from=imported.rewind_from)
    kept = PROMPT + 2  # the head kept one draft
    assert torch.equal(decode(sender, "v", hidden[:, kept:kept + 1], kept, start_layer=1),
                       decode(receiver, "v", hidden[:, kept:kept + 1], kept, start_layer=1))


def tampered(data: bytes, *, metadata: dict | None = None, tensors: dict | None = None) -> bytes:
    size = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8:8 + size])["__metadata__"] | (metadata or {})
    return save((load(data) | (tensors or {})), metadata=meta)


@pytest.fixture(scope="module")
def sent(llama):
    """(the sender, a session's bytes)."""
    sender = llama(1)
    torch.manual_seed(2)
    prefill_and_step(sender, "t", torch.randn(1, PROMPT + 1, sender.info.hidden_size), start_layer=1)
    return sender, export_session(sender, sender.sessions.get("t"))


@pytest.mark.parametrize(("change", "says"), [
    (lambda d, s: b"\x00" * 40, "not a safetensors file"),
    (lambda d, s: d[:-10], "not a safetensors file"),
    (lambda d, s: tampered(d, metadata={"format": "other/9"}), "format"),
    (lambda d, s: tampered(d, metadata={"fingerprint": "0" * 16}), "another model"),
    (lambda d, s: tampered(d, metadata={"dtype": "bfloat16"}), "holds bfloat16"),
    (lambda d, s: tampered(d, metadata={"end": "2"}), "do not end where they end"),
    (lambda d, s: tampered(d, metadata={"past_len": "99999999"}), "context"),
    (lambda d, s: tampered(d, metadata={"past_len": "-3"}), "not a count"),
    (lambda d, s: tampered(d, tensors={"keys.7": torch.zeros(1)}), "unexpected ['keys.7']"),
    (lambda d, s: tampered(d, tensors={"keys.1": torch.zeros(1, 2, 3, 4)}), "keys.1 is float32 [1, 2, 3, 4]"),
    (lambda d, s: tampered(d, tensors={"values.2": load(d)["values.2"].double()}), "values.2 is float64"),
])
def test_a_malformed_transfer_is_refused_in_one_line_and_stores_nothing(llama, sent, change, says):
    sender, data = sent
    receiver = llama(1)
    with pytest.raises(BadRequest) as refused:
        import_session(receiver, change(data, sender))
    assert says in refused.value.message and "\n" not in refused.value.message
    assert len(receiver.sessions) == 0


def test_a_receiver_that_does_not_end_where_the_sender_ended_refuses(tiny_model, sent):
    sender, data = sent
    folder = tiny_model("llama")
    shorter = ModelShard(folder, 1, 2, head=False, sessions=SessionCacheStore(), dtype=torch.float32)
    with pytest.raises(BadRequest, match="do not end where they end"):
        import_session(shorter, data)


def test_linear_attention_state_stays_where_it_is(tiny_model):
    """A hybrid model's recurrent state is not keys and values: such a session does not move (its head replays
    the span elsewhere instead)."""
    folder = tiny_model("qwen3_5")
    n = read_model_info(folder).num_layers
    shard = ModelShard(folder, 0, n - 1, head=False, sessions=SessionCacheStore(), dtype=torch.float32)
    torch.manual_seed(3)
    prefill_and_step(shard, "h", torch.randn(1, PROMPT + 1, shard.info.hidden_size), start_layer=0)
    assert not movable(shard, shard.sessions.get("h"))
