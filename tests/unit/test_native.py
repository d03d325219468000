"""The native products (``daemon/model/gemv.c`` through ``daemon.model.native``), built on this machine.

Each output is a dot product summed in float32 in a fixed order, so results stay within float rounding of
``F.linear``'s, do not depend on the thread count, and a machine without a C compiler plans without them.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from daemon.model import kernels, native
from tests.support.q8 import int8_product

needs_library = pytest.mark.skipif(native.library() is None, reason="no C compiler here: the fallback is tested below")


@needs_library
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 33, 1000, 8200: not a multiple of 32; 8200: rows long enough to be taken four at a time
@pytest.mark.parametrize("shape", [(160, 96), (7, 33), (1536, 576), (3, 1000), (6, 8200)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_computes_f_linears_products_within_rounding(dtype, shape, bias):
    torch.manual_seed(0)
    out_features, in_features = shape
    weight = torch.randn(out_features, in_features).to(dtype)
    b = torch.randn(out_features).to(dtype) if bias else None
    for rows in (1, 2, 5, 16):
        x = torch.randn(1, rows, in_features).to(dtype)
        assert native.supports(x, weight)
        got = native.gemv(x, weight, b)
        exact = F.linear(x.double(), weight.double(), b.double() if bias else None)  # the true products
        assert got.shape == (1, rows, out_features) and got.dtype == dtype
        scale = exact.abs().max()
        if dtype == torch.float32:
            assert (got.double() - exact).abs().max() <= 1e-6 * scale
        else:  # one rounding of each output to bfloat16 (8 bits of mantissa), as torch's own product
            assert (got.double() - exact).abs().max() <= 2 ** -8 * exact.abs().max()
            assert (got.double() - exact).abs().max() <= 2 * (F.linear(x, weight, b).double() - exact).abs().max()


@needs_library
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_product_does_not_depend_on_the_thread_count(dtype):
    torch.manual_seed(1)
    weight, x = torch.randn(1000, 300).to(dtype), torch.randn(3, 300).to(dtype)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(native.gemv(x, weight))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@needs_library
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_output_does_not_depend_on_the_rows_computed_beside_it(dtype):
    """Long rows go four at a time, short ones and a matrix's last few one at a time, and so do a tall bfloat16
    matrix's rows (an LM head's) by bfloat16 inputs: the same sums either way."""
    torch.manual_seed(3)
    for out_features, in_features in ((7, 100), (7, 9000), (16387, 40)):
        weight, x = torch.randn(out_features, in_features).to(dtype), torch.randn(1, in_features).to(dtype)
        together = native.gemv(x, weight)
        alone = torch.cat([native.gemv(x, weight[r:r + 3]) for r in range(0, out_features, 3)], dim=-1)
        assert torch.equal(together, alone)


@needs_library
@pytest.mark.parametrize("kind", ["float32", "int8", "int4"])
def test_a_rows_outputs_do_not_depend_on_the_rows_beside_it(kind):
    """A batch's rows (or a verify step's) go two at a time by four weight rows, their sums' chains side by side: each
    row's outputs are still the ones it gets alone, bit for bit, with or without a bias, whole blocks or a last
    partial one, an odd row out, a matrix's last few weight rows."""
    torch.manual_seed(4)
    for out_features, in_features in ((1536, 576), (30, 200), (7, 96), (9, 8200)):
        if kind == "int4" and in_features % 32:
            continue
        product = _product(kind, torch.randn(out_features, in_features))
        for rows in (2, 3, 8, 16):
            x = torch.randn(rows, in_features)
            for bias in (None, torch.randn(out_features)):
                together = product(x, bias)
                alone = torch.cat([product(x[m:m + 1], bias) for m in range(rows)])
                assert torch.equal(together, alone), (out_features, in_features, rows)


def _product(kind: str, weight: torch.Tensor):
    """``(x, bias) -> x`` by ``weight`` as ``kind`` keeps it (``weight``'s shape only, for int8)."""
    from daemon.model import int4

    if kind == "int8":
        q = torch.randint(-128, 128, weight.shape, dtype=torch.int8)
        scale = torch.rand(weight.shape[0]).bfloat16()
        return lambda x, bias: native.gemv_int8(x, q, scale, bias)
    if kind == "int4":
        packed, scale = int4.quantize(weight)
        return lambda x, bias: native.gemv_q4(x, packed, scale, weight.shape[1], bias)
    return lambda x, bias: native.gemv(x, weight, bias)


