"""A generation that ends frees its session on every node unless the mesh keeps it to reuse: a client that leaves
mid-stream (the head stops stepping), and any answer on a head with prefix reuse off."""

from __future__ import annotations

import time

import pytest

from tests.support.meshd import start_mesh

pytestmark = pytest.mark.slow  # a long end-to-end run: in .ci/run, not in the fast subset


@pytest.fixture(scope="module")
def mesh(tiny_model, tmp_path_factory):
    daemons = start_mesh(tiny_model("llama"), [("0-1", []), ("2-3", [])], log_dir=tmp_path_factory.mktemp("logs"))
    yield daemons
    for d in daemons:
        d.stop()


def test_leaving_mid_stream_stops_the_generation(mesh):
    head, tail = mesh
    events = head.stream({"messages": [{"role": "user", "content": "go on forever"}], "max_tokens": 900,
                          "ignore_eos": True, "temperature": 0}, timeout=30)
    for _ in range(5):
        assert next(events)  # a few events arrive: the generation is running
    assert head.get("/v1/status")["active_generations"] == 1
    events.close()  # the client goes away

    deadline = time.monotonic() + 10
    while head.get("/v1/status")["active_generations"] and time.monotonic() < deadline:
        time.sleep(0.1)
    status = head.get("/v1/status")
    assert status["active_generations"] == 0
    steps_after_leaving = tail.get("/v1/status")["steps_served"]
    time.sleep(1.0)
    assert tail.get("/v1/status")["steps_served"] == steps_after_leaving, "the head kept stepping"
    assert steps_after_leaving < 900
    assert head.get("/v1/sessions")["sessions"] == []
    assert _wait_until_empty(tail) == [], "the tail still holds the abandoned session"
    assert tail.get("/v1/status")["store"]["evictions"]["dropped"] >= 1


def _wait_until_empty(node, seconds: float = 5.0) -> list:
    deadline = time.monotonic() + seconds  # the head releases remote sessions in the background
    while (sessions := node.get("/v1/sessions")["sessions"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return sessions


def test_an_answer_without_prefix_reuse_frees_its_sessions(tiny_model, tmp_path):
    # nothing will start from the session: left to its TTL it would hold the tail's memory, and the tail's batching
    # would wait for its next step for a while (steps.ACTIVE_SECONDS) before computing the next answer's
    head, tail = start_mesh(tiny_model("llama"), [("0-1", ["--prefix-reuse", "off"]), ("2-3", [])], log_dir=tmp_path)
    try:
        status, body = head.chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "ignore_eos": True,
                                  "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] == 6, body
        assert head.get("/v1/sessions")["sessions"] == []
        assert _wait_until_empty(tail) == [], "the tail still holds the finished session"
        assert tail.get("/v1/status")["store"]["evictions"]["dropped"] == 1
    finally:
        for d in (head, tail):
            d.stop()
