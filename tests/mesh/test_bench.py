"""``meshd bench``: one quick run end to end on a tiny model, and the arithmetic of its table.

Speed itself is never asserted here (the machine is shared and noisy): the run
checks that every row is measured, that the mesh's tokens match ``generate``'s,
and that the JSON carries what BENCHMARKS.md reports.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from daemon.bench import check_targets, mesh_row, window_tps
from daemon.bench import mesh as bench_mesh
from daemon.bench.mesh import counter_value, paired_sessions
from daemon.bench.reuse import (
    QUESTIONS,
    USER_TURNS,
    client_messages,
    group_row,
    ratio,
    shared_and_own,
    turn_row,
)


@pytest.mark.slow
def test_a_quick_run_measures_every_setup_and_writes_json(tiny_model, tmp_path):
    model = tiny_model("llama")
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "bench", "--model", str(model), "--tokens", "6",
         "--sessions", "2", "--session-tokens", "3", "--precisions", "float32", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "6/6 tokens" in proc.stderr  # progress while it runs
    result = json.loads(out.read_text())
    setups = {r["setup"] for r in result["rows"]}
    assert {"mesh, 1 node", "mesh, 2 nodes, cached", "mesh, 2 nodes, stateless", "mesh, 3 nodes, cached"} <= setups
    # every setup by default; llama.cpp needs the bench extra and a .gguf model, and says so in one line
    assert "llama.cpp" in proc.stderr and "measuring without it" in proc.stderr
    assert "2-node cached vs 1 node, 6 tokens" in {t["target"] for t in result["targets"]}
    assert any(s.startswith("generate, 1 process") for s in setups)
    hidden = result["model"]["hidden_size"]
    for row in result["rows"]:
        assert row["new_tokens"] == 6 and len(row["token_ids"]) == 6 and len(row["step_ms"]) == 5
        assert row["decode_tps"] > 0 and row["first10_tps"] > 0 and row["last10_tps"] > 0
        assert row["ratio"] > 0
        if row["setup"].startswith("mesh"):
            assert row["tokens_match"] is True, row["setup"]  # greedy: the mesh generates what generate does
            assert row["setup"] in proc.stdout
            # each mesh run right after a generate run: the ratio is the pairs' median
            assert len(row["paired_ratios"]) == row["runs"] == 1 and row["ratio"] == row["paired_ratios"][0]
            if row["setup"] == "mesh, 2 nodes, cached":  # and right after a run of the one-node mesh, kept open
                assert len(row["paired_one_ratios"]) == 1 and row["vs_one"] == row["paired_one_ratios"][0] > 0
                assert "x one node, run straight before it" in proc.stdout
            if row["setup"] == "mesh, 1 node":  # no hop: nothing crosses the network
                assert row["overhead_ms_per_hop_step"] is None and row["payload_bytes_per_hop_step"] is None
                continue
            assert row["overhead_ms_per_hop_step"] >= 0
            # a cached decode hop carries one token's activation; a stateless one the whole sequence
            per_token = hidden * 4
            if "cached" in row["setup"]:
                assert row["payload_bytes_per_hop_step"] == per_token
            else:
                assert row["payload_bytes_per_hop_step"] > per_token
            assert row["wire_bytes_per_hop_step"] > row["payload_bytes_per_hop_step"]  # HTTP framing counted
    assert [s["sessions"] for s in result["sessions"]] == [1, 2]
    two = result["sessions"][1]  # after a one-session run of its own: its ratios are that pair's
    assert two["runs"] == 1 and two["tps_ratio"] == two["paired_tps_ratios"][0] > 0 and two["tokens_match_one"]
    for group in result["sessions"]:
        assert group["aggregate_tps"] > 0 and 0 < group["itl_p50_ms"] <= group["itl_p95_ms"]
        assert group["sessions_agree"] and len(group["mean_batch"]) == 2  # both nodes' steps per forward
        assert all(1.0 <= b <= group["sessions"] for b in group["mean_batch"])
    assert "mean batch" in proc.stdout
    assert result["targets"] and result["machine"]["cores"] >= 1


@pytest.mark.slow
def test_a_short_run_measures_one_mesh_against_generate_in_each_precision(tiny_model, tmp_path):
    """A short run of ``meshd bench``: the reference, the cached two-node mesh and the floor, in each precision
    (int8 weights compute in bfloat16)."""
    out, precisions = tmp_path / "bench.json", ("float32", "bfloat16", "int8")
    proc = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "bench", "--model", str(tiny_model("llama")), "--tokens", "4",
         "--setups", "generate", "cached", "--reference-threads", "1", "--sessions", "0",
         "--precisions", *precisions, "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {(r["setup"], r["precision"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(setup, precision) for setup in ("generate, 1 process, 1 thread", "mesh, 2 nodes, cached")
                         for precision in precisions}
    for precision in precisions:
        size = {"float32": 4, "int8": 4}.get(precision, 2)  # int8 weights compute in float32
        mesh, reference = rows["mesh, 2 nodes, cached", precision], rows["generate, 1 process, 1 thread", precision]
        assert mesh["tokens_match"] is True and mesh["token_ids"] == reference["token_ids"]  # generate in its dtype
        assert mesh["cached_tokens"] == 0  # the warm-up's prompt is not reused: each run computes its prompt whole
        assert mesh["decode_tps"] > 0 and mesh["payload_bytes_per_hop_step"] == 64 * size  # the tiny hidden size
        assert [n["dtype"] for n in mesh["nodes"]] == [{"int8": "float32"}.get(precision, precision)] * 2
        assert all(n["peak_rss_bytes"] > n["weights_bytes"] > 0 for n in mesh["nodes"])
        assert 0 <= mesh["load"] < 1000
    assert "loopback floor" in proc.stdout


@pytest.mark.slow
def test_a_short_run_measures_prompt_reuse_warm_against_cold(tiny_model, tmp_path):
    """The multiturn and shared-prefix setups on a tiny model: what each turn and each group of clients reused
    and computed, warm next to cold on the same mesh, with the same tokens (float32, greedy)."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "bench", "--model", str(tiny_model("llama")), "--setups", "multiturn",
         "shared-prefix", "--precisions", "float32", "--turn-tokens", "4", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"turn {len(USER_TURNS)}/{len(USER_TURNS)}" in proc.stderr and "8 clients at once, warm" in proc.stderr
    result = json.loads(out.read_text())
    assert result["rows"] == [] and result["turn_tokens"] == 4

    turns = result["multiturn"]
    assert [t["turn"] for t in turns] == list(range(1, len(USER_TURNS) + 1))
    assert all(a["prompt_tokens"] < b["prompt_tokens"] for a, b in zip(turns, turns[1:]))  # the history grows
    assert turns[0]["cached_tokens"] == 0  # nothing of this chat on the mesh yet
    for t in turns:
        assert t["precision"] == "float32" and 0 <= t["load"] < 1000
        assert t["cold_cached_tokens"] == 0 and t["cold_computed_tokens"] == t["prompt_tokens"]  # cold: all of it
        assert t["cached_tokens"] + t["computed_tokens"] == t["prompt_tokens"] and t["reprefills"] == 0
        assert t["ttft_warm_ms"] > 0 and t["ttft_cold_ms"] > 0 and t["ttft_ratio"] > 0
        assert t["tokens_match"] is True and len(t["token_ids"]) == 4
    for t in turns[1:]:
        # the chat so far is held: only the last answer's token, the template and the new question are computed
        assert t["cached_tokens"] > t["prompt_tokens"] - 64 and t["computed_tokens"] >= 1

    cold, warm = result["shared_prefix"]
    assert (cold["reuse"], warm["reuse"]) == (False, True)
    for group in (cold, warm):
        assert group["clients"] == 8 and group["tokens_match"] is True and group["reprefills"] == 0
        assert group["prompt_tokens"] == 8 * group["shared_tokens"] + group["own_tokens"]
        assert group["ideal_tokens"] == group["shared_tokens"] + group["own_tokens"]
        assert group["metrics_computed_tokens"] == group["computed_tokens"]  # the head's /metrics agrees
        assert group["wall_s"] > 0 and group["mean_ttft_ms"] > 0 and len(group["token_ids"]) == 8
    assert group["shared_tokens"] > 400 and all(len(ids) == 4 for ids in warm["token_ids"])
    assert cold["computed_tokens"] == cold["prompt_tokens"] and cold["cached_tokens"] == 0
    # the system prompt computed once: its 7 other clients each forked it from the first
    assert warm["computed_ratio"] <= 1.3 and warm["cached_tokens"] >= 7 * warm["shared_tokens"] - 7

    targets = {c["target"] for c in result["targets"]}
    assert targets == {f"multiturn: turn {len(USER_TURNS)} TTFT warm / cold",
                       "shared prefix, 8 clients: prompt tokens computed / (system prompt + own)"}
    assert "multi-turn chat, 2 nodes" in proc.stdout and "clients at once with one system prompt" in proc.stdout


