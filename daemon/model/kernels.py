"""Each weight matrix's memory layout, and each product's kernel, measured on this CPU when a node loads.

A decode step multiplies one row (a batch of sessions: a few rows) by every weight matrix of the
node's layers, and reads every weight once to do it. ``nn.Linear`` keeps a weight as ``[out, in]``,
one output's weights after another; the BLAS then computes each output as a dot product. The same
values can be kept transposed in memory, ``[in, out]``, with the parameter a ``[out, in]`` view of
them, so every caller (tied embeddings included) sees the same tensor; the BLAS then streams the
matrix input by input. Which is faster depends on the CPU, the BLAS and the shape, and so does
which library multiplies a few rows best, MKL (``F.linear``) or oneDNN (``mkldnn._linear_pointwise``,
which takes the same plain weights). On a 2-core AMD EPYC (Zen 4) with torch 2.13's MKL, one
thread (``scripts/kernel_plans.py`` prints the table for the host it runs on):

=========================  ==========  ===========  ================
one row by                 [out, in]   [in, out]    4 rows, best
=========================  ==========  ===========  ================
1536x576 (gate, up)        0.43 ms     0.25 ms      0.34 ms (oneDNN)
49152x576 (LM head)        9.9 ms      5.0 ms       10.2 ms (oneDNN)
576x1536 (down)            0.24 ms     0.28 ms      0.34 ms (MKL)
=========================  ==========  ===========  ================

MKL's four-row products there took 1.5-1.6x oneDNN's. So a node times both layouts and both
kernels per weight shape, on a sample of its own weights large enough to stream from memory, at
one row and at the batch sizes it runs (:data:`ROWS`), keeps the layout whose best times add up
least, and runs each product with the kernel measured fastest for its row count
(:class:`PlannedLinear`). Longer products (prompts) run ``F.linear`` in either layout. Layers that take
native one-position steps (:class:`daemon.model.decode.NativeSteps`) keep ``[out, in]``, the layout those
steps read: a plan that laid them out anew, on a timing a busy host had skewed, would turn their steps off.

What a plan changes in the arithmetic: the order in which each output's sum is accumulated, so
logits move by float rounding (about 1e-6 of their scale in float32). Tokens on the test prompts
stay those of transformers' ``generate`` (``tests/unit/test_kernels.py``); ``--tune-kernels off`` keeps
transformers' own products, bit for bit. bfloat16 rounds each product's output, so another accumulation
order moves logits by more (up to 0.037 of their scale on the built-in model) and can flip near-tied greedy
tokens: a bfloat16 weight keeps transformers' product unless another takes under :data:`ROUNDED_MARGIN` of
its time (large matrices, where MKL's bfloat16 product streams at 0.6 of the memory's speed). Plans are
remembered per CPU, torch version, thread count, dtype and shape in ``kernel-plans.json`` beside the model
cache, so a node decides once per machine and computes the same way on every start.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from daemon.host import copy_out_of_file, cpu_name, file_mappings, return_freed_memory
from daemon.model import native

log = logging.getLogger(__name__)

ROWS = (1, 4, 8)  # the row counts a plan is measured at; a product of r rows takes the kernel of the nearest
SAMPLE_BYTES = 64 << 20  # weights timed per shape and layout: past a CPU's caches, streamed from memory as a step does
ROUNDS = 4  # interleaved timing rounds per candidate: the first sets kernels up, the fastest of the rest counts
MARGIN = 0.97  # the transposed layout is kept only when its time is under this share of the plain layout's
# bfloat16 and float16 products round each output, so another kernel or layout can move tokens: one is kept only
# where it takes under this share of transformers' own product's time (large matrices on CPUs whose MKL
# bfloat16 product runs at a fraction of the memory's speed), see docs/adr/0039-bfloat16-plans-where-they-pay.md
ROUNDED_MARGIN = 0.8
KERNELS = ("blas", "onednn", "gemv")


@dataclass(frozen=True)
class Plan:
    """How one weight shape is kept and multiplied: ``transposed`` layout, and a kernel per :data:`ROWS` entry."""

    transposed: bool
    kernels: tuple[str, ...]
    ms: dict[str, float] | None = None  # what was measured, for the log: "plain 1" -> ms per matrix

    def kernel(self, rows: int) -> str:
        """The kernel for a product of ``rows`` rows: the one measured at the nearest of :data:`ROWS` (the smaller
        on a tie); ``F.linear``'s for longer products (prompts)."""
        if rows >= len(_NEAREST):
            return "blas"
        nearest = _NEAREST[rows]
        return self.kernels[nearest] if nearest < len(self.kernels) else "blas"


