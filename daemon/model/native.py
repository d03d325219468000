"""Products of a few rows by a weight matrix at the memory's speed: ``gemv.c``, built on this machine.

A decode step reads every weight once, so it can go no faster than the memory streams them. On a 2-core AMD
EPYC (Zen 4, 31 GB/s read on two threads) torch 2.13's kernels for one row stream far slower than that: MKL's
float32 product of one row by the built-in model's 1536x576 matrix 9.9 GB/s (it ran on one thread whatever
the thread count), oneDNN's 18.6 GB/s, PyTorch's int8-weight kernel 8-10 GB/s; the dot products of
``gemv.c``, compiled for the CPU it runs on, 25-33 GB/s (``scripts/kernel_plans.py`` prints what each takes
here). It is one more kernel a weight plan measures (``"gemv"`` in :mod:`daemon.model.kernels`), and int8
weights' decode products (up to :data:`MAX_ROWS` rows) always run on it (:mod:`daemon.model.quantize`).

The library is compiled once per machine into the user cache (about a second with the system's C compiler,
``$CC`` or ``cc``) and loaded with ctypes; its threads are torch's own OpenMP team. Without a compiler, or
with ``MESHNET_NATIVE_KERNELS=off``, it is not built and plans choose among torch's kernels alone.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import subprocess
import threading
from pathlib import Path

import torch

from daemon.host import cpu_name

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gemv.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
LIBS = ("-lm",)
ENV = "MESHNET_NATIVE_KERNELS"  # "off": never build or use the library
MAX_ROWS = 16  # longer products (prompts) read each weight row once per row: a blocked GEMM does better
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


class Matrix(ctypes.Structure):
    """``struct matrix`` of ``gemv.c``: a weight matrix of one of the kinds :data:`MATRIX_KINDS` names."""

    _fields_ = [("w", _P), ("scale", _P), ("bias", _P), ("rows", _L), ("cols", _L), ("kind", _I)]


MATRIX_KINDS = {torch.float32: 0, torch.int8: 2, torch.uint8: 3}  # uint8: 4-bit values, two a byte
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


class Layer(ctypes.Structure):
    """``struct layer`` of ``gemv.c``: what a Llama-family layer's native decode step reads."""

    _fields_ = [*((name, Matrix) for name in PROJECTIONS), ("norm_in", _P), ("norm_post", _P),
                ("eps_in", ctypes.c_float), ("eps_post", ctypes.c_float), ("scaling", ctypes.c_float),
                ("hidden", _L), ("heads", _L), ("kv_heads", _L), ("head_dim", _L), ("inter", _L)]


