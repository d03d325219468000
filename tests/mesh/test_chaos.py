"""Churn as it comes: 16 nodes (4 layer ranges x 4 replicas) serving 8 streams while nodes die and come back (90
tokens each), then while half the workers are restarted, one of each range at a time (130 tokens each: the streams
outlast both rounds of restarts). Each kill and each restart takes the node holding the most sessions: the router
may send every stream through the same replicas, and churn elsewhere would break nothing.

The workers know only the head (they join by announcing). Every answer must be ``generate``'s; through the
rolling restart, where every draining node hands its sessions to a replica, no answer may re-prefill for it.
"""

from __future__ import annotations

import random
import signal
import threading
import time

import pytest

from tests.support.http_client import send
from tests.support.meshd import Daemon
from tests.support.streams import Stream

pytestmark = pytest.mark.slow  # minutes of 16 processes: in .ci/run, not in the fast subset

RANGES = ("0-7", "8-15", "16-22", "23-29")
REPLICAS = 4
KILLED_TOKENS = 200  # a stream outlives about five kills on a 2-core host (8 streams batched natively: ~9 tok/s each)
RESTARTED_TOKENS = 130  # two rounds of restarts took about 36 s on a 2-core host, the streams 2.7 tok/s each
RESTART_ROUNDS = 2  # each a node of every range: the second round's drains hand sessions to nodes just restarted
STREAMS = 8
PROMPTS = [[{"role": "user", "content": "Describe the water cycle to a ten-year-old."}],
           [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]]
KILL_EVERY = 4.0  # seconds between kills
BACK_AFTER = 5.0  # a killed node is started again this long after
NODE_OPTIONS = ["--kv-max-sessions", "64"]  # a replica may take every stream of another's at once


def request(prompt: list[dict], tokens: int) -> dict:
    return {"messages": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def mesh(default_model, tmp_path_factory):
    """(the head, serving 0-7 and every chat; the 15 workers, each started with only ``--peer HEAD``)."""
    log_dir = tmp_path_factory.mktemp("chaos")
    head = Daemon(default_model, RANGES[0], log_dir=log_dir, extra=NODE_OPTIONS)
    workers: list[Daemon] = []
    try:
        head.wait_ready()
        workers = [Daemon(default_model, layers, peers=[head], log_dir=log_dir, extra=NODE_OPTIONS)
                   for layers in RANGES for _ in range(REPLICAS - (layers == RANGES[0]))]
        for worker in workers:
            worker.wait_ready()
        everyone_knows_everyone(head, workers)
        yield head, workers
    finally:
        for daemon in [head, *workers]:
            daemon.stop()


def everyone_knows_everyone(head: Daemon, workers: list[Daemon]) -> None:
    """Wait until every node sees the 15 others up: a worker learns the rest from the head's status (gossip), and a
    draining node hands its sessions only to replicas it knows."""
    for node in [head, *workers]:
        node.wait_peers(len(workers), timeout=60)


def run_streams(head: Daemon, tokens: int) -> tuple[list[threading.Thread], dict[int, dict]]:
    results: dict[int, dict] = {}

    def run(i: int) -> None:
        results[i] = Stream(head, request(PROMPTS[i % len(PROMPTS)], tokens)).finish()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(STREAMS)]
    for thread in threads:
        thread.start()
    return threads, results


def check_answers(results: dict[int, dict], reference_tokens, tokens: int) -> None:
    assert sorted(results) == list(range(STREAMS))
    for i, stats in results.items():
        assert "error" not in stats, f"stream {i}: {stats}"
        assert stats["token_ids"] == reference_tokens(PROMPTS[i % len(PROMPTS)], tokens, ignore_eos=True), \
            f"stream {i}"


def summary(what: str, results: dict[int, dict]) -> str:
    counts = {key: sum(stats[key] for stats in results.values())
              for key in ("failovers", "moved_sessions", "span_replays", "reprefills")}
    rates = sorted(round(stats["decode_tokens_per_second"], 1) for stats in results.values())
    return f"{what}: {len(results)} of {STREAMS} answers generate's; {counts}; tok/s per stream {rates}"


def sessions_held(daemon: Daemon) -> int:
    """How many sessions' caches the node holds now."""
    return len(daemon.get("/v1/sessions")["sessions"])


