"""``meshd bench``: the mesh measured side by side with one process running the same model.

Every row runs in this one invocation on this one machine, so the ratios are
comparable even on a shared, noisy host. For each number of new tokens it
measures single-process ``transformers`` ``generate`` (the limit), a two-node
mesh with the KV cache, the same mesh stateless (``--no-kv-cache``) and a
three-node mesh, then many sessions at once on the two-node mesh. Each mesh run
follows a run of ``generate`` straight before it, and a mesh row's ratio is the
median of those pairs' ratios. It prints a table and writes the same numbers,
with the targets they are held to, as JSON.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from daemon.api import auth_headers
from daemon.config import host_cores

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
SETUPS = ("generate", "cached", "stateless", "three")
WINDOW = 10  # steps in the first-N and last-N throughput windows

# The targets of the performance work, checked against every run (see README, "Speed").
TARGET_RATIO = 0.9  # two-node cached decode vs generate
TARGET_DECAY = 0.9  # last-10 over first-10 tokens/s, over 512 tokens
TARGET_VS_STATELESS = 4.0  # cached over stateless decode at 512 tokens
TARGET_OVERHEAD_MS = 3.0  # per hop per decode step, on loopback
TARGET_EXTRA_BYTES = 512  # a decode hop's request may exceed hidden size x 4 bytes by this much


def _say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


class Progress:
    """One line on stderr that counts tokens: redrawn in place on a terminal, every quarter otherwise."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, total, 0
        self.started = time.perf_counter()
        self._tty = sys.stderr.isatty()
        self._shown = 0  # tokens when last drawn (terminal) or quarters reported (log)

    def step(self) -> None:
        """One more token (a streamed chunk of text counts as one: close enough for a progress line)."""
        self.done += 1
        elapsed = time.perf_counter() - self.started
        if self._tty:
            if self.done == self.total or self.done - self._shown >= 4:
                self._shown = self.done
                print(f"\r[bench] {self.label}: {self.done}/{self.total} tokens, {elapsed:.1f} s",
                      end="", file=sys.stderr, flush=True)
        elif self.done * 4 // self.total > self._shown:
            self._shown = self.done * 4 // self.total
            _say(f"{self.label}: {self.done}/{self.total} tokens, {elapsed:.1f} s")

    def end(self) -> None:
        if self._tty:
            print(file=sys.stderr, flush=True)


def window_tps(step_ms: list[float], *, last: bool) -> float | None:
    """Tokens per second over the first (or last) ``WINDOW`` decode steps."""
    steps = step_ms[-WINDOW:] if last else step_ms[:WINDOW]
    return len(steps) * 1000.0 / sum(steps) if steps and sum(steps) > 0 else None


# ---- the reference: one process, transformers' own generate ----------------------------------


