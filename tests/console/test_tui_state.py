"""What the console learns from polls and answers, as plain data: no Textual, no network."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon.api import GenerationStats, NodeStatus, RouteEvent, RouteInfo
from meshtui.client import Usage
from meshtui.config import ChatSettings
from meshtui.export import conversation_record, write_export
from meshtui.state import GenerationRecord, MeshState, NodeState, layer_coverage, layer_runs, short_reason
from tests.support.tui_data import HEAD, NOW, REPLICA, WORKER, failover_route, node_status, session, session_list


def test_node_rates_come_from_counter_growth_between_polls():
    node = NodeState(WORKER)
    node.record(node_status(WORKER, 15, 30, time=NOW, tokens_served=100, steps_served=10), None, None, NOW)
    assert node.tokens_per_second == []  # one poll is no rate yet
    first = node.tokens_per_second
    node.record(node_status(WORKER, 15, 30, time=NOW + 2, tokens_served=180, steps_served=14), None, None, NOW + 2)
    assert node.tokens_per_second == [40.0] and node.steps_per_second == [2.0]
    assert node.tokens_per_second is not first  # a new list, so a Sparkline repaints


def test_a_restarted_node_starts_its_rates_again():
    node = NodeState(WORKER)
    node.record(node_status(WORKER, 15, 30, time=NOW, tokens_served=500), None, None, NOW)
    restarted = node_status(WORKER, 15, 30, time=NOW + 1, tokens_served=3)
    restarted.started_at = NOW + 0.5
    node.record(restarted, None, None, NOW + 1)
    assert node.tokens_per_second == []


def test_a_failed_poll_keeps_the_last_status_and_hides_the_sessions():
    node = NodeState(WORKER)
    node.record(node_status(WORKER, 15, 30), session_list([session("s1", 4, 15, idle=1, ttl_left=60)]), None, NOW)
    node.record(None, None, "timed out", NOW + 5)
    assert not node.up and node.status is not None and node.last_seen == NOW
    assert node.live_sessions == []


def test_ttl_counts_down_on_the_nodes_clock():
    node = NodeState(HEAD)
    node_clock = NOW + 30  # the node's clock runs 30 s ahead of ours
    entry = session("s1", 4, 0, idle=2, ttl_left=100, time=node_clock)
    node.record(None, session_list([entry], time=node_clock), None, NOW)
    assert node.ttl_left(entry, NOW) == 100
    assert node.ttl_left(entry, NOW + 40) == 60
    assert node.idle_for(entry, NOW + 40) == 42
    assert node.ttl_left(entry, NOW + 500) == 0


def test_the_head_comes_first_and_brings_its_peers():
    mesh = MeshState()
    mesh.add_node(WORKER)
    mesh.set_head(HEAD)
    assert mesh.node_urls() == [HEAD, WORKER]
    third = "http://10.0.0.3:7071"
    mesh.record_poll(HEAD, node_status(HEAD, 0, 15, peers=[WORKER, third]), None, None, NOW)
    assert mesh.node_urls() == [HEAD, WORKER, third]
    assert not mesh.remove_node(HEAD) and mesh.remove_node(third)


def test_coverage_counts_only_nodes_that_are_up():
    mesh = MeshState()
    mesh.set_head(HEAD)
    mesh.add_node(WORKER)
    mesh.record_poll(HEAD, node_status(HEAD, 0, 16), None, None, NOW)
    mesh.record_poll(WORKER, node_status(WORKER, 14, 30), None, None, NOW)
    counts = mesh.coverage()
    assert layer_runs(counts, lambda c: c > 1) == [(14, 15)] and layer_runs(counts, lambda c: c == 0) == []
    mesh.record_poll(WORKER, None, None, "connection refused", NOW + 1)
    assert layer_runs(mesh.coverage(), lambda c: c == 0) == [(16, 29)]
    assert layer_coverage(4, [(0, 2), (3, 9)]) == [1, 1, 0, 1]


def test_a_draining_node_is_up_but_covers_nothing():
    mesh = MeshState()
    mesh.set_head(HEAD)
    mesh.add_node(WORKER)
    mesh.record_poll(HEAD, node_status(HEAD, 0, 15), None, None, NOW)
    mesh.record_poll(WORKER, node_status(WORKER, 15, 30, draining=True), None, None, NOW)
    worker = mesh.nodes[WORKER]
    assert worker.up and worker.draining and not worker.serving and mesh.draining == 1
    assert layer_runs(mesh.coverage(), lambda c: c == 0) == [(15, 29)]  # heads route nothing new through it


def test_a_refused_token_is_told_apart_from_a_node_that_is_down():
    node = NodeState(WORKER)
    node.record(None, None, "401: wrong or missing token", NOW, http_status=401)
    assert node.unauthorized and not node.up
    node.record(None, None, "connection refused", NOW + 1)
    assert not node.unauthorized
    node.record(node_status(WORKER, 15, 30), None, None, NOW + 2, http_status=401)
    assert node.up and not node.unauthorized  # a status code only means something with an error


def test_route_events_come_newest_first_in_a_few_words():
    mesh = MeshState()
    mesh.record_route(failover_route(), None)
    failover, reroute, no_route = mesh.recent_route_events()
    assert (failover.kind, failover.failed, failover.reason) == ("failover", REPLICA, "unreachable")
    assert failover.position == 45 and failover.route == ("local", WORKER)
    assert (reroute.failed, reroute.reason, reroute.route) == (None, "old route 14.9 ms/step", ("local", REPLICA))
    assert (no_route.reason, no_route.route) == ("no node for layers 15-29", ())
    assert len(mesh.recent_route_events(limit=2)) == 2
    mesh.record_route(None, "timed out")
    assert mesh.recent_route_events() == []  # the head stopped answering: its events are stale
    mesh.record_route(RouteInfo.from_dict({"events": [{"kind": "failover"}]}), None)  # sparse events still read
    assert mesh.recent_route_events()[0].reason == ""


def event(kind: str, reason: str, **detail) -> RouteEvent:
    """A route event as the console reads it from the head's JSON."""
    return RouteEvent.from_dict({"kind": kind, "reason": reason, "failed": "http://127.0.0.1:7072", **detail})


