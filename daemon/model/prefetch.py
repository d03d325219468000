"""How the native kernels stream weights (how far ahead they ask for them, how many rows at a time), chosen on
each machine by timing the node's own.

A decode step streams every weight once, and ``gemv.c``'s dot products can ask for each weight row some bytes
before they read it (``__builtin_prefetch``). Whether that pays depends on the CPU. On a 2-core Xeon asking 2 KiB
ahead made products of bfloat16 experts 20% faster and the built-in model's int8 node 7%; on a 2-core Zen 4 the
hardware's own prefetchers did better alone: the built-in model's float32 steps took 0.87-0.96 of the time without it
and its int8 steps 0.94, while its 4-bit steps took 1.07 (steps in one process, the two settings alternating).

So when a node plans its kernels it times, for each kind of weight it holds (float32, bfloat16, int8, 4-bit), one
row by a sample of its own matrices both ways, the two passes alternating over :data:`ROUNDS` rounds, and asks
ahead (:data:`AHEAD` bytes) unless not asking takes under :data:`MARGIN` of the time in the median round. The
choice is remembered beside the kernel plans, per CPU, torch, library build and thread count, so later starts
reuse it. A kind with less than :data:`SAMPLE_BYTES` of weights is not timed (its products would be read from the
caches, where asking ahead changes nothing) and keeps what was remembered, or :data:`AHEAD`.

The same goes for tall bfloat16 matrices (an LM head of :data:`TALL` rows or more), which ``gemv.c`` may multiply
four rows at a time, the input read once for the four: 23 -> 25 GB/s on a Zen 4 asking 1 KiB ahead, but on the Zen 4
VM above, asking nothing ahead, a row at a time took the Qwen3.5-MoE-shaped step in one process from 20.6 to 15.0 ms
(its LM head is 192 of its 418 MiB a step). A node with such a matrix times it both ways too.

The arithmetic is the same every way: only when the bytes arrive changes, and four rows at a time sum each row
as one row at a time does (``tests/unit/test_prefetch.py``).
"""

from __future__ import annotations

import contextlib
import functools
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
MARGIN = 0.97  # a setting is turned off only where off takes under this share of the time on takes
TALL = 16384  # gemv.c's TALL: bfloat16 matrices this tall may take four rows at a time

Product = Callable[[], object]


def plan_prefetch(modules: Iterable[nn.Module], *, store=None,
                  progress: Callable[[str], None] | None = None) -> dict[str, int]:
    """Set how far ahead each kind of weight among ``modules`` is asked for, and whether tall bfloat16 matrices take
    four rows at a time (remembered in ``store``, or measured there and then); the settings made, by name (a kind,
    or ``"four tall"``). Nothing where the native library is not built."""
    lib = native.library()
    if lib is None:
        return {}
    modules = list(modules)
    threads = torch.get_num_threads()
    settings: dict[str, int] = {}
    ratios: dict[str, float] = {}

    def setting(name: str, sample: list[Product] | None, apply: Callable[[int], None], current: int,
                on: int) -> None:
        key = f"prefetch {name} threads {threads}" if name in KINDS else f"{name} threads {threads}"
        value = store.setting(key) if store is not None else None
        if value is None and sample is not None:
            ratios[name] = compare(apply, current, sample, on=on)
            value = 0 if ratios[name] < MARGIN else on
            if store is not None:
                store.remember(key, value)
        if value is not None:
            apply(value)
            settings[name] = value

    with store.locked() if store is not None else contextlib.nullcontext():
        for kind, sample in _products_by_kind(modules).items():
            setting(kind, sample, functools.partial(lib.set_ahead, KINDS[kind]), lib.ahead(KINDS[kind]), AHEAD)
        if any(_tall(m) for m in modules):  # timed with bfloat16's distance as just set
            setting("four tall", _tall_sample(modules), lib.set_four_tall, lib.four_tall(), 1)
    if progress is not None and settings:
        progress("weights streamed: " + ", ".join(
            f"{name} {describe(name, value)}" + (f" (off took {ratios[name]:.2f} of on's time)" if name in ratios
                                                  else "") for name, value in settings.items()))
    return settings


def compare(apply: Callable[[int], None], current: int, sample: list[Product], *, on: int,
            rounds: int = ROUNDS) -> float:
    """Time ``sample`` (one-row products) with the setting ``on`` and with 0, alternating (``apply`` sets it);
    the median round's time with 0 over its time with ``on``. The setting is ``current`` again afterwards."""
    ratios = []
    try:
        for _ in range(2):  # warm-up: the first passes fault pages and set the kernels up
            for product in sample:
                product()
        for r in range(rounds):
            times = {}
            for value in (0, on) if r % 2 == 0 else (on, 0):
                apply(value)
                started = time.perf_counter()
                for product in sample:
                    product()
                times[value] = time.perf_counter() - started
            ratios.append(times[0] / times[on])
    finally:
        apply(current)
    return statistics.median(ratios)


