"""The ``POST /forward`` wire protocol against real ``meshd`` processes, spoken as raw HTTP.

A tiny random 4-layer llama (hidden 64) is split over a head (layers 0-1) and a tail (2-3);
a third daemon hosts 2-3 with ``--no-kv-cache``. Activations are built in this process with
the same model loaded whole by transformers, so every answer is checked against a reference:
the head's hidden states against ``hidden_states[2]`` and the tail's tokens against the
reference's greedy choice. Then: each 409 cache-miss reason, a barrage of malformed requests
(each a 400 that names its header), and proof that the node still serves afterwards.
"""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import pytest
import torch

from daemon import channel
from daemon.wire import BATCH_CONTENT_TYPE, BATCH_PATH
from tests.support.headers import CACHE, DTYPE, HOP_INDEX, PAST_LEN, SAMPLING, SESSION, SHAPE, START_LAYER
from tests.support.http_client import Reply, send
from tests.support.meshd import Daemon, start_mesh

HIDDEN = 64
KV = ["--kv-max-sessions", "256"]  # this module opens many sessions: none may be LRU-evicted
PROMPT = "The capital of France is"
SURVIVOR = "survivor-0001"  # prefilled before the barrage, decoded after it


# --- /forward ------------------------------------------------------------------------------------


def forward(url: str, tensor_or_bytes, headers: dict | None = None, *, dtype: str | None = "float32",
            shape: str | None = None) -> Reply:
    """POST /forward; a tensor is sent as ``dtype`` bytes with a matching shape header."""
    if isinstance(tensor_or_bytes, torch.Tensor):
        body = to_bytes(tensor_or_bytes, dtype or "float32")
        shape = shape or ",".join(map(str, tensor_or_bytes.shape))
    else:
        body = tensor_or_bytes
    sent = {"Content-Type": "application/octet-stream"}
    if dtype is not None:
        sent[DTYPE] = dtype
    if shape is not None:
        sent[SHAPE] = shape
    sent.update(headers or {})
    return send("POST", url + "/forward", body, {k: v for k, v in sent.items() if v is not None})


TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def to_bytes(t: torch.Tensor, dtype: str = "float32") -> bytes:
    return t.detach().to(TORCH_DTYPES[dtype]).contiguous().view(torch.uint8).numpy().tobytes()


def from_reply(reply: Reply) -> torch.Tensor:
    dtype = reply.headers[DTYPE]
    shape = tuple(int(p) for p in reply.headers[SHAPE].split(","))
    return torch.frombuffer(bytearray(reply.body), dtype=TORCH_DTYPES[dtype]).view(shape).float()


def random_hidden(tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))


def token_of(reply: Reply) -> int:
    assert reply.status == 200, reply
    assert reply.headers.get_content_type() == "application/json", reply
    body = reply.json()
    assert isinstance(body["token_id"], int) and not isinstance(body["token_id"], bool), body
    assert isinstance(body["text"], str), body
    return body["token_id"]


def assert_cache_miss(reply: Reply, reason: str) -> None:
    assert reply.status == 409, reply
    body = reply.json()
    assert body["error"] == "cache_miss", body
    assert body["reason"] == reason, body
    assert isinstance(body.get("message"), str) and body["message"], body


# --- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def mesh(model_dir, tmp_path_factory):
    daemons = start_mesh(model_dir, [("0-1", KV), ("2-3", KV)], log_dir=tmp_path_factory.mktemp("forward-logs"))
    yield daemons
    for d in daemons:
        d.stop()


@pytest.fixture(scope="module")
def head(mesh) -> Daemon:
    return mesh[0]


@pytest.fixture(scope="module")
def tail(mesh) -> Daemon:
    return mesh[1]


@pytest.fixture(scope="module")
def nokv(model_dir, tmp_path_factory):
    """A stand-alone tail that keeps no session caches (not a peer of the mesh above)."""
    d = Daemon(model_dir, "2-3", extra=["--no-kv-cache"], log_dir=tmp_path_factory.mktemp("nokv-logs"))
    try:
        d.wait_ready()
        yield d
    finally:
        d.stop()