def answers(daemon: Daemon) -> bool:
    try:
        return send("GET", daemon.url + "/health", timeout=0.5).status == 200
    except OSError:
        return False


def test_eight_streams_come_through_a_node_killed_every_four_seconds(mesh, reference_tokens):
    head, workers = mesh
    for prompt in PROMPTS:  # before the streams: generate would otherwise take the cores from the mesh
        reference_tokens(prompt, KILLED_TOKENS, ignore_eos=True)
    rng = random.Random(28)
    killed: dict[Daemon, float] = {}  # killed, when
    starting: set[Daemon] = set()  # started again, not yet serving
    kills = 0
    threads, results = run_streams(head, KILLED_TOKENS)
    next_kill = time.monotonic() + KILL_EVERY
    try:
        while any(t.is_alive() for t in threads):
            now = time.monotonic()
            for node, at in list(killed.items()):
                if now - at >= BACK_AFTER:
                    node.restart()
                    starting.add(node)
                    del killed[node]
            starting -= {node for node in starting if answers(node)}
            if now >= next_kill:
                serving = [w for w in workers if w not in killed and w not in starting]
                # never the last node serving its range: the head serves 0-7 throughout
                victims = [w for w in serving if w.layers == RANGES[0]
                           or sum(o.layers == w.layers for o in serving) >= 2]
                if victims:  # the one holding the most sessions (ties at random): a kill that breaks streams
                    rng.shuffle(victims)
                    victim = max(victims, key=sessions_held)
                    victim.kill()
                    killed[victim] = now
                    kills += 1
                    next_kill += KILL_EVERY
                else:  # on a slow host the nodes started again are not serving yet: the kill waits for them
                    next_kill = now + 0.5
            time.sleep(0.1)
    finally:  # every worker serves again for the next test, whatever happened here
        for node in killed:
            node.restart()
        for node in [*killed, *starting]:
            node.wait_ready()
    assert kills >= 3, f"the streams ended after {kills} kills"
    check_answers(results, reference_tokens, KILLED_TOKENS)
    # each kill takes the node holding the most sessions: the streams through it fail over (all but a last kill
    # that came as they ended)
    assert sum(stats["failovers"] for stats in results.values()) >= kills - 1, summary(f"{kills} kills", results)
    print(summary(f"{kills} kills", results))  # shown with -rP


def test_a_rolling_restart_of_half_the_workers_moves_every_stream_without_a_re_prefill(mesh, reference_tokens):
    head, workers = mesh
    everyone_knows_everyone(head, workers)
    threads, results = run_streams(head, RESTARTED_TOKENS)
    by_range = [[w for w in workers if w.layers == layers] for layers in RANGES]
    deadline = time.monotonic() + 60
    while not any(sessions_held(w) for w in workers):  # the streams' prompts are in
        assert time.monotonic() < deadline, "no worker took a stream's session"
        time.sleep(0.2)
    restarted, done = 0, set()
    for _ in range(RESTART_ROUNDS):  # one node of each range at a time: the one holding the most sessions now
        # (the router may send every stream through the same replicas: restarting others would move nothing)
        nodes = [max((r for r in replicas if id(r) not in done), key=sessions_held) for replicas in by_range]
        done.update(id(node) for node in nodes)
        for node in nodes:
            node.proc.send_signal(signal.SIGTERM)
        for node in nodes:
            assert node.proc.wait(timeout=60) == 0
            node.restart()
        for node in nodes:
            node.wait_ready()
        restarted += len(nodes)
        everyone_knows_everyone(head, workers)  # the next round's nodes hand their sessions to these
    for thread in threads:
        thread.join()
    assert restarted == RESTART_ROUNDS * len(RANGES)
    check_answers(results, reference_tokens, RESTARTED_TOKENS)
    for i, stats in results.items():
        # a reroute (the router moving to a far faster route: on a slow host a node just restarted is idle, the
        # others busy) re-prefills by design; the restarts themselves must re-prefill nothing
        assert stats["reprefills"] == stats["reroutes"] and stats["span_replays"] == 0, f"stream {i}: {stats}"
    # each round drains, in every range, the replica the most streams ran through: their sessions move
    assert sum(stats["moved_sessions"] for stats in results.values()) >= STREAMS // 2, \
        "the streams ended before the workers they ran on were restarted"
    print(summary(f"{restarted} workers restarted", results))