class Library:
    """The loaded ``gemv.c``: its entry points, bound with their argument types."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.key = path.stem
        lib = ctypes.CDLL(str(path))
        for name, argtypes, restype in (  # each entry point meshnet_<name>, bound as self.<name>
            ("gemv", [_P, _P, _P, _P, _L, _L, _L, _I, _P], None),
            ("gemv_pairs", [_P, _L, _P, _L, _P, _P, _L, _L, _I, _P], None),
            ("gemv_int8", [_P, _P, _P, _P, _P, _L, _L, _L, _I, _P], None),
            ("gemm_int8", [_P, _P, _P, _P, _P, _L, _L, _L, _I, _P], None),
            ("gemm_q4", [_P, _P, _P, _P, _P, _L, _L, _L, _I, _P], None),
            ("gemv_q4", [_P, _P, _P, _P, _P, _L, _L, _L, _I, _P], None),
            ("gemv_pairs_q4", [_P, _P, _P, _L, _P, _P, _L, _L, _I, _P], None),
            ("dequantize_q4", [_P, _P, _P, _L, _L, _L, _I], None),
            ("llama_layer", [ctypes.POINTER(Layer), _P, _P, _P, _P, _P, _L, _L, _L, _P], None),
            ("llama_layer_batch", [ctypes.POINTER(Layer), _P, _P, _P, _P, _P, _P, _P, _L, _P], None),
            ("attend_bf16", [_P, _P, _P, _P, _L, _L, _L, _L, _L, _L, ctypes.c_float, _P], None),
            ("delta_step", [_P, _P, _P, _P, _P, _P, _P, _P, _I, _P], None),
            ("q8_floats", [_L], _L),
            ("set_ahead", [_I, _L], None),
            ("ahead", [_I], _L),
            ("set_four_tall", [_I], None),
            ("four_tall", [], _I),
            ("argmax", [_P, _L], _L),
            # ctypes lets go of the GIL while the team sleeps
            ("send_and_wait", [_I, ctypes.c_char_p, _L, ctypes.POINTER(_I), _I, _I, _I], _I),
        ):
            function = getattr(lib, f"meshnet_{name}")
            function.argtypes, function.restype = argtypes, restype
            setattr(self, name, function)

    def wait_readable(self, fds: list[int], *, team: bool, timeout: float | None = None, send_fd: int = -1,
                      data: bytes = b"") -> int:
        """Write ``data`` to ``send_fd`` (if any), then sleep, with the calling thread's OpenMP team where
        ``team``, until one of ``fds`` is readable or ``timeout`` seconds pass: poll's count (0: timed out), -2
        when the write failed (see ``meshnet_send_and_wait``)."""
        timeout_ms = -1 if timeout is None else max(1, int(timeout * 1000))
        return self.send_and_wait(send_fd, data, len(data), (ctypes.c_int * len(fds))(*fds), len(fds), int(team),
                                  timeout_ms)


@functools.cache
def library() -> Library | None:
    """This machine's build of ``gemv.c``, compiled on first use; None where it cannot be (said once, in the log)."""
    if os.environ.get(ENV, "on").strip().lower() in ("off", "0", "false", "no"):
        return None
    try:
        path = _build()
        lib = Library(path)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        log.warning("native kernels unavailable (%s); weight plans choose among torch's kernels", exc)
        return None
    runtimes = _openmp_runtimes()
    if len(runtimes) > 1:  # two thread teams would fight over the cores
        log.warning("native kernels not used: they loaded a second OpenMP runtime (%s)", ", ".join(sorted(runtimes)))
        return None
    return lib


def signature() -> str:
    """What plans measured here may have chosen from: the library's build key, or ``none``."""
    lib = library()
    return lib.key if lib is not None else "none"


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC") or "cc")


def _build() -> Path:
    """The compiled library in the cache, built (atomically: several daemons may start at once) when missing."""
    from daemon.model.source import cache_dir

    compiler = _compiler()
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS + LIBS).encode(), version.encode(), _cpu_flags().encode(),
                 torch.__version__.encode()):
        digest.update(part)
    folder = cache_dir().parent / "native"
    path = folder / f"gemv-{digest.hexdigest()[:16]}.so"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    command = [*compiler, *FLAGS, str(SOURCE), "-o", str(temporary), *LIBS]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        temporary.unlink(missing_ok=True)
        first = (done.stderr.strip().splitlines() or ["no output"])[0]
        raise ValueError(f"{' '.join(command[:1])} failed: {first}")
    temporary.replace(path)
    log.info("built native kernels for %s: %s", cpu_name(), path)
    return path


