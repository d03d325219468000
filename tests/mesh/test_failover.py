"""Replicas, route choice and failover on real meshd processes on 127.0.0.1.

Every generation here is greedy with ``ignore_eos``, so it must equal, token for token, transformers'
own ``generate`` however many nodes die, restart or slow down underneath it.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.support.http_client import http_json, send
from tests.support.meshd import Daemon, free_port
from tests.support.streams import Stream

pytestmark = pytest.mark.slow  # long end-to-end runs: in .ci/run, not in the fast subset

PROMPT = [{"role": "user", "content": "Describe the water cycle to a ten-year-old."}]
TOKENS = 40


def request(max_tokens: int = TOKENS, messages=PROMPT) -> dict:
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def start(model, layers: str, log_dir, *, peers: list[Daemon] = (), extra: list[str] = (), env=None,
          variant: str | None = None) -> Daemon:
    return Daemon(model, layers, peers=list(peers), extra=list(extra), env=env, log_dir=log_dir, variant=variant)


def stop_all(daemons: list[Daemon]) -> None:
    for d in daemons:
        d.stop()


def holds_session(daemon: Daemon, session_id: str) -> bool:
    return any(s["session_id"] == session_id for s in daemon.get("/v1/sessions")["sessions"])


@pytest.fixture
def replicas(default_model, tmp_path):
    """A head hosting 0-14 that is told of one replica of 15-29, which is told of the other."""
    r2 = start(default_model, "15-29", tmp_path)
    r1 = start(default_model, "15-29", tmp_path, peers=[r2])
    head = start(default_model, "0-14", tmp_path, peers=[r1])
    daemons = [head, r1, r2]
    try:
        for d in daemons:
            d.wait_ready()
        head.wait_peers(2)  # the second replica is learned from the first
    except BaseException:
        stop_all(daemons)
        raise
    yield head, r1, r2
    stop_all(daemons)


def test_a_head_given_one_peer_learns_the_rest(replicas):
    head, r1, r2 = replicas
    peers = {p["url"]: p for p in head.get("/v1/status")["peers"]}
    assert set(peers) == {r1.url, r2.url}
    assert peers[r1.url]["learned_from"] is None
    assert peers[r2.url]["learned_from"] == r1.url
    assert all(p["up"] for p in peers.values())


def prefill_steps(daemon: Daemon) -> float:
    """``meshnet_forward_steps_total{mode="prefill"}``: prefill steps this node computed."""
    return sum(float(line.split()[1]) for line in daemon.metrics().splitlines()
               if line.startswith('meshnet_forward_steps_total{mode="prefill"}'))


def test_killing_the_replica_in_use_mid_generation_prefills_only_the_other(replicas, reference_tokens):
    """The head keeps the inputs it sent the replica; when that replica dies, the other one is prefilled from
    them alone, and the head's own layers (which still hold the session) compute nothing again."""
    head, r1, r2 = replicas
    stream = Stream(head, request())
    stream.read_tokens(6)
    in_use = [r for r in (r1, r2) if holds_session(r, stream.session_id)]
    assert len(in_use) == 1, "exactly one replica serves the generation"
    victim, survivor = (r1, r2) if in_use[0] is r1 else (r2, r1)
    before = {d: prefill_steps(d) for d in (head, survivor)}
    victim.kill()

    stats = stream.finish()
    assert "error" not in stats, stats
    assert stats["token_ids"] == reference_tokens(PROMPT, TOKENS, ignore_eos=True)
    assert stats["failovers"] == 1 and stats["span_replays"] == 1 and stats["reprefills"] == 0
    assert prefill_steps(head) == before[head]  # the surviving node computed nothing again
    assert prefill_steps(survivor) == before[survivor] + 1  # the replacement: one prefill, from the inputs held
    assert [h["url"] for h in stats["route"]] == [head.url, survivor.url]
    assert holds_session(survivor, stream.session_id)

    route = head.get("/v1/route")
    failover = [e for e in route["events"] if e["kind"] == "failover"]
    assert failover and failover[-1]["failed"] == victim.url and failover[-1]["session_id"] == stream.session_id
    assert route["failovers"] == 1
    assert not {p["url"]: p for p in head.get("/v1/status")["peers"]}[victim.url]["up"]


def test_restarting_the_only_tail_mid_generation_changes_nothing_for_the_client(default_model, tmp_path,
                                                                                reference_tokens):
    tail = start(default_model, "15-29", tmp_path)
    head = start(default_model, "0-14", tmp_path, peers=[tail], extra=["--failover-wait", "90"])
    try:
        for d in (head, tail):
            d.wait_ready()
        head.wait_peers(1)
        stream = Stream(head, request())
        stream.read_tokens(6)
        tail.kill()
        tail.restart()  # same port; it loads its layers again while the head waits
        stats = stream.finish()
        assert "error" not in stats, stats
        assert stats["token_ids"] == reference_tokens(PROMPT, TOKENS, ignore_eos=True)
        assert stats["failovers"] >= 1 and stats["reprefills"] >= 1
        assert holds_session(tail, stream.session_id)  # the restarted tail has the session again
    finally:
        stop_all([head, tail])