def test_daemon_reasons_are_cut_to_a_few_words():
    url = "http://127.0.0.1:7072"
    # the words come from the code and its fields; the sentence beside them is only for people and logs
    assert short_reason(event("failover", f"{url} is unreachable: timed out after 10 s", code="timed_out")) \
        == "timed out"
    assert short_reason(event("failover", f"{url} answered 503: this node is draining", code="http_status",
                              status=503)) == "answered 503"
    assert short_reason(event("failover", f"{url} is unreachable: ServerDisconnectedError", code="unreachable")) \
        == "unreachable"
    assert short_reason(event("no_route", "no live node serves layers 3-7 of 0-29; start a node",
                              code="no_node_for_layers", layers=[3, 8])) == "no node for layers 3-7"
    assert short_reason(event("reroute", "expected 9.5 ms per step on the old route", code="slower_route",
                              step_ms=9.5)) == "old route 9.5 ms/step"
    assert short_reason(event("failover", "something new: with details")) == "something new: with details"
    assert len(short_reason(event("failover", "x" * 80))) == 40


def test_nodes_joining_and_leaving_show_with_the_route_events():
    from meshtui.screens.mesh import _event_line

    url = "http://127.0.0.1:7072"
    mesh = MeshState(head_url="http://127.0.0.1:7070")
    mesh.record_route(RouteInfo.from_dict({"events": [
        {"time": 1.0, "kind": "joined", "node": url, "code": "joined", "layers": [15, 30],
         "reason": f"{url} joined, serving layers 15-29"},
        {"time": 2.0, "kind": "down", "node": url, "code": "down", "reason": f"{url} stopped answering: reset"},
        {"time": 3.0, "kind": "left", "node": url, "code": "left", "reason": f"{url} left the mesh"},
        {"time": 4.0, "kind": "forgotten", "node": url, "code": "forgotten", "reason": "..."},
    ]}), None)
    forgotten, left, down, joined = mesh.recent_route_events()
    assert [(e.kind, e.node, e.reason) for e in (joined, down, left, forgotten)] == [
        ("joined", url, "layers 15-29"), ("down", url, "stopped answering"), ("left", url, "stopped on its own"),
        ("forgotten", url, "down too long")]
    assert _event_line(joined, mesh.head_url).plain.endswith("joined    :7072 layers 15-29")
    assert _event_line(left, mesh.head_url).plain.endswith("left      :7072 stopped on its own")


def test_the_words_never_come_from_the_sentence():
    # an older head sends no code: its sentence shows as it is, cut, with nothing read out of it
    older = event("failover", "http://127.0.0.1:7072 answered 503: this node is draining")
    assert short_reason(older) == "http://127.0.0.1:7072 answered 503: thi…"
    # the code decides, whatever the sentence says
    assert short_reason(event("failover", "answered 500", code="unreachable")) == "unreachable"
    assert short_reason(event("reroute", "expected 1.0 ms per step", code="slower_route", step_ms=14.94)) \
        == "old route 14.9 ms/step"


@pytest.mark.parametrize("detail", [
    {"code": "http_status"},  # without the status it names
    {"code": "http_status", "status": "503"},
    {"code": "http_status", "status": True},
    {"code": "http_status", "status": 42},
    {"code": "no_node_for_layers", "layers": [7, 3]},
    {"code": "no_node_for_layers", "layers": [3, 4, 5]},
    {"code": "no_node_for_layers", "layers": "3-7"},
    {"code": "slower_route", "step_ms": "9.5"},
    {"code": "slower_route", "step_ms": -1},
    {"code": "slower_route", "step_ms": float("inf")},
    {"code": "a_newer_code"},
    {"code": ["unreachable"]},
])
def test_a_code_without_its_fields_or_unknown_reads_as_none(detail):
    read = event("failover", "the sentence", **detail)
    assert read.code is None and short_reason(read) == "the sentence"


