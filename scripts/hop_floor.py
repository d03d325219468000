"""The least a second process can cost a single stream on this host: two processes with no HTTP, no event loop.

    .venv/bin/python scripts/hop_floor.py [--quantize int4] [--rounds 8] [--steps 25]

A two-node mesh on one host against one node holding every layer pays, per token, the second process's part of
the step and one round trip. This measures the floor under that, whatever the protocol: one process computing the
built-in model's 30 layers and LM head, against two that hold half each, where each process's one torch thread
computes its layers, writes the hidden state straight to the other over a loopback TCP socket and waits for the
answer with its OpenMP team asleep (every thread of the team sleeps until the socket is readable, as a parked
``meshd`` does until its next step). Each process computes as a node does (native decode steps, ``--quantize``).

Rows run in rounds, each setup once per round, so a host whose speed moves between seconds slows both alike. It
prints each setup's median step time, the two-process step over the one-process step measured in the same
round (median over rounds), each process's median compute, and the host's load. Needs a C compiler (as the
native kernels do) for the few lines that put the team to sleep on a socket.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LAYERS = 30  # the built-in model's
SLEEP_ON_SOCKET = r"""
#include <limits.h>
#include <poll.h>
#include <omp.h>
/* every thread of the calling thread's OpenMP team waits until fd is readable: the bytes wake them all at once */
void sleep_on(int fd) {
#pragma omp parallel
    {
        struct pollfd p = {fd, POLLIN, 0};
        poll(&p, 1, -1);
    }
}
"""


def _sleeper(folder: str) -> ctypes.CDLL:
    source, library = Path(folder) / "sleep.c", Path(folder) / "sleep.so"
    if not library.exists():
        source.write_text(SLEEP_ON_SOCKET)
        subprocess.run([os.environ.get("CC", "cc"), "-O2", "-fopenmp", "-shared", "-fPIC", str(source), "-o",
                        str(library)], check=True)
    return ctypes.CDLL(str(library))


def _stepper(start: int, end: int, quantize: str | None):
    """Decode steps of layers ``[start, end)`` (and the LM head at the end) over a cache of a few hundred positions."""
    import torch

    from daemon.kvstore import SessionCacheStore
    from daemon.model.quantize import keep_torchao_unloaded
    from daemon.model.shard import ModelShard
    from daemon.model.source import fetch_default_model

    keep_torchao_unloaded()  # as meshd: int8 and int4 do not need it
    torch.set_num_threads(os.cpu_count() or 1)
    shard = ModelShard(fetch_default_model(progress=lambda *_: None), start, end, head=start == 0,
                       sessions=SessionCacheStore(), quantize=quantize)
    shard.plan_kernels(max_rows=1)
    prompt = torch.randn(1, 40, shard.info.hidden_size) * 0.5
    state = {}

    def fresh() -> None:
        state["cache"], state["position"] = shard.new_cache(), prompt.shape[1]
        shard.run_layers(prompt, start_layer=start, past_len=0, cache=state["cache"])

    computed: list[float] = []

    def step(hidden: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        out = shard.run_layers(hidden, start_layer=start, past_len=state["position"], cache=state["cache"])
        if shard.is_tail:
            shard.logits_last(out).argmax()
        state["position"] += 1
        if state["position"] > 300:
            fresh()
        computed.append(time.perf_counter() - started)
        return out

    fresh()
    return torch, shard.info.hidden_size, step, computed


def tail(port: int, quantize: str | None, folder: str) -> None:
    torch, width, step, computed = _stepper(LAYERS // 2, LAYERS, quantize)
    sleep_on = _sleeper(folder).sleep_on
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        sleep_on(sock.fileno())
        data = sock.recv(1 << 16)
        if not data:
            sys.stderr.write(f"{statistics.median(computed[-500:]) * 1000:.2f}\n")
            return
        step(torch.frombuffer(bytearray(data), dtype=torch.float32).view(1, 1, width))
        sock.sendall(b"t")


def driven(setup: str, quantize: str | None, folder: str) -> None:
    """One setup, timing ``--steps`` steps each time the parent asks (a byte on stdin), answering the median."""
    two = setup == "two"
    torch, width, step, computed = _stepper(0, LAYERS // 2 if two else LAYERS, quantize)
    if two:
        server = socket.create_server(("127.0.0.1", 0))
        peer = subprocess.Popen([sys.executable, __file__, "--tail", str(server.getsockname()[1]), folder],
                                env=os.environ, stderr=subprocess.PIPE, text=True)
        sock, _ = server.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sleep_on = _sleeper(folder).sleep_on

    def one() -> None:
        out = step(torch.randn(1, 1, width) * 0.5)
        if two:
            sock.sendall(out.numpy().tobytes())
            sleep_on(sock.fileno())
            sock.recv(16)

    for _ in range(5):
        one()
    commands, answers = os.fdopen(0, "rb", buffering=0), os.fdopen(1, "wb", buffering=0)
    answers.write(b"r")
    steps = int(os.environ["HOP_FLOOR_STEPS"])
    while commands.read(1):
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            one()
            times.append(time.perf_counter() - started)
        answers.write(struct.pack("d", statistics.median(times) * 1000))
    computes = [statistics.median(computed[-500:]) * 1000]
    if two:
        sock.close()
        computes.append(float((peer.stderr.read().strip().splitlines() or ["nan"])[-1]))
        peer.wait()
    sys.stderr.write(" + ".join(f"{c:.2f}" for c in computes) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantize", choices=["int8", "int4"], help="the layers' weights (default float32)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=25, help="decode steps per setup per round")
    args = parser.parse_args()
    env = os.environ | {"HOP_FLOOR_STEPS": str(args.steps), "HOP_FLOOR_QUANTIZE": args.quantize or ""}
    with tempfile.TemporaryDirectory() as folder:
        _sleeper(folder)
        procs = {}
        try:
            for setup in ("one", "two"):
                procs[setup] = subprocess.Popen([sys.executable, __file__, "--setup", setup, folder], env=env,
                                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                bufsize=0)
                if procs[setup].stdout.read(1) != b"r":
                    raise SystemExit(f"{setup}: did not start ({procs[setup].stderr.read().decode()[-500:]})")
            steps: dict[str, list[float]] = {setup: [] for setup in procs}
            loads = []
            for _ in range(args.rounds):
                loads.append(os.getloadavg()[0])
                for setup, proc in procs.items():
                    proc.stdin.write(b"g")
                    steps[setup].append(struct.unpack("d", proc.stdout.read(8))[0])
            computes = {}
            for setup, proc in procs.items():
                proc.stdin.close()
                computes[setup] = proc.stderr.read().decode().strip().splitlines()[-1]
                proc.wait()
        finally:
            for proc in procs.values():
                proc.kill()
    ratio = statistics.median(two / one for one, two in zip(steps["one"], steps["two"]))
    print(f"built-in model, {args.quantize or 'float32'}, {args.rounds} rounds of {args.steps} steps, "
          f"load {min(loads):.2f}-{max(loads):.2f}")
    print(f"{'setup':32s} {'step ms':>8s} {'two / one':>9s}  compute ms per process")
    print(f"{'one process, 30 layers':32s} {statistics.median(steps['one']):8.2f} {'':>9s}  {computes['one']}")
    print(f"{'two processes, 15 layers each':32s} {statistics.median(steps['two']):8.2f} {ratio:9.3f}  "
          f"{computes['two']}")
    print(f"one / two (tok/s ratio): {1 / ratio:.2f}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--tail"]:
        tail(int(sys.argv[2]), os.environ.get("HOP_FLOOR_QUANTIZE") or None, sys.argv[3])
    elif sys.argv[1:2] == ["--setup"]:
        driven(sys.argv[2], os.environ.get("HOP_FLOOR_QUANTIZE") or None, sys.argv[3])
    else:
        sys.exit(main())
