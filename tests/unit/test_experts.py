"""A decode step's routed experts one by one (``daemon.model.experts``): ``grouped_mm``'s result bit for bit,
for one token, for tokens sharing an expert, and past the pairs it takes (where it hands over)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.integrations.moe import grouped_mm_experts_forward
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from daemon.model import experts as decode_experts
from daemon.model import native
from daemon.model.experts import MAX_PAIRS, decode_experts_forward


def _experts(dtype: torch.dtype) -> torch.nn.Module:
    config = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4)
    module = Qwen3MoeExperts(config).to(dtype)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return module


def _routing(tokens: int, top_k: int, experts: int, seed: int, shared: bool = False):
    generator = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    if shared:  # every token routed to expert 3 in one slot: an expert with several rows
        index[:, 0] = 3
        index[:, 1:] = torch.where(index[:, 1:] == 3, 15, index[:, 1:])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=generator), dim=-1)
    return index, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "top_k", "shared"), [(1, 4, False), (2, 4, False), (4, 2, True)])
def test_routed_experts_one_by_one_equal_grouped_mm(dtype, tokens, top_k, shared):
    assert tokens * top_k <= MAX_PAIRS  # computed one by one, not handed to grouped_mm
    module = _experts(dtype)
    hidden = torch.randn(tokens, 64).to(dtype)
    index, weights = _routing(tokens, top_k, 16, seed=tokens, shared=shared)
    with torch.inference_mode():
        want = grouped_mm_experts_forward(module, hidden, index, weights)
        got = decode_experts_forward(module, hidden, index, weights)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


def test_more_pairs_than_it_takes_go_to_grouped_mm(monkeypatch):
    module = _experts(torch.float32)
    tokens = MAX_PAIRS // 4 + 1
    handed = []
    monkeypatch.setattr(decode_experts, "grouped_mm_experts_forward",
                        lambda *args: handed.append(args[1].shape[0]) or grouped_mm_experts_forward(*args))
    index, weights = _routing(tokens, 4, 16, seed=9)
    decode_experts_forward(module, torch.randn(tokens, 64), index, weights)
    assert handed == [tokens]
    decode_experts_forward(module, torch.randn(1, 64), *_routing(1, 4, 16, seed=1))
    assert handed == [tokens]  # one token's 4 pairs: computed here


def test_planned_kernels_compute_the_same_products_within_rounding():
    from daemon.model.kernels import KERNELS, Plan, onednn_available

    module = _experts(torch.float32)
    hidden = torch.randn(2, 64)
    index, weights = _routing(2, 4, 16, seed=5)
    kernel = "onednn" if onednn_available() else KERNELS[0]
    module.meshnet_plans = (Plan(False, (kernel,) * 3), Plan(False, (kernel,) * 3))
    with torch.inference_mode():
        want = grouped_mm_experts_forward(module, hidden, index, weights)
        got = decode_experts_forward(module, hidden, index, weights)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_expert_plans_choose_kernels_in_the_layout_the_experts_have(monkeypatch):
    from daemon.model import kernels
    from daemon.model.experts import NAME, plan_experts

    module = _experts(torch.bfloat16)
    module.config._experts_implementation = NAME
    timed_layouts = set()

    def fake(weights, x, kernel):  # oneDNN a third faster for gate/up ([64, 64] per expert), no faster for down
        timed_layouts.add("transposed" if weights[0].stride(0) == 1 else "plain")
        fast = kernel == "onednn" and weights[0].shape == (64, 64)
        return 2.0 if fast else 3.0
    monkeypatch.setattr(kernels, "_time", fake)
    monkeypatch.setattr(kernels, "onednn_available", lambda: True)
    plans = plan_experts([torch.nn.Linear(4, 4), module], max_rows=1)
    assert set(plans) == {(64, 64, "bfloat16"), (64, 32, "bfloat16")}
    gate_up, down = module.meshnet_plans
    assert gate_up.kernels == ("onednn",) and down.kernels == ("blas",)
    assert not gate_up.transposed and not down.transposed and timed_layouts == {"plain"}
    assert module.gate_up_proj.is_contiguous()  # the fused tensor is left as it was


@pytest.mark.skipif(native.library() is None, reason="gemv.c does not build here (no C compiler)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "top_k", "shared"), [(1, 4, False), (4, 2, True)])
def test_experts_planned_on_gemv_run_in_one_call_per_matrix(monkeypatch, dtype, tokens, top_k, shared):
    """Every pair's product in one call (``native.gemv_pairs``): each output gemv's for that row and expert."""
    from daemon.model.kernels import Plan

    module = _experts(dtype)
    module.meshnet_plans = (Plan(False, ("gemv",) * 3), Plan(False, ("gemv",) * 3))
    hidden = torch.randn(tokens, 64).to(dtype)
    index, weights = _routing(tokens, top_k, 16, seed=7, shared=shared)
    calls = []
    pairs = native.gemv_pairs
    monkeypatch.setattr(native, "gemv_pairs", lambda *args: calls.append(args[0].shape[0]) or pairs(*args))
    with torch.inference_mode():
        got = decode_experts_forward(module, hidden, index, weights)
        assert calls == [tokens * top_k] * 2
        # the same products pair by pair
        per_expert = torch.zeros(tokens * top_k, 64, dtype=dtype)
        flat = index.reshape(-1)
        for pair, expert in enumerate(flat.tolist()):
            x = hidden[pair // top_k:pair // top_k + 1]
            h = module._apply_gate(native.gemv(x, module.gate_up_proj[expert]))
            per_expert[pair] = native.gemv(h, module.down_proj[expert])[0]
    want = (per_expert * weights.reshape(-1).unsqueeze(-1)).view(tokens, top_k, -1).sum(dim=1).to(dtype)
    assert torch.equal(got, want)


@pytest.mark.parametrize("norm", [True, False])
def test_routers_take_their_planned_kernel(monkeypatch, norm):
    """A router's product by its plan's kernel: transformers' kernel gives its own forward bit for bit, gemv.c the
    same experts and weights within rounding."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from daemon.model import kernels
    from daemon.model.experts import plan_experts

    config = Qwen3MoeConfig(hidden_size=64, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm)
    router = Qwen3MoeTopKRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 64, generator=torch.Generator().manual_seed(3)))
    own = router.forward
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    kernel = {"kernel": "blas"}
    monkeypatch.setattr(kernels, "_time", lambda weights, x, k: 1.0 if k == kernel["kernel"] else 2.0)
    plans = plan_experts([router], max_rows=1)
    assert set(plans) == {(16, 64, "float32")} and router.meshnet_plan.kernels == ("blas",)
    with torch.inference_mode():
        for got, want in zip(router(hidden), own(hidden)):
            assert torch.equal(got, want)
        if native.library() is not None:
            router.meshnet_plan = kernels.Plan(False, ("gemv",))
            got, want = router(hidden), own(hidden)
            assert torch.equal(got[2], want[2])  # the same experts
            for g, w in zip(got[:2], want[:2]):
                assert (g - w).abs().max() <= 1e-5 * w.abs().max()