class Reference:
    """The whole tiny model in this process: hidden states after layer 1 and greedy next tokens."""

    def __init__(self, folder) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(folder)

    @torch.inference_mode()
    def embed(self, ids: list[int]) -> torch.Tensor:
        return self.model.model.embed_tokens(torch.tensor([ids]))

    @torch.inference_mode()
    def run(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states entering layer 2 ``[1, T, 64]``, logits of the last position)."""
        out = self.model(torch.tensor([ids]), output_hidden_states=True)
        return out.hidden_states[2], out.logits[0, -1]

    def next_token(self, ids: list[int]) -> int:
        return int(torch.argmax(self.run(ids)[1]))

    def assert_greedy(self, token: int, ids: list[int]) -> None:
        """``token`` is the reference's greedy choice after ``ids`` (or its runner-up on a near tie)."""
        logits = self.run(ids)[1]
        top = torch.topk(logits, 2)
        if float(top.values[0] - top.values[1]) > 1e-3:
            assert token == int(top.indices[0]), (token, top)
        else:
            assert token in top.indices.tolist(), (token, top)


@pytest.fixture(scope="module")
def ref(model_dir) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def prompt_ids(ref) -> list[int]:
    ids = ref.tokenizer.encode(PROMPT, add_special_tokens=False)
    assert len(ids) >= 4
    return ids


@pytest.fixture(scope="module")
def survivor(tail, ref, prompt_ids):
    """A session prefilled on the tail before the barrage: (session id, past length, its first token)."""
    hidden, _ = ref.run(prompt_ids)
    token = token_of(forward(tail.url, hidden, {CACHE: "prefill", SESSION: SURVIVOR, START_LAYER: "2"}))
    ref.assert_greedy(token, prompt_ids)
    return SURVIVOR, len(prompt_ids), token


def store_stats(daemon: Daemon) -> dict:
    return daemon.get("/v1/status")["store"]


# --- valid calls --------------------------------------------------------------------------------


def test_survivor_prefilled_before_the_barrage(survivor, tail):
    sid, past_len, _ = survivor
    listed = {s["session_id"]: s for s in tail.get("/v1/sessions")["sessions"]}
    assert listed[sid]["past_len"] == past_len


def test_stateless_head_answers_activations_matching_the_reference(head, ref, prompt_ids):
    hidden_in = ref.embed(prompt_ids)
    reply = forward(head.url, hidden_in)
    assert reply.status == 200, reply
    assert reply.headers.get_content_type() == "application/octet-stream"
    assert reply.headers[DTYPE] == "float32"
    assert reply.headers[SHAPE] == f"1,{len(prompt_ids)},{HIDDEN}"
    assert len(reply.body) == len(prompt_ids) * HIDDEN * 4
    expected, _ = ref.run(prompt_ids)
    torch.testing.assert_close(from_reply(reply), expected, atol=1e-5, rtol=1e-4)


def test_stateless_head_defaults_to_float32_without_a_dtype_header(head, ref, prompt_ids):
    reply = forward(head.url, ref.embed(prompt_ids), dtype=None)
    assert reply.status == 200, reply
    assert reply.headers[DTYPE] == "float32"
    assert len(reply.body) == len(prompt_ids) * HIDDEN * 4


def test_stateless_tail_answers_the_greedy_token(tail, ref, prompt_ids):
    hidden, _ = ref.run(prompt_ids)
    reply = forward(tail.url, hidden)
    token = token_of(reply)
    ref.assert_greedy(token, prompt_ids)
    assert reply.json()["text"] == ref.tokenizer.decode([token])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_bodies_are_accepted(head, tail, ref, prompt_ids, dtype):
    reply = forward(head.url, ref.embed(prompt_ids), dtype=dtype)
    assert reply.status == 200, reply
    assert reply.headers[DTYPE] == dtype  # the reply travels in the request's dtype
    assert reply.headers[SHAPE] == f"1,{len(prompt_ids)},{HIDDEN}"
    assert len(reply.body) == len(prompt_ids) * HIDDEN * 2
    expected, _ = ref.run(prompt_ids)
    torch.testing.assert_close(from_reply(reply), expected, atol=0.1, rtol=0.05)
    token_of(forward(tail.url, from_reply(reply), dtype=dtype))