def test_new_generations_move_to_the_faster_replica(default_model, tmp_path, reference_tokens):
    fast = start(default_model, "15-29", tmp_path)
    slow = start(default_model, "15-29", tmp_path, variant="slow-300")
    # no exploration: a randomised plan may send the second generation to the measured slow node too
    head = start(default_model, "0-14", tmp_path, peers=[slow, fast], extra=["--route-explore", "0"])
    daemons = [head, slow, fast]
    try:
        for d in daemons:
            d.wait_ready()
        head.wait_peers(2)
        tails = []
        for _ in range(5):
            status, body = head.chat(request(max_tokens=6))
            assert status == 200, body
            assert body["meshnet"]["token_ids"] == reference_tokens(PROMPT, 6, ignore_eos=True)
            tails.append(body["meshnet"]["route"][-1]["url"])
        # the first two generations may try either (nothing is measured yet); then the fast one only
        assert set(tails[:2]) == {slow.url, fast.url} or tails[:2] == [fast.url] * 2
        assert tails[2:] == [fast.url] * 3, tails
        nodes = head.get("/v1/route")["nodes"]
        assert nodes[slow.url]["latency_ms"] > nodes[fast.url]["latency_ms"] + 200  # the 300 ms delay, measured
        assert nodes[fast.url]["overhead_ms"] < nodes[fast.url]["latency_ms"]
    finally:
        stop_all(daemons)


def test_losing_the_only_node_of_a_range_is_a_clear_error_quickly(default_model, tmp_path):
    tail = start(default_model, "15-29", tmp_path)
    head = start(default_model, "0-14", tmp_path, peers=[tail], extra=["--failover-wait", "3"])
    try:
        for d in (head, tail):
            d.wait_ready()
        head.wait_peers(1)

        # mid-stream: the stream ends with an error event naming the missing layers, after the bounded wait
        stream = Stream(head, request(max_tokens=200))
        stream.read_tokens(4)
        tail.kill()
        killed = time.monotonic()
        error = stream.finish()
        assert time.monotonic() - killed < 3 + 10
        assert error["error"]["code"] == "no_route"
        assert "layers 15-29" in error["error"]["message"]

        # a plain request: a 503 naming them, at once
        started = time.monotonic()
        status, body = head.chat(request(max_tokens=4), timeout=30)
        assert status == 503
        assert body["error"]["code"] == "no_route" and "15-29" in body["error"]["message"]
        assert time.monotonic() - started < 5
        route = head.get("/v1/route?refresh=1")
        assert route["hops"] == [] and "15-29" in route["error"]
        assert any(e["kind"] == "no_route" for e in route["events"])
    finally:
        stop_all([head, tail])


def test_a_fresh_request_right_after_a_node_dies_fails_fast(default_model, tmp_path):
    # the head still believes the tail is up (its next poll is up to 2 s away): the first hop fails,
    # and a request that has produced nothing waits only briefly for another route
    tail = start(default_model, "15-29", tmp_path)
    head = start(default_model, "0-14", tmp_path, peers=[tail])  # default --failover-wait 30
    try:
        for d in (head, tail):
            d.wait_ready()
        head.wait_peers(1)
        status, _ = head.chat(request(max_tokens=2))
        assert status == 200
        tail.kill()
        started = time.monotonic()
        status, body = head.chat(request(max_tokens=4), timeout=60)
        assert status == 503, body
        assert "15-29" in body["error"]["message"]
        assert time.monotonic() - started < 10  # well inside the 30 s a running generation would wait
    finally:
        stop_all([head, tail])


