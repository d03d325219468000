"""Nodes join a mesh by announcing themselves and leave it by saying so: meshd processes on 127.0.0.1.

The head is told of no one. A worker started with only ``--peer HEAD`` must be on the head's route within 10 s,
another node that knows only the head must learn the worker through it, and a worker stopped with SIGTERM must be
off the head's route within 5 s. The mesh has an API key: announcing needs it like any request."""

from __future__ import annotations

import signal
import time

import pytest

from tests.support.http_client import bearer, http_json, send
from tests.support.meshd import Daemon

KEY = "join-test-key-0123456789"
MESSAGES = [{"role": "user", "content": "Name three rivers."}]


def up_peers(node: Daemon) -> set[str]:
    return {p["url"] for p in node.get("/v1/status")["peers"] if p["up"]}


def until(condition, timeout: float, what: str) -> float:
    """Seconds until ``condition()`` holds, polled every 0.1 s; fails after ``timeout``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            pytest.fail(f"{what} not within {timeout:g} s")
        time.sleep(0.1)
    return time.monotonic() - started


@pytest.mark.slow
def test_a_worker_joins_by_announcing_and_leaves_on_sigterm(default_model, reference_tokens, tmp_path):
    env = {"MESHNET_API_KEY": KEY}
    head = Daemon(default_model, "0-14", log_dir=tmp_path, env=env)
    other = Daemon(default_model, "0-14", log_dir=tmp_path, env=env, peer_urls=[head.url])
    worker = Daemon(default_model, "15-29", log_dir=tmp_path, env=env, peer_urls=[head.url])
    daemons = [head, other, worker]
    try:
        head.wait_ready()
        other.wait_ready()
        worker.wait_ready()
        joined = until(lambda: worker.url in up_peers(head), 10.0, "the worker on the head's peers")
        until(lambda: worker.url in up_peers(other), 5.0, "the worker known to a node that knows only the head")
        assert other.url in up_peers(head)

        status, body = head.chat({"messages": MESSAGES, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        assert body["meshnet"]["token_ids"] == reference_tokens(MESSAGES, 12, ignore_eos=True)
        assert body["meshnet"]["route"][-1]["url"] == worker.url  # layers 0-14 may be the head's or the other's
        events = head.get("/v1/route")["events"]
        assert {"kind": "joined", "node": worker.url, "layers": [15, 30]}.items() <= next(
            e for e in events if e["node"] == worker.url).items()

        worker.proc.send_signal(signal.SIGTERM)
        left = until(lambda: worker.url not in up_peers(head), 5.0, "the stopped worker off the head's peers")
        status, body = head.chat({"messages": MESSAGES, "max_tokens": 4})
        assert status == 503 and "15-29" in body["error"]["message"], body  # no route: nothing serves 15-29 now
        assert any(e["kind"] == "left" and e["node"] == worker.url for e in head.get("/v1/route")["events"])
        print(f"joined after {joined:.1f} s, left after {left:.1f} s")
    finally:
        for d in daemons:
            d.stop()


@pytest.mark.slow
def test_announcements_need_the_key_and_are_validated(default_model, tmp_path):
    env = {"MESHNET_API_KEY": KEY}
    node = Daemon(default_model, "0-29", log_dir=tmp_path, env=env).wait_ready()
    try:
        url = node.url + "/v1/peers/announce"
        assert http_json("POST", url, {"url": "http://127.0.0.1:9"})[0] == 401  # no key
        peer = "http://127.0.0.1:9"
        for body, param in [({"url": "ftp://x:1"}, "url"), ({"url": peer, "leaving": "yes"}, "leaving"),
                            ([1, 2], None), ({"url": peer, "leaving": True, "moved": [1]}, "moved"),
                            ({"url": peer, "leaving": True, "moved": {"no spaces": "http://127.0.0.1:8"}}, "moved"),
                            ({"url": peer, "leaving": True, "moved": {"s1": "ftp://x:1"}}, "moved"),
                            ({"url": peer, "moved": {"s1": "http://127.0.0.1:8"}}, "moved")]:  # only when leaving
            status, answer = http_json("POST", url, body, token=KEY)
            assert status == 400 and answer["error"].get("param") == param, answer
        handed = node.url + "/v1/sessions/s1/import"  # a draining node's transfer: node to node, with the key too
        assert send("POST", handed, b"x", {"Content-Type": "application/vnd.meshnet.session"}).status == 401
        reply = send("POST", handed, b"x", {"Content-Type": "application/json"} | bearer(KEY))
        assert reply.status == 400 and b"application/vnd.meshnet.session" in reply.body
        reply = send("POST", url, b"{not json", {"Content-Type": "application/json"} | bearer(KEY))
        assert reply.status == 400
        status, answer = http_json("POST", url, {"url": "http://127.0.0.1:9"}, token=KEY)
        assert status == 200 and answer["joined"] is True  # taken, polled, down: nothing answers there
        assert {p["url"]: p["up"] for p in answer["peers"]} == {"http://127.0.0.1:9": False}
        status, answer = http_json("POST", url, {"url": "http://127.0.0.1:9", "leaving": True}, token=KEY)
        assert status == 200 and answer == {"left": "http://127.0.0.1:9", "known": True}
        assert node.get("/v1/status")["peers"] == []
        assert node.get("/health")["status"] == "ok"  # nothing of it hurt the node
    finally:
        node.stop()
