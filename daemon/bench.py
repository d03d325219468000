"""``meshd bench``: the mesh measured side by side with one process running the same model.

Every row runs in this one invocation on this one machine, so ratios are
comparable even on a shared, noisy host. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


def _say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def reference(folder: Path, tokens: int, threads: int) -> dict:
    """Single-process ``transformers`` ``generate``: the limit the mesh is measured against."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, eos_token_id=None)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False, eos_token_id=None)
        total = time.perf_counter() - t0
    new = out.shape[1] - ids.shape[1]
    return {"prefill_ms": prefill * 1000, "decode_tps": (new - 1) / (total - prefill), "tokens": new}


class Mesh:
    """meshd processes on 127.0.0.1, the first one the head."""

    def __init__(self, model: str | None, specs: list[tuple[str, list[str]]], threads: int | None) -> None:
        self.procs: list[subprocess.Popen] = []
        ports = [_free_port() for _ in specs]
        self.head = f"http://127.0.0.1:{ports[0]}"
        for i, ((layers, extra), port) in enumerate(zip(specs, ports)):
            argv = [sys.executable, "-m", "daemon.cli", "--layers", layers, "--port", str(port), *extra]
            if model:
                argv += ["--model", model]
            if threads:
                argv += ["--threads", str(threads)]
            if i == 0:
                for p in ports[1:]:
                    argv += ["--peer", f"http://127.0.0.1:{p}"]
            self.procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if sum(p["up"] for p in _get(self.head + "/v1/status")["peers"]) == len(specs) - 1:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError("the mesh did not come up")

    def generate(self, tokens: int) -> dict:
        body = {"messages": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
        _post(self.head + "/v1/chat/completions", body | {"max_tokens": 4})  # warm-up
        stats = _post(self.head + "/v1/chat/completions", body)["meshnet"]
        # a stateless mesh has no prefill step: its first token's time is the prefill
        return {"prefill_ms": stats["prefill_ms"] or stats["first_token_ms"],
                "decode_tps": stats["decode_tokens_per_second"],
                "tokens": stats["completion_tokens"], "reprefills": stats["reprefills"]}

    def stop(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGINT)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshd bench", description=__doc__)
    parser.add_argument("--model", help="model (default: the built-in one)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128], help="new tokens per run (default 128)")
    parser.add_argument("--threads", type=int, help="torch threads per daemon (default: meshd's own default)")
    parser.add_argument("--json", default="bench-results/bench.json", help="where to write the results")
    args = parser.parse_args(argv)

    from daemon.model.shard import read_model_info
    from daemon.model.source import resolve_model

    folder = resolve_model(args.model, progress=_say)
    n = read_model_info(folder).num_layers
    half = n // 2
    cores = len(os.sched_getaffinity(0))
    rows: list[dict] = []
    setups = [
        ("mesh, 2 nodes, cached", [(f"0-{half - 1}", []), (f"{half}-{n - 1}", [])]),
        ("mesh, 2 nodes, stateless", [(f"0-{half - 1}", []), (f"{half}-{n - 1}", ["--no-kv-cache"])]),
    ]
    for tokens in args.tokens:
        _say(f"single-process generate, {tokens} tokens")
        ref = reference(folder, tokens, cores)
        rows.append({"setup": "transformers generate (1 process)", "new_tokens": tokens, **ref, "ratio": 1.0})
        for name, specs in setups:
            _say(f"{name}, {tokens} tokens")
            mesh = Mesh(args.model, specs, args.threads)
            try:
                result = mesh.generate(tokens)
            finally:
                mesh.stop()
            rows.append({"setup": name, "new_tokens": tokens, **result,
                         "ratio": result["decode_tps"] / ref["decode_tps"]})
    header = f"{'setup':<36} {'tokens':>6} {'prefill ms':>10} {'decode tok/s':>12} {'vs generate':>11}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['setup']:<36} {r['new_tokens']:>6} {r['prefill_ms']:>10.1f} {r['decode_tps']:>12.2f} "
              f"{r['ratio']:>10.2f}x")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"machine": {"cores": cores}, "rows": rows}, indent=2))
    _say(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