def describe(name: str, value: int) -> str:
    if name not in KINDS:
        return "four rows at a time" if value else "a row at a time"
    return "not asked ahead" if value == 0 else f"asked {value / 1024:g} KiB ahead"


def _tall(module: nn.Module) -> bool:
    """A bfloat16 matrix gemv.c may take four rows at a time whatever its rows' length (an LM head)."""
    return (isinstance(module, nn.Linear) and _plain(module.weight) and module.weight.dtype == torch.bfloat16
            and module.weight.shape[0] >= TALL)


def _tall_sample(modules: list[nn.Module]) -> list[Product] | None:
    return _sample([(m.weight.numel() * 2, functools.partial(_gemv_row, m.weight.detach())) for m in modules
                    if _tall(m)])


def _products_by_kind(modules: Iterable[nn.Module]) -> dict[str, list[Product] | None]:
    """For each kind of weight the native kernels multiply among ``modules``: a sample of one-row products by its
    matrices of at least :data:`SAMPLE_BYTES`, or None where there are fewer bytes of that kind. Only the
    sample's products are made (each with an input row drawn): a 40-layer MoE node holds some 20,000 matrices."""
    from daemon.model.experts import known_layout
    from daemon.model.int4 import Int4WeightLinear
    from daemon.model.quantize import Int8WeightLinear

    found: dict[str, list[tuple[int, Callable[[], Product]]]] = {}
    held: dict[str, int] = {}  # bytes found so far, by kind

    def full(kind: str) -> bool:  # the sample has its bytes: later matrices of the kind are never taken
        return held.get(kind, 0) >= SAMPLE_BYTES

    def add(kind: str, nbytes: int, make: Callable[[], Product]) -> None:
        if not full(kind):
            found.setdefault(kind, []).append((nbytes, make))
            held[kind] = held.get(kind, 0) + nbytes

    seen: set[int] = set()
    for module in modules:
        if id(module) in seen:
            continue
        seen.add(id(module))
        if type(module) is Int8WeightLinear and module.weight_int8.device.type == "cpu":
            add("int8", module.weight_int8.numel(), functools.partial(
                _drawn, native.gemv_int8, module.in_features, torch.float32, module.weight_int8, module.scale))
        elif type(module) is Int4WeightLinear and module.weight_q4.device.type == "cpu":
            add("int4", module.weight_q4.numel(), functools.partial(
                _drawn, native.gemv_q4, module.in_features, torch.float32, module.weight_q4, module.scale,
                module.in_features))
        elif isinstance(module, nn.Linear) and _plain(module.weight):
            weight = module.weight.detach()
            add(_dtype_kind(weight), weight.numel() * weight.element_size(), functools.partial(_gemv_row, weight))
        elif known_layout(module):
            for stack in (module.gate_up_proj, module.down_proj):
                if _plain(stack[0]):
                    stack, kind = stack.detach(), _dtype_kind(stack)
                    for i in range(stack.shape[0]):
                        if full(kind):
                            break
                        add(kind, stack[0].numel() * stack.element_size(), functools.partial(_gemv_expert, stack, i))
    return {kind: _sample(products) for kind, products in found.items()}


def _sample(products: list[tuple[int, Callable[[], Product]]]) -> list[Product] | None:
    """The first products of ``(bytes, make)`` that read :data:`SAMPLE_BYTES`, made, or None where all read fewer."""
    sample, total = [], 0
    for nbytes, make in products:
        if total >= SAMPLE_BYTES:
            break
        sample.append(make)
        total += nbytes
    return [make() for make in sample] if total >= SAMPLE_BYTES else None


def _plain(weight: torch.Tensor) -> bool:
    """A float32 or bfloat16 CPU matrix ``gemv`` reads as it is."""
    return (type(weight.data) is torch.Tensor and weight.dim() == 2 and weight.device.type == "cpu"
            and weight.dtype in (torch.float32, torch.bfloat16) and weight.is_contiguous())


def _dtype_kind(weight: torch.Tensor) -> str:
    return "float32" if weight.dtype == torch.float32 else "bfloat16"


def _bind(function, *args) -> Product:
    return lambda: function(*args)


def _drawn(function, width: int, dtype: torch.dtype, *args) -> Product:
    """``function`` of a random input row of ``width`` values and ``args``."""
    return _bind(function, torch.randn(1, width, dtype=dtype), *args)


def _gemv_row(weight: torch.Tensor) -> Product:
    return _drawn(native.gemv, weight.shape[1], weight.dtype, weight)


def _gemv_expert(stack: torch.Tensor, index: int) -> Product:
    return _gemv_row(stack[index])
