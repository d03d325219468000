"""Unit tests of the /forward wire protocol (``daemon.wire``): round trips and header validation."""

from __future__ import annotations

import json
import struct

import pytest

from daemon import wire
from daemon.api import Sampling
from daemon.errors import BadRequest
from daemon.wire import (
    Activation,
    forward_headers,
    parse_activation,
    parse_forward,
    parse_sampling,
    parse_shape,
)

HIDDEN = 8
FIRST, END = 10, 20  # this node hosts layers 10-19 (half-open [10, 20))


def body_for(dtype: str, seq: int, hidden: int = HIDDEN) -> bytes:
    return b"\x01" * (seq * hidden * wire.DTYPE_SIZES[dtype])


def activation(dtype: str = "float32", seq: int = 3) -> Activation:
    if dtype == "float32":
        data = struct.pack(f"<{seq * HIDDEN}f", *[i * 0.5 for i in range(seq * HIDDEN)])
    else:
        data = body_for(dtype, seq)
    return Activation(dtype=dtype, shape=(1, seq, HIDDEN), data=data)


def parse(headers: dict, body: bytes, *, first: int = FIRST, end: int = END):
    return parse_forward(headers, body, hidden_size=HIDDEN, first_layer=first, end_layer=end)


def good_headers(**overrides) -> dict:
    act = activation()
    headers = forward_headers(act, mode="decode", session_id="sess-1", past_len=7, start_layer=12, hop_index=1)
    headers.update(overrides)
    return headers


def bad(headers: dict, body: bytes | None = None, **kw) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        parse(headers, activation().data if body is None else body, **kw)
    assert info.value.status == 400
    return info.value


# ---- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_activation_headers_round_trip(dtype):
    act = activation(dtype, seq=5)
    parsed = parse_activation(act.headers(), act.data, hidden_size=HIDDEN)
    assert parsed.dtype == dtype
    assert parsed.shape == (1, 5, HIDDEN)
    assert bytes(parsed.data) == bytes(act.data)
    assert act.headers() == {wire.DTYPE: dtype, wire.SHAPE: f"1,5,{HIDDEN}"}


def test_forward_round_trip_decode_with_sampling():
    act = activation(seq=1)
    sampling = {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 1234}
    headers = forward_headers(act, mode="decode", session_id="abc.DEF:1-2_3", past_len=41,
                              start_layer=15, hop_index=2, sampling=sampling)
    assert headers["Content-Type"] == "application/octet-stream"
    req = parse(headers, act.data)
    assert req.mode == "decode"
    assert req.session_id == "abc.DEF:1-2_3"
    assert req.past_len == 41
    assert req.start_layer == 15
    assert req.hop_index == 2
    assert req.sampling == sampling
    assert req.activation == Activation("float32", (1, 1, HIDDEN), act.data)


def test_forward_round_trip_prefill_sends_no_past_len():
    act = activation(seq=4)
    headers = forward_headers(act, mode="prefill", session_id="s", past_len=99, start_layer=10, hop_index=0)
    assert wire.PAST_LEN not in headers
    req = parse(headers, act.data)
    assert (req.mode, req.session_id, req.past_len, req.start_layer, req.hop_index) == ("prefill", "s", 0, 10, 0)
    assert req.sampling == {}


def test_forward_round_trip_stateless():
    act = activation("bfloat16", seq=2)
    headers = forward_headers(act, mode=None, session_id=None, past_len=0, start_layer=19, hop_index=3)
    assert wire.CACHE not in headers and wire.SESSION not in headers and wire.SAMPLING not in headers
    req = parse(headers, act.data)
    assert req.mode is None and req.session_id is None
    assert req.start_layer == 19
    assert req.activation.dtype == "bfloat16"


def test_forward_defaults_with_minimal_headers():
    body = activation(seq=2).data
    req = parse({wire.SHAPE: f"1,2,{HIDDEN}"}, body)
    assert req.activation.dtype == "float32"  # the exact default
    assert req.start_layer == FIRST  # default: this node's first layer
    assert req.mode is None and req.session_id is None and req.past_len == 0
    assert req.hop_index is None and req.sampling == {}