def test_llama_cpp_asked_for_and_not_possible_is_refused_in_one_line(tiny_model, capsys):
    from daemon.bench import main

    with pytest.raises(SystemExit) as exit:
        main(["--model", str(tiny_model("llama")), "--setups", "one", "llama.cpp"])
    assert exit.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    # without the bench extra, how to install it; with it, that llama.cpp needs the model as a .gguf file
    assert 'pip install "meshnet[bench]"' in error or "needs the model as a .gguf file" in error, error


def test_windows_and_rows_from_generation_stats():
    assert window_tps([100.0] * 10 + [200.0] * 10, last=False) == 10.0
    assert window_tps([100.0] * 10 + [200.0] * 10, last=True) == 5.0
    assert window_tps([], last=True) is None
    stats = {
        "prefill_ms": 50.0, "first_token_ms": 50.0, "decode_tokens_per_second": 10.0, "reprefills": 0,
        "cached_tokens": 3, "step_ms": [100.0] * 4, "token_ids": [1, 2, 3, 4, 5],
        "decode_hops": [
            {"url": "a", "local": True, "steps": 4, "latency_ms": 200.0, "compute_ms": 196.0,
             "payload_bytes": 0, "sent_bytes": 0, "received_bytes": 0},
            {"url": "b", "local": False, "steps": 4, "latency_ms": 210.0, "compute_ms": 200.0,
             "payload_bytes": 4 * 2304, "sent_bytes": 4 * 2700, "received_bytes": 4 * 200},
        ],
    }
    row = mesh_row(stats)
    assert row["overhead_ms_per_hop_step"] == 2.5  # (210 - 200) / 4, remote hops only
    assert row["local_overhead_ms_per_step"] == 1.0
    assert row["payload_bytes_per_hop_step"] == 2304 and row["wire_bytes_per_hop_step"] == 2700
    assert row["cached_tokens"] == 3  # prompt tokens a reused prefix held


