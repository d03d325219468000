"""``meshd bench``: the mesh measured side by side with one process running the same model.

Every row runs in this one invocation on this one machine, so the ratios are comparable even on a
shared, noisy host. For each precision (compute dtype) and each number of new tokens it measures
single-process ``transformers`` ``generate`` in that dtype (the limit), one node with every layer,
llama.cpp on the same weights at the same precision (with the ``bench`` extra;
:mod:`daemon.bench.llama_cpp`), a two-node mesh with the KV cache, the same mesh stateless
(``--no-kv-cache``) and a three-node mesh, then many sessions at once on the two-node mesh. Each mesh
run follows a run of ``generate`` straight before it (the one-node run, a run of llama.cpp too), and a
mesh row's ratio is the median of those pairs' ratios; likewise each run of many sessions follows a
run of one session, its ratios the median of those pairs'. Each mesh row also has its nodes' peak
resident memory next to the weights they hold, and every row the host's load average when it ended.
Then prompt reuse on two-node meshes of their own: a six-turn chat with a long system prompt, each
turn's time to first token with the chat's prefix reused next to the same request computed whole; and
concurrent clients with one system prompt, the prompt tokens the mesh computed for them against the
system prompt's plus each client's own. Asked for, real layer sizes: random-weight models of real
shapes, each node's decode step against this machine's read-bandwidth floor
(:mod:`daemon.bench.real_size`). It prints tables and writes the same numbers, with the targets they
are held to, as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import daemon.bench.llama_cpp as llama_cpp
import daemon.bench.real_size as real_size
import daemon.bench.speculation as speculation
from daemon.bench.floor import loopback_floor
from daemon.bench.mesh import Mesh, paired_sessions
from daemon.bench.progress import say
from daemon.bench.reference import Reference, prompt_ids
from daemon.bench.report import check_targets, machine, print_table, window_tps
from daemon.bench.reuse import REUSE_BY_USER, USER_TURNS, client_messages, clients_at_once, multiturn_chat
from daemon.host import host_cores

SETUPS = ("generate", "one", "llama.cpp", "cached", "stateless", "three", "multiturn", "shared-prefix", "real-size",
          "speculation")
PRECISIONS = ("auto", "float32", "bfloat16", "float16", "int8", "int4")
# a precision's compute dtype and quantization: int8 or int4 weights with float32 activations, which a CPU node's
# native decode steps take (daemon.model.decode.NativeSteps; with bfloat16 activations they run torch's ops)
QUANTIZED = {"int8": ("float32", "int8"), "int4": ("float32", "int4")}


def fastest(times: int, run, *args) -> dict:
    """Of ``times`` calls of ``run(*args)``, the one with the most decode tokens/s (the least disturbed)."""
    results = [run(*args) for _ in range(times)]
    best = max(results, key=lambda r: r["decode_tps"] or 0.0)
    return best | {"runs": times, "decode_tps_runs": [r["decode_tps"] for r in results]}


def against_one(one: Mesh, two: Mesh, tokens: int, times: int) -> dict:
    """``times`` pairs of runs side by side: the one-node mesh, then the two-node one straight after it (both open,
    each on cores of its own folder, so neither node sees the idle mesh's). The two-node mesh's tokens/s over the
    one node's in each pair, and their median: the two-node target's measure, with no third program between."""
    one.generate(4)  # warm again after the other meshes' runs
    ratios = []
    for _ in range(times):
        first, second = one.measure(tokens), two.measure(tokens)
        if first["decode_tps"] and second["decode_tps"]:
            ratios.append(second["decode_tps"] / first["decode_tps"])
    return {"vs_one": statistics.median(ratios), "paired_one_ratios": ratios} if ratios else {}


def _thirds(n: int) -> list[str]:
    cuts = [0, round(n / 3), round(2 * n / 3), n]
    return [f"{a}-{b - 1}" for a, b in zip(cuts, cuts[1:])]


def main(argv: list[str] | None = None) -> int:
    """``meshd bench [options]``: measure, print the table, write the JSON; 0 when the run completed."""
    parser = argparse.ArgumentParser(prog="meshd bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model (default: the built-in one)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512],
                        help="new tokens per run (default 128 512)")
    parser.add_argument("--setups", nargs="+", choices=SETUPS,
                        help="what to measure (default all but real-size): generate, one (1 node with every layer), "
                        "llama.cpp "
                        "(on the same weights at the same precision, with the bench extra), cached (2 nodes), "
                        "stateless (2 nodes), three (3 nodes, cached), multiturn (a chat's turns with and without "
                        "its prefix reused), shared-prefix (clients at once with one system prompt, with and "
                        "without reuse), real-size (random-weight layers of real models' sizes, each node's "
                        "decode step against the read-bandwidth floor)")
    parser.add_argument("--shapes", nargs="+", choices=list(real_size.SHAPES), default=list(real_size.SHAPES),
                        help="the real-size models (default all; written once into the meshnet cache, "
                        "2.6 and 3.8 GB)")
    parser.add_argument("--shape-tokens", type=int, default=32, help="new tokens per real-size run (default 32)")
    parser.add_argument("--shape-quantize", choices=("int8", "int4"), help="real-size setup: each shape once more "
                        "with its layers quantized so (bfloat16 compute), against the floor of the bytes that reads")
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=["auto"],
                        help="compute dtypes to measure, each against generate in the same dtype (default auto: "
                        "what meshd runs in on this machine); int8, int4: quantized weights in float32, against "
                        "generate with the same quantization")
    parser.add_argument("--device", default="cpu", help="where every node and the reference compute: cpu, cuda, "
                        "cuda:N or mps (default cpu)")
    parser.add_argument("--threads", type=int, help="torch threads per daemon (default: meshd's own, which shares "
                        "the cores among the daemons computing at each moment)")
    parser.add_argument("--reference-threads", type=int, nargs="+",
                        help="torch threads of single-process generate; the fastest is the reference (default: "
                        "1 and every core: on a loaded host one thread can beat all of them)")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 8, 16],
                        help="concurrent session counts measured on the cached 2-node mesh, each against one "
                        "session (0: skip; default 1 4 8 16)")
    parser.add_argument("--session-tokens", type=int, default=128, help="new tokens per concurrent session")
    parser.add_argument("--clients", type=int, default=8,
                        help="concurrent clients of the shared-prefix setup (default 8)")
    parser.add_argument("--turn-tokens", type=int, default=16,
                        help="new tokens at most per answer of the multiturn and shared-prefix setups (default 16)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run each generate and cached row this many times and keep the fastest, against "
                        "a noisy host; each mesh run is paired with a generate run just before it, and each "
                        "many-session run with a one-session run (the slow stateless rows run once; default 1)")
    parser.add_argument("--hop-rtt-ms", type=float, nargs="+", default=[0.0, 10.0, 40.0],
                        help="speculation setup: the round trips put on every remote hop, one row each "
                        "(default 0 10 40)")
    parser.add_argument("--draft-model", default="built-in", help="speculation setup: the head's draft model "
                        "(default built-in, as meshd's --draft-model)")
    parser.add_argument("--draft-quantize", default="int8", help="speculation setup: its --draft-quantize "
                        "(default int8; 'none' for none)")
    parser.add_argument("--draft-max", type=int, default=4, help="speculation setup: its --draft-max (default 4)")
    parser.add_argument("--json", default="bench-results/bench.json", help="where to write the results")
    args = parser.parse_args(argv)
    chosen = args.setups is not None
    args.setups = args.setups or [s for s in SETUPS if s not in ("real-size", "speculation")]
    if min(args.tokens) < 2:
        parser.error("--tokens must be at least 2 (one prefill, one decode step)")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.clients < 1 or args.turn_tokens < 1:
        parser.error("--clients and --turn-tokens must be at least 1")

    from daemon.model.checkpoint import read_model_info
    from daemon.model.device import checkpoint_dtype, dtype_name, resolve_device, resolve_dtype
    from daemon.model.source import resolve_model, source_gguf

    if "llama.cpp" in args.setups and not llama_cpp.installed():
        if chosen:
            parser.error(llama_cpp.INSTALL_HINT)
        say(f"{llama_cpp.INSTALL_HINT}; measuring without it")
        args.setups.remove("llama.cpp")
    folder = resolve_model(args.model, progress=say)
    args.gguf = source_gguf(args.model)
    if "llama.cpp" in args.setups and args.gguf is None:
        message = (f"llama.cpp needs the model as a .gguf file (the built-in model, or --model FILE.gguf), "
                   f"not {args.model}")
        if chosen:
            parser.error(message)
        say(f"{message}; measuring without it")
        args.setups.remove("llama.cpp")
    info = read_model_info(folder)
    n = info.num_layers
    half = n // 2
    cores = host_cores()
    host = machine()
    meshes = {
        "one": ("mesh, 1 node", [(f"0-{n - 1}", [])]),
        "cached": ("mesh, 2 nodes, cached", [(f"0-{half - 1}", []), (f"{half}-{n - 1}", [])]),
        "stateless": ("mesh, 2 nodes, stateless",
                      [(f"0-{half - 1}", ["--no-kv-cache"]), (f"{half}-{n - 1}", ["--no-kv-cache"])]),
        "three": ("mesh, 3 nodes, cached", [(layers, []) for layers in _thirds(n)]),
    }
    device = resolve_device(args.device)
    saved = checkpoint_dtype(folder)  # auto resolves as meshd's own --dtype auto does on this device
    precisions = list(dict.fromkeys(p if p in QUANTIZED else dtype_name(resolve_dtype(p, device, saved))
                                    for p in args.precisions))
    say(f"{info.name}, {n} layers, hidden size {info.hidden_size}; {cores} cores; tokens {args.tokens}; "
        f"in {', '.join(precisions)} on {device}")
    rows: list[dict] = []
    sessions: list[dict] = []
    multiturn: list[dict] = []
    shared_prefix: list[dict] = []
    speculating: list[dict] = []
    for precision in precisions:
        _measure_precision(args, folder, precision, meshes, rows, sessions)
        _measure_reuse(args, folder, precision, meshes["cached"][1], multiturn, shared_prefix)
        if "speculation" in args.setups:
            draft = ["--draft-model", args.draft_model, "--draft-max", str(args.draft_max)]
            draft += ["--draft-quantize", args.draft_quantize] if args.draft_quantize != "none" else []
            speculating += speculation.measure(
                meshes["three"][1], args.model, args.threads, _node_args(args, precision) + ["--prefix-reuse", "off"],
                rtts=args.hop_rtt_ms, draft=draft, tokens=max(args.tokens), times=args.repeat, precision=precision)
    shapes = _measure_real_size(args, cores) if "real-size" in args.setups else []
    order = [name for name, _ in meshes.values()]
    rows.sort(key=lambda r: (precisions.index(r["precision"]), r["new_tokens"],
                             order.index(r["setup"]) if r["setup"] in order else -1, r["setup"]))

    cached = [r for r in rows if r["setup"] == meshes["cached"][0] and r.get("hops")]
    remote = [h for r in cached for h in r["hops"] if not h["local"] and h["steps"]]
    pause = sum(h["compute_ms"] for h in remote) / sum(h["steps"] for h in remote) if remote else 40.0
    say(f"loopback floor: a bare hop around a {pause:.0f} ms pause")
    floor = loopback_floor(pause)
    checks = check_targets(rows, info.hidden_size, multiturn=multiturn, shared_prefix=shared_prefix,
                           sessions=sessions, shapes=shapes)
    print_table(rows, sessions, checks, floor, multiturn=multiturn, shared_prefix=shared_prefix, shapes=shapes)
    speculation.print_rows(speculating)
    host["load_average_at_end"] = os.getloadavg()
    out = {
        "machine": host,
        "model": {"name": info.name, "layers": n, "hidden_size": info.hidden_size},
        "threads_per_daemon": args.threads or "adaptive (meshd default)",
        "rows": rows, "sessions": sessions, "targets": checks, "loopback_floor": floor,
        "turn_tokens": args.turn_tokens, "multiturn": multiturn, "shared_prefix": shared_prefix,
        "real_size": shapes, "speculation": speculating,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    say(f"wrote {args.json}")
    return 0


def _measure_precision(args, folder: Path, precision: str, meshes: dict, rows: list[dict],
                       sessions: list[dict]) -> None:
    """Every setup of the run in one compute dtype, each against ``generate`` in that dtype."""
    reference: dict[int, dict] = {}  # new tokens -> the fastest single-process generate
    best_threads: dict[int, int] = {}  # new tokens -> the thread count of that run
    ref_model = None
    ref_threads = sorted(set(args.reference_threads or [1, host_cores()]))
    if "generate" in args.setups:
        say(f"loading the model for single-process generate in {precision}")
        ref_model = Reference(folder, *QUANTIZED.get(precision, (precision, None)), device=args.device)
    # llama.cpp on the same weights at the same precision, and (next to int8 and int4) on the file as it came
    kind = llama_cpp.SAME_PRECISION.get(precision) if "llama.cpp" in args.setups else None
    llama_files = {}
    if kind:
        from daemon.model.source import cache_dir

        say(f"writing {args.gguf.name} as {kind} for llama.cpp (once; kept in the meshnet cache)")
        llama_files[kind] = llama_cpp.gguf_file(args.gguf, kind, cache_dir() / "bench")
        if precision in QUANTIZED:
            llama_files["source"] = args.gguf
    llama_threads: dict[int, int] = {}  # new tokens -> the thread count of the fastest same-precision run
    llama_builds: set[str] = set()
    ids = prompt_ids(folder) if llama_files else []

    def run_llama(file_kind: str, tokens: int, threads: int) -> dict:
        say(f"llama.cpp on {llama_files[file_kind].name}, {threads} thread(s), {tokens} tokens")
        result = llama_cpp.measure(llama_files[file_kind], ids, tokens, threads)
        build = f"llama.cpp {result.get('llama_cpp_version', '?')}: {result.get('system_info', '?')}"
        if build not in llama_builds:  # what that build runs with here (its SIMD, AMX, repacking), said once
            llama_builds.add(build)
            say(build)
        return result

    def measure_llama(tokens: int) -> None:
        if not llama_files or tokens in llama_threads:
            return
        for file_kind in llama_files:
            runs = {threads: fastest(args.repeat, run_llama, file_kind, tokens, threads) for threads in ref_threads}
            if file_kind == kind:
                llama_threads[tokens] = max(runs, key=lambda threads: runs[threads]["decode_tps"] or 0.0)
            label = f"{llama_files[file_kind].stem.rsplit('.', 1)[-1]} as shipped" if file_kind == "source" else kind
            for threads, result in runs.items():
                bare = "" if result.get("extra_bufts", True) else " (no repacking: it crashed)"
                add(f"llama.cpp {label}, {threads} thread{'s' if threads > 1 else ''}{bare}", tokens, result)

    def add(setup: str, tokens: int, result: dict) -> None:
        ref = reference.get(tokens)
        ratio = result["decode_tps"] / ref["decode_tps"] if ref and result["decode_tps"] and ref["decode_tps"] \
            else None
        if result.get("paired_ratios"):  # a mesh row: against the reference runs next to its own
            ratio = statistics.median(result["paired_ratios"])
        first, last = window_tps(result["step_ms"], last=False), window_tps(result["step_ms"], last=True)
        same = result["token_ids"] == ref["token_ids"] if ref and result is not ref else None
        rows.append({"setup": setup, "precision": precision, "new_tokens": tokens, **result, "first10_tps": first,
                     "last10_tps": last, "decay": last / first if first and last else None, "ratio": ratio,
                     "tokens_match": same, "load": os.getloadavg()[0]})

    def measure_reference(tokens: int) -> None:
        if ref_model is None or tokens in reference:
            return
        runs = {threads: fastest(args.repeat, ref_model.run, tokens, threads) for threads in ref_threads}
        best_threads[tokens] = max(runs, key=lambda threads: runs[threads]["decode_tps"] or 0.0)
        reference[tokens] = runs[best_threads[tokens]]
        for threads, result in runs.items():
            add(f"generate, 1 process, {threads} thread{'s' if threads > 1 else ''}", tokens, result)

    def measure_mesh(mesh: Mesh, tokens: int, times: int, *, against_llama: bool = False) -> dict:
        """``times`` runs of ``mesh``, each right after a run of the reference (its fastest thread count) and,
        ``against_llama``, of llama.cpp at the same precision (its fastest thread count).

        The mesh's ratios are the medians of the pairs' ratios: each pair ran under the same load of a shared
        host, where the fastest of several reference runs against the fastest of fewer mesh runs would
        favour the reference."""
        llama = against_llama and tokens in llama_threads
        results, ratios, llama_ratios = [], [], []
        for _ in range(times):
            ref = ref_model.run(tokens, best_threads[tokens]) if ref_model is not None else None
            other = run_llama(kind, tokens, llama_threads[tokens]) if llama else None
            result = mesh.measure(tokens)
            results.append(result)
            if ref is not None and ref["decode_tps"] and result["decode_tps"]:
                ratios.append(result["decode_tps"] / ref["decode_tps"])
            if other is not None and other["decode_tps"] and result["decode_tps"]:
                llama_ratios.append(result["decode_tps"] / other["decode_tps"])
        best = max(results, key=lambda r: r["decode_tps"] or 0.0)
        vs_llama = {"vs_llama": statistics.median(llama_ratios), "paired_llama_ratios": llama_ratios,
                    "llama": f"llama.cpp {kind}, {llama_threads[tokens]} thread(s)"} if llama_ratios else {}
        return best | {"runs": times, "decode_tps_runs": [r["decode_tps"] for r in results],
                       "paired_ratios": ratios} | vs_llama

    one = None  # the one-node mesh, kept open and idle while the two-node cached mesh runs: runs of the two pair up
    try:
        for key in ("one", "cached", "stateless", "three"):
            if key not in args.setups:
                continue
            name, specs = meshes[key]
            say(f"starting {name} in {precision}")
            # room for every concurrent session, live or kept for reuse: no eviction shows up as a re-prefill
            room = ["--kv-max-sessions", str(2 * max(args.sessions) + 2)] if key == "cached" else []
            # every run computes its prompt whole, as generate does: a repeat starting from the last run's prefix
            # would compute its last prompt position alone, which in bfloat16 rounds otherwise and may change later
            # tokens
            mesh = Mesh(name, specs, args.model, args.threads,
                        node_args=_node_args(args, precision) + room + ["--prefix-reuse", "off"])
            try:
                mesh.generate(4)  # warm-up: connections, route measurements, lazy loads
                for tokens in args.tokens:
                    measure_reference(tokens)  # right before the mesh it is compared with: both see the same load
                    if key == "one":
                        measure_llama(tokens)
                    result = measure_mesh(mesh, tokens, 1 if key == "stateless" else args.repeat,
                                          against_llama=key == "one")
                    if key == "cached" and one is not None:
                        result |= against_one(one, mesh, tokens, args.repeat)
                    add(name, tokens, result | {"nodes": mesh.memory()})
                counts = sorted({1, *args.sessions} - {0}) if any(args.sessions) else []
                if key == "cached" and counts:
                    sessions.extend(group | {"precision": precision}
                                    for group in paired_sessions(mesh, counts, args.session_tokens, args.repeat))
            finally:
                if key == "one" and "cached" in args.setups:
                    one = mesh
                else:
                    mesh.stop()
            if key == "cached" and one is not None:
                one.stop()
                one = None
    finally:
        if one is not None:
            one.stop()
    for tokens in args.tokens:
        measure_reference(tokens)
        measure_llama(tokens)


def _measure_real_size(args, cores: int) -> list[dict]:
    """Each real-size model (written once) on one ``meshd`` in bfloat16, against this machine's read-bandwidth
    floor (:mod:`daemon.bench.real_size`)."""
    from daemon.model.source import cache_dir, fetch_default_model

    tokenizer_from = fetch_default_model(progress=say)  # every shape speaks the built-in model's vocabulary
    rows = []
    for name in args.shapes:
        shape = real_size.SHAPES[name]
        folder = cache_dir() / "bench" / "shapes" / name
        record = real_size.build(shape, folder, tokenizer_from)
        for quantize in (None, args.shape_quantize) if args.shape_quantize else (None,):
            sample = (shape, record, folder)
            if quantize and shape.deeper:  # the deeper sample, about the bytes of the bfloat16 row
                deep_folder = folder.with_name(shape.deeper.name)
                sample = (shape.deeper, real_size.build_deeper(shape, folder, deep_folder), deep_folder)
            say(f"{name}{f' {quantize}' if quantize else ''}: the machine's read bandwidth on {cores} thread(s) "
                "around each of 3 runs of decode steps")
            rows.append(real_size.measure(*sample, args.shape_tokens, args.threads, cores, quantize=quantize))
            say("read bandwidth: " + "; ".join(", ".join(f"{b / 1e9:.1f}" for b in pair)
                                               for pair in rows[-1]["bandwidth_readings"]) + " GB/s; of the floor: "
                + " ".join(f"{r:.2f}" for r in rows[-1]["of_floor_rounds"]))
    return rows


def _node_args(args, precision: str) -> list[str]:
    """Every node's compute dtype, device and quantization for ``precision``."""
    dtype, quantize = QUANTIZED.get(precision, (precision, None))
    return ["--dtype", dtype, "--device", args.device] + (["--quantize", quantize] if quantize else [])


def _measure_reuse(args, folder: Path, precision: str, specs: list[tuple[str, list[str]]], multiturn: list[dict],
                   shared_prefix: list[dict]) -> None:
    """The prompt-reuse setups in one compute dtype, each on a two-node mesh of its own (:mod:`daemon.bench.reuse`)."""
    # room for every session a setup holds at once, live or retained, so no eviction shows up as a cold start
    room = ["--kv-max-sessions", str(2 * max(args.clients, len(USER_TURNS)) + 2)]
    for key, name in (("multiturn", "multiturn, 2 nodes"), ("shared-prefix", "shared prefix, 2 nodes")):
        if key not in args.setups:
            continue
        say(f"starting {name} in {precision}")
        mesh = Mesh(name, specs, args.model, args.threads,
                    node_args=_node_args(args, precision) + REUSE_BY_USER + room)
        try:
            # warm-up: connections, route measurements, lazy loads, and one prompt as long as the measured ones
            mesh.chat(client_messages(0), 4, user="bench-warm-up")
            if key == "multiturn":
                multiturn.extend(t | {"precision": precision} for t in multiturn_chat(mesh, args.turn_tokens))
            else:
                from transformers import AutoConfig

                from daemon.model.tokenizer import ChatTokenizer

                encode = ChatTokenizer.load(folder, AutoConfig.from_pretrained(folder)).encode_chat
                shared_prefix.extend(g | {"precision": precision}
                                     for g in clients_at_once(mesh, args.clients, args.turn_tokens, encode))
        finally:
            mesh.stop()