def test_header_values_tolerate_case_and_whitespace():
    act = activation()
    headers = good_headers(**{wire.CACHE: " Decode ", wire.DTYPE: " Float32 ",
                              wire.PAST_LEN: " 7 ", wire.SHAPE: f" 1 , 3 , {HIDDEN} "})
    req = parse(headers, act.data)
    assert req.mode == "decode" and req.past_len == 7 and req.activation.shape == (1, 3, HIDDEN)


# ---- shape ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [
    "1,3", "1,3,8,1", "x,3,8", "1,-3,8", "1,3.0,8", "", "1,3,", "1,0,8", "2,3,8", "1,3,9",
    "1,1234567890,8",
])
def test_bad_shape(shape):
    err = bad(good_headers(**{wire.SHAPE: shape}))
    assert err.param == wire.SHAPE


def test_missing_shape():
    headers = good_headers()
    del headers[wire.SHAPE]
    err = bad(headers)
    assert err.param == wire.SHAPE
    assert "missing" in err.message


def test_shape_sequence_limit():
    assert parse_shape(f"1,{wire.MAX_SEQUENCE},{HIDDEN}", hidden_size=HIDDEN) == (1, wire.MAX_SEQUENCE, HIDDEN)
    with pytest.raises(BadRequest) as info:
        parse_shape(f"1,{wire.MAX_SEQUENCE + 1},{HIDDEN}", hidden_size=HIDDEN)
    assert info.value.param == wire.SHAPE


# ---- dtype and body ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float64", "int8", "fp16", "", "pickle"])
def test_bad_dtype(dtype):
    err = bad(good_headers(**{wire.DTYPE: dtype}))
    assert err.param == wire.DTYPE


@pytest.mark.parametrize("delta", [-1, 1, -4, 4])
def test_body_length_must_match(delta):
    body = activation().data
    body = body[:delta] if delta < 0 else body + b"\0" * delta
    err = bad(good_headers(), body)
    assert err.param == "body"
    assert str(len(body)) in err.message


def test_body_length_depends_on_dtype():
    body = activation("float32").data  # 4 bytes a value: twice what float16 needs
    err = bad(good_headers(**{wire.DTYPE: "float16"}), body)
    assert err.param == "body"
    ok = parse(good_headers(**{wire.DTYPE: "float16"}), body[: len(body) // 2])
    assert ok.activation.dtype == "float16"


def test_empty_body():
    err = bad(good_headers(), b"")
    assert err.param == "body"


# ---- past-len, session, cache mode ---------------------------------------------------------------


@pytest.mark.parametrize("value", ["-1", "abc", "1.5", "", "1e3", "0x10", "1234567890", str(wire.MAX_SEQUENCE + 1)])
def test_bad_past_len(value):
    err = bad(good_headers(**{wire.PAST_LEN: value}))
    assert err.param == wire.PAST_LEN


def test_decode_needs_past_len():
    headers = good_headers()
    del headers[wire.PAST_LEN]
    err = bad(headers)
    assert err.param == wire.PAST_LEN


def test_superscript_digit_is_a_bad_request():
    err = bad(good_headers(**{wire.PAST_LEN: "²"}))
    assert err.param == wire.PAST_LEN


def test_superscript_digit_in_shape_is_a_bad_request():
    err = bad(good_headers(**{wire.SHAPE: f"1,³,{HIDDEN}"}))
    assert err.param == wire.SHAPE


@pytest.mark.parametrize("session", ["", "has space", "semi;colon", "x" * 129, "slash/", "é"])
def test_bad_session(session):
    err = bad(good_headers(**{wire.SESSION: session}))
    assert err.param == wire.SESSION


def test_session_length_limit():
    req = parse(good_headers(**{wire.SESSION: "x" * 128}), activation().data)
    assert req.session_id == "x" * 128


def test_session_with_trailing_newline_is_rejected():
    err = bad(good_headers(**{wire.SESSION: "abc\n"}))
    assert err.param == wire.SESSION


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_cache_mode_needs_session(mode):
    headers = good_headers(**{wire.CACHE: mode})
    del headers[wire.SESSION]
    err = bad(headers)
    assert err.param == wire.SESSION


@pytest.mark.parametrize("mode", ["stateless", "", "prefil", "decode,prefill"])
def test_bad_cache_mode(mode):
    err = bad(good_headers(**{wire.CACHE: mode}))
    assert err.param == wire.CACHE


# ---- start layer, hop index -----------------------------------------------------------------------


@pytest.mark.parametrize("start", [0, FIRST - 1, END, END + 1, 1000])
def test_start_layer_out_of_range(start):
    err = bad(good_headers(**{wire.START_LAYER: str(start)}))
    assert err.param == wire.START_LAYER


@pytest.mark.parametrize("start", ["-1", "ten", "1.0"])
def test_start_layer_not_an_integer(start):
    err = bad(good_headers(**{wire.START_LAYER: start}))
    assert err.param == wire.START_LAYER


@pytest.mark.parametrize("start", [FIRST, 15, END - 1])
def test_start_layer_in_range(start):
    assert parse(good_headers(**{wire.START_LAYER: str(start)}), activation().data).start_layer == start


@pytest.mark.parametrize("hop", ["1025", "-1", "x"])
def test_bad_hop_index(hop):
    err = bad(good_headers(**{wire.HOP_INDEX: hop}))
    assert err.param == wire.HOP_INDEX


# ---- sampling ---------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [
    '{"temperature": 0.5, "bogus": 1}',  # unknown field
    '{"top_k": 1.5}',  # wrong type
    '{"top_k": true}',  # bool is not an int here
    '{"seed": "1"}',
    '{"temperature": "hot"}',
    '{"top_p": null}',
    "[1, 2]",  # not an object
    '"temperature"',
    "{not json",
])
def test_bad_sampling(raw):
    err = bad(good_headers(**{wire.SAMPLING: raw}))
    assert err.param == wire.SAMPLING