def test_targets_are_checked_against_the_rows():
    rows = [
        {"setup": "mesh, 2 nodes, cached", "new_tokens": 512, "ratio": 0.95, "decay": 0.8, "decode_tps": 9.0,
         "overhead_ms_per_hop_step": 2.0, "wire_bytes_per_hop_step": 2700.0},
        {"setup": "mesh, 2 nodes, stateless", "new_tokens": 512, "ratio": 0.1, "decay": 0.5, "decode_tps": 1.0},
    ]
    met = {c["target"]: c["met"] for c in check_targets(rows, hidden_size=576)}
    assert met == {
        "2-node cached vs generate, 512 tokens": True,
        "2-node cached last-10 / first-10 tokens/s, 512 tokens": False,
        "2-node cached vs stateless, 512 tokens": True,
        "mesh, 2 nodes, cached: overhead per hop per decode step (ms)": True,
        "mesh, 2 nodes, cached: bytes sent per hop per decode step": True,
    }


def test_one_node_is_held_to_llama_cpp_at_its_precision_and_two_nodes_to_one():
    def rows(precision: str, vs_llama: float, one: float, two: float) -> list[dict]:
        return [{"setup": "mesh, 1 node", "precision": precision, "new_tokens": 128, "ratio": one,
                 "vs_llama": vs_llama, "llama": "llama.cpp Q8_0, 2 threads"},
                {"setup": "mesh, 2 nodes, cached", "precision": precision, "new_tokens": 128, "ratio": two}]

    checks = check_targets(rows("float32", 0.92, 1.0, 0.79) + rows("int8", 0.5, 1.25, 1.0)
                           + rows("bfloat16", 0.1, 1.0, 1.0), hidden_size=576)
    met = {(c["precision"], c["target"]): (round(c["value"], 3), c["limit"], c["met"]) for c in checks
           if "1 node" in c["target"]}
    assert met == {
        ("float32", "1 node vs llama.cpp Q8_0, 2 threads, 128 tokens"): (0.92, 0.9, True),
        ("float32", "2-node cached vs 1 node, 128 tokens"): (0.79, 0.8, False),
        ("int8", "1 node vs llama.cpp Q8_0, 2 threads, 128 tokens"): (0.5, 0.9, False),
        ("int8", "2-node cached vs 1 node, 128 tokens"): (0.8, 0.8, True),  # 1.0 / 1.25: each against generate
        ("bfloat16", "2-node cached vs 1 node, 128 tokens"): (1.0, 0.8, True),  # no llama.cpp target in bfloat16
    }


