"""A client that leaves mid-stream ends its generation: the head stops stepping and every node frees its session."""

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
    deadline = time.monotonic() + 5  # the head releases the tail's session in the background
    while tail.get("/v1/sessions")["sessions"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tail.get("/v1/sessions")["sessions"] == [], "the tail still holds the abandoned session"
    assert tail.get("/v1/status")["store"]["evictions"]["dropped"] >= 1