def test_prefill_then_decode_along_the_route_matches_greedy_generation(head, tail, ref, prompt_ids):
    sid = "route-gen-1"
    ids = list(prompt_ids)
    mode_headers = {CACHE: "prefill", SESSION: sid}
    feed = ids
    for step in range(4):
        hop0 = forward(head.url, ref.embed(feed), mode_headers | {START_LAYER: "0", HOP_INDEX: "0"})
        assert hop0.status == 200, (step, hop0)
        expected, _ = ref.run(ids)
        torch.testing.assert_close(from_reply(hop0), expected[:, -len(feed):], atol=1e-5, rtol=1e-4)
        reply = forward(tail.url, hop0.body, mode_headers | {START_LAYER: "2", HOP_INDEX: "1"},
                        shape=hop0.headers[SHAPE])
        token = token_of(reply)
        ref.assert_greedy(token, ids)
        mode_headers = {CACHE: "decode", SESSION: sid, PAST_LEN: str(len(ids))}
        ids.append(token)
        feed = [token]
    for node, start in ((head, 0), (tail, 2)):
        entry = {s["session_id"]: s for s in node.get("/v1/sessions")["sessions"]}[sid]
        assert entry["past_len"] == len(ids) - 1
        assert entry["start_layer"] == start


def test_multi_token_decode_on_a_cache_that_does_not_hold_layer_0(tail, ref, prompt_ids):
    """A chunked continuation on the tail (layers 2-3): the mask must be built against layer 2."""
    sid = "chunked-1"
    first, rest = prompt_ids[:2], prompt_ids[2:]
    hidden, _ = ref.run(prompt_ids)
    token_of(forward(tail.url, hidden[:, :2], {CACHE: "prefill", SESSION: sid}))
    reply = forward(tail.url, hidden[:, 2:], {CACHE: "decode", SESSION: sid, PAST_LEN: str(len(first))})
    ref.assert_greedy(token_of(reply), first + rest)
    entry = {s["session_id"]: s for s in tail.get("/v1/sessions")["sessions"]}[sid]
    assert entry["past_len"] == len(prompt_ids)


# --- 409 cache misses ---------------------------------------------------------------------------


@pytest.mark.parametrize("node", ["head", "tail"])
def test_decode_of_an_unknown_session_is_a_409(request, node):
    daemon = request.getfixturevalue(node)
    reply = forward(daemon.url, random_hidden(1), {CACHE: "decode", SESSION: f"never-seen-{node}", PAST_LEN: "5"})
    assert_cache_miss(reply, "unknown_session")


@pytest.mark.parametrize("past_len", ["4", "6", "0"])
def test_decode_with_the_wrong_past_len_is_a_409(tail, past_len):
    sid = f"past-len-{past_len}"
    token_of(forward(tail.url, random_hidden(5), {CACHE: "prefill", SESSION: sid}))
    reply = forward(tail.url, random_hidden(1, 1), {CACHE: "decode", SESSION: sid, PAST_LEN: past_len})
    assert_cache_miss(reply, "past_len_mismatch")


def test_decode_from_another_start_layer_is_a_409(tail):
    sid = "start-layer-1"
    token_of(forward(tail.url, random_hidden(3), {CACHE: "prefill", SESSION: sid, START_LAYER: "2"}))
    reply = forward(tail.url, random_hidden(1, 1), {CACHE: "decode", SESSION: sid, PAST_LEN: "3", START_LAYER: "3"})
    assert_cache_miss(reply, "start_layer_mismatch")


@pytest.mark.slow
def test_a_node_without_a_kv_cache_prefills_statelessly_and_refuses_decode(nokv, ref, prompt_ids):
    hidden, _ = ref.run(prompt_ids)
    token = token_of(forward(nokv.url, hidden, {CACHE: "prefill", SESSION: "nokv-1"}))
    ref.assert_greedy(token, prompt_ids)
    assert nokv.get("/v1/sessions")["sessions"] == []  # nothing was cached
    reply = forward(nokv.url, random_hidden(1), {CACHE: "decode", SESSION: "nokv-1", PAST_LEN: str(len(prompt_ids))})
    assert_cache_miss(reply, "cache_disabled")
    status = nokv.get("/v1/status")
    assert status["supports_kv_cache"] is False
    assert status["kv_cache_enabled"] is False