def assert_int8_products_as_defined(dtype):
    """Rows by int8 weights (-128 included) give tests/support/q8.py's products: whole blocks of 64 inputs and a
    last partial one, each row the same alone as beside others; the quantized inputs really are quantized. A
    prompt's rows (gemm_int8, in tiles of eight) too, each row's outputs whatever rows are beside it."""
    torch.manual_seed(2)
    for out_features, in_features in ((300, 200), (64, 576), (5, 1000)):
        q = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8)
        scale = (torch.rand(out_features) / 100).to(torch.bfloat16)
        bias = torch.randn(out_features)
        x = torch.randn(4, in_features).to(dtype)
        x[1, :64] = 0  # a block of zeros: d = 0
        want = int8_product(x, q, scale, bias)
        got = native.gemv_int8(x, q, scale, bias)
        assert got.dtype == dtype and got.shape == (4, out_features)
        bound = 2e-6 if dtype == torch.float32 else 2 ** -8  # float32 sums of exact block sums; a bfloat16 output
        assert (got.double() - want).abs().max() <= bound * want.abs().max()
        unquantized = F.linear(x.double(), q.double() * scale.double()[:, None], bias.double())
        assert (unquantized - want).abs().max() > 1e-4 * want.abs().max()  # the inputs' quantization shows
        alone = torch.cat([native.gemv_int8(x[m:m + 1], q, scale, bias) for m in range(4)])
        assert torch.equal(got, alone)
        prompt = torch.randn(21, in_features).to(dtype)  # a prompt's rows: two tiles of eight and a short one
        prompt[3, 64:128] = 0
        tiled = native.gemm_int8(prompt, q, scale, bias)
        want = int8_product(prompt, q, scale, bias)
        assert tiled.dtype == dtype and tiled.shape == (21, out_features)
        assert (tiled.double() - want).abs().max() <= bound * want.abs().max()
        assert torch.equal(native.gemm_int8(prompt[5:16], q, scale, bias), tiled[5:16])  # whatever rows beside it
    with pytest.raises(ValueError, match="int8"):
        native.gemv_int8(x, q.t(), scale)  # not contiguous rows
    with pytest.raises(ValueError, match="gemm_int8"):
        native.gemm_int8(x[:, 1:], q, scale)  # not the matrix's row length


@needs_library
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_weights_multiply_int8_inputs_as_defined(dtype):
    assert_int8_products_as_defined(dtype)


@needs_library
def test_without_avx512_the_plain_c_computes_the_same(rebuilt, monkeypatch):
    """Machines without AVX-512 VNNI (or AVX-512) build the plain C sums of the same quantized products (int8 and
    4-bit weights by int8 inputs), and the same greedy pick."""
    from tests.unit.test_int4 import assert_products_as_defined

    monkeypatch.setattr(native, "FLAGS", (*native.FLAGS, "-mno-avx512f"))
    assert native.library() is not None
    assert_int8_products_as_defined(torch.float32)
    assert_products_as_defined(torch.float32)
    assert_argmax_as_torch()


@needs_library
def test_what_it_does_not_take_is_not_offered():
    weight = torch.randn(64, 32)
    assert native.supports(torch.randn(1, 32), weight)
    assert not native.supports(torch.randn(1, 32), weight.t().contiguous().t())  # the transposed layout
    assert not native.supports(torch.randn(1, 32, dtype=torch.bfloat16), weight)  # mixed dtypes
    assert not native.supports(torch.randn(native.MAX_ROWS + 1, 32), weight)  # a prompt
    assert not native.supports(torch.randn(1, 32).half(), weight.half())
    assert "gemv" in kernels.available_kernels("plain") and "gemv" not in kernels.available_kernels("transposed")


@needs_library
def test_it_runs_on_torchs_own_openmp_threads():
    assert len(native._openmp_runtimes()) <= 1