def test_route_event_codes_survive_the_json_round_trip():
    for original in failover_route().events:
        read = RouteEvent.from_dict(json.loads(json.dumps(original.to_dict())))
        assert read == original and read.code is not None


def test_answer_rates_and_the_conversation():
    record = GenerationRecord(number=1, prompt="hi", started_at=NOW)
    for i, at in enumerate([0.0, 0.1, 0.2, 0.4]):
        record.add_text(f"t{i} ", NOW + at)
    assert record.rates(window=2) == pytest.approx([10.0, 10.0, 2 / 0.3], rel=1e-4)
    assert record.tokens == 4 and record.tokens_per_second == pytest.approx(7.5, rel=1e-4)
    record.stats = GenerationStats(completion_tokens=5, decode_seconds=4 / 9.5)  # 4 steps after the first token
    assert record.tokens == 5 and record.tokens_per_second == 9.5

    mesh = MeshState()
    failed = mesh.start_generation("first", NOW)
    mesh.finish_generation(failed, "failed", "timed out")
    assert mesh.conversation == []
    cancelled = mesh.start_generation("second", NOW)
    cancelled.add_text("half an", NOW)
    mesh.finish_generation(cancelled, "cancelled")
    assert mesh.request_messages("third") == [
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "half an"},
        {"role": "user", "content": "third"},
    ]


def test_prompt_reuse_comes_from_the_usage_block_else_the_meshnet_one():
    record = GenerationRecord(number=1, prompt="hi", started_at=NOW)
    assert record.prompt_reuse is None
    record.stats = GenerationStats(prompt_tokens=57, cached_tokens=35)
    assert record.prompt_reuse == (35, 57)
    # both come from the same count on a meshd head; the OpenAI block is the one any server sends
    record.usage = Usage.from_dict({"prompt_tokens": 57, "completion_tokens": 9,
                                    "prompt_tokens_details": {"cached_tokens": 36}})
    assert record.prompt_reuse == (36, 57)
    # a server that reuses nothing may leave the details out, or send null
    assert Usage.from_dict({"prompt_tokens": 12, "prompt_tokens_details": None}) == Usage(prompt_tokens=12)


def test_state_client_config_and_export_know_nothing_of_textual():
    code = ("import sys, meshtui.state, meshtui.client, meshtui.config, meshtui.export; "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('textual', 'torch')]")
    subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], check=True, timeout=60)


def test_the_chat_limits_come_from_the_heads_status_and_old_nodes_report_none():
    state = MeshState()
    state.set_head(HEAD)
    assert (state.chat_limits.max_tokens, state.chat_limits.context_length) == (None, None)  # not polled yet
    reported = node_status(HEAD, 0, 30)
    reported.max_tokens_cap, reported.context_length = 2048, 8192
    state.record_poll(HEAD, reported, None, None, NOW)
    assert (state.chat_limits.max_tokens, state.chat_limits.context_length) == (2048, 8192)
    old = node_status(HEAD, 0, 30).to_dict()
    del old["max_tokens_cap"], old["context_length"]  # a node from before they were reported
    state.record_poll(HEAD, NodeStatus.from_dict(old), None, None, NOW + 1)
    assert (state.chat_limits.max_tokens, state.chat_limits.context_length) == (None, None)


def test_a_new_conversation_keeps_the_system_prompt_and_drops_late_answers_of_the_old_one():
    state = MeshState(system_prompt="Be brief.")
    first = state.start_generation("hi", NOW)
    first.text = "Hello."
    state.finish_generation(first, "done")
    assert state.request_messages("more") == [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "Hello."},
                                              {"role": "user", "content": "more"}]
    late = state.start_generation("more", NOW)
    late.text = "Half an ans"
    state.new_conversation()  # while "more" was still streaming: it ends cancelled, after the reset
    state.finish_generation(late, "cancelled")
    assert state.conversation == [] and state.conversation_records == []
    assert state.request_messages("again") == [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "again"}]
    assert len(state.generations) == 2  # the Throughput view keeps its history


def test_an_export_never_overwrites_one_made_in_the_same_second(tmp_path):
    state = MeshState()
    record = state.start_generation("hi", NOW)
    record.text = "Hello."
    state.finish_generation(record, "done")
    data = conversation_record(state, ChatSettings(), NOW)
    first = write_export(tmp_path, data, NOW)
    second = write_export(tmp_path, data, NOW)
    stem = time.strftime("chat-%Y%m%d-%H%M%S", time.localtime(NOW))  # the local time, as the operator reads it
    assert [p.name for p in first] == [f"{stem}.md", f"{stem}.json"]
    assert [p.name for p in second] == [f"{stem}-2.md", f"{stem}-2.json"]
    assert json.loads(second[1].read_text())["messages"] == [{"role": "user", "content": "hi"},
                                                             {"role": "assistant", "content": "Hello."}]
    assert "## You\n\nhi\n\n## the mesh\n\nHello.\n" in first[0].read_text()  # no model known: still readable