def test_sampling_unknown_field_is_named():
    with pytest.raises(BadRequest) as info:
        parse_sampling('{"top_z": 3}')
    assert "top_z" in info.value.message


def test_sampling_accepts_ints_for_floats():
    value = {"temperature": 1, "top_p": 1, "top_k": 0, "seed": 2**40}
    assert parse_sampling(json.dumps(value)) == value
    assert parse_sampling(None) == {}
    assert parse_sampling("{}") == {}


def test_history_travels_after_the_activation_bytes():
    act = wire.Activation("float32", (1, 2, 8), bytes(64))
    history = wire.History((5, 1, 900), (7, 7))
    headers = wire.forward_headers(act, mode="decode", session_id="s", past_len=3, start_layer=0, hop_index=1,
                                   sampling=Sampling(presence_penalty=1.0).to_wire(), history=history)
    parsed = wire.parse_forward(headers, bytes(act.data) + history.to_bytes(), hidden_size=8, first_layer=0,
                                end_layer=4)
    assert parsed.history == history
    assert parsed.activation.data == bytes(64)
    assert parsed.sampling["presence_penalty"] == 1.0
    without = wire.parse_forward(wire.forward_headers(act, mode="prefill", session_id="s", past_len=0,
                                                      start_layer=0, hop_index=1), bytes(64), hidden_size=8,
                                 first_layer=0, end_layer=4)
    assert without.history is None


@pytest.mark.parametrize("count, extra", [("3,0", 8), ("1", 4), ("a,b", 4), ("0,99999", 4), ("-1,2", 4)])
def test_a_bad_history_is_a_400(count, extra):
    act = wire.Activation("float32", (1, 1, 8), bytes(32))
    headers = wire.forward_headers(act, mode="prefill", session_id="s", past_len=0, start_layer=0, hop_index=0)
    headers[wire.HISTORY] = count
    with pytest.raises(BadRequest):
        wire.parse_forward(headers, bytes(32 + extra), hidden_size=8, first_layer=0, end_layer=4)


@pytest.mark.parametrize("field, value", [("min_p", 1.5), ("repetition_penalty", 0), ("presence_penalty", 3),
                                          ("frequency_penalty", -2.5), ("logprobs", 21), ("logprobs", 1.0)])
def test_bad_later_sampling_fields_are_a_400(field, value):
    with pytest.raises(BadRequest):
        wire.parse_sampling(json.dumps({field: value}))


def test_the_tail_json_has_logprobs_only_when_asked():
    plain = wire.ForwardReply(token_id=3, text="x")
    assert plain.token_json() == {"token_id": 3, "text": "x"}
    asked = wire.ForwardReply(token_id=3, text="x", logprob=-0.5, top_logprobs=[(3, -0.5), (4, -1.5)])
    assert asked.token_json() == {"token_id": 3, "text": "x", "logprob": -0.5, "top_logprobs": [[3, -0.5], [4, -1.5]]}
