"""Profile a two-node mesh while it generates: where each daemon's CPU time goes, per Python function.

    .venv/bin/python scripts/profile_mesh.py [--tokens 256] [--sessions N] [--model M] [--out bench-results/profile]

Starts two ``meshd`` on 127.0.0.1 (as ``meshd bench`` does), attaches ``py-spy record`` to both
for one greedy generation, and prints each daemon's busiest functions by own time and by time
spent under them, grouped into what the mesh adds (HTTP, serialisation, the generation loop) and
what it cannot avoid (the layers). The raw collapsed stacks stay in ``--out`` for flame graphs.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from daemon.bench import Mesh  # noqa: E402
from daemon.bench.mesh import at_once  # noqa: E402

# a stack's share is booked to the group of its innermost frame that matches one
GROUPS = (
    ("torch layers", ("run_layers", "run_batch", "logits_last", "logits_rows", "embed (daemon")),
    ("sampling", ("sample_token",)),
    ("serialisation", ("to_activation", "to_tensor", "parse_activation", "as_sent")),
    ("HTTP client", ("aiohttp/client", "HopClient", "mesh/transport")),
    ("HTTP server", ("aiohttp/web_protocol", "aiohttp/web_app", "aiohttp/http_parser", "daemon/server")),
    ("generation loop", ("daemon/mesh",)),
    ("event loop", ("asyncio",)),
)


def _group(frames: list[str]) -> str:
    """The group of the innermost frame that belongs to one (a generation runs inside the HTTP server's frames)."""
    for frame in reversed(frames):
        for name, needles in GROUPS:
            if any(needle in frame for needle in needles):
                return name
    return "other"


def summarise(path: Path, top: int) -> str:
    own: collections.Counter[str] = collections.Counter()
    under: collections.Counter[str] = collections.Counter()
    groups: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        own[frames[-1]] += n
        for frame in set(frames):
            under[frame] += n
        groups[_group(frames)] += n
    if not total:
        return f"{path.name}: no samples"
    lines = [f"{path.stem}: {total} samples of busy threads"]
    lines += [f"  {share:5.1f}%  {name}" for name, share in
              ((name, 100.0 * n / total) for name, n in groups.most_common())]
    lines.append("  own time:")
    lines += [f"  {100.0 * n / total:5.1f}%  {frame}" for frame, n in own.most_common(top)]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--sessions", type=int, default=1, help="generations at once (default 1)")
    parser.add_argument("--model")
    parser.add_argument("--top", type=int, default=12, help="functions listed by own time per daemon")
    parser.add_argument("--out", default="bench-results/profile")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from daemon.model.checkpoint import read_model_info
    from daemon.model.source import resolve_model

    n = read_model_info(resolve_model(args.model)).num_layers
    mesh = Mesh("profiled mesh", [(f"0-{n // 2 - 1}", []), (f"{n // 2}-{n - 1}", [])], args.model)
    spies = []
    try:
        mesh.generate(4)  # warm-up: connections, lazy loads, route measurements
        for role, proc in zip(("head", "tail"), mesh.procs):
            spies.append(subprocess.Popen(
                [py_spy, "record", "--pid", str(proc.pid), "--rate", "200", "--format", "raw",
                 "--output", str(out / f"{role}.txt"), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1.0)  # py-spy attaches
        results, _ = at_once([lambda: mesh.generate(args.tokens)] * args.sessions)
        stats = results[0]
    finally:
        for spy in spies:
            spy.send_signal(2)  # py-spy writes its file on SIGINT
        for spy in spies:
            spy.wait(30)
        mesh.stop()
    print(f"{args.sessions} x {args.tokens} tokens, decode {stats['decode_tokens_per_second']:.2f} tok/s each")
    for role in ("head", "tail"):
        print()
        print(summarise(out / f"{role}.txt", args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
