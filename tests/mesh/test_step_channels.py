"""Step channels (``GET /v1/steps``, ``daemon.channel``) between real ``meshd`` processes on 127.0.0.1.

A tiny random 4-layer llama: a tail holds layers 2-3; two heads hold 0-1, one with step channels (the default)
and one with ``MESHNET_STEP_CHANNELS=off``; the mesh has an API key. Both heads' answers are the same tokens, and
the tail's status shows which head's decode steps came over a channel. Then the channel is spoken by hand: the
key is needed to open one, and every malformed or misplaced step is answered in a frame as ``POST /forward``
answers it, a broken frame closes the channel, and the node serves on.
"""

from __future__ import annotations

import json
import socket
import struct
from urllib.parse import urlsplit

import pytest
import torch

from daemon import channel
from tests.support.headers import CACHE, DTYPE, PAST_LEN, SESSION, SHAPE, START_LAYER
from tests.support.http_client import send
from tests.support.meshd import Daemon, start_mesh
from tests.support.watch import wait_for

KEY = "channel-test-key"
HIDDEN = 64
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def mesh(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("channel-logs")
    env = {"MESHNET_API_KEY": KEY}
    head, tail = start_mesh(tiny_model("llama"), [("0-1", []), ("2-3", [])], log_dir=logs, env=env)
    plain = Daemon(tiny_model("llama"), "0-1", peers=[tail], log_dir=logs, env=env | {"MESHNET_STEP_CHANNELS": "off"})
    try:
        plain.wait_ready()
        plain.wait_peers(1)
        yield head, plain, tail
    finally:
        for d in (head, plain, tail):
            d.stop()


def answer(head: Daemon, tokens: int = 24) -> list[int]:
    status, body = head.chat({"messages": MESSAGES, "max_tokens": tokens, "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    return body["meshnet"]["token_ids"]


def test_decode_steps_take_the_channel_and_answer_as_post_forward_does(mesh):
    head, plain, tail = mesh
    before = tail.get("/v1/status")["channel_steps"]
    over_http = answer(plain)
    assert tail.get("/v1/status")["channel_steps"] == before  # that head sends every step on POST /forward
    first = answer(head)  # its first decode steps go on POST /forward while the channel opens
    wait_for(lambda: tail.get("/v1/status")["step_channels"] == 1, timeout=10)
    counted = tail.get("/v1/status")["channel_steps"]
    second = answer(head)
    status = tail.get("/v1/status")
    assert first == second == over_http and len(first) == 24
    assert status["channel_steps"] - counted == 23  # every decode step of the second answer (the prefill is not)
    assert status["step_channels"] == 1  # the head keeps the one channel open


def raw_channel(node: Daemon, *, key: str | None = KEY) -> tuple[socket.socket, bytes]:
    """A connection to ``node`` that asked to open a step channel: the socket and the answer's head."""
    parts = urlsplit(node.url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    sock.sendall(f"GET {channel.PATH} HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: {channel.UPGRADE}\r\n"
                 f"{auth}\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        assert chunk, head
        head += chunk
    return sock, head


def step(sock: socket.socket, headers: dict, body: bytes) -> tuple[int, dict]:
    sock.sendall(channel.request_frame(headers, body))
    status, reply_headers, reply_body, _ = channel.read_reply(sock)
    is_json = reply_headers.get("Content-Type", "").startswith("application/json")
    return status, json.loads(reply_body) if is_json else {"bytes": len(reply_body)}


def activation(tokens: int) -> tuple[dict, bytes]:
    hidden = torch.randn(1, tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    return {DTYPE: "float32", SHAPE: f"1,{tokens},{HIDDEN}"}, hidden.numpy().tobytes()


def test_opening_a_channel_needs_the_key(mesh):
    _, _, tail = mesh
    sock, head = raw_channel(tail, key=None)
    assert head.startswith(b"HTTP/1.1 401"), head
    sock.close()
    sock, head = raw_channel(tail, key="wrong")
    assert head.startswith(b"HTTP/1.1 401"), head
    sock.close()


def test_a_channel_answers_each_step_as_post_forward_would_and_a_broken_frame_closes_it(mesh):
    _, _, tail = mesh
    sock, head = raw_channel(tail)
    assert head.startswith(b"HTTP/1.1 101"), head
    try:
        shape, body = activation(1)
        missing = step(sock, shape | {CACHE: "decode", SESSION: "nobody-holds-this", PAST_LEN: "3"}, body)
        assert missing[0] == 409 and missing[1]["reason"] == "unknown_session", missing
        bad = step(sock, shape | {CACHE: "decode", SESSION: "s", PAST_LEN: "x"}, body)
        assert bad[0] == 400 and bad[1]["error"]["param"] == PAST_LEN, bad
        outside = step(sock, shape | {CACHE: "decode", SESSION: "s", PAST_LEN: "3", START_LAYER: "0"}, body)
        assert outside[0] == 400 and outside[1]["error"]["param"] == START_LAYER, outside
        prompt_shape, prompt = activation(4)
        long = step(sock, prompt_shape | {CACHE: "prefill", SESSION: "by-hand"}, prompt)
        assert long[0] == 400 and "POST /forward" in long[1]["error"]["message"], long
        wrong_size = step(sock, shape | {CACHE: "decode", SESSION: "s", PAST_LEN: "3"}, body[:-4])
        assert wrong_size[0] == 400, wrong_size
        assert tail.get("/v1/status")["step_channels"] >= 1  # every refusal kept the channel open
        sock.sendall(struct.pack(">II", channel.MAX_HEADER_BYTES + 1, 0))  # a frame over the limits
        assert sock.recv(1) == b""  # closed
    finally:
        sock.close()
    assert tail.get("/health")  # and the node serves on


def test_a_frame_without_headers_continues_the_last_step_the_node_answered(mesh):
    _, _, tail = mesh
    prompt_shape, prompt = activation(4)
    for session in ("in-full", "continued"):  # two sessions prefilled alike, decoded alike
        reply = send("POST", tail.url + "/forward", prompt, prompt_shape | {
            CACHE: "prefill", SESSION: session, "Authorization": f"Bearer {KEY}",
            "Content-Type": "application/octet-stream"})
        assert reply.status == 200, reply.body
    inputs = [torch.randn(1, 1, HIDDEN, generator=torch.Generator().manual_seed(100 + i)).numpy().tobytes()
              for i in range(4)]
    shape = {DTYPE: "float32", SHAPE: f"1,1,{HIDDEN}"}
    sock, head = raw_channel(tail)
    try:
        alone = step(sock, {}, inputs[0])  # nothing before it on this channel
        assert alone[0] == 400 and alone[1]["error"]["param"] == PAST_LEN, alone
        tokens = {}
        for session in ("in-full", "continued"):
            answers = [step(sock, {} if session == "continued" and i else
                             shape | {CACHE: "decode", SESSION: session, PAST_LEN: str(4 + i)}, body)
                       for i, body in enumerate(inputs)]
            assert all(status == 200 for status, _ in answers), answers
            tokens[session] = [answer["token_id"] for _, answer in answers]
        assert tokens["continued"] == tokens["in-full"]
        short = step(sock, {}, inputs[0][:-4])  # a body the step it continues would not take
        assert short[0] == 400 and short[1]["error"]["param"] == "body", short
        after = step(sock, {}, inputs[0])  # a refusal ends what a continuation may follow
        assert after[0] == 400 and after[1]["error"]["param"] == PAST_LEN, after
        missing = step(sock, shape | {CACHE: "decode", SESSION: "nobody-holds-this", PAST_LEN: "3"}, inputs[0])
        assert missing[0] == 409, missing
        assert step(sock, {}, inputs[0])[0] == 400  # nor does a cache miss
        assert tail.get("/v1/status")["step_channels"] >= 1  # every refusal kept the channel open
    finally:
        sock.close()


def test_a_plain_get_of_the_channel_path_is_refused(mesh):
    _, _, tail = mesh
    parts = urlsplit(tail.url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(f"GET {channel.PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
        assert sock.recv(4096).startswith(b"HTTP/1.1 400")
