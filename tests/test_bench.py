"""``meshd bench``: one quick run end to end on a tiny model, and the arithmetic of its table.

Speed itself is never asserted here (the machine is shared and noisy): the run
checks that every row is measured, that the mesh's tokens match ``generate``'s,
and that the JSON carries what the README's "Speed" section reports.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from daemon.bench import check_targets, mesh_row, window_tps


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
    assert {"mesh, 2 nodes, cached", "mesh, 2 nodes, stateless", "mesh, 3 nodes, cached"} <= setups
    assert any(s.startswith("generate, 1 process") for s in setups)
    hidden = result["model"]["hidden_size"]
    for row in result["rows"]:
        assert row["new_tokens"] == 6 and len(row["token_ids"]) == 6 and len(row["step_ms"]) == 5
        assert row["decode_tps"] > 0 and row["first10_tps"] > 0 and row["last10_tps"] > 0
        assert row["ratio"] > 0
        if row["setup"].startswith("mesh"):
            assert row["tokens_match"] is True, row["setup"]  # greedy: the mesh generates what generate does
            # each mesh run right after a generate run: the ratio is the pairs' median
            assert len(row["paired_ratios"]) == row["runs"] == 1 and row["ratio"] == row["paired_ratios"][0]
            assert row["overhead_ms_per_hop_step"] >= 0
            # a cached decode hop carries one token's activation; a stateless one the whole sequence
            per_token = hidden * 4
            if "cached" in row["setup"]:
                assert row["payload_bytes_per_hop_step"] == per_token
            else:
                assert row["payload_bytes_per_hop_step"] > per_token
            assert row["wire_bytes_per_hop_step"] > row["payload_bytes_per_hop_step"]  # HTTP framing counted
            assert row["setup"] in proc.stdout
    assert [s["sessions"] for s in result["sessions"]] == [1, 2]
    assert all(s["aggregate_tps"] > 0 for s in result["sessions"])
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
        size = {"float32": 4}.get(precision, 2)  # int8 weights compute in bfloat16
        mesh, reference = rows["mesh, 2 nodes, cached", precision], rows["generate, 1 process, 1 thread", precision]
        assert mesh["tokens_match"] is True and mesh["token_ids"] == reference["token_ids"]  # generate in its dtype
        assert mesh["decode_tps"] > 0 and mesh["payload_bytes_per_hop_step"] == 64 * size  # the tiny hidden size
        assert [n["dtype"] for n in mesh["nodes"]] == [{"int8": "bfloat16"}.get(precision, precision)] * 2
        assert all(n["peak_rss_bytes"] > n["weights_bytes"] > 0 for n in mesh["nodes"])
        assert 0 <= mesh["load"] < 1000
    assert "loopback floor" in proc.stdout


def test_windows_and_rows_from_generation_stats():
    assert window_tps([100.0] * 10 + [200.0] * 10, last=False) == 10.0
    assert window_tps([100.0] * 10 + [200.0] * 10, last=True) == 5.0
    assert window_tps([], last=True) is None
    stats = {
        "prefill_ms": 50.0, "first_token_ms": 50.0, "decode_tokens_per_second": 10.0, "reprefills": 0,
        "step_ms": [100.0] * 4, "token_ids": [1, 2, 3, 4, 5],
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