@pytest.mark.slow
def test_a_cache_disabled_miss_is_counted(nokv):
    before = store_stats(nokv)
    assert_cache_miss(forward(nokv.url, random_hidden(1), {CACHE: "decode", SESSION: "nokv-2", PAST_LEN: "3"}),
                      "cache_disabled")
    after = store_stats(nokv)
    assert after["misses_by_reason"]["cache_disabled"] == before["misses_by_reason"]["cache_disabled"] + 1
    assert after["misses"] == before["misses"] + 1


# --- malformed requests: every one a 400 naming its field, before any model work ----------------


def _bad(name, *, param, match=None, node="tail", body=None, drop=(), marks=(), **headers):
    return pytest.param(node, body, drop, headers, param, match, id=name, marks=marks)


_F32_1 = to_bytes(random_hidden(1, 7))
_F32_2 = to_bytes(random_hidden(2, 7))
BARRAGE = [
    # shape
    _bad("shape-batch-2", param=SHAPE, match="batch", body=_F32_2, **{SHAPE: "2,1,64"}),
    _bad("shape-hidden-65", param=SHAPE, match="hidden", body=b"\0" * 65 * 4, **{SHAPE: "1,1,65"}),
    _bad("shape-hidden-63", param=SHAPE, match="hidden", body=b"\0" * 63 * 4, **{SHAPE: "1,1,63"}),
    _bad("shape-missing", param=SHAPE, match=SHAPE, drop=(SHAPE,)),
    _bad("shape-abc", param=SHAPE, match=SHAPE, **{SHAPE: "abc"}),
    _bad("shape-two-dims", param=SHAPE, match=SHAPE, **{SHAPE: "1,64"}),
    _bad("shape-four-dims", param=SHAPE, match=SHAPE, **{SHAPE: "1,1,64,1"}),
    _bad("shape-x-separated", param=SHAPE, match=SHAPE, **{SHAPE: "1x1x64"}),
    _bad("shape-empty", param=SHAPE, match=SHAPE, **{SHAPE: ""}),
    _bad("shape-negative", param=SHAPE, match=SHAPE, **{SHAPE: "1,-1,64"}),
    _bad("shape-zero-tokens", param=SHAPE, match=SHAPE, body=b"", **{SHAPE: "1,0,64"}),
    _bad("shape-float", param=SHAPE, match=SHAPE, **{SHAPE: "1,1,64.0"}),
    _bad("shape-huge", param=SHAPE, match=SHAPE, **{SHAPE: "1,999999999,64"}),
    _bad("shape-unicode-digit", param=SHAPE, match=SHAPE, **{SHAPE: "1,\u00b9,64".encode()}),
    # dtype
    _bad("dtype-float64", param=DTYPE, match=DTYPE, **{DTYPE: "float64"}),
    _bad("dtype-int8", param=DTYPE, match=DTYPE, **{DTYPE: "int8"}),
    _bad("dtype-fp32", param=DTYPE, match=DTYPE, **{DTYPE: "fp32"}),
    _bad("dtype-empty", param=DTYPE, match=DTYPE, **{DTYPE: ""}),
    _bad("dtype-float16-with-float32-bytes", param="body", match="bytes", **{DTYPE: "float16"}),
    # body length
    _bad("body-one-byte-short", param="body", match="bytes", body=_F32_1[:-1]),
    _bad("body-four-bytes-long", param="body", match="bytes", body=_F32_1 + b"\0" * 4),
    _bad("body-two-tokens-for-one", param="body", match="bytes", body=_F32_2),
    _bad("body-empty", param="body", match="bytes", body=b""),
    _bad("body-empty-no-shape", param=SHAPE, match=SHAPE, body=b"", drop=(SHAPE,)),
    # past length
    _bad("past-len-abc", param=PAST_LEN, match=PAST_LEN, **{PAST_LEN: "abc"}),
    _bad("past-len-negative", param=PAST_LEN, match=PAST_LEN, **{PAST_LEN: "-1"}),
    _bad("past-len-float", param=PAST_LEN, match=PAST_LEN, **{PAST_LEN: "1.5"}),
    _bad("past-len-hex", param=PAST_LEN, match=PAST_LEN, **{PAST_LEN: "0x10"}),
    _bad("past-len-exponent", param=PAST_LEN, match=PAST_LEN, **{PAST_LEN: "1e3"}),
    _bad("past-len-empty", param=PAST_LEN, match=PAST_LEN, **{PAST_LEN: ""}),
    _bad("past-len-too-long", param=PAST_LEN, match=PAST_LEN, **{PAST_LEN: "99999999999"}),
    _bad("past-len-too-large", param=PAST_LEN, match=PAST_LEN, **{PAST_LEN: "2000000"}),
    _bad("past-len-unicode-digit", param=PAST_LEN, match=PAST_LEN,
         **{PAST_LEN: "\u00b2".encode()}),
    _bad("decode-without-past-len", param=PAST_LEN, match=PAST_LEN, drop=(PAST_LEN,)),
    # session
    _bad("decode-without-session", param=SESSION, match=SESSION, drop=(SESSION,)),
    _bad("prefill-without-session", param=SESSION, match=SESSION, drop=(SESSION, PAST_LEN), **{CACHE: "prefill"}),
    _bad("session-slash", param=SESSION, match=SESSION, **{SESSION: "bad/id"}),
    _bad("session-space", param=SESSION, match=SESSION, **{SESSION: "bad id"}),
    _bad("session-semicolon", param=SESSION, match=SESSION, **{SESSION: "bad;id"}),
    _bad("session-latin1", param=SESSION, match=SESSION, **{SESSION: "s\u00fcrvivor"}),
    _bad("session-utf8", param=SESSION, match=SESSION, **{SESSION: "s\u00fcrvivor".encode()}),
    _bad("session-empty", param=SESSION, match=SESSION, **{SESSION: ""}),
    _bad("session-129-chars", param=SESSION, match=SESSION, **{SESSION: "a" * 129}),
    # cache mode
    _bad("cache-sideways", param=CACHE, match=CACHE, **{CACHE: "sideways"}),
    _bad("cache-empty", param=CACHE, match=CACHE, **{CACHE: ""}),
    _bad("cache-two-modes", param=CACHE, match=CACHE, **{CACHE: "decode,prefill"}),
    # start layer
    _bad("start-layer-0-on-tail", param=START_LAYER, match=START_LAYER, **{START_LAYER: "0"}),
    _bad("start-layer-1-on-tail", param=START_LAYER, match=START_LAYER, **{START_LAYER: "1"}),
    _bad("start-layer-4-on-tail", param=START_LAYER, match=START_LAYER, **{START_LAYER: "4"}),
    _bad("start-layer-99-on-tail", param=START_LAYER, match=START_LAYER, **{START_LAYER: "99"}),
    _bad("start-layer-negative", param=START_LAYER, match=START_LAYER, **{START_LAYER: "-2"}),
    _bad("start-layer-abc", param=START_LAYER, match=START_LAYER, **{START_LAYER: "x"}),
    _bad("start-layer-unicode-digit", param=START_LAYER, match=START_LAYER,
         **{START_LAYER: "\u00b3".encode()}),
    _bad("start-layer-2-on-head", param=START_LAYER, match=START_LAYER, node="head", **{START_LAYER: "2"}),
    # hop index
    _bad("hop-index-abc", param=HOP_INDEX, match=HOP_INDEX, **{HOP_INDEX: "x"}),
    _bad("hop-index-negative", param=HOP_INDEX, match=HOP_INDEX, **{HOP_INDEX: "-1"}),
    _bad("hop-index-too-large", param=HOP_INDEX, match=HOP_INDEX, **{HOP_INDEX: "99999"}),
    # sampling
    _bad("sampling-not-json", param=SAMPLING, match=SAMPLING, **{SAMPLING: "{not json"}),
    _bad("sampling-list", param=SAMPLING, match=SAMPLING, **{SAMPLING: "[1, 2]"}),
    _bad("sampling-string", param=SAMPLING, match=SAMPLING, **{SAMPLING: '"greedy"'}),
    _bad("sampling-null", param=SAMPLING, match=SAMPLING, **{SAMPLING: "null"}),
    _bad("sampling-temperature-string", param=SAMPLING, match="temperature", **{SAMPLING: '{"temperature": "hot"}'}),
    _bad("sampling-unknown-field", param=SAMPLING, match="bogus", **{SAMPLING: '{"bogus": 1}'}),
    _bad("sampling-float-seed", param=SAMPLING, match="seed", **{SAMPLING: '{"seed": 1.5}'}),
    _bad("sampling-bool-top-k", param=SAMPLING, match="top_k", **{SAMPLING: '{"top_k": true}'}),
    _bad("sampling-nan-temperature", param=SAMPLING, match="temperature", **{SAMPLING: '{"temperature": NaN}'}),
    _bad("sampling-infinite-temperature", param=SAMPLING, match="temperature",
         **{SAMPLING: '{"temperature": Infinity}'}),
    _bad("sampling-negative-temperature", param=SAMPLING, match="temperature", **{SAMPLING: '{"temperature": -1}'}),
    _bad("sampling-negative-top-p", param=SAMPLING, match="top_p", **{SAMPLING: '{"temperature": 1, "top_p": -1}'}),
    _bad("sampling-zero-top-p", param=SAMPLING, match="top_p", **{SAMPLING: '{"temperature": 1, "top_p": 0}'}),
    _bad("sampling-nan-top-p", param=SAMPLING, match="top_p", **{SAMPLING: '{"temperature": 1, "top_p": NaN}'}),
    _bad("sampling-negative-top-k", param=SAMPLING, match="top_k", **{SAMPLING: '{"top_k": -3}'}),
    _bad("sampling-huge-seed", param=SAMPLING, match="seed", **{SAMPLING: '{"seed": 100000000000000000000000}'}),
]