def test_two_nodes_are_held_to_the_one_node_runs_beside_them_where_they_were_paired():
    one = {"setup": "mesh, 1 node", "precision": "bfloat16", "new_tokens": 128, "ratio": 1.25}
    paired = {"setup": "mesh, 2 nodes, cached", "precision": "bfloat16", "new_tokens": 128, "ratio": 0.95,
              "vs_one": 0.86, "paired_one_ratios": [0.91, 0.86, 0.84]}
    [check] = [c for c in check_targets([one, paired], hidden_size=576) if "1 node" in c["target"]]
    assert (check["value"], check["met"]) == (0.86, True)  # not 0.95 / 1.25 through generate's runs
    unpaired = {k: v for k, v in paired.items() if k not in ("vs_one", "paired_one_ratios")}
    [check] = [c for c in check_targets([one, unpaired], hidden_size=576) if "1 node" in c["target"]]
    assert (round(check["value"], 3), check["met"]) == (0.76, False)


def test_many_sessions_are_measured_against_a_one_session_run_just_before_each(monkeypatch):
    # a host whose speed halves, thirds... from one pair of runs to the next; one session makes 10 tok/s times
    # that speed, 4 sessions 25 and 8 sessions 35, times a disturbance of their own per round; p95 latencies grow
    calls = []
    disturbed = [1.0, 1.2, 0.9]

    def fake_run(mesh, sessions, tokens):
        pair = len(calls) // 2
        speed = 1.0 / (1 + pair)
        calls.append(sessions)
        tps = {1: 10.0, 4: 25.0, 8: 35.0}[sessions] * speed * (disturbed[pair // 2] if sessions > 1 else 1.0)
        p95 = {1: 50.0, 4: 90.0, 8: 150.0}[sessions] / speed
        return {"sessions": sessions, "aggregate_tps": tps, "itl_p95_ms": p95, "token_ids": [1, 2],
                "sessions_agree": True, "call": len(calls)}

    monkeypatch.setattr(bench_mesh, "many_sessions", fake_run)
    one, four, eight = paired_sessions(None, [1, 4, 8], tokens=3, times=3)
    assert calls == [1, 4, 1, 8] * 3  # each many-session run right after a one-session run
    assert four["paired_tps_ratios"] == pytest.approx([2.5, 3.0, 2.25])  # the host's slowing cancels in each pair
    assert four["tps_ratio"] == pytest.approx(2.5) and four["call"] == 2  # the median pair's run is the row
    assert eight["tps_ratio"] == pytest.approx(3.5) and eight["call"] == 4
    assert four["p95_ratio"] == pytest.approx(1.8) and eight["p95_ratio"] == pytest.approx(3.0)
    assert one["runs"] == 6 and one["tps_ratio"] == 1.0
    assert one["aggregate_tps"] == pytest.approx(10.0 / 4)  # the lower middle of the six one-session runs
    assert four["runs"] == eight["runs"] == 3 and four["tokens_match_one"] and four["sessions_agree"]
    groups = [group | {"precision": "float32"} for group in (one, four, eight)]
    measured = {c["target"]: c["value"] for c in check_targets([], 576, sessions=groups)}
    assert measured["4 sessions: aggregate tok/s over one session's"] == four["tps_ratio"]
    assert measured["4 sessions: p95 inter-token latency over one session's"] == four["p95_ratio"]


def test_prompts_split_into_what_all_share_and_each_ones_own():
    assert shared_and_own([[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 7]]) == (2, [2, 3, 1])
    assert shared_and_own([[1, 2, 3]]) == (3, [0])
    assert shared_and_own([[1, 2], [1, 2, 3]]) == (2, [0, 1])
    assert shared_and_own([[5, 1], [6, 1]]) == (0, [2, 2])
    # every client has the system prompt and a question of its own, also beyond the written questions
    chats = [client_messages(i) for i in range(len(QUESTIONS) + 2)]
    assert len({c[0]["content"] for c in chats}) == 1 and len({c[1]["content"] for c in chats}) == len(chats)


def test_counters_are_read_from_prometheus_text():
    text = """# HELP meshnet_prompt_tokens_total Prompt tokens of generations this node headed
# TYPE meshnet_prompt_tokens_total counter
meshnet_prompt_tokens_total{kind="reused"} 3570.0
meshnet_prompt_tokens_total{kind="computed"} 650.0
meshnet_prompt_tokens_created{kind="computed"} 1.7e+09
meshnet_generations_total{finish="length"} 7.0
meshnet_generations_total{finish="stop"} 2.0
"""
    assert counter_value(text, "meshnet_prompt_tokens_total", kind="computed") == 650.0
    assert counter_value(text, "meshnet_prompt_tokens_total") == 4220.0
    assert counter_value(text, "meshnet_generations_total") == 9.0
    assert counter_value(text, "meshnet_tokens_generated_total") == 0.0


def test_turns_and_groups_from_answers():
    assert ratio(1.0, 4.0) == 0.25 and ratio(None, 4.0) is None and ratio(1.0, 0) is None and ratio(1.0, None) is None

    def answer(prompt, cached, ttft, ids, first_token_ms=10.0):
        return {"prompt_tokens": prompt, "cached_tokens": cached, "prompt_computed_tokens": prompt - cached,
                "ttft_ms": ttft, "first_token_ms": first_token_ms, "prefill_ms": 5.0, "reprefills": 0,
                "token_ids": ids}

    row = turn_row(6, answer(700, 670, 50.0, [1, 2]), answer(700, 0, 400.0, [1, 2]))
    assert row["cached_tokens"] == 670 and row["computed_tokens"] == 30 and row["cold_computed_tokens"] == 700
    assert row["ttft_ratio"] == 0.125 and row["tokens_match"] is True
    assert turn_row(2, answer(10, 0, 5.0, [1]), answer(10, 0, 5.0, [2]))["tokens_match"] is False

    # 4 clients: a 500-token system prompt, 20 tokens each of their own; the first computes it, 3 fork it
    warm = [answer(520, 0, 300.0, [1])] + [answer(520, 500, 100.0, [1])] * 3
    group = group_row(True, warm, 2.0, 580.0, 500, [20] * 4)
    assert group["ideal_tokens"] == 580 and group["computed_tokens"] == 580 and group["computed_ratio"] == 1.0
    assert group["cached_tokens"] == 1500 and group["mean_ttft_ms"] == 150.0 and group["max_ttft_ms"] == 300.0
    cold = group_row(False, [answer(520, 0, 400.0, [1])] * 4, 3.0, None, 500, [20] * 4)
    assert cold["computed_tokens"] == 2080 and cold["computed_ratio"] == 2080 / 580


def test_reuse_targets_hold_the_last_turn_and_the_warm_group():
    turns = [{"precision": "float32", "turn": t, "ttft_ratio": r} for t, r in ((1, 1.0), (6, 0.3), (2, 0.5))]
    groups = [{"precision": "float32", "reuse": False, "clients": 8, "computed_ratio": 6.5},
              {"precision": "float32", "reuse": True, "clients": 8, "computed_ratio": 1.4}]
    checks = check_targets([], hidden_size=576, multiturn=turns, shared_prefix=groups)
    assert {c["target"]: (c["value"], c["met"]) for c in checks} == {
        "multiturn: turn 6 TTFT warm / cold": (0.3, True),
        "shared prefix, 8 clients: prompt tokens computed / (system prompt + own)": (1.4, False),
    }
    assert all(c["precision"] == "float32" and not c["at_least"] for c in checks)
