"""How far ahead the native kernels ask for weights (``daemon.model.prefetch``): the same products either way, the
faster setting kept per machine, and a node's choice remembered beside its kernel plans."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from daemon.model import int4, native, prefetch
from daemon.model.kernels import PlanStore
from daemon.model.quantize import Int8WeightLinear

needs_library = pytest.mark.skipif(native.library() is None, reason="no C compiler here: nothing asks ahead")


@pytest.fixture
def library():
    """The native library, its settings put back afterwards (they are the process's)."""
    lib = native.library()
    before, four_tall = {kind: lib.ahead(kind) for kind in prefetch.KINDS.values()}, lib.four_tall()
    yield lib
    for kind, value in before.items():
        lib.set_ahead(kind, value)
    lib.set_four_tall(four_tall)


def _products(dtype_or_kind: str):
    """One row by a weight of each kind, through the kernels a decode step uses."""
    torch.manual_seed(0)
    linear = nn.Linear(3000, 40)
    if dtype_or_kind == "int8":
        module = Int8WeightLinear(linear)
        x = torch.randn(3, 3000)
        return lambda: module(x)
    if dtype_or_kind == "int4":
        module = int4.Int4WeightLinear(nn.Linear(4096, 40))
        x = torch.randn(3, 4096)
        return lambda: module(x)
    dtype = getattr(torch, dtype_or_kind)
    weight, x = linear.weight.detach().to(dtype).contiguous(), torch.randn(3, 3000).to(dtype)
    return lambda: native.gemv(x, weight)


@needs_library
@pytest.mark.parametrize("kind", list(prefetch.KINDS))
def test_asking_ahead_or_not_the_products_are_the_same_bit_for_bit(library, kind):
    product = _products(kind)
    outputs = []
    for value in (0, 2048, 4096, 64):
        library.set_ahead(prefetch.KINDS[kind], value)
        assert library.ahead(prefetch.KINDS[kind]) == value
        outputs.append(product())
    assert all(torch.equal(outputs[0], out) for out in outputs[1:])


@needs_library
def test_a_setting_out_of_range_is_ignored_and_a_negative_one_is_none(library):
    library.set_ahead(0, -5)
    assert library.ahead(0) == 0
    library.set_ahead(7, 4096)  # no such kind: nothing changes
    assert library.ahead(7) == -1 and [library.ahead(k) for k in range(4)].count(4096) == 0


@pytest.mark.parametrize("off, on, expected", [(0.002, 0.004, 0), (0.004, 0.002, 2048), (0.0045, 0.004, 2048)])
def test_a_setting_is_turned_off_only_where_off_is_faster_by_the_margin(monkeypatch, off, on, expected):
    """(Sleeps stand for products: a slower host oversleeps both alike.) A fake library takes the settings."""
    settings = {1: 1024}

    class Library:
        def set_ahead(self, kind, value):
            settings[kind] = value

        def ahead(self, kind):
            return settings[kind]

        set_four_tall = four_tall = None

    monkeypatch.setattr(native, "library", Library)
    monkeypatch.setattr(prefetch, "ROUNDS", 3)
    monkeypatch.setattr(prefetch, "_products_by_kind",
                        lambda modules: {"bfloat16": [lambda: time.sleep({0: off, 2048: on}.get(settings[1], 0.0))]})
    said = []
    assert prefetch.plan_prefetch([], progress=said.append) == {"bfloat16": expected}
    assert settings[1] == expected
    ratio = float(said[0].split("off took ")[1].split(" ")[0])
    assert ratio == pytest.approx(off / on, rel=0.4)


def test_comparing_leaves_the_setting_as_it_found_it():
    seen = []
    ratio = prefetch.compare(seen.append, 7, [lambda: None], on=2048, rounds=3)
    assert seen[-1] == 7 and set(seen[:-1]) == {0, 2048} and ratio > 0


@needs_library
def test_a_node_measures_each_kind_it_holds_once_and_remembers_it(library, tmp_path, monkeypatch):
    monkeypatch.setattr(prefetch, "SAMPLE_BYTES", 1 << 20)
    floats = [nn.Linear(1024, 512) for _ in range(2)]  # 4 MiB of float32 weights
    small = Int8WeightLinear(nn.Linear(256, 64))  # 16 KiB of int8: too little to stream from memory
    store = PlanStore(tmp_path / "plans.json")
    library.set_ahead(prefetch.KINDS["int8"], 1024)
    said = []
    chosen = prefetch.plan_prefetch([*floats, small], store=store, progress=said.append)
    key = f"prefetch float32 threads {torch.get_num_threads()}"
    assert set(chosen) == {"float32"} and chosen["float32"] in (0, prefetch.AHEAD)
    assert library.ahead(prefetch.KINDS["float32"]) == chosen["float32"]
    assert library.ahead(prefetch.KINDS["int8"]) == 1024  # not measured, nothing remembered: left alone
    assert PlanStore(tmp_path / "plans.json").setting(key) == chosen["float32"]
    assert said and said[0].startswith("weights streamed: float32 ") and "of on's time" in said[0]

    # the next node on this machine takes what was measured, without timing again
    remembered = 0 if chosen["float32"] else prefetch.AHEAD
    store.remember(key, remembered)

    def no_timing(*_args, **_kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(prefetch, "compare", no_timing)
    assert prefetch.plan_prefetch(floats, store=PlanStore(tmp_path / "plans.json")) == {"float32": remembered}
    assert library.ahead(prefetch.KINDS["float32"]) == remembered


@needs_library
def test_experts_and_quantized_weights_are_sampled_by_their_kind(monkeypatch):
    monkeypatch.setattr(prefetch, "SAMPLE_BYTES", 64 << 10)
    packed = int4.Int4WeightLinear(nn.Linear(4096, 64))  # 128 KiB of 4-bit values
    int8 = Int8WeightLinear(nn.Linear(512, 64))  # 32 KiB: under the sample
    bf16 = nn.Linear(512, 256).to(torch.bfloat16)  # 256 KiB
    samples = prefetch._products_by_kind([packed, int8, bf16, bf16])
    assert set(samples) == {"int4", "int8", "bfloat16"}
    assert samples["int8"] is None
    assert len(samples["int4"]) == 1 and len(samples["bfloat16"]) == 1  # one module counted once
    for sample in (samples["int4"], samples["bfloat16"]):
        sample[0]()  # each product runs


def test_without_the_library_nothing_is_set(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "library", lambda: None)
    store = PlanStore(tmp_path / "plans.json")
    assert prefetch.plan_prefetch([nn.Linear(1024, 1024)], store=store) == {}
    assert not (tmp_path / "plans.json").exists()


@needs_library
def test_a_tall_bfloat16_matrix_four_rows_at_a_time_or_one_gives_the_same_products(library):
    torch.manual_seed(0)
    weight = torch.randn(prefetch.TALL + 4, 96).to(torch.bfloat16)
    x = torch.randn(3, 96).to(torch.bfloat16)
    library.set_four_tall(1)
    four = native.gemv(x, weight)
    library.set_four_tall(0)
    assert library.four_tall() == 0
    assert torch.equal(native.gemv(x, weight), four)


@needs_library
def test_a_node_with_a_tall_bfloat16_matrix_times_it_four_rows_at_a_time_and_one(library, tmp_path, monkeypatch):
    monkeypatch.setattr(prefetch, "SAMPLE_BYTES", 1 << 20)
    head = nn.Linear(64, prefetch.TALL).to(torch.bfloat16)  # 2 MiB
    settings = prefetch.plan_prefetch([head], store=PlanStore(tmp_path / "plans.json"))
    assert set(settings) == {"bfloat16", "four tall"} and settings["four tall"] in (0, 1)
    assert library.four_tall() == settings["four tall"]
    key = f"four tall threads {torch.get_num_threads()}"
    assert PlanStore(tmp_path / "plans.json").setting(key) == settings["four tall"]
