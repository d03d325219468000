"""The ``meshd plan`` command line: machines' memory in, a layer range and a cache budget for each out.

    meshd plan --model ./Llama-70B --node 64GiB --node 48GiB --node 32GiB --node 24GiB --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from daemon.errors import ModelUnavailable
from daemon.model.footprint import DTYPE_BYTES, QUANTIZATIONS, Precision

# meshd's own runtime with one layer of the built-in model loaded measured 460 MiB of RSS (Python, torch,
# transformers, aiohttp, the tokenizer): a round number above it
DEFAULT_RESERVE = 512 << 20
DEFAULT_CONTEXT_CAP = 8192  # a model's full context (often 128K) is rarely what sessions use

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``16GiB``, ``8GB``, ``512MiB``, ``1.5GiB`` or plain ``1073741824``."""
    match = _SIZE.fullmatch(text)
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write it like 16GiB, 8GB, 512MiB or plain bytes")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be more than 0 bytes")
    return size


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens above 0")
    return int(text)


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, like every meshd error, instead of argparse's usage block
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="meshd plan", description="Propose a contiguous --layers range for each machine so the model's "
                "weights fit, and say how many sessions of --context tokens each can then cache. Reads the model's "
                "config and its weight files' headers, never the weights. Exits 1 when the model does not fit.")
    p.add_argument("--model", help="a Hugging Face model folder (config.json alone is enough), a .gguf file, or the "
                   "built-in default SmolLM2-135M-Instruct (used when absent)")
    p.add_argument("--node", action="append", type=parse_size, default=[], metavar="SIZE",
                   help="memory of one machine, like 16GiB, 8GB or 512MiB; one per machine, in route order")
    p.add_argument("--dtype", choices=("auto", *DTYPE_BYTES), default="auto",
                   help="weights' dtype (default auto: the checkpoint's own, as meshd --dtype auto keeps it on a "
                   "device that computes it; bfloat16 for a GGUF file)")
    p.add_argument("--quantize", choices=QUANTIZATIONS, help="int8: weight-only int8 of the decoder layers' Linear "
                   "weights (1 byte each plus a bfloat16 scale per output channel; int8-torchao: a float32 scale "
                   "and an int8 zero point); int4: half a byte each plus a float16 scale per 32 (llama.cpp's Q4_0)")
    p.add_argument("--context", type=_positive_int, metavar="TOKENS", help="tokens per session to size the caches "
                   f"for (default: the model's context, at most {DEFAULT_CONTEXT_CAP})")
    p.add_argument("--reserve", type=parse_size, default=DEFAULT_RESERVE, metavar="SIZE",
                   help="memory kept back on each node for meshd's own runtime (default 512MiB)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def _say(message: str) -> None:
    print(f"meshd: {message}", file=sys.stderr, flush=True)


def _fail(message: str, code: int) -> int:
    print(f"meshd: error: {message}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str]) -> int:
    """``meshd plan``: print the plan (a table, or JSON); 0 when the model fits, 1 when not, 2 on bad usage."""
    try:
        args = _parser().parse_args(argv)
    except _UsageError as exc:
        return _fail(f"plan: {exc}", 2)
    if not args.node:
        return _fail("plan: give each machine's memory with --node SIZE (one per machine, in route order)", 2)
    from daemon.model.footprint import read_footprint
    from daemon.plan.report import plan_json, render_text
    from daemon.plan.split import plan_mesh

    try:
        footprint = read_footprint(args.model, progress=_say)
    except ModelUnavailable as exc:
        return _fail(exc.message.splitlines()[0], 1)
    limit = footprint.max_positions
    context = args.context or min(limit or DEFAULT_CONTEXT_CAP, DEFAULT_CONTEXT_CAP)
    if limit and context > limit:
        return _fail(f"plan: --context {context} is longer than the model's context of {limit} tokens", 2)
    try:
        dtype = args.dtype
        if dtype == "auto":
            dtype = footprint.saved_dtype or ("bfloat16" if footprint.source == "GGUF header" else "float32")
        plan = plan_mesh(footprint, args.node, Precision(dtype, args.quantize), context=context,
                         reserve=args.reserve)
    except ValueError as exc:
        return _fail(f"plan: {exc}", 2)
    if args.json:
        print(json.dumps(plan_json(plan, args.model), indent=2))
    else:
        print(render_text(plan, args.model), end="")
    return 0 if plan.fits else 1