@pytest.mark.parametrize("node, body, drop, headers, param, match", BARRAGE)
def test_malformed_request_is_a_400_naming_the_field(request, survivor, node, body, drop, headers, param, match):
    """Each request is a decode of the survivor session with one thing wrong (or missing)."""
    daemon = request.getfixturevalue(node)
    sid, past_len, _ = survivor
    sent = {
        "Content-Type": "application/octet-stream",
        DTYPE: "float32",
        SHAPE: f"1,1,{HIDDEN}",
        CACHE: "decode",
        SESSION: sid,
        PAST_LEN: str(past_len),
        START_LAYER: "2" if node == "tail" else "0",
        HOP_INDEX: "1",
    }
    sent.update(headers)
    for name in drop:
        sent.pop(name)
    reply = send("POST", daemon.url + "/forward", _F32_1 if body is None else body, sent)
    assert reply.status == 400, reply
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error", error
    assert error["param"] == param, error
    assert match.lower() in error["message"].lower(), error


def test_a_truncated_body_is_never_served(tail):
    """The client promises more bytes than it sends, then closes its side: no 2xx answer."""
    body = to_bytes(random_hidden(3))
    u = urlsplit(tail.url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        head = (f"POST /forward HTTP/1.1\r\nHost: {u.hostname}\r\nConnection: close\r\n{SHAPE}: 1,3,{HIDDEN}\r\n"
                f"{DTYPE}: float32\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        s.sendall(head + body[: len(body) // 2])
        s.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    if answer:  # closing without an answer is fine too
        status = int(answer.split(b" ", 2)[1])
        assert 400 <= status < 500, answer[:300]
    assert tail.get("/health")["status"] == "ok"


@pytest.mark.parametrize("temperature", ["1e-300", "1e-45"])
def test_a_tiny_temperature_is_greedy_or_rejected_never_a_500(tail, ref, prompt_ids, temperature):
    hidden, _ = ref.run(prompt_ids)
    reply = forward(tail.url, hidden, {SAMPLING: f'{{"temperature": {temperature}, "seed": 7}}'})
    if reply.status == 400:
        assert reply.json()["error"]["param"] == SAMPLING, reply
    else:
        ref.assert_greedy(token_of(reply), prompt_ids)


# --- after the barrage --------------------------------------------------------------------------


def test_node_still_serves_after_the_barrage(head, tail, survivor, ref, prompt_ids):
    sid, past_len, first_token = survivor
    for daemon in (head, tail):
        health = send("GET", daemon.url + "/health")
        assert health.status == 200, health
        assert health.json()["status"] == "ok"
    ids = prompt_ids + [first_token]
    hidden, _ = ref.run(ids)
    # the barrage used this very session id; none of it touched the cache
    reply = forward(tail.url, hidden[:, -1:], {CACHE: "decode", SESSION: sid, PAST_LEN: str(past_len)})
    ref.assert_greedy(token_of(reply), ids)
    entry = {s["session_id"]: s for s in tail.get("/v1/sessions")["sessions"]}[sid]
    assert entry["past_len"] == past_len + 1


# --- sessions, status, route --------------------------------------------------------------------


def test_sessions_list_and_drop(tail):
    sid = "listed-1"
    tokens = 3
    token_of(forward(tail.url, random_hidden(tokens, 3), {CACHE: "prefill", SESSION: sid}))
    listing = tail.get("/v1/sessions")
    entry = {s["session_id"]: s for s in listing["sessions"]}[sid]
    assert entry["past_len"] == tokens
    assert entry["start_layer"] == 2
    # K and V of 2 layers x 2 kv heads x head dim 16, float32
    assert entry["bytes"] == 2 * 2 * 2 * 16 * 4 * tokens
    assert entry["created_at"] <= entry["last_used"] < entry["expires_at"]
    assert entry["expires_at"] > listing["time"]
    assert entry["expires_at"] - listing["time"] > 500  # the default TTL is 600 s
    assert abs(listing["time"] - time.time()) < 60

    dropped = send("DELETE", tail.url + f"/v1/sessions/{sid}")
    assert dropped.status == 200, dropped
    assert sid not in {s["session_id"] for s in tail.get("/v1/sessions")["sessions"]}
    assert_cache_miss(forward(tail.url, random_hidden(1), {CACHE: "decode", SESSION: sid, PAST_LEN: str(tokens)}),
                      "unknown_session")
    again = send("DELETE", tail.url + f"/v1/sessions/{sid}")
    assert again.status == 404, again
    assert isinstance(again.json()["error"]["message"], str)


def test_store_statistics_count_hits_and_misses(tail):
    sid = "stats-1"
    token_of(forward(tail.url, random_hidden(4), {CACHE: "prefill", SESSION: sid}))
    before = store_stats(tail)
    token_of(forward(tail.url, random_hidden(1, 1), {CACHE: "decode", SESSION: sid, PAST_LEN: "4"}))
    token_of(forward(tail.url, random_hidden(1, 2), {CACHE: "decode", SESSION: sid, PAST_LEN: "5"}))
    assert_cache_miss(forward(tail.url, random_hidden(1), {CACHE: "decode", SESSION: "stats-none", PAST_LEN: "4"}),
                      "unknown_session")
    assert_cache_miss(forward(tail.url, random_hidden(1), {CACHE: "decode", SESSION: sid, PAST_LEN: "9"}),
                      "past_len_mismatch")
    after = store_stats(tail)
    assert after["hits"] == before["hits"] + 2
    assert after["misses"] == before["misses"] + 2
    by_reason = {k: after["misses_by_reason"][k] - before["misses_by_reason"][k] for k in before["misses_by_reason"]}
    assert by_reason == {"unknown_session": 1, "past_len_mismatch": 1, "start_layer_mismatch": 0,
                         "cache_disabled": 0, "prefix_unavailable": 0, "not_croppable": 0}
    assert after["sessions"] == before["sessions"] - 1  # the mismatched session's cache was dropped


def test_status_fields(head, tail, model_dir):
    for daemon, start, end in ((head, 0, 2), (tail, 2, 4)):
        status = daemon.get("/v1/status")
        assert status["model"]["name"] == model_dir.name
        assert status["model"]["num_layers"] == 4
        assert status["model"]["hidden_size"] == HIDDEN
        assert status["model"]["model_type"] == "llama"
        assert (status["start"], status["end"]) == (start, end)
        assert status["layers"] == f"{start}-{end - 1}"
        assert status["supports_kv_cache"] is True
        assert status["kv_cache_enabled"] is True
        assert status["store"]["max_sessions"] == 256
        assert ("tail" in status["roles"]) is (daemon is tail)
        # what a chat may ask for: the console's sampling dialog is bounded by it
        assert status["context_length"] > 0
        assert status["max_tokens_cap"] == min(status["context_length"], 4096)
    head_status = head.get("/v1/status")
    assert [p["up"] for p in head_status["peers"]] == [True]
    assert head_status["peers"][0]["url"] == tail.url


def test_route_on_the_head_covers_every_layer(head, tail):
    route = head.get("/v1/route?refresh=1")
    assert route["error"] is None
    hops = route["hops"]
    assert [(h["url"], h["start_layer"], h["end_layer"]) for h in hops] == [(head.url, 0, 2), (tail.url, 2, 4)]
    assert [h["local"] for h in hops] == [True, False]
    assert all(h["kv_cache"] for h in hops)


# --- POST /forward/batch: several steps in one request --------------------------------------------


def batch(url: str, body: bytes) -> Reply:
    return send("POST", url + BATCH_PATH, body, {"Content-Type": BATCH_CONTENT_TYPE})


def test_a_batch_answers_each_of_its_steps_as_post_forward_would(tail, ref, prompt_ids):
    held = {}  # session -> its tokens so far
    for sid, prompt in (("batch-a", prompt_ids), ("batch-b", prompt_ids[:-1])):
        hidden, _ = ref.run(prompt)
        held[sid] = prompt + [token_of(forward(tail.url, hidden, {CACHE: "prefill", SESSION: sid, START_LAYER: "2"}))]
    frames = []
    for sid, ids in held.items():
        hidden, _ = ref.run(ids)
        frames.append(({DTYPE: "float32", SHAPE: f"1,1,{HIDDEN}", CACHE: "decode", SESSION: sid,
                        PAST_LEN: str(len(ids) - 1), START_LAYER: "2"}, to_bytes(hidden[:, -1:])))
    step = frames[0][1]
    frames.append(({DTYPE: "float32", SHAPE: f"1,1,{HIDDEN}", CACHE: "decode", SESSION: "nobody-holds-this",
                    PAST_LEN: "3"}, step))
    frames.append(({DTYPE: "float32", SHAPE: f"1,1,{HIDDEN}", CACHE: "decode", SESSION: "batch-a", PAST_LEN: "x"},
                   step))
    reply = batch(tail.url, b"".join(channel.request_frame(h, b) for h, b in frames))
    assert reply.status == 200, reply
    assert reply.headers.get_content_type() == BATCH_CONTENT_TYPE
    answers = channel.replies_in(reply.body)
    assert [status for status, *_ in answers] == [200, 200, 409, 400]
    for (_, _, body, _), ids in zip(answers, held.values()):
        ref.assert_greedy(json.loads(body)["token_id"], ids)
    assert json.loads(answers[2][2])["reason"] == "unknown_session"
    assert json.loads(answers[3][2])["error"]["param"] == PAST_LEN
    listed = {s["session_id"]: s["past_len"] for s in tail.get("/v1/sessions")["sessions"]}
    assert [listed[sid] for sid in held] == [len(ids) for ids in held.values()]  # each step went into its cache


@pytest.mark.parametrize("body", [b"", b"\x00\x00\x00\x05", b"not frames at all",
                                  channel.request_frame({"A": "b"}, b"x")[:-1]])
def test_a_batch_that_is_not_whole_step_frames_is_refused_whole_and_the_node_serves_on(tail, body):
    reply = batch(tail.url, body)
    assert reply.status == 400, reply
    assert reply.json()["error"]["type"] == "invalid_request_error"
    assert tail.get("/health")["status"] == "ok"
