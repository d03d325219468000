"""How long OpenMP workers should spin between parallel regions when two daemons share the cores.

    .venv/bin/python scripts/spin_count.py [--spins 100000 30000 10000] [--rounds 10] [--steps 25]
                                           [--gap-ms 1.4] [--threads 1] [--quantize int8]

A single stream through a co-located two-node mesh computes on one node, then on the other. Each
node's libgomp workers spin ``GOMP_SPINCOUNT`` times after a parallel region before they sleep: long
enough bridges the gaps between a step's regions, too long keeps spinning on a core the other node
has started computing on. This measures that alone, without HTTP: one process computing all the
built-in model's layers, against two processes holding half each that take turns over a pipe
(layers 0-14 then 15-29 and the LM head, per one-token decode step), for each spin count.

Rows run in rounds, every setup once per round, so a host whose speed moves between seconds slows all of them
alike; each row prints the median over rounds of its steps' median time, its ratio to the one process measured
in the same rounds, and the cores each process used while its setup ran. It also prints how long a worker
spins after a region at each count, on this CPU (a spin is a ``pause`` instruction, whose length varies with
the CPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODEL_LAYERS = 30  # the built-in model's


def node(start: int, end: int) -> None:
    """A stand-in node on stdin/stdout: a decode step of layers [start, end) for each byte read, a byte back."""
    import torch

    from daemon.kvstore import SessionCacheStore
    from daemon.model.shard import ModelShard
    from daemon.model.source import fetch_default_model

    torch.set_num_threads(int(os.environ.get("SPIN_COUNT_THREADS") or os.cpu_count() or 1))
    shard = ModelShard(fetch_default_model(progress=lambda *_: None), start, end, head=start == 0,
                       sessions=SessionCacheStore(), quantize=os.environ.get("SPIN_COUNT_QUANTIZE") or None)
    shard.plan_kernels(max_rows=1)  # as a node does by default (--tune-kernels on): native decode steps
    prompt = torch.randn(1, 40, shard.info.hidden_size) * 0.5

    def fresh():
        cache = shard.new_cache()
        shard.run_layers(prompt, start_layer=start, past_len=0, cache=cache)
        return cache

    cache, position = fresh(), prompt.shape[1]
    out, inp = os.fdopen(1, "wb", buffering=0), os.fdopen(0, "rb", buffering=0)
    out.write(b"r")
    while inp.read(1):
        hidden = shard.run_layers(torch.randn(1, 1, shard.info.hidden_size) * 0.5, start_layer=start,
                                  past_len=position, cache=cache)
        if shard.is_tail:
            shard.logits_last(hidden).argmax()
        position += 1
        if position > 300:  # a cache of a few hundred positions, as in a bench run
            cache, position = fresh(), prompt.shape[1]
        out.write(b"d")


def spin_ms() -> None:
    """Print how long a worker spins after a region at this process's GOMP_SPINCOUNT (median of 30)."""
    import torch

    torch.set_num_threads(2)
    a = torch.randn(256, 256)
    a @ a
    python_threads = {t.native_id for t in threading.enumerate()}
    workers = [int(t) for t in os.listdir("/proc/self/task") if int(t) not in python_threads]

    def cpu_ns() -> int:
        return sum(int(Path(f"/proc/self/task/{w}/schedstat").read_text().split()[0]) for w in workers)

    spins = []
    for _ in range(30):
        a @ a
        before = cpu_ns()
        time.sleep(0.02)
        spins.append((cpu_ns() - before) / 1e6)
    print(f"{statistics.median(spins):.2f}")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spins", type=int, nargs="+", default=[100_000, 30_000, 10_000])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=25, help="decode steps per setup per round")
    p.add_argument("--gap-ms", type=float, default=0.0,
                   help="a pause after each node's part, as a hop between nodes takes (not counted in the step)")
    p.add_argument("--threads", type=int, help="torch threads per process (default: every core)")
    p.add_argument("--quantize", choices=["int8"], help="the nodes' weights in int8 (default float32)")
    args = p.parse_args()
    if args.threads:
        os.environ["SPIN_COUNT_THREADS"] = str(args.threads)
    if args.quantize:
        os.environ["SPIN_COUNT_QUANTIZE"] = args.quantize
    half = MODEL_LAYERS // 2
    setups = {"one process": ({}, [(0, MODEL_LAYERS)])}
    for spins in args.spins:
        setups[f"two, {spins} spins"] = ({"GOMP_SPINCOUNT": str(spins)}, [(0, half), (half, MODEL_LAYERS)])
    for spins in args.spins:
        out = subprocess.run([sys.executable, __file__, "--spin-ms"], env=os.environ | {"GOMP_SPINCOUNT": str(spins)},
                             capture_output=True, text=True, check=True).stdout.strip()
        print(f"GOMP_SPINCOUNT={spins}: a worker spins {out} ms after a region")
    procs: dict[str, list[subprocess.Popen]] = {}
    try:
        for name, (env, ranges) in setups.items():
            procs[name] = []
            for start, end in ranges:
                proc = subprocess.Popen([sys.executable, __file__, "--node", str(start), str(end)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        env=os.environ | env, bufsize=0)
                if proc.stdout.read(1) != b"r":
                    raise SystemExit(f"{name}: a node did not start")
                procs[name].append(proc)
        steps: dict[str, list[float]] = {name: [] for name in setups}
        cores: dict[str, list[list[float]]] = {name: [] for name in setups}
        for _ in range(args.rounds):
            for name, group in procs.items():
                times, cpu_before, started = [], [_cpu_seconds(q.pid) for q in group], time.perf_counter()
                for _ in range(args.steps):
                    step = 0.0
                    for q in group:
                        t = time.perf_counter()
                        q.stdin.write(b"g")
                        q.stdout.read(1)
                        step += time.perf_counter() - t
                        if args.gap_ms:
                            time.sleep(args.gap_ms / 1000.0)
                    times.append(step)
                wall = time.perf_counter() - started
                steps[name].append(statistics.median(times) * 1000.0)
                cores[name].append([(_cpu_seconds(q.pid) - c) / wall for q, c in zip(group, cpu_before)])
    finally:
        for group in procs.values():
            for q in group:
                q.kill()
    base = steps["one process"]
    print(f"{'setup':22s} {'step ms':>8s} {'vs one':>7s}  cores used per process   (load {os.getloadavg()[0]:.2f})")
    for name, values in steps.items():
        ratio = statistics.median(a / b for a, b in zip(values, base))
        used = " + ".join(f"{statistics.median(c[i] for c in cores[name]):.2f}" for i in range(len(cores[name][0])))
        print(f"{name:22s} {statistics.median(values):8.2f} {ratio:7.3f}  {used}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--node"]:
        node(int(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1:2] == ["--spin-ms"]:
        spin_ms()
    else:
        sys.exit(main())
