"""Print what a node's weight plans measure on this machine (``daemon.model.kernels``), shape by shape.

    .venv/bin/python scripts/kernel_plans.py [--threads 1] [--max-rows 16] [--dtype float32]

Loads the built-in model's layers and LM head as one shard, and for each weight shape times one pass of the
products a plan chooses between: the weight as ``[out, in]`` (as transformers keeps it) and transposed, each
with MKL (``F.linear``) and oneDNN, at 1, 4 and 8 rows. Prints the fastest kernel's time per matrix for each
layout and row count (a matrix larger than the sample, the LM head, is timed on its first 64 MiB of outputs),
and the plan kept. Nothing is saved: a node measures (and remembers) its own.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--max-rows", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()

    import torch

    from daemon.host import cpu_name
    from daemon.model import kernels
    from daemon.model.checkpoint import read_model_info
    from daemon.model.shard import ModelShard
    from daemon.model.source import fetch_default_model

    torch.set_num_threads(args.threads)
    folder = fetch_default_model(progress=lambda *_: None)
    shard = ModelShard(folder, 0, read_model_info(folder).num_layers, kv_cache=False, dtype=getattr(torch, args.dtype))
    plans = shard.plan_kernels(max_rows=args.max_rows)
    rows = [r for r in kernels.ROWS if r == 1 or r <= args.max_rows]
    print(f"{cpu_name()}, torch {torch.__version__}, {args.threads} thread(s), {args.dtype}, "
          f"load {os.getloadavg()[0]:.2f}; ms per matrix, the fastest kernel of each")
    header = " ".join(f"{'[out,in] ' + str(r):>12s}" for r in rows) + " " + \
        " ".join(f"{'[in,out] ' + str(r):>12s}" for r in rows)
    print(f"{'shape':>16s} {header}  plan")
    for (out, inp, _), plan in plans.items():
        times = " ".join(f"{plan.ms[f'plain {r}']:12.3f}" for r in rows) + " " + \
            " ".join(f"{plan.ms[f'transposed {r}']:12.3f}" for r in rows)
        layout = "[in, out]" if plan.transposed else "[out, in]"
        chosen = "/".join(f"{r}:{k}" for r, k in zip(rows, plan.kernels))
        print(f"{f'{out}x{inp}':>16s} {times}  {layout} {chosen}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
