"""A node exposed to a network: the mesh token, request limits, graceful shutdown, metrics and request-id logs.

Real meshd processes on 127.0.0.1; most use a tiny random-weight Llama (fast to load), the
token-identity checks the built-in model.
"""

from __future__ import annotations

import http.client
import json
import math
import signal
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.headers import CACHE, PAST_LEN, REQUEST_ID, SAMPLING, SESSION, SHAPE
from tests.support.http_client import http_json, send
from tests.support.meshd import Daemon, free_port, run_meshd_in_process, start_mesh

TOKEN = "s3cret-mesh-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = [{"role": "user", "content": "Tell me about owls."}]


def chat_body(max_tokens: int = 8, **extra) -> bytes:
    return json.dumps({"messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
                      | extra).encode()


def openai_error(data: dict, code: str) -> None:
    assert set(data) == {"error"}, data
    assert set(data["error"]) == {"message", "type", "param", "code"}, data
    assert data["error"]["code"] == code, data


# ---- the mesh token ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def token_mesh(default_model, tmp_path_factory):
    """Two nodes that need the token and log JSON (one mesh for the token's tests and the logs' and metrics')."""
    json_logs = ["--log-format", "json"]
    mesh = start_mesh(default_model, [("0-14", json_logs), ("15-29", json_logs)], env={"MESHNET_TOKEN": TOKEN},
                      log_dir=tmp_path_factory.mktemp("logs"))
    yield mesh
    for d in mesh:
        d.stop()


def test_every_endpoint_but_health_needs_the_token(token_mesh):
    head, tail = token_mesh
    status, _, data = send("GET", head.url + "/health")
    assert status == 200 and data["status"] == "ok"
    endpoints = [
        ("GET", "/v1/status", None), ("GET", "/v1/sessions", None), ("GET", "/v1/route", None),
        ("GET", "/metrics", None), ("GET", "/v1/models", None), ("POST", "/v1/chat/completions", chat_body()),
        ("POST", "/forward", b"\0" * 16), ("DELETE", "/v1/sessions/abc", None),
        ("POST", "/v1/peers", b'{"url": "http://127.0.0.1:9"}'), ("DELETE", "/v1/peers?url=http://127.0.0.1:9", None),
        ("GET", "/no/such/path", None),
    ]
    for method, path, body in endpoints:
        for headers in ({}, {"Authorization": "Bearer wrong-token-wrong-token"}, {"Authorization": TOKEN},
                        {"Authorization": f"Basic {TOKEN}"}, {"Authorization": f"Bearer {TOKEN}x"}):
            status, response_headers, data = send(method, tail.url + path, body=body, headers=headers)
            assert status == 401, (method, path, headers, status, data)
            openai_error(data, "invalid_api_key")
    # with the token the same requests reach their handlers
    for method, path in (("GET", "/v1/status"), ("GET", "/v1/sessions"), ("GET", "/metrics")):
        status, _, _ = send(method, tail.url + path, headers=AUTH)
        assert status == 200, path


def test_nodes_send_the_token_to_each_other(token_mesh, reference_tokens):
    head, tail = token_mesh
    status, _, data = send("GET", head.url + "/v1/status", headers=AUTH)
    assert status == 200 and [p["up"] for p in data["peers"]] == [True]  # the head's polls carried the token
    status, _, data = send("POST", head.url + "/v1/chat/completions", body=chat_body(12), headers=AUTH)
    assert status == 200, data
    assert data["meshnet"]["token_ids"] == reference_tokens(PROMPT, 12, ignore_eos=True)
    assert [h["url"] for h in data["meshnet"]["route"]] == [head.url, tail.url]  # /forward carried it too


def test_the_openai_sdk_uses_the_token_as_its_api_key(token_mesh):
    import openai

    head, _ = token_mesh
    good = openai.OpenAI(base_url=head.url + "/v1", api_key=TOKEN)
    model = good.models.list().data[0].id  # a model the head does not serve would be a 404
    answer = good.chat.completions.create(model=model, messages=PROMPT, max_tokens=4)
    assert answer.choices[0].message.content
    bad = openai.OpenAI(base_url=head.url + "/v1", api_key="not-the-token-at-all", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=model, messages=PROMPT, max_tokens=4)


@pytest.mark.slow
def test_a_node_with_another_token_is_down_to_its_peers(default_model, tmp_path, token_mesh):
    head, _ = token_mesh
    stranger = Daemon(default_model, "15-29", env={"MESHNET_TOKEN": "another-token-entirely-000"},
                      log_dir=tmp_path).wait_ready()
    try:
        status, _, data = send("POST", head.url + "/v1/peers", headers=AUTH,
                               body=json.dumps({"url": stranger.url}).encode())
        assert status == 200
        peer = {p["url"]: p for p in data["peers"]}[stranger.url]
        assert peer["up"] is False and "401" in peer["error"]
    finally:
        send("DELETE", head.url + f"/v1/peers?url={stranger.url}", headers=AUTH)
        stranger.stop()


@pytest.mark.slow
def test_binding_beyond_loopback_without_a_token_warns_loudly(tmp_path):
    # the model does not exist, so the node stops before it binds anything: only the warning is tested (in this
    # process: the command refuses as it would on its own)
    missing = tmp_path / "no-model"
    run = run_meshd_in_process("--host", "0.0.0.0", "--port", str(free_port()), "--model", str(missing),
                               env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert run.returncode != 0
    assert "WARNING: listening on 0.0.0.0 without an API key" in run.stderr
    for variable in ("MESHNET_TOKEN", "MESHNET_API_KEY"):  # the key by either name
        quiet = run_meshd_in_process("--host", "0.0.0.0", "--port", str(free_port()), "--model", str(missing),
                                     env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), variable: TOKEN})
        assert "WARNING" not in quiet.stderr and "error" in quiet.stderr