def test_four_concurrent_streams_each_equal_their_own_run(default_model, tmp_path, reference_tokens):
    prompts = [
        PROMPT,
        [{"role": "user", "content": "Name three rivers in Europe."}],
        [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "What is bread?"}],
        [{"role": "user", "content": "Count from one to twenty in words."}],
    ]
    tail = start(default_model, "15-29", tmp_path)
    head = start(default_model, "0-14", tmp_path, peers=[tail])
    try:
        for d in (head, tail):
            d.wait_ready()
        head.wait_peers(1)
        results: dict[int, dict] = {}
        spans: dict[int, tuple[float, float]] = {}
        health_ms: list[float] = []

        def run(i: int) -> None:
            stream = Stream(head, request(max_tokens=24, messages=prompts[i]))
            stream.read_tokens(1)
            first = time.monotonic()
            results[i] = stream.finish()
            spans[i] = (first, time.monotonic())

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            started = time.monotonic()
            status, _ = http_json("GET", head.url + "/health", timeout=10)
            assert status == 200
            health_ms.append((time.monotonic() - started) * 1000)
            time.sleep(0.1)
        for t in threads:
            t.join()

        for i, prompt in enumerate(prompts):
            assert "error" not in results[i], results[i]
            assert results[i]["token_ids"] == reference_tokens(prompt, 24, ignore_eos=True), f"stream {i}"
        assert len({r["session_id"] for r in results.values()}) == 4
        # they really ran at once: every stream was still going when the last one started
        assert max(s for s, _ in spans.values()) < min(e for _, e in spans.values())
        # the event loop never waited on torch: /health answered between steps throughout
        assert health_ms and sorted(health_ms)[len(health_ms) // 2] < 200
        assert head.get("/v1/status")["generations"] == 4
    finally:
        stop_all([head, tail])


def test_a_port_with_nothing_behind_it_is_a_down_peer_not_a_hang(default_model, tmp_path):
    head = start(default_model, "0-29", tmp_path, extra=["--peer", f"http://127.0.0.1:{free_port()}"])
    try:
        head.wait_ready()
        status, body = head.chat(request(max_tokens=3))
        assert status == 200, body  # the head hosts every layer: a dead peer is simply not on the route
        peers = head.get("/v1/status")["peers"]
        assert len(peers) == 1 and peers[0]["up"] is False and peers[0]["error"]
    finally:
        head.stop()


def test_a_failover_keeps_penalties_and_logprobs_exact(replicas, reference_model, reference_tokens):
    """The new tail gets the tokens so far with the re-prefill: the penalized answer and its logprobs are
    generate's and the model's own, however the route changed."""
    import torch

    model, tokenizer = reference_model
    head, r1, r2 = replicas
    stream = Stream(head, request() | {"repetition_penalty": 1.3, "logprobs": True, "top_logprobs": 2})
    stream.read_tokens(6)
    (r1 if holds_session(r1, stream.session_id) else r2).kill()
    stats = stream.finish()
    assert "error" not in stats, stats
    assert stats["failovers"] == 1

    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=TOKENS, do_sample=False, eos_token_id=None,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long), repetition_penalty=1.3)
        expected = out[0, len(ids):].tolist()
        rows = torch.log_softmax(model(torch.tensor([ids + expected])).logits[0, len(ids) - 1:-1].float(), dim=-1)
    assert stats["token_ids"] == expected
    plain = reference_tokens(PROMPT, TOKENS, ignore_eos=True)
    assert expected[6:] != plain[6:]  # the penalty matters after the failover too
    content = [e for c in stream.chunks if c.get("choices") and c["choices"][0].get("logprobs")
               for e in c["choices"][0]["logprobs"]["content"]]
    assert [e["logprob"] for e in content] == pytest.approx([float(r[i]) for r, i in zip(rows, expected)], abs=1e-3)


def replicas_that_drain(model, log_dir, variant: str) -> tuple[Daemon, Daemon, Daemon]:
    """(head, r1, r2), started: a head hosting 0-14 told of r1, and two replicas of 15-29 as meshd's ``variant``,
    r1 told of r2."""
    r2 = start(model, "15-29", log_dir, variant=variant)
    r1 = start(model, "15-29", log_dir, variant=variant, peers=[r2])
    return start(model, "0-14", log_dir, peers=[r1]), r1, r2


def wait_meshed(daemons) -> None:
    """Every node serving and seeing the other two: either replica may hand its sessions to the other."""
    for d in daemons:
        d.wait_ready()
    for d in daemons:
        d.wait_peers(len(daemons) - 1)