class Reference:
    """The whole model in this process, generating with ``model.generate``: the limit of the mesh."""

    def __init__(self, folder: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt")
        self.ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        self._generate(4, None)  # warm-up

    def _generate(self, tokens: int, progress: Progress | None) -> tuple[list[int], list[float]]:
        import torch

        times: list[float] = []
        prompt_seen = False

        class Clock:  # a streamer: generate hands it each new token the moment it exists
            def put(self, value) -> None:
                nonlocal prompt_seen
                if not prompt_seen:  # the first call carries the prompt
                    prompt_seen = True
                    return
                times.append(time.perf_counter())
                if progress is not None:
                    progress.step()

            def end(self) -> None:
                pass

        started = time.perf_counter()
        with torch.inference_mode():
            # no EOS: exactly ``tokens`` new tokens, as the mesh's ignore_eos generates them
            out = self.model.generate(self.ids, attention_mask=torch.ones_like(self.ids), max_new_tokens=tokens,
                                      do_sample=False, eos_token_id=None, streamer=Clock())
        return out[0, self.ids.shape[1]:].tolist(), [started, *times]

    def run(self, tokens: int, threads: int) -> dict:
        import torch

        torch.set_num_threads(threads)
        progress = Progress(f"generate, {threads} thread(s), {tokens} tokens", tokens)
        token_ids, times = self._generate(tokens, progress)
        progress.end()
        step_ms = [(b - a) * 1000.0 for a, b in zip(times[1:], times[2:])]
        decode_s = times[-1] - times[1]
        return {
            "prefill_ms": (times[1] - times[0]) * 1000.0,
            "decode_tps": (len(token_ids) - 1) / decode_s if decode_s > 0 else None,
            "step_ms": step_ms,
            "token_ids": token_ids,
        }


# ---- the mesh: meshd processes on 127.0.0.1 --------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Mesh:
    """meshd processes on 127.0.0.1, the first one the head; stopped by :meth:`stop`.

    ``specs``: per node, its inclusive layer range and extra arguments.
    """

    def __init__(self, name: str, specs: list[tuple[str, list[str]]], model: str | None = None,
                 threads: int | None = None) -> None:
        self.name, self.specs, self.model, self.threads = name, specs, model, threads
        # a mesh with a token (the daemons inherit MESHNET_TOKEN) wants it on every request
        self.headers = {"Content-Type": "application/json"} | auth_headers(os.environ.get("MESHNET_TOKEN"))
        self.log_dir = Path(tempfile.mkdtemp(prefix="meshd-bench-"))
        self.procs: list[subprocess.Popen] = []
        ports = [_free_port() for _ in self.specs]
        self.port = ports[0]
        for i, ((layers, extra), port) in enumerate(zip(self.specs, ports)):
            argv = [sys.executable, "-m", "daemon.cli", "--layers", layers, "--port", str(port), *extra]
            argv += ["--model", self.model] if self.model else []
            argv += ["--threads", str(self.threads)] if self.threads else []
            argv += [a for p in ports if p != port for a in ("--peer", f"http://127.0.0.1:{p}")]
            log = open(self.log_dir / f"{self.name.replace(' ', '-')}-{i}.log", "wb")
            self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                break
            try:
                if sum(p["up"] for p in self._request("GET", "/v1/status")["peers"]) >= len(self.specs) - 1:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"the {self.name} mesh did not come up; logs in {self.log_dir}")

    def _request(self, method: str, path: str, body: dict | None = None, timeout: float = 5.0) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, json.dumps(body) if body is not None else None, self.headers)
            resp = conn.getresponse()
            data = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{method} {path} answered {resp.status}: {data[:300]!r}")
            return json.loads(data)
        finally:
            conn.close()

    def generate(self, tokens: int, progress: Progress | None = None) -> dict:
        """One streamed generation of exactly ``tokens`` tokens; its ``meshnet`` statistics."""
        body = {"messages": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(body), self.headers)
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"the {self.name} mesh answered {resp.status}: {resp.read()[:300]!r}")
            stats = None
            while line := resp.readline():
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"the {self.name} mesh failed: {event['error']}")
                if "meshnet" in event:
                    stats = event["meshnet"]
                elif progress is not None and event["choices"] and event["choices"][0]["delta"].get("content"):
                    progress.step()
        finally:
            conn.close()
        if stats is None:
            raise RuntimeError(f"the {self.name} mesh ended the stream without its statistics")
        return stats

    def measure(self, tokens: int) -> dict:
        """One generation of ``tokens`` tokens with a progress line: the table's numbers."""
        progress = Progress(f"{self.name}, {tokens} tokens", tokens)
        stats = self.generate(tokens, progress)
        progress.end()
        return mesh_row(stats)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def mesh_row(stats: dict) -> dict:
    """The table's numbers from one generation's ``meshnet`` statistics."""
    remote = [h for h in stats["decode_hops"] if not h["local"] and h["steps"]]
    local = [h for h in stats["decode_hops"] if h["local"] and h["steps"]]
    steps = sum(h["steps"] for h in remote)

    def per_step(key: str, hops: list[dict], n: int) -> float | None:
        return sum(h[key] for h in hops) / n if n else None

    overhead = sum(h["latency_ms"] - h["compute_ms"] for h in remote) / steps if steps else None
    local_steps = sum(h["steps"] for h in local)
    return {
        # a stateless mesh has no prefill step: its first token's time is the prefill
        "prefill_ms": stats["prefill_ms"] or stats["first_token_ms"],
        "decode_tps": stats["decode_tokens_per_second"],
        "step_ms": stats["step_ms"],
        "token_ids": stats["token_ids"],
        "reprefills": stats["reprefills"],
        "payload_bytes_per_hop_step": per_step("payload_bytes", remote, steps),
        "wire_bytes_per_hop_step": per_step("sent_bytes", remote, steps),
        "reply_bytes_per_hop_step": per_step("received_bytes", remote, steps),
        "overhead_ms_per_hop_step": overhead,
        "local_overhead_ms_per_step": (sum(h["latency_ms"] - h["compute_ms"] for h in local) / local_steps
                                       if local_steps else None),
        "hops": stats["decode_hops"],
    }