# the index into ROWS nearest each row count a plan covers (up to twice the largest measured), looked up per product
_NEAREST = tuple(min(range(len(ROWS)), key=lambda i: abs(ROWS[i] - rows)) for rows in range(2 * ROWS[-1] + 1))


class PlannedLinear(nn.Linear):
    """An ``nn.Linear`` whose products run the kernel its :class:`Plan` measured fastest for their row count."""

    plan: Plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return product(x, self.weight, self.bias, self.plan.kernel(x.numel() // x.shape[-1]))


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed by ``kernel``: MKL through ``F.linear`` ("blas"), oneDNN, or this
    machine's build of ``gemv.c`` (:mod:`daemon.model.native`; a weight kept ``[out, in]``, a few rows)."""
    if kernel == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if kernel == "gemv" and native.supports(x, weight) and native.library() is not None:
        return native.gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def available_kernels(layout: str) -> tuple[str, ...]:
    """The kernels a plan measures for weights in ``layout`` ("plain" ``[out, in]`` or "transposed") here."""
    kernels = ["blas"]
    if onednn_available():
        kernels.append("onednn")
    if layout == "plain" and native.library() is not None:
        kernels.append("gemv")
    return tuple(kernels)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


PLANNED_DTYPES = (torch.float32, torch.bfloat16)


def plannable_dtype(dtype: torch.dtype) -> bool:
    return dtype in PLANNED_DTYPES


def plannable(module: nn.Module) -> bool:
    """Whether ``module`` is a plain CPU ``nn.Linear`` with float32 or bfloat16 weights a plan can lay out (not
    quantized). float16: no CPU kernel of either library streams it faster than transformers' own."""
    if type(module) not in (nn.Linear, PlannedLinear):
        return False
    weight = module.weight
    return (type(weight.data) is torch.Tensor and weight.device.type == "cpu"
            and plannable_dtype(weight.dtype) and weight.dim() == 2)


def plan_linears(modules: Iterable[nn.Module], *, max_rows: int, store: PlanStore | None = None,
                 progress: Callable[[str], None] | None = None, plain_only: bool = False) -> dict[tuple, Plan]:
    """Measure and apply a plan to every plannable ``nn.Linear`` in ``modules`` (in place), one plan per weight
    shape, for products of up to ``max_rows`` rows (``plain_only``: kernels for the ``[out, in]`` layout alone).
    Returns the plans by ``(out, in, dtype)``."""
    groups: dict[tuple, list[nn.Linear]] = {}
    seen: set[int] = set()
    for module in modules:
        if plannable(module) and id(module) not in seen:
            seen.add(id(module))
            groups.setdefault(weight_shape(module.weight), []).append(module)
    plans = measured_plans({shape: [m.weight.detach() for m in group] for shape, group in groups.items()},
                           max_rows=max_rows, store=store, plain_only=plain_only)
    mappings = file_mappings()
    for shape, group in groups.items():
        for module in group:
            apply_plan(module, plans[shape], mappings)
    return_freed_memory()
    if progress is not None and plans:
        progress(describe(plans))
    return plans


def measured_plans(weights: dict[tuple, list[torch.Tensor]], *, max_rows: int, store: PlanStore | None = None,
                   plain_only: bool = False) -> dict[tuple, Plan]:
    """A plan per shape of ``weights`` (``(out, in, dtype)`` -> that shape's matrices), read from ``store`` or
    measured (and remembered) for products of up to ``max_rows`` rows. ``plain_only``: kernels for the
    ``[out, in]`` layout alone, for weights that cannot be laid out anew."""
    rows = tuple(r for r in ROWS if r == 1 or r <= max_rows)
    plans: dict[tuple, Plan] = {}
    threads = torch.get_num_threads()
    # one daemon measures at a time on this host (two timing at once would each see the other's load)
    with store.locked() if store is not None else contextlib.nullcontext():
        for shape, group in weights.items():
            key = _key(shape, rows, threads) + (" plain" if plain_only else "")
            plan = store.get(key) if store is not None else None
            if plan is None:
                plan = measure_plan(group, rows, plain_only=plain_only)
                if store is not None:
                    store.put(key, plan)
            plans[shape] = plan
    return plans


def apply_plan(module: nn.Linear, plan: Plan, mappings: list[tuple[int, int]] = ()) -> None:
    """Lay ``module``'s weight out as ``plan`` says (the same Parameter object: a tied weight stays tied) and make
    its products follow the plan. Where the former weight lies in a file mapping (``mappings``), its pages are let
    go of block by block as they are copied, so a node never holds a matrix twice."""
    weight = module.weight
    transposed = weight.stride(0) == 1 and weight.shape[1] > 1
    if plan.transposed != transposed:
        old = weight.data
        shape = old.shape[::-1] if plan.transposed else old.shape
        new = torch.empty(shape, dtype=old.dtype, device=old.device)
        new = new.t() if plan.transposed else new
        with torch.no_grad():
            copy_out_of_file(old, new, mappings, block_bytes=4 << 20)
            weight.data = new
        del old
        return_freed_memory()  # the former weight, where it came from the heap (a cast checkpoint's copy)
    module.__class__ = PlannedLinear
    module.plan = plan


def measure_plan(weights: list[torch.Tensor], rows: tuple[int, ...], *, plain_only: bool = False) -> Plan:
    """Time ``weights`` (one shape) in both layouts (``plain_only``: as they are) with every kernel at each of
    ``rows``: the fastest plan."""
    sample, total = [], 0
    for weight in weights:  # whole matrices, the last (or a huge one) cut to its first outputs
        outputs = max(1, (SAMPLE_BYTES - total) // (weight.shape[1] * weight.element_size()))
        sample.append(weight[:outputs])
        total += sample[-1].numel() * weight.element_size()
        if total >= SAMPLE_BYTES:
            break
    layouts = {"plain": [w.contiguous() for w in sample]}
    if not plain_only:
        layouts["transposed"] = [w.t().contiguous().t() for w in sample]
    kernels = {layout: available_kernels(layout) for layout in layouts}
    inputs = {r: torch.randn(r, sample[0].shape[1], dtype=sample[0].dtype) for r in rows}
    times: dict[tuple[str, int, str], list[float]] = {}
    with torch.inference_mode():
        for _ in range(ROUNDS):
            for layout, group in layouts.items():
                for r in rows:
                    for kernel in kernels[layout]:
                        times.setdefault((layout, r, kernel), []).append(_time(group, inputs[r], kernel))
    # the fastest round: what the product costs when the host leaves it alone (the first round sets kernels up)
    fastest = {k: min(v[1:]) for k, v in times.items()}
    # float32: the fastest kernel of each layout; a rounded dtype keeps transformers' own product (MKL, [out, in])
    # unless another is faster by the margin
    rounded = sample[0].dtype != torch.float32
    margin = ROUNDED_MARGIN if rounded else MARGIN

    def best_kernel(layout: str, r: int) -> str:
        kernel = min(kernels[layout], key=lambda k: fastest[layout, r, k])
        if rounded and kernel != "blas" and fastest[layout, r, kernel] >= margin * fastest["plain", r, "blas"]:
            return "blas"
        return kernel

    best = {(layout, r): best_kernel(layout, r) for layout in layouts for r in rows}
    score = {layout: sum(fastest[layout, r, best[layout, r]] for r in rows) for layout in layouts}
    layout = "transposed" if not plain_only and score["transposed"] < margin * score["plain"] else "plain"
    ms = {f"{name} {r}": round(fastest[name, r, best[name, r]] * 1000.0, 4) for name in layouts for r in rows}
    del layouts
    return_freed_memory()  # the sample's transposed copies
    return Plan(layout == "transposed", tuple(best[layout, r] for r in rows), ms)


def _time(weights: list[torch.Tensor], x: torch.Tensor, kernel: str) -> float:
    """Seconds per matrix of one pass of ``x`` by every weight in ``weights`` with ``kernel``."""
    started = time.perf_counter()
    for w in weights:
        product(x, w, None, kernel)
    return (time.perf_counter() - started) / len(weights)


def describe(plans: dict[tuple, Plan]) -> str:
    """One line: each shape's layout and kernels."""
    parts = []
    for (out, inp, dtype), plan in plans.items():
        layout = "[in, out]" if plan.transposed else "[out, in]"
        kernels = "/".join(f"{r}:{k}" for r, k in zip(ROWS, plan.kernels))
        parts.append(f"{out}x{inp} {dtype} {layout} {kernels}")
    return "weight plans: " + "; ".join(parts)


def weight_shape(weight: torch.Tensor) -> tuple:
    """A matrix's plan key: ``(out, in, dtype name)``."""
    return (weight.shape[0], weight.shape[1], str(weight.dtype).removeprefix("torch."))


def _key(shape: tuple, rows: tuple[int, ...], threads: int) -> str:
    out, inp, dtype = shape
    return f"{out}x{inp} {dtype} rows {','.join(map(str, rows))} threads {threads}"


class PlanStore:
    """Plans measured on this machine, in a JSON file: one section per CPU model and torch version."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.section = f"{cpu_name()} | torch {torch.__version__} | native {native.signature()}"
        self._read()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold this machine's plan lock for the block, with the plans read afresh (another daemon may have just
        measured what this one needs); without a writable folder, the block runs unlocked."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path.with_suffix(".lock"), os.O_CREAT | os.O_RDWR, 0o600)
        except OSError:
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._read()
            yield
        finally:
            os.close(fd)  # releases the lock

    def _read(self) -> None:
        path = self.path
        try:
            self._all = json.loads(path.read_text())
            if not isinstance(self._all, dict):
                raise ValueError("not an object")
        except FileNotFoundError:
            self._all = {}
        except (OSError, ValueError) as exc:  # unreadable: measured again and written anew
            log.warning("ignoring the kernel plans in %s (%s)", path, exc)
            self._all = {}

    def get(self, key: str) -> Plan | None:
        entry = self._all.get(self.section, {}).get(key)
        try:
            return Plan(bool(entry["transposed"]), tuple(entry["kernels"]), entry.get("ms")) if entry else None
        except (KeyError, TypeError):
            return None

    def put(self, key: str, plan: Plan) -> None:
        self._write(key, asdict(plan) | {"kernels": list(plan.kernels)})

    def setting(self, key: str) -> int | None:
        """A whole-number setting measured on this machine (:mod:`daemon.model.prefetch`), or None."""
        value = self._all.get(self.section, {}).get(key)
        return value if type(value) is int else None

    def remember(self, key: str, value: int) -> None:
        self._write(key, value)

    def _write(self, key: str, entry) -> None:
        self._all.setdefault(self.section, {})[key] = entry
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary = self.path.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_text(json.dumps(self._all, indent=1))
            temporary.replace(self.path)  # two nodes starting together each write a whole file
        except OSError as exc:
            log.warning("cannot save kernel plans to %s (%s); they are measured again at the next start",
                        self.path, exc)


def default_store() -> PlanStore:
    from daemon.model.source import cache_dir

    return PlanStore(cache_dir() / "kernel-plans.json")