def _cpu_flags() -> str:
    """The CPU's feature flags (what ``-march=native`` compiles for), or its name where the kernel does not say."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return cpu_name()


def _openmp_runtimes() -> set[str]:
    """The OpenMP runtime libraries mapped into this process (Linux; elsewhere none are seen)."""
    try:
        with open("/proc/self/maps") as maps:
            names = {line.rsplit("/", 1)[-1].strip() for line in maps if "/lib" in line}
    except OSError:
        return set()
    return {name for name in names if name.startswith(("libgomp", "libiomp", "libomp"))}


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``gemv`` computes ``x`` by ``weight`` here: CPU tensors of one dtype it knows, the weight kept
    ``[out, in]`` in contiguous rows, and at most :data:`MAX_ROWS` rows."""
    return (x.dtype == weight.dtype and weight.dtype in _DTYPES and weight.device.type == "cpu"
            and weight.is_contiguous() and x.numel() <= MAX_ROWS * weight.shape[1])


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by ``gemv.c`` (the caller has checked :func:`supports` and :func:`library`)."""
    lib = library()
    x, bias, y, rows = _rows_by(x, bias, *weight.shape)
    work = scratch(rows * weight.shape[1]) if x.dtype != torch.float32 else None  # bfloat16 rows as float32
    lib.gemv(weight.data_ptr(), x.data_ptr(), _pointer(bias), y.data_ptr(), rows, *weight.shape, _DTYPES[x.dtype],
             work)
    return y


def gemv_pairs(x: torch.Tensor, stack: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
    """Row ``p`` of ``x [pairs, in]`` by matrix ``which[p]`` of ``stack [matrices, out, in]`` (a mixture-of-experts
    layer's experts), each output row ``gemv``'s for that row and matrix bit for bit, all in one call. The caller
    has checked :func:`supports` on a matrix of the stack and :func:`library`; ``which`` holds int64 indices."""
    lib = library()
    x = x.contiguous()
    pairs = x.shape[0]
    if pairs > MAX_ROWS or which.dtype != torch.int64 or which.numel() != pairs or not stack.is_contiguous():
        raise ValueError(f"gemv_pairs takes up to {MAX_ROWS} rows, one int64 index each, by a contiguous stack")
    which = which.contiguous()
    y = torch.empty(pairs, stack.shape[1], dtype=x.dtype)
    work = scratch(pairs * stack.shape[2]) if x.dtype != torch.float32 else None
    lib.gemv_pairs(stack.data_ptr(), stack.shape[1] * stack.shape[2], which.data_ptr(), pairs, x.data_ptr(),
                   y.data_ptr(), stack.shape[1], stack.shape[2], _DTYPES[x.dtype], work)
    return y


def attend_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
    """One query's attention ``q [1, heads, 1, dim]`` over ``k`` and ``v [1, kv_heads, positions, dim]``, all
    bfloat16 on the CPU, as float32 SDPA computes it (``meshnet_attend_bf16``), in bfloat16; None where the
    tensors are not laid out for it (keys and values alike, rows contiguous) or the library is not built."""
    lib = library()
    if (lib is None or not q.dtype == k.dtype == v.dtype == torch.bfloat16 or q.shape[0] != 1 or k.shape[0] != 1
            or q.shape[2] != 1 or k.stride() != v.stride() or k.stride(-1) != 1 or k.shape != v.shape
            or q.shape[1] % k.shape[1] or q.device.type != "cpu" or k.shape[2] == 0):
        return None
    q = q.contiguous()
    heads, dim = q.shape[1], q.shape[3]
    kv_heads, positions = k.shape[1], k.shape[2]
    out = torch.empty(1, heads, 1, dim, dtype=torch.bfloat16)
    lib.attend_bf16(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), heads, kv_heads, positions, dim,
                    k.stride(1), k.stride(2), scale, scratch(heads * positions))
    return out


def argmax(logits: torch.Tensor) -> int | None:
    """The index of the first largest of ``logits [vocab]`` (float32, on the CPU), as ``torch.argmax`` picks it, or
    -1 where any logit is NaN or infinite (``meshnet_argmax``); None where the row is not laid out for it or the
    library is not built."""
    lib = library()
    if lib is None or logits.dtype != torch.float32 or logits.dim() != 1 or logits.device.type != "cpu" \
            or logits.stride(0) != 1:
        return None
    return lib.argmax(logits.data_ptr(), logits.shape[0])


def gemv_int8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
    """``x`` by int8 ``weight [out, in]`` whose row r stands for ``weight[r] * scale[r]`` (``scale`` bfloat16), in
    ``x``'s dtype (float32 or bfloat16), at most :data:`MAX_ROWS` rows: each row of ``x`` quantized to int8 in
    blocks of 64, much as llama.cpp quantizes a row for its Q8_0 weights, the products exact integer sums, each
    block's scaled in float32 (ADR-0041)."""
    lib = library()
    if (x.dtype not in _DTYPES or weight.dtype != torch.int8 or scale.dtype != torch.bfloat16
            or not weight.is_contiguous() or not scale.is_contiguous() or x.numel() > MAX_ROWS * weight.shape[1]):
        raise ValueError("gemv_int8 takes float32 or bfloat16 rows by a contiguous int8 matrix with bfloat16 scales")
    x, bias, y, rows = _rows_by(x, bias, *weight.shape)
    work = scratch(rows * lib.q8_floats(weight.shape[1]))  # each row quantized
    lib.gemv_int8(weight.data_ptr(), scale.data_ptr(), x.data_ptr(), _pointer(bias), y.data_ptr(), rows,
                  *weight.shape, _DTYPES[x.dtype], work)
    return y


def gemm_int8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
    """:func:`gemv_int8`'s product for any number of rows (a prompt's): each row quantized as there, four weight rows
    by eight input rows at a time (``meshnet_gemm_int8``); each row's outputs within float32 rounding of
    :func:`gemv_int8`'s and independent of the rows beside it."""
    if (x.dtype not in _DTYPES or weight.dtype != torch.int8 or scale.dtype != torch.bfloat16
            or not weight.is_contiguous() or not scale.is_contiguous() or x.shape[-1] != weight.shape[1]):
        raise ValueError("gemm_int8 takes float32 or bfloat16 rows by a contiguous int8 matrix with bfloat16 scales")
    return _prompt(library().gemm_int8, x, weight, scale, weight.shape[1], bias)


def gemm_q4(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, columns: int,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`gemv_q4`'s product for any number of rows (a prompt's), as :func:`gemm_int8` is :func:`gemv_int8`'s
    (``meshnet_gemm_q4``)."""
    if (x.dtype not in _DTYPES or packed.dtype != torch.uint8 or scale.dtype != torch.float16 or columns % 32
            or packed.shape[1] * 2 != columns or scale.shape != (packed.shape[0], columns // 32)
            or not packed.is_contiguous() or not scale.is_contiguous() or x.shape[-1] != columns):
        raise ValueError("gemm_q4 takes float32 or bfloat16 rows by a contiguous 4-bit matrix with float16 scales")
    return _prompt(library().gemm_q4, x, packed, scale, columns, bias)


def _prompt(product, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, columns: int,
            bias: torch.Tensor | None) -> torch.Tensor:
    x, bias, y, rows = _rows_by(x, bias, weight.shape[0], columns)
    work = torch.empty(rows * (library().q8_floats(columns) + columns // 32), dtype=torch.float32)  # rows quantized
    product(weight.data_ptr(), scale.data_ptr(), x.data_ptr(), _pointer(bias), y.data_ptr(), rows, weight.shape[0],
            columns, _DTYPES[x.dtype], work.data_ptr())
    return y


def gemv_q4(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, columns: int,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` by the 4-bit matrix ``packed [out, columns / 2]`` with float16 block scales ``scale [out, columns / 32]``
    (:mod:`daemon.model.int4`), in ``x``'s dtype (float32 or bfloat16), at most :data:`MAX_ROWS` rows: each row of
    ``x`` quantized as :func:`gemv_int8` quantizes it, the products exact integer sums per block of 32, each block's
    scaled in float32."""
    lib = library()
    if (x.dtype not in _DTYPES or packed.dtype != torch.uint8 or scale.dtype != torch.float16 or columns % 32
            or packed.shape[1] * 2 != columns or scale.shape != (packed.shape[0], columns // 32)
            or not packed.is_contiguous() or not scale.is_contiguous() or x.shape[-1] != columns
            or x.numel() > MAX_ROWS * columns):
        raise ValueError("gemv_q4 takes float32 or bfloat16 rows by a contiguous 4-bit matrix with float16 scales")
    x, bias, y, rows = _rows_by(x, bias, packed.shape[0], columns)
    lib.gemv_q4(packed.data_ptr(), scale.data_ptr(), x.data_ptr(), _pointer(bias), y.data_ptr(), rows,
                packed.shape[0], columns, _DTYPES[x.dtype], scratch(rows * lib.q8_floats(columns)))
    return y


def gemv_pairs_q4(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
    """Row ``p`` of ``x [pairs, in]`` by 4-bit matrix ``which[p]`` of the stack ``packed [matrices, out, in / 2]``
    with scales ``scale [matrices, out, in / 32]`` (a mixture-of-experts layer's 4-bit experts), each output row
    :func:`gemv_q4`'s for that row and matrix bit for bit, all in one call; ``which`` holds int64 indices."""
    lib = library()
    count, out, half = packed.shape
    columns = half * 2
    x = x.contiguous()
    pairs = x.shape[0]
    if (x.dtype not in _DTYPES or packed.dtype != torch.uint8 or scale.dtype != torch.float16 or columns % 32
            or scale.shape != (count, out, columns // 32) or not packed.is_contiguous() or not scale.is_contiguous()
            or x.dim() != 2 or x.shape[1] != columns or pairs > MAX_ROWS or which.dtype != torch.int64
            or which.numel() != pairs):
        raise ValueError(f"gemv_pairs_q4 takes up to {MAX_ROWS} float32 or bfloat16 rows, one int64 index each, by a "
                         "contiguous 4-bit stack with float16 scales")
    which = which.contiguous()
    y = torch.empty(pairs, out, dtype=x.dtype)
    lib.gemv_pairs_q4(packed.data_ptr(), scale.data_ptr(), which.data_ptr(), pairs, x.data_ptr(), y.data_ptr(), out,
                      columns, _DTYPES[x.dtype], scratch(pairs * lib.q8_floats(columns)))
    return y


def dequantize_q4(packed: torch.Tensor, scale: torch.Tensor, columns: int, first: int, last: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """Rows ``first..last`` of a 4-bit matrix (as :func:`gemv_q4` takes it) as weights in ``dtype``."""
    if dtype not in _DTYPES or not 0 <= first <= last <= packed.shape[0]:
        raise ValueError(f"dequantize_q4 gives float32 or bfloat16 rows of {packed.shape[0]}")
    y = torch.empty(last - first, columns, dtype=dtype)
    library().dequantize_q4(packed.data_ptr(), scale.data_ptr(), y.data_ptr(), first, last - first, columns,
                            _DTYPES[dtype])
    return y


def _rows_by(x: torch.Tensor, bias: torch.Tensor | None, out_features: int, in_features: int):
    """What a product of ``x`` by a matrix of ``out_features`` rows of ``in_features`` weights passes the library:
    ``x`` contiguous, the bias contiguous in ``x``'s dtype, the output to fill, and the row count."""
    x = x.contiguous()
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        bias = bias.to(x.dtype).contiguous()
    y = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype)
    return x, bias, y, x.numel() // in_features


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return tensor.data_ptr() if tensor is not None else None


_scratch_buffers = threading.local()  # per thread: a float32 copy of bfloat16 inputs, grown as needed


def scratch(count: int) -> int:
    """The address of this thread's float32 scratch of at least ``count`` floats, for one native call at a time."""
    buffer = getattr(_scratch_buffers, "buffer", None)
    if buffer is None or buffer.numel() < count:
        buffer = _scratch_buffers.buffer = torch.empty(max(count, 1 << 14), dtype=torch.float32)
    return buffer.data_ptr()
