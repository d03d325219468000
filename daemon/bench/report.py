"""What a run reports: the throughput windows, the targets each run is held to, the machine, the table."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from pathlib import Path

from daemon.host import cpu_name, host_cores

WINDOW = 10  # steps in the first-N and last-N throughput windows

# The targets of the performance work, checked against every run (see BENCHMARKS.md).
TARGET_RATIO = 0.9  # two-node cached decode vs generate
TARGET_VS_LLAMA = {"float32": 0.9, "int8": 0.9, "int4": 0.8}  # one node vs llama.cpp at its precision (F32, Q8_0, Q4_0)
TARGET_TWO_VS_ONE = 0.8  # two-node cached decode vs one node with every layer
TARGET_OF_FLOOR = {"llama-8b": 0.7, "qwen3.5-moe": 0.6}  # real-size decode step: the floor's time over the step's
TARGET_PEAK_OVER_WEIGHTS = 1.15  # a real-size node's peak resident set over its weights' bytes
TARGET_DECAY = 0.9  # last-10 over first-10 tokens/s, over 512 tokens
TARGET_VS_STATELESS = 4.0  # cached over stateless decode at 512 tokens
TARGET_OVERHEAD_MS = 3.0  # per hop per decode step, on loopback
TARGET_EXTRA_BYTES = 512  # a decode hop's request may exceed hidden size x 4 bytes by this much
TARGET_LAST_TURN_TTFT = 0.35  # a chat's last turn: TTFT with the mesh's prefix over TTFT computing it all
TARGET_SHARED_COMPUTED = 1.3  # concurrent clients, one system prompt: prompt tokens computed over the least
TARGET_SESSIONS_TPS = {4: 2.5, 8: 3.5}  # concurrent sessions: aggregate tok/s over one session's
TARGET_SESSIONS_P95 = {4: 2.0}  # concurrent sessions: p95 inter-token latency over one session's


def window_tps(step_ms: list[float], *, last: bool) -> float | None:
    """Tokens per second over the first (or last) ``WINDOW`` decode steps."""
    steps = step_ms[-WINDOW:] if last else step_ms[:WINDOW]
    return len(steps) * 1000.0 / sum(steps) if steps and sum(steps) > 0 else None


def machine() -> dict:
    """This host as the JSON records it: cores, CPU, memory, versions, load."""
    import torch
    import transformers

    mem = next((int(line.split()[1]) * 1024 for line in _read_lines("/proc/meminfo")
                if line.startswith("MemTotal")), None)
    return {
        "cores": host_cores(),
        "cpu": cpu_name(), "memory_bytes": mem, "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "load_average_at_start": os.getloadavg(),
    }


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


# on the wire: quantized nodes compute in float32
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 4, "int4": 4}


def check_targets(rows: list[dict], hidden_size: int, *, multiturn: Sequence[dict] = (),
                  shared_prefix: Sequence[dict] = (), sessions: Sequence[dict] = (),
                  shapes: Sequence[dict] = ()) -> list[dict]:
    """Each target in BENCHMARKS.md against this run's rows (where the run measured it),
    per precision: a bfloat16 mesh is held to generate in bfloat16, its hops to bfloat16's bytes.
    ``multiturn`` and ``shared_prefix``: the prompt-reuse rows (``daemon.bench.reuse``)."""
    checks = []

    def check(name: str, value, limit: float, *, at_least: bool) -> None:
        if value is not None:
            ok = value >= limit if at_least else value <= limit
            checks.append({"target": name, "precision": precision, "value": value, "limit": limit,
                           "at_least": at_least, "met": ok})

    for precision in dict.fromkeys(r.get("precision", "float32") for r in rows):
        ours = [r for r in rows if r.get("precision", "float32") == precision]
        by = {(r["setup"], r["new_tokens"]): r for r in ours}
        counts = sorted({r["new_tokens"] for r in ours})
        long = max((n for n in counts if n >= 512), default=None)
        for n in counts:
            cached = by.get(("mesh, 2 nodes, cached", n))
            if cached is not None:
                check(f"2-node cached vs generate, {n} tokens", cached.get("ratio"), TARGET_RATIO,
                      at_least=True)
            one = by.get(("mesh, 1 node", n))
            if one is not None and one.get("vs_llama") is not None and precision in TARGET_VS_LLAMA:
                check(f"1 node vs {one['llama']}, {n} tokens", one["vs_llama"], TARGET_VS_LLAMA[precision],
                      at_least=True)
            if cached is not None and cached.get("vs_one") is not None:  # the two meshes' runs side by side
                check(f"2-node cached vs 1 node, {n} tokens", cached["vs_one"], TARGET_TWO_VS_ONE, at_least=True)
            elif one is not None and cached is not None and one.get("ratio") and cached.get("ratio"):
                # each against generate run just before it: the two ratios' quotient cancels the host's drift
                check(f"2-node cached vs 1 node, {n} tokens", cached["ratio"] / one["ratio"], TARGET_TWO_VS_ONE,
                      at_least=True)
        if long is not None and (cached := by.get(("mesh, 2 nodes, cached", long))):
            check(f"2-node cached last-{WINDOW} / first-{WINDOW} tokens/s, {long} tokens",
                  cached["decay"], TARGET_DECAY, at_least=True)
            stateless = by.get(("mesh, 2 nodes, stateless", long))
            if stateless is not None and stateless["decode_tps"]:
                check(f"2-node cached vs stateless, {long} tokens",
                      cached["decode_tps"] / stateless["decode_tps"], TARGET_VS_STATELESS, at_least=True)
        for setup in ("mesh, 2 nodes, cached", "mesh, 3 nodes, cached"):
            measured = [r for r in ours if r["setup"] == setup and r.get("overhead_ms_per_hop_step") is not None]
            if measured:
                check(f"{setup}: overhead per hop per decode step (ms)",
                      max(r["overhead_ms_per_hop_step"] for r in measured), TARGET_OVERHEAD_MS, at_least=False)
                check(f"{setup}: bytes sent per hop per decode step",
                      max(r["wire_bytes_per_hop_step"] for r in measured),
                      hidden_size * DTYPE_BYTES.get(precision, 4) + TARGET_EXTRA_BYTES, at_least=False)
    for precision in dict.fromkeys(t["precision"] for t in multiturn):
        last = max((t for t in multiturn if t["precision"] == precision), key=lambda t: t["turn"])
        check(f"multiturn: turn {last['turn']} TTFT warm / cold", last["ttft_ratio"], TARGET_LAST_TURN_TTFT,
              at_least=False)
    for precision in dict.fromkeys(g["precision"] for g in sessions):
        by_count = {g["sessions"]: g for g in sessions if g["precision"] == precision}
        one = by_count.get(1)
        for count, group in by_count.items() if one else ():
            gain, p95 = group["tps_ratio"], group["p95_ratio"]  # medians of its pairs (bench.mesh.paired_sessions)
            if count in TARGET_SESSIONS_TPS:
                check(f"{count} sessions: aggregate tok/s over one session's", gain, TARGET_SESSIONS_TPS[count],
                      at_least=True)
            if count in TARGET_SESSIONS_P95 and p95 is not None:
                check(f"{count} sessions: p95 inter-token latency over one session's", p95,
                      TARGET_SESSIONS_P95[count], at_least=False)
    precision = "bfloat16"
    for shape in shapes:  # real sizes: one node in bfloat16 against the read-bandwidth floor
        if shape["shape"] in TARGET_OF_FLOOR:
            check(f"{shape['shape']}: decode step at the read-bandwidth floor's time / the step's", shape["of_floor"],
                  TARGET_OF_FLOOR[shape["shape"]], at_least=True)
        check(f"{shape['shape']}: node peak resident set / its weights", shape["peak_over_weights"],
              TARGET_PEAK_OVER_WEIGHTS, at_least=False)
    for group in shared_prefix:
        if group["reuse"]:
            precision = group["precision"]
            check(f"shared prefix, {group['clients']} clients: prompt tokens computed / (system prompt + own)",
                  group["computed_ratio"], TARGET_SHARED_COMPUTED, at_least=False)
    return checks


def _fmt(value, spec: str, width: int) -> str:
    return f"{value:{width}{spec}}" if value is not None else f"{'-':>{width}}"


def print_table(rows: list[dict], sessions: list[dict], checks: list[dict], floor: dict, *,
                multiturn: Sequence[dict] = (), shared_prefix: Sequence[dict] = (),
                shapes: Sequence[dict] = ()) -> None:
    """The run's rows, concurrent sessions, prompt reuse, loopback floor and targets, as tables on stdout."""
    header = (f"{'setup':<34} {'dtype':>8} {'tokens':>6} {'prefill ms':>10} {'tok/s':>7} {'first10':>7} "
              f"{'last10':>7} {'decay':>5} {'B/hop/step':>10} {'ovh ms/hop':>10} {'vs gen':>7} {'same':>4} "
              f"{'peak MiB/node':>15} {'load':>5}")
    if rows:
        print(header)
        print("-" * len(header))
    for r in rows:
        same = {True: "yes", False: "NO", None: "-"}[r.get("tokens_match")]
        peaks = "/".join(f"{n['peak_rss_bytes'] / 2**20:.0f}" for n in r.get("nodes", []) if n["peak_rss_bytes"])
        print(f"{r['setup']:<34} {r.get('precision', '-'):>8} {r['new_tokens']:>6} {_fmt(r['prefill_ms'], '.1f', 10)} "
              f"{_fmt(r['decode_tps'], '.2f', 7)} {_fmt(r['first10_tps'], '.2f', 7)} "
              f"{_fmt(r['last10_tps'], '.2f', 7)} {_fmt(r['decay'], '.2f', 5)} "
              f"{_fmt(r.get('wire_bytes_per_hop_step'), '.0f', 10)} "
              f"{_fmt(r.get('overhead_ms_per_hop_step'), '.2f', 10)} {_fmt(r['ratio'], '.2f', 6)}x {same:>4} "
              f"{peaks or '-':>15} {_fmt(r.get('load'), '.2f', 5)}")
    for r in rows:
        if r.get("vs_llama") is not None:
            print(f"{r['setup']}, {r.get('precision')}, {r['new_tokens']} tokens: {r['vs_llama']:.2f}x "
                  f"{r['llama']} (median of the pairs {' '.join(f'{x:.2f}' for x in r['paired_llama_ratios'])})")
        if r.get("vs_one") is not None:
            print(f"{r['setup']}, {r.get('precision')}, {r['new_tokens']} tokens: {r['vs_one']:.2f}x one node, run "
                  f"straight before it (median of the pairs {' '.join(f'{x:.2f}' for x in r['paired_one_ratios'])})")
    if sessions:
        print()
        print("concurrent sessions, 2 nodes, cached: aggregate tok/s and inter-token latency (ITL) against one "
              "session's run just before (the median of the pairs); mean batch = steps per forward on each node")
        print(f"{'sessions':>8} {'dtype':>8} {'tokens':>6} {'wall s':>7} {'agg tok/s':>9} {'vs 1':>5} "
              f"{'ITL p50':>7} {'ITL p95':>7} {'p95 vs 1':>8} {'mean batch':>11} {'same':>4} {'load':>5}  "
              "vs 1 in each pair")
        ones = {s.get("precision"): s for s in sessions if s["sessions"] == 1}
        for s in sessions:
            one = ones.get(s.get("precision"))
            gain, p95 = s["tps_ratio"], s["p95_ratio"]
            same = s["sessions_agree"] and s.get("tokens_match_one", True) and (
                one is None or s["token_ids"] == one["token_ids"])
            batch = "/".join(_fmt(b, ".2f", 1) for b in s["mean_batch"])
            print(f"{s['sessions']:>8} {s.get('precision', '-'):>8} {s['tokens_each']:>6} {s['wall_s']:>7.1f} "
                  f"{s['aggregate_tps']:>9.2f} {_fmt(gain, '.2f', 4)}x {_fmt(s['itl_p50_ms'], '.1f', 7)} "
                  f"{_fmt(s['itl_p95_ms'], '.1f', 7)} {_fmt(p95, '.2f', 7)}x {batch:>11} "
                  f"{'yes' if same else 'NO':>4} {s['load']:>5.2f}  "
                  f"{' '.join(f'{r:.2f}' for r in s.get('paired_tps_ratios', ()))}")
    _print_reuse(multiturn, shared_prefix)
    _print_shapes(shapes)
    print()
    print(f"loopback floor: a bare hop on the same HTTP stack with one hand-off to a worker thread costs "
          f"{floor['median_ms']:.2f} ms (median; min {floor['min_ms']:.2f}) around a {floor['pause_ms']:.0f} ms "
          "pause on this host")
    if checks:
        print()
        for c in checks:
            op = ">=" if c["at_least"] else "<="
            print(f"{'met ' if c['met'] else 'MISS'} {c.get('precision', '')} {c['target']}: {c['value']:.2f} "
                  f"(target {op} {c['limit']:g})")


