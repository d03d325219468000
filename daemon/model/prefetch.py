"""How far ahead the native kernels ask for weights, chosen on each machine by timing the node's own.

A decode step streams every weight once, and ``gemv.c``'s dot products can ask for each weight row some bytes
before they read it (``__builtin_prefetch``). Whether that pays depends on the CPU. On a 2-core Xeon asking 2 KiB
ahead made products of bfloat16 experts 20% faster and the built-in model's int8 node 7%; on a 2-core Zen 4 the
hardware's own prefetchers did better alone: the built-in model's float32 steps were 4-15% faster without it and its
int8 steps 6-7%, while its 4-bit steps were 2.5-7% slower (steps in one process, alternating the two settings).

So when a node plans its kernels it times, for each kind of weight it holds (float32, bfloat16, int8, 4-bit), one
row by a sample of its own matrices both ways, the two passes alternating over :data:`ROUNDS` rounds, and asks
ahead (:data:`AHEAD` bytes) unless not asking takes under :data:`MARGIN` of the time in the median round. The
choice is remembered beside the kernel plans, per CPU, torch, library build and thread count, so later starts
reuse it. A kind with less than :data:`SAMPLE_BYTES` of weights is not timed (its products would be read from the
caches, where asking ahead changes nothing) and keeps what was remembered, or :data:`AHEAD`. The arithmetic is
the same either way: only when the bytes arrive changes.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterable

import torch
from torch import nn

from daemon.model import native

AHEAD = 2048  # bytes: the library's own setting until a node measures
KINDS = {"float32": 0, "bfloat16": 1, "int8": 2, "int4": 3}  # gemv.c's W_F32, W_BF16, W_INT8, W_Q4
SAMPLE_BYTES = 64 << 20  # past a CPU's caches: the sample streams from memory as a step does
ROUNDS = 9
MARGIN = 0.97  # not asking ahead is chosen only when it takes under this share of the time asking ahead takes

Product = Callable[[], object]


def plan_prefetch(modules: Iterable[nn.Module], *, store=None,
                  progress: Callable[[str], None] | None = None) -> dict[str, int]:
    """Set how far ahead each kind of weight among ``modules`` is asked for (remembered in ``store``, or measured
    there and then); the bytes by kind, for the kinds set. Nothing where the native library is not built."""
    lib = native.library()
    if lib is None:
        return {}
    products = _products_by_kind(modules)
    threads = torch.get_num_threads()
    chosen: dict[str, int] = {}
    measured: dict[str, float] = {}
    with store.locked() if store is not None else contextlib.nullcontext():
        for kind, sample in products.items():
            key = f"prefetch {kind} threads {threads}"
            value = store.setting(key) if store is not None else None
            if value is None and sample is not None:
                value, measured[kind] = choose(lib, KINDS[kind], sample)
                if store is not None:
                    store.remember(key, value)
            if value is not None:
                lib.set_ahead(KINDS[kind], value)
                chosen[kind] = value
    if progress is not None and chosen:
        progress("weights asked for ahead: " + ", ".join(
            f"{kind} {describe(value)}" + (f" (none took {measured[kind]:.2f} of the time)" if kind in measured else "")
            for kind, value in chosen.items()))
    return chosen


def choose(lib, kind: int, sample: list[Product], rounds: int = ROUNDS) -> tuple[int, float]:
    """Time ``sample`` (products of one row by weights of ``kind``) asking :data:`AHEAD` bytes ahead and not at
    all, alternating; the setting to keep and the median round's time without over the time with."""
    before = lib.ahead(kind)
    ratios = []
    try:
        for _ in range(2):  # warm-up: the first passes fault pages and set the kernels up
            for product in sample:
                product()
        for r in range(rounds):
            times = {}
            for value in (0, AHEAD) if r % 2 == 0 else (AHEAD, 0):
                lib.set_ahead(kind, value)
                started = time.perf_counter()
                for product in sample:
                    product()
                times[value] = time.perf_counter() - started
            ratios.append(times[0] / times[AHEAD])
    finally:
        lib.set_ahead(kind, before)
    ratio = statistics.median(ratios)
    return (0 if ratio < MARGIN else AHEAD), ratio


def describe(value: int) -> str:
    return "not at all" if value == 0 else f"{value / 1024:g} KiB"


def _products_by_kind(modules: Iterable[nn.Module]) -> dict[str, list[Product] | None]:
    """For each kind of weight the native kernels multiply among ``modules``: a sample of one-row products by its
    matrices of at least :data:`SAMPLE_BYTES`, or None where there are fewer bytes of that kind."""
    from daemon.model.experts import known_layout
    from daemon.model.int4 import Int4WeightLinear
    from daemon.model.quantize import Int8WeightLinear

    found: dict[str, list[tuple[int, Product]]] = {}

    def add(kind: str, nbytes: int, product: Product) -> None:
        found.setdefault(kind, []).append((nbytes, product))

    seen: set[int] = set()
    for module in modules:
        if id(module) in seen:
            continue
        seen.add(id(module))
        if type(module) is Int8WeightLinear and module.weight_int8.device.type == "cpu":
            x = torch.randn(1, module.in_features)
            add("int8", module.weight_int8.numel(), _bind(native.gemv_int8, x, module.weight_int8, module.scale))
        elif type(module) is Int4WeightLinear and module.weight_q4.device.type == "cpu":
            x = torch.randn(1, module.in_features)
            add("int4", module.weight_q4.numel(), _bind(native.gemv_q4, x, module.weight_q4, module.scale,
                                                        module.in_features))
        elif isinstance(module, nn.Linear) and _plain(module.weight):
            weight = module.weight.detach()
            add(_dtype_kind(weight), weight.numel() * weight.element_size(),
                _bind(native.gemv, torch.randn(1, weight.shape[1], dtype=weight.dtype), weight))
        elif known_layout(module):
            for stack in (module.gate_up_proj, module.down_proj):
                if _plain(stack[0]):
                    x = torch.randn(1, stack.shape[2], dtype=stack.dtype)
                    for matrix in stack.detach().unbind(0):
                        add(_dtype_kind(matrix), matrix.numel() * matrix.element_size(), _bind(native.gemv, x, matrix))
    samples: dict[str, list[Product] | None] = {}
    for kind, products in found.items():
        sample, total = [], 0
        for nbytes, product in products:
            if total >= SAMPLE_BYTES:
                break
            sample.append(product)
            total += nbytes
        samples[kind] = sample if total >= SAMPLE_BYTES else None
    return samples


def _plain(weight: torch.Tensor) -> bool:
    """A float32 or bfloat16 CPU matrix ``gemv`` reads as it is."""
    return (type(weight.data) is torch.Tensor and weight.dim() == 2 and weight.device.type == "cpu"
            and weight.dtype in (torch.float32, torch.bfloat16) and weight.is_contiguous())


def _dtype_kind(weight: torch.Tensor) -> str:
    return "float32" if weight.dtype == torch.float32 else "bfloat16"


def _bind(function, *args) -> Product:
    return lambda: function(*args)