# ---- limits ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def limited(tiny_model, tmp_path_factory):
    node = Daemon(tiny_model("llama"), "0-3", extra=["--max-body-bytes", "65536", "--max-tokens-cap", "64",
                                                     "--max-generations", "1"],
                  log_dir=tmp_path_factory.mktemp("logs")).wait_ready()
    yield node
    node.stop()


@pytest.mark.slow
def test_a_body_over_the_limit_is_a_413(limited):
    status, _, data = send("POST", limited.url + "/v1/chat/completions",
                           body=json.dumps({"messages": [{"role": "user", "content": "x" * 70000}]}).encode(),
                           headers={"Content-Type": "application/json"})
    assert status == 413
    openai_error(data, "request_too_large")
    status, _, data = send("POST", limited.url + "/forward", body=b"\0" * 70000, headers={SHAPE: "1,1,70000"})
    assert status == 413


@pytest.mark.slow
def test_max_tokens_above_the_cap_is_a_400(limited):
    status, _, data = send("POST", limited.url + "/v1/chat/completions", body=chat_body(65))
    assert status == 400 and data["error"]["param"] == "max_tokens"
    status, _, data = send("POST", limited.url + "/v1/chat/completions", body=chat_body(64))
    assert status == 200 and data["usage"]["completion_tokens"] == 64


@pytest.mark.slow
def test_a_prompt_longer_than_the_context_is_a_400_before_any_work(limited):
    # the tiny model's context is 1024 positions; this prompt is far longer but the body is under 64 KiB
    words = " ".join(["owl"] * 5000)
    steps = limited.get("/v1/status")["steps_served"]
    status, _, data = send("POST", limited.url + "/v1/chat/completions",
                           body=json.dumps({"messages": [{"role": "user", "content": words}]}).encode())
    assert status == 400 and "context" in data["error"]["message"]
    assert limited.get("/v1/status")["steps_served"] == steps  # nothing ran for it
    # a /forward whose positions would pass the context is refused too
    hidden = limited.get("/v1/status")["model"]["hidden_size"]
    status, _, data = send("POST", limited.url + "/forward", body=b"\0" * (4 * hidden * 2), headers={
        SHAPE: f"1,2,{hidden}", CACHE: "decode", SESSION: "s1", PAST_LEN: "1023"})
    assert status == 400 and "context" in data["error"]["message"]