def _print_reuse(multiturn: Sequence[dict], shared_prefix: Sequence[dict]) -> None:
    same = {True: "yes", False: "NO", None: "-"}
    if multiturn:
        print()
        print("multi-turn chat, 2 nodes: each turn cold (nothing to reuse), then warm (the chat's prefix reused); "
              "TTFT from request to first text")
        print(f"{'dtype':>8} {'turn':>4} {'prompt':>6} {'cached':>6} {'computed':>8} {'TTFT warm ms':>12} "
              f"{'TTFT cold ms':>12} {'warm/cold':>9} {'same':>4} {'load':>5}")
        for t in multiturn:
            print(f"{t['precision']:>8} {t['turn']:>4} {t['prompt_tokens']:>6} {t['cached_tokens']:>6} "
                  f"{t['computed_tokens']:>8} {t['ttft_warm_ms']:>12.1f} {t['ttft_cold_ms']:>12.1f} "
                  f"{_fmt(t['ttft_ratio'], '.2f', 9)} {same[t['tokens_match']]:>4} {t['load']:>5.2f}")
    if shared_prefix:
        print()
        print("clients at once with one system prompt, 2 nodes: prompt tokens computed against the system prompt's "
              "plus each client's own")
        print(f"{'dtype':>8} {'reuse':>5} {'clients':>7} {'prompt':>6} {'computed':>8} {'sys+own':>7} "
              f"{'ratio':>5} {'wall s':>6} {'mean TTFT ms':>12} {'same':>4} {'load':>5}")
        for g in shared_prefix:
            print(f"{g['precision']:>8} {'on' if g['reuse'] else 'off':>5} {g['clients']:>7} {g['prompt_tokens']:>6} "
                  f"{g['computed_tokens']:>8} {g['ideal_tokens']:>7} {_fmt(g['computed_ratio'], '.2f', 5)} "
                  f"{g['wall_s']:>6.1f} {g['mean_ttft_ms']:>12.1f} {same[g['tokens_match']]:>4} {g['load']:>5.2f}")