def many_sessions(mesh: Mesh, sessions: int, tokens: int) -> dict:
    """Aggregate tokens/s of ``sessions`` generations started together (every token over the wall time)."""
    results: list[dict] = []
    errors: list[BaseException] = []
    progress = Progress(f"{mesh.name}, {sessions} concurrent session(s) of {tokens} tokens", sessions * tokens)
    lock = threading.Lock()

    def one() -> None:
        try:
            stats = mesh.generate(tokens, progress)
            with lock:
                results.append(stats)
        except BaseException as exc:  # noqa: BLE001 - reported below, after the others finish
            errors.append(exc)

    started = time.perf_counter()
    workers = [threading.Thread(target=one) for _ in range(sessions)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = time.perf_counter() - started
    progress.end()
    if errors:
        raise errors[0]
    total = sum(s["completion_tokens"] for s in results)
    return {
        "sessions": sessions,
        "tokens_each": tokens,
        "wall_s": wall,
        "aggregate_tps": total / wall,
        "mean_session_decode_tps": sum(s["decode_tokens_per_second"] for s in results) / len(results),
    }


# ---- what loopback HTTP costs on this host, with nothing of meshnet in it ----------------------

_FLOOR_SERVER = """
import asyncio, sys, time
from concurrent.futures import ThreadPoolExecutor
from aiohttp import web
from daemon.cli import _loop_factory
worker = ThreadPoolExecutor(1)
async def step(request):
    body = await request.read()
    pause = float(request.headers["X-Pause"])
    await asyncio.get_running_loop().run_in_executor(worker, time.sleep, pause)
    return web.json_response({"token_id": 1, "text": "x"})
async def main():
    app = web.Application()
    app.router.add_post("/forward", step)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", int(sys.argv[1])).start()
    await asyncio.Event().wait()
with asyncio.Runner(loop_factory=_loop_factory()) as runner:
    runner.run(main())
"""


def loopback_floor(pause_ms: float, steps: int = 60) -> dict:
    """A bare hop on meshd's own stack (aiohttp server, the head's hop transport, the same event loop): the
    same body, one hand-off to a worker thread that idles ``pause_ms`` (as a node computes), the same JSON
    answer. Its latency minus the pause is what any hop costs here before meshnet adds anything: on a
    virtual machine, mostly waking idle cores."""
    import asyncio

    from daemon.cli import _loop_factory
    from daemon.mesh.transport import HopTransport, TransportError

    port = _free_port()
    server = subprocess.Popen([sys.executable, "-c", _FLOOR_SERVER, str(port)])

    async def measure() -> list[float]:
        hops = HopTransport()
        url = f"http://127.0.0.1:{port}/forward"
        for _ in range(100):
            try:
                await hops.post(url, b"0", headers={"X-Pause": "0"}, timeout=5.0, connect_timeout=1.0)
                break
            except TransportError:
                await asyncio.sleep(0.1)
        body = bytes(2304)
        overheads = []
        for _ in range(steps):
            started = time.perf_counter()
            await hops.post(url, body, headers={"X-Pause": str(pause_ms / 1000)}, timeout=5.0, connect_timeout=1.0)
            overheads.append((time.perf_counter() - started) * 1000 - pause_ms)
        await hops.close()
        return overheads

    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            overheads = runner.run(measure())
    finally:
        server.terminate()
        server.wait()
    return {"pause_ms": pause_ms, "steps": steps, "median_ms": statistics.median(overheads),
            "min_ms": min(overheads)}


# ---- the run -----------------------------------------------------------------------------------


def fastest(times: int, run, *args) -> dict:
    """Of ``times`` calls of ``run(*args)``, the one with the most decode tokens/s (the least disturbed)."""
    results = [run(*args) for _ in range(times)]
    best = max(results, key=lambda r: r["decode_tps"] or 0.0)
    return best | {"runs": times, "decode_tps_runs": [r["decode_tps"] for r in results]}


def _thirds(n: int) -> list[str]:
    cuts = [0, round(n / 3), round(2 * n / 3), n]
    return [f"{a}-{b - 1}" for a, b in zip(cuts, cuts[1:])]


def machine() -> dict:
    import torch
    import transformers

    cpu = next((line.split(":", 1)[1].strip() for line in _read_lines("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor() or "unknown")
    mem = next((int(line.split()[1]) * 1024 for line in _read_lines("/proc/meminfo")
                if line.startswith("MemTotal")), None)
    return {
        "cores": host_cores(),
        "cpu": cpu, "memory_bytes": mem, "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "load_average_at_start": os.getloadavg(),
    }


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def check_targets(rows: list[dict], hidden_size: int) -> list[dict]:
    """Each target of the README's "Speed" section against this run's rows (where the run measured it)."""
    by = {(r["setup"], r["new_tokens"]): r for r in rows}
    counts = sorted({r["new_tokens"] for r in rows})
    long = max((n for n in counts if n >= 512), default=None)
    checks = []

    def check(name: str, value, limit: float, *, at_least: bool) -> None:
        if value is not None:
            ok = value >= limit if at_least else value <= limit
            checks.append({"target": name, "value": value, "limit": limit, "at_least": at_least, "met": ok})

    for n in counts:
        cached = by.get(("mesh, 2 nodes, cached", n))
        if cached is not None:
            check(f"2-node cached vs generate, {n} tokens", cached.get("ratio"), TARGET_RATIO, at_least=True)
    if long is not None and (cached := by.get(("mesh, 2 nodes, cached", long))):
        check(f"2-node cached last-{WINDOW} / first-{WINDOW} tokens/s, {long} tokens", cached["decay"],
              TARGET_DECAY, at_least=True)
        stateless = by.get(("mesh, 2 nodes, stateless", long))
        if stateless is not None and stateless["decode_tps"]:
            check(f"2-node cached vs stateless, {long} tokens", cached["decode_tps"] / stateless["decode_tps"],
                  TARGET_VS_STATELESS, at_least=True)
    for setup in ("mesh, 2 nodes, cached", "mesh, 3 nodes, cached"):
        measured = [r for r in rows if r["setup"] == setup and r.get("overhead_ms_per_hop_step") is not None]
        if measured:
            check(f"{setup}: overhead per hop per decode step (ms)",
                  max(r["overhead_ms_per_hop_step"] for r in measured), TARGET_OVERHEAD_MS, at_least=False)
            check(f"{setup}: bytes sent per hop per decode step",
                  max(r["wire_bytes_per_hop_step"] for r in measured), hidden_size * 4 + TARGET_EXTRA_BYTES,
                  at_least=False)
    return checks


def _fmt(value, spec: str, width: int) -> str:
    return f"{value:{width}{spec}}" if value is not None else f"{'-':>{width}}"


def print_table(rows: list[dict], sessions: list[dict], checks: list[dict], floor: dict) -> None:
    header = (f"{'setup':<34} {'tokens':>6} {'prefill ms':>10} {'tok/s':>7} {'first10':>7} {'last10':>7} "
              f"{'decay':>5} {'B/hop/step':>10} {'ovh ms/hop':>10} {'vs gen':>7} {'same':>4}")
    print(header)
    print("-" * len(header))
    for r in rows:
        same = {True: "yes", False: "NO", None: "-"}[r.get("tokens_match")]
        print(f"{r['setup']:<34} {r['new_tokens']:>6} {_fmt(r['prefill_ms'], '.1f', 10)} "
              f"{_fmt(r['decode_tps'], '.2f', 7)} {_fmt(r['first10_tps'], '.2f', 7)} "
              f"{_fmt(r['last10_tps'], '.2f', 7)} {_fmt(r['decay'], '.2f', 5)} "
              f"{_fmt(r.get('wire_bytes_per_hop_step'), '.0f', 10)} "
              f"{_fmt(r.get('overhead_ms_per_hop_step'), '.2f', 10)} {_fmt(r['ratio'], '.2f', 6)}x {same:>4}")
    if sessions:
        print()
        print(f"{'concurrent sessions (2 nodes, cached)':<40} {'tokens each':>11} {'wall s':>8} "
              f"{'aggregate tok/s':>16}")
        for s in sessions:
            print(f"{s['sessions']:<40} {s['tokens_each']:>11} {s['wall_s']:>8.1f} {s['aggregate_tps']:>16.2f}")
    print()
    print(f"loopback floor: a bare hop on the same HTTP stack with one hand-off to a worker thread costs "
          f"{floor['median_ms']:.2f} ms (median; min {floor['min_ms']:.2f}) around a {floor['pause_ms']:.0f} ms "
          "pause on this host")
    if checks:
        print()
        for c in checks:
            op = ">=" if c["at_least"] else "<="
            print(f"{'met ' if c['met'] else 'MISS'} {c['target']}: {c['value']:.2f} (target {op} {c['limit']:g})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshd bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model (default: the built-in one)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512],
                        help="new tokens per run (default 128 512)")
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS),
                        help="what to measure (default all): generate, cached (2 nodes), stateless (2 nodes), "
                        "three (3 nodes, cached)")
    parser.add_argument("--threads", type=int, help="torch threads per daemon (default: meshd's own, which shares "
                        "the cores among the daemons computing at each moment)")
    parser.add_argument("--reference-threads", type=int, nargs="+",
                        help="torch threads of single-process generate; the fastest is the reference (default: "
                        "1 and every core: on a loaded host one thread can beat all of them)")
    parser.add_argument("--sessions", type=int, default=4,
                        help="concurrent sessions measured next to one on the cached 2-node mesh (0: skip; default 4)")
    parser.add_argument("--session-tokens", type=int, default=128, help="new tokens per concurrent session")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run each generate and cached row this many times and keep the fastest, against "
                        "a noisy host; each mesh run is paired with a generate run just before it (the slow "
                        "stateless rows run once; default 1)")
    parser.add_argument("--json", default="bench-results/bench.json", help="where to write the results")
    args = parser.parse_args(argv)
    if min(args.tokens) < 2:
        parser.error("--tokens must be at least 2 (one prefill, one decode step)")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")

    from daemon.model.shard import read_model_info
    from daemon.model.source import resolve_model

    folder = resolve_model(args.model, progress=_say)
    info = read_model_info(folder)
    n = info.num_layers
    half = n // 2
    cores = host_cores()
    host = machine()
    meshes = {
        "cached": ("mesh, 2 nodes, cached", [(f"0-{half - 1}", []), (f"{half}-{n - 1}", [])]),
        "stateless": ("mesh, 2 nodes, stateless",
                      [(f"0-{half - 1}", ["--no-kv-cache"]), (f"{half}-{n - 1}", ["--no-kv-cache"])]),
        "three": ("mesh, 3 nodes, cached", [(layers, []) for layers in _thirds(n)]),
    }
    _say(f"{info.name}, {n} layers, hidden size {info.hidden_size}; {cores} cores; tokens {args.tokens}")

    reference: dict[int, dict] = {}  # new tokens -> the fastest single-process generate
    best_threads: dict[int, int] = {}  # new tokens -> the thread count of that run
    ref_model = None
    ref_threads = sorted(set(args.reference_threads or [1, cores]))
    if "generate" in args.setups:
        _say("loading the model for single-process generate")
        ref_model = Reference(folder)
    rows: list[dict] = []
    sessions: list[dict] = []

    def add(setup: str, tokens: int, result: dict) -> None:
        ref = reference.get(tokens)
        ratio = result["decode_tps"] / ref["decode_tps"] if ref and result["decode_tps"] and ref["decode_tps"] \
            else None
        if result.get("paired_ratios"):  # a mesh row: against the reference runs next to its own
            ratio = statistics.median(result["paired_ratios"])
        first, last = window_tps(result["step_ms"], last=False), window_tps(result["step_ms"], last=True)
        same = result["token_ids"] == ref["token_ids"] if ref and result is not ref else None
        rows.append({"setup": setup, "new_tokens": tokens, **result, "first10_tps": first, "last10_tps": last,
                     "decay": last / first if first and last else None, "ratio": ratio, "tokens_match": same})

    def measure_reference(tokens: int) -> None:
        if ref_model is None or tokens in reference:
            return
        runs = {threads: fastest(args.repeat, ref_model.run, tokens, threads) for threads in ref_threads}
        best_threads[tokens] = max(runs, key=lambda threads: runs[threads]["decode_tps"] or 0.0)
        reference[tokens] = runs[best_threads[tokens]]
        for threads, result in runs.items():
            add(f"generate, 1 process, {threads} thread{'s' if threads > 1 else ''}", tokens, result)

    def measure_mesh(mesh: Mesh, tokens: int, times: int) -> dict:
        """``times`` runs of ``mesh``, each right after a run of the reference (its fastest thread count).

        The mesh's ratio is the median of the pairs' ratios: each pair ran under the same load of a shared
        host, where the fastest of several reference runs against the fastest of fewer mesh runs would
        favour the reference."""
        results, ratios = [], []
        for _ in range(times):
            ref = ref_model.run(tokens, best_threads[tokens]) if ref_model is not None else None
            result = mesh.measure(tokens)
            results.append(result)
            if ref is not None and ref["decode_tps"] and result["decode_tps"]:
                ratios.append(result["decode_tps"] / ref["decode_tps"])
        best = max(results, key=lambda r: r["decode_tps"] or 0.0)
        return best | {"runs": times, "decode_tps_runs": [r["decode_tps"] for r in results],
                       "paired_ratios": ratios}

    for key in ("cached", "stateless", "three"):
        if key not in args.setups:
            continue
        name, specs = meshes[key]
        _say(f"starting {name}")
        mesh = Mesh(name, specs, args.model, args.threads)
        try:
            mesh.generate(4)  # warm-up: connections, route measurements, lazy loads
            for tokens in args.tokens:
                measure_reference(tokens)  # right before the mesh it is compared with, so both see the same load
                add(name, tokens, measure_mesh(mesh, tokens, 1 if key == "stateless" else args.repeat))
            if key == "cached" and args.sessions > 0:
                sessions.append(many_sessions(mesh, 1, args.session_tokens))
                sessions.append(many_sessions(mesh, args.sessions, args.session_tokens))
        finally:
            mesh.stop()
    for tokens in args.tokens:
        measure_reference(tokens)
    order = [name for name, _ in meshes.values()]
    rows.sort(key=lambda r: (r["new_tokens"], order.index(r["setup"]) if r["setup"] in order else -1, r["setup"]))

    cached = [r for r in rows if r["setup"] == meshes["cached"][0] and r.get("hops")]
    remote = [h for r in cached for h in r["hops"] if not h["local"] and h["steps"]]
    pause = sum(h["compute_ms"] for h in remote) / sum(h["steps"] for h in remote) if remote else 40.0
    _say(f"loopback floor: a bare hop around a {pause:.0f} ms pause")
    floor = loopback_floor(pause)
    checks = check_targets(rows, info.hidden_size)
    print_table(rows, sessions, checks, floor)
    host["load_average_at_end"] = os.getloadavg()
    out = {
        "machine": host,
        "model": {"name": info.name, "layers": n, "hidden_size": info.hidden_size},
        "threads_per_daemon": args.threads or "adaptive (meshd default)",
        "rows": rows, "sessions": sessions, "targets": checks, "loopback_floor": floor,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    _say(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