def test_without_a_compiler_plans_choose_among_torchs_kernels(rebuilt, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger="daemon.model.native"):
        assert native.library() is None
    assert "native kernels unavailable" in caplog.text
    assert "gemv" not in kernels.available_kernels("plain")
    assert native.signature() == "none"
    x, weight = torch.randn(2, 32), torch.randn(64, 32)
    assert torch.equal(kernels.product(x, weight, None, "gemv"), F.linear(x, weight))  # a stored plan's "gemv"


def test_a_source_that_does_not_compile_is_said_in_one_line(rebuilt, monkeypatch, tmp_path, caplog):
    broken = tmp_path / "gemv.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(native, "SOURCE", broken)
    with caplog.at_level(logging.WARNING, logger="daemon.model.native"):
        assert native.library() is None
    assert "failed" in caplog.text and not list(rebuilt.glob("*.tmp"))  # no half-written library left behind


def test_turned_off_it_is_never_built(rebuilt, monkeypatch):
    monkeypatch.setenv(native.ENV, "off")
    assert native.library() is None
    assert not rebuilt.exists()


@needs_library
def test_it_is_built_once_per_machine(rebuilt):
    first = native.library()
    assert first is not None and first.path.parent == rebuilt
    built = first.path.stat().st_mtime_ns
    native.library.cache_clear()
    assert native.library().path == first.path and first.path.stat().st_mtime_ns == built


@needs_library
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "positions"),
                         [(4, 4, 16, 1), (32, 8, 128, 300), (16, 2, 256, 77)])
def test_one_query_attends_as_float32_sdpa(heads, kv_heads, dim, positions):
    """bfloat16 keys and values read where they lie (a growing cache's view, rows a capacity apart): float32 SDPA's
    output within float rounding, rounded to bfloat16."""
    generator = torch.Generator().manual_seed(positions)
    q = torch.randn(1, heads, 1, dim, generator=generator).to(torch.bfloat16)
    held = [torch.randn(1, kv_heads, positions + 10, dim, generator=generator).to(torch.bfloat16) for _ in range(2)]
    k, v = (t[:, :, :positions] for t in held)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=0.3,
                                          enable_gqa=heads != kv_heads).to(torch.bfloat16)
    got = native.attend_bf16(q, k, v, 0.3)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()
    assert native.attend_bf16(q.float(), k.float(), v.float(), 0.3) is None  # float32: SDPA's own
    assert native.attend_bf16(q, k, v.contiguous(), 0.3) is None  # keys and values laid out alike, or not here


def assert_argmax_as_torch() -> None:
    """``meshnet_argmax`` picks as ``torch.argmax`` (the first of equal largest values), over rows whose length is
    and is not a multiple of the vector width, and answers -1 for a NaN or an infinity wherever it lies."""
    generator = torch.Generator().manual_seed(11)
    for n in (1, 15, 16, 17, 1000, 49152, 49155):
        logits = torch.randn(n, generator=generator)
        assert native.argmax(logits) == int(torch.argmax(logits))
        for first, second in {(n - 1, n - 1), (0, n - 1), (n // 3, n // 2), (max(n - 2, 0), n - 1)}:
            tied = logits.clone()
            tied[first] = tied[second] = 9.0
            assert native.argmax(tied) == min(first, second) == int(torch.argmax(tied))
        for at in {0, n // 2, n - 1}:
            for bad in (float("nan"), float("inf"), float("-inf")):
                spoilt = logits.clone()
                spoilt[at] = bad
                assert native.argmax(spoilt) == -1, (n, at, bad)
    signed = torch.tensor([-1.0, -0.0, 0.0, -2.0])  # -0.0 == 0.0: the first of them, as torch picks
    assert native.argmax(signed) == int(torch.argmax(signed)) == 1


@needs_library
def test_a_greedy_pick_is_torchs_argmax_and_rejects_non_finite_logits():
    assert_argmax_as_torch()
    row = torch.randn(2, 64)
    assert native.argmax(row) is None  # one row
    assert native.argmax(row[:, 0]) is None  # not contiguous
    assert native.argmax(row[0].to(torch.bfloat16)) is None  # float32 only