def _print_shapes(shapes: Sequence[dict]) -> None:
    if not shapes:
        return
    print()
    print("real layer sizes, random weights, one meshd in bfloat16 (a row named int4 or int8: its layers so): its "
          "decode step against the read-bandwidth "
          "floor (the active weights' bytes at the faster of the machine's read rates just before and after each of "
          "3 runs; the median round's ratio, rate and floor); the node's peak resident set, its runtime (the resident "
          "set before its first weight was read), and the peak less the runtime over the weights")
    print(f"{'shape':<16} {'weights MiB':>11} {'active MiB':>10} {'GB/s':>5} {'floor ms':>8} {'step ms':>7} "
          f"{'best ms':>7} {'of floor':>8} {'peak MiB':>8} {'peak/weights':>12} {'runtime MiB':>11} "
          f"{'rest/weights':>12} {'load':>5}  what")
    for s in shapes:
        print(f"{s['shape']:<16} {s['weights_bytes'] / 2**20:>11.0f} {s['active_bytes'] / 2**20:>10.0f} "
              f"{s['bandwidth_bytes_per_s'] / 1e9:>5.1f} {s['floor_ms']:>8.1f} {s['step_ms_median']:>7.1f} "
              f"{s['step_ms_best']:>7.1f} {s['of_floor']:>8.2f} "
              f"{_fmt(s['peak_rss_bytes'] and s['peak_rss_bytes'] / 2**20, '.0f', 8)} "
              f"{_fmt(s['peak_over_weights'], '.2f', 12)} "
              f"{_fmt(s.get('runtime_rss_bytes') and s['runtime_rss_bytes'] / 2**20, '.0f', 11)} "
              f"{_fmt(s.get('rest_over_weights'), '.2f', 12)} {s['load']:>5.2f}  {s['about']}")