def test_a_draining_replica_hands_its_session_over_and_the_stream_goes_on_computing_nothing_again(
        default_model, tmp_path, reference_tokens):
    """SIGTERM to the replica serving a stream: it sends the session's cache to the other replica, names it in its
    answer to the next step and when it leaves, and the head goes on there. No node computes anything again, and
    a malformed transfer to the taker is refused in one line while it keeps serving."""
    import signal

    daemons = head, r1, r2 = replicas_that_drain(default_model, tmp_path, "slow-40")
    try:
        wait_meshed(daemons)
        stream = Stream(head, request(max_tokens=48))
        stream.read_tokens(6)
        victim, survivor = (r1, r2) if holds_session(r1, stream.session_id) else (r2, r1)
        before = {d: prefill_steps(d) for d in (head, survivor)}
        victim.proc.send_signal(signal.SIGTERM)

        stats = stream.finish()
        assert victim.proc.wait(timeout=30) == 0
        assert "error" not in stats, stats
        assert stats["token_ids"] == reference_tokens(PROMPT, 48, ignore_eos=True)
        assert (stats["failovers"], stats["moved_sessions"], stats["span_replays"], stats["reprefills"]) == (1, 1, 0, 0)
        assert prefill_steps(head) == before[head] and prefill_steps(survivor) == before[survivor]
        assert [h["url"] for h in stats["route"]] == [head.url, survivor.url]
        assert "handed to " + survivor.url in victim.log()

        refused = send("POST", survivor.url + "/v1/sessions/junk/import", b"not a cache",
                       headers={"Content-Type": "application/vnd.meshnet.session"})
        message = json.loads(refused.body)["error"]["message"]
        assert refused.status == 400 and "not a safetensors file" in message and "\n" not in message
        assert not holds_session(survivor, "junk") and survivor.get("/health")["status"] == "ok"
    finally:
        stop_all(daemons)


def test_a_session_made_by_a_prefill_under_way_when_the_drain_begins_is_handed_over_too(
        default_model, tmp_path, reference_tokens):
    """SIGTERM reaches the replica while it still holds a stream's prefill (its session not made yet): the drain
    waits for that step, then hands the session it made over with the others, and the head goes on at the taker
    without replaying anything."""
    import signal

    daemons = head, r1, r2 = replicas_that_drain(default_model, tmp_path, "slow-prefill-3000")
    try:
        wait_meshed(daemons)
        stream = Stream(head, request(max_tokens=12))
        deadline = time.monotonic() + 30
        while not (holding := [r for r in (r1, r2) if "holding a prefill" in r.log()]):
            assert time.monotonic() < deadline, "no replica took the prefill"
            time.sleep(0.02)
        victim = holding[0]
        survivor = r2 if victim is r1 else r1
        victim.proc.send_signal(signal.SIGTERM)

        stats = stream.finish()
        assert victim.proc.wait(timeout=30) == 0
        assert "error" not in stats, stats
        assert stats["token_ids"] == reference_tokens(PROMPT, 12, ignore_eos=True)
        assert (stats["moved_sessions"], stats["span_replays"], stats["reprefills"]) == (1, 0, 0), \
            {k: v for k, v in stats.items() if k not in ("token_ids", "step_ms", "sampling")}
        assert "handed to " + survivor.url in victim.log()
    finally:
        stop_all(daemons)


def test_a_rolling_restart_of_the_replicas_moves_every_stream_without_a_re_prefill(default_model, tmp_path,
                                                                                     reference_tokens):
    """Four streams through a head (0-14) and two replicas of 15-29, each step there 150 ms slower so the streams
    outlast the restarts. Each replica in turn is stopped with SIGTERM and started again: it hands its sessions to
    the other replica as it drains, and the streams on it go on there. No stream re-prefills or replays a span
    (nothing is computed again), and every answer is generate's."""
    import signal

    prompts = [PROMPT, [{"role": "user", "content": "Name three rivers in Europe."}],
               [{"role": "user", "content": "What is bread?"}], [{"role": "user", "content": "Count to twenty."}]]
    r2 = start(default_model, "15-29", tmp_path, variant="slow-150")
    r1 = start(default_model, "15-29", tmp_path, variant="slow-150", peers=[r2])
    head = start(default_model, "0-14", tmp_path, peers=[r1, r2])
    daemons = [head, r1, r2]
    try:
        for d in daemons:
            d.wait_ready()
        head.wait_peers(2)
        results: dict[int, dict] = {}

        def run(i: int) -> None:
            results[i] = Stream(head, request(max_tokens=96, messages=prompts[i])).finish()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        time.sleep(2.0)
        for node in (r1, r2):
            assert any(t.is_alive() for t in threads), "the streams ended before the restarts"
            node.proc.send_signal(signal.SIGTERM)
            node.proc.wait(timeout=30)
            node.restart().wait_ready()
            head.wait_peers(2)
        for t in threads:
            t.join()
        for i, prompt in enumerate(prompts):
            stats = results[i]
            assert "error" not in stats, stats
            assert stats["token_ids"] == reference_tokens(prompt, 96, ignore_eos=True), f"stream {i}"
            # a reroute (the router moving to a far faster route on a busy host) re-prefills by design: the
            # restarts themselves re-prefill nothing
            assert stats["reprefills"] == stats["reroutes"] and stats["span_replays"] == 0, stats
            assert stats["failovers"] == stats["moved_sessions"], stats
        assert sum(r["moved_sessions"] for r in results.values()) >= 2  # each restart moved a stream at least
    finally:
        stop_all(daemons)