@pytest.mark.slow
def test_no_cors_unless_origins_are_allowed(limited):
    # a node started without --allowed-origins answers no browser's preflight and names no origin
    status, headers, _ = send("OPTIONS", limited.url + "/v1/chat/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
    assert status == 405 and not any(h.lower().startswith("access-control-") for h in headers)
    status, headers, _ = send("GET", limited.url + "/v1/models", headers={"Origin": "https://app.example"})
    assert status == 200 and not any(h.lower().startswith("access-control-") for h in headers)


@pytest.mark.slow
def test_bounds_on_session_ids_and_header_values(limited):
    hidden = limited.get("/v1/status")["model"]["hidden_size"]
    base = {SHAPE: f"1,1,{hidden}", CACHE: "prefill"}
    body = b"\0" * (4 * hidden)
    status, _, data = send("POST", limited.url + "/forward", body=body, headers=base | {SESSION: "a" * 129})
    assert status == 400 and data["error"]["param"] == SESSION
    status, _, data = send("POST", limited.url + "/forward", body=body,
                           headers=base | {SESSION: "s", SAMPLING: "{" + " " * 2000 + "}"})
    assert status == 400 and data["error"]["param"] == SAMPLING
    status, _, _ = send("POST", limited.url + "/forward", body=body, headers=base | {"X-Junk": "j" * 20000})
    assert 400 <= status < 500  # an oversized header is refused by the HTTP parser itself
    assert send("GET", limited.url + "/health").status == 200


@pytest.mark.slow
def test_generations_beyond_the_limit_get_429_with_retry_after(limited):
    events = limited.stream(json.loads(chat_body(64)), timeout=60)
    next(events)  # the first generation is running
    try:
        status, headers, data = send("POST", limited.url + "/v1/chat/completions", body=chat_body(4))
        assert status == 429
        assert int(headers["Retry-After"]) >= 1
        openai_error(data, "too_many_generations")
    finally:
        for _ in events:
            pass
    status, _, _ = send("POST", limited.url + "/v1/chat/completions", body=chat_body(4))
    assert status == 200  # the slot is free again


# ---- graceful shutdown ---------------------------------------------------------------------------


def slow_two_node(tiny_model, tmp_path, *, extra: list[str] = ()) -> tuple[Daemon, Daemon]:
    """A head (layers 0-1) before a tail that answers every step 30 ms late: however fast the host, a
    generation of N tokens takes at least N * 30 ms, so a test can act while it runs."""
    head, tail = start_mesh(tiny_model("llama"), [("0-1", list(extra)), ("2-3", [], "slow-30")], peers=[[1], []],
                            log_dir=tmp_path)
    return head, tail


@pytest.mark.slow
def test_sigterm_drains_running_generations_then_exits(tiny_model, tmp_path):
    node, tail = slow_two_node(tiny_model, tmp_path)
    try:
        result: dict = {}

        def run() -> None:
            chunks = list(node.stream(json.loads(chat_body(200)), timeout=60))
            result["finish"] = [c for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"]]
            result["errors"] = [c for c in chunks if "error" in c]

        reader = threading.Thread(target=run)
        reader.start()
        deadline = time.monotonic() + 30
        while node.get("/v1/status")["active_generations"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        node.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while send("GET", node.url + "/health").status != 503 and time.monotonic() < deadline:
            time.sleep(0.02)

        status, headers, data = send("GET", node.url + "/health")
        assert status == 503 and data["status"] == "draining"
        status, headers, data = send("POST", node.url + "/v1/chat/completions", body=chat_body(4))
        assert status == 503 and int(headers["Retry-After"]) >= 1
        openai_error(data, "draining")
        status, _, _ = send("POST", node.url + "/forward", body=b"")
        assert status == 503
        assert send("GET", node.url + "/v1/status").data["draining"] is True  # read-only state still answers

        reader.join(60)
        assert result["errors"] == [] and result["finish"][-1]["choices"][0]["finish_reason"] == "length"
        assert result["finish"][-1]["meshnet"]["completion_tokens"] == 200  # it finished, not cut off
        assert node.proc.wait(30) == 0
        assert "draining: 1 generation(s) running" in node.log()
    finally:
        node.stop(), tail.stop()


@pytest.mark.slow
def test_the_grace_period_bounds_the_wait(tiny_model, tmp_path):
    node, tail = slow_two_node(tiny_model, tmp_path, extra=["--shutdown-grace", "1"])
    try:
        events = node.stream(json.loads(chat_body(900)), timeout=60)  # at least 27 s of steps on any host
        next(events)
        started = time.monotonic()
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(30) == 0
        assert time.monotonic() - started < 10
        assert "stopping with 1 generation(s) unfinished" in node.log()
        chunks = []
        try:
            chunks.extend(events)
        except (http.client.HTTPException, OSError):
            pass  # the connection was cut
        assert not any(c.get("choices") and c["choices"][0]["finish_reason"] for c in chunks)
        # the generation stopped at its first step after the grace, and its stream says why
        assert chunks and chunks[-1]["error"]["code"] == "draining", chunks[-3:]
        assert sum(1 for c in chunks if c.get("choices")) < 150  # 1 s of grace + a step, at 30 ms a step or more
    finally:
        node.stop(), tail.stop()


# ---- metrics and request ids ------------------------------------------------------------------


def samples(daemon: Daemon) -> dict[str, float]:
    reply = send("GET", daemon.url + "/metrics", headers=AUTH, timeout=10)
    assert reply.status == 200 and reply.headers.get("Content-Type").startswith("text/plain")
    text = reply.body.decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_metrics_count_what_a_generation_did(token_mesh):
    head, tail = token_mesh
    before_head, before_tail = samples(head), samples(tail)
    status, _, data = send("POST", head.url + "/v1/chat/completions", body=chat_body(10), headers=AUTH)
    assert status == 200
    after_head, after_tail = samples(head), samples(tail)

    def delta(after, before, name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta(after_head, before_head, "meshnet_tokens_generated_total") == 10
    assert delta(after_head, before_head, "meshnet_time_to_first_token_seconds_count") == 1
    assert delta(after_head, before_head, "meshnet_inter_token_latency_seconds_count") == 9
    hop = f"meshnet_hop_latency_seconds_count{{mode=decode,node={tail.url}}}"
    assert delta(after_head, before_head, hop) == 9
    assert delta(after_head, before_head, "meshnet_generations_total{finish=length}") == 1
    # the first step is a prefill, or (a prompt an earlier test on this mesh sent) a decode step that extends
    # the session that test kept with the prompt's new tokens
    reused = data["meshnet"]["cached_tokens"] > 0
    assert delta(after_tail, before_tail, "meshnet_forward_steps_total{mode=decode}") == 9 + reused
    assert delta(after_tail, before_tail, "meshnet_forward_steps_total{mode=prefill}") == 1 - reused
    assert delta(after_tail, before_tail, "meshnet_kv_hits_total") == 9 + reused
    assert after_tail["meshnet_kv_sessions"] >= 1 and after_tail["meshnet_kv_bytes"] > 0
    for name in ("meshnet_reprefills_total", "meshnet_failovers_total", "meshnet_requests_running{endpoint=/metrics}"):
        assert name in after_head, name
    assert after_head["meshnet_requests_running{endpoint=/metrics}"] == 1  # this scrape itself
    assert delta(after_head, before_head, "meshnet_http_requests_total{endpoint=/v1/chat/completions,status=200}") == 1


def test_one_request_id_follows_a_generation_across_nodes(token_mesh):
    head, tail = token_mesh
    rid = f"trace-{time.time_ns()}"
    status, headers, _ = send("POST", head.url + "/v1/chat/completions", body=chat_body(3),
                              headers=AUTH | {REQUEST_ID: rid})
    assert status == 200 and headers[REQUEST_ID] == rid

    def lines(daemon: Daemon) -> list[dict]:
        out = []
        for line in daemon.log().splitlines():
            if line.startswith("{"):
                out.append(json.loads(line))
        return out

    deadline = time.monotonic() + 5
    while not any(r.get("request_id") == rid for r in lines(tail)) and time.monotonic() < deadline:
        time.sleep(0.1)
    head_lines = [r for r in lines(head) if r.get("request_id") == rid]
    tail_lines = [r for r in lines(tail) if r.get("request_id") == rid]
    assert head_lines and tail_lines
    for record in head_lines + tail_lines:
        assert {"time", "level", "logger", "message", "node", "request_id"} <= set(record)
    assert {r["node"] for r in head_lines} == {head.url} and {r["node"] for r in tail_lines} == {tail.url}
    # a prefill, or (a prompt this mesh has seen the start of) an extend from a session it kept
    assert any("prefill" in r["message"] or "tokens of session" in r["message"] for r in tail_lines)
    # a junk id is not echoed into logs: the node makes its own
    status, headers, _ = send("GET", head.url + "/v1/status", headers=AUTH | {REQUEST_ID: "bad id\twith junk"})
    assert status == 200 and headers[REQUEST_ID] != "bad id\twith junk"
    assert http_json("GET", head.url + "/health")[0] == 200


@pytest.mark.slow
def test_non_finite_activations_are_a_400_on_the_tail(limited):
    import struct

    hidden = limited.get("/v1/status")["model"]["hidden_size"]
    for sampling in ('{"temperature": 0.7, "seed": 1}', '{"temperature": 0}'):
        status, _, data = send("POST", limited.url + "/forward", body=struct.pack("<f", math.nan) * hidden,
                               headers={SHAPE: f"1,1,{hidden}", SAMPLING: sampling})
        assert status == 400, (status, data)
        assert "non-finite" in data["error"]["message"]
    assert send("GET", limited.url + "/health").status == 200
