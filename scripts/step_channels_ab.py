"""Step channels against ``POST /forward``, side by side: one node, and two-node meshes with and without channels.

    .venv/bin/python scripts/step_channels_ab.py [--quantize int4] [--rounds 10] [--tokens 128]

Starts every mesh at once on this host (the built-in model, float32 compute, ``--quantize`` weights), then runs
rounds of one greedy generation on each in turn, so a host whose speed moves between seconds slows them alike. It
prints each mesh's median decode tok/s, its ratio to the one node (median over rounds) and the host's load.
``MESHNET_STEP_CHANNELS=off`` is what turns the channels off in the third mesh (ADR-0049).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from daemon.bench.mesh import Mesh  # noqa: E402 - after the path is set

TWO = [("0-14", []), ("15-29", [])]
SETUPS = [("one node", "on", [("0-29", [])]), ("two nodes, step channels", "on", TWO),
          ("two nodes, POST /forward", "off", TWO)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantize", choices=["int8", "int4"], help="the layers' weights (default float32)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    node_args = ["--prefix-reuse", "off", "--dtype", "float32"] + (["--quantize", args.quantize] if args.quantize
                                                                   else [])
    meshes: dict[str, Mesh] = {}
    try:
        for name, channels, specs in SETUPS:
            os.environ["MESHNET_STEP_CHANNELS"] = channels  # the daemons inherit it
            meshes[name] = Mesh(name, specs, node_args=node_args)
            meshes[name].generate(32)  # warm: plans, caches, the channel opened
        speeds: dict[str, list[float]] = {name: [] for name in meshes}
        loads = []
        for _ in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for name, mesh in meshes.items():
                speeds[name].append(mesh.generate(args.tokens)["decode_tokens_per_second"])
    finally:
        for mesh in meshes.values():
            mesh.stop()
    one = speeds["one node"]
    print(f"built-in model, {args.quantize or 'float32'}, {args.rounds} rounds of {args.tokens} tokens, "
          f"load {min(loads):.2f}-{max(loads):.2f}")
    print(f"{'setup':28s} {'tok/s':>8s} {'/ one node':>10s}")
    for name, tps in speeds.items():
        print(f"{name:28s} {statistics.median(tps):8.2f} {statistics.median(b / a for a, b in zip(one, tps)):10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
