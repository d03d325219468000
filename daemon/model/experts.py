"""A decode step's routed experts, multiplied expert by expert: transformers' ``grouped_mm`` arithmetic, without
its walk over every expert.

transformers 5 runs a mixture-of-experts layer's experts as ``grouped_mm`` by default: it sorts the step's
(token, expert) pairs by expert, counts them per expert with a histogram, and hands PyTorch's grouped product
offsets over *all* the layer's experts. On a CPU that product walks every expert, 256 in Qwen3.5-MoE, to
multiply the 8 a one-token step routed to, and the bookkeeping around it is a dozen more ops. For a few pairs
:func:`decode_experts_forward` makes the same products directly: for each expert the step selected, its
tokens by its gate/up matrix (``F.linear``, the same BLAS product ``grouped_mm`` makes per expert), the
model's own gate, the down product; then each pair's output times its routing weight, summed over a token's
pairs in ``grouped_mm``'s order and dtypes. The result is ``grouped_mm``'s bit for bit (the architecture
matrix compares every MoE model's tokens and logits with ``generate``'s). Prompts (more than
:data:`MAX_PAIRS` pairs) and expert layouts it does not know run ``grouped_mm`` itself.

On Qwen3.5-MoE-shaped layers (2 layers, 256 experts, 8 routed) a one-node decode step took 35.1-36.1 ms
this way against 37.0-37.9 ms through ``grouped_mm``, with the same tokens.

With weight plans (:func:`plan_experts`, ``--tune-kernels on``) each expert matrix shape also gets the kernel
measured fastest for its row count, as a plain ``nn.Linear`` does (:mod:`daemon.model.kernels`), in the layout
it has: laying a fused tensor out anew would hold it twice for a moment. On a 2-core Xeon one row by a
1024x2048 bfloat16 gate/up matrix took 0.364 ms with MKL and 0.269 ms with oneDNN; the plan then moves logits
by rounding, as every bfloat16 plan may (ADR-0039). Where every product of the step is planned on ``gemv.c``,
the step makes each matrix's products for all its pairs in one call (``native.gemv_pairs``: one parallel region
and one Python call in place of one per expert), each output the one a call per expert makes, bit for bit.
"""

from __future__ import annotations

import types

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward

from daemon.model import native
from daemon.model.kernels import Plan, measured_plans, plannable_dtype, product, weight_shape

NAME = "meshnet_decode"  # the experts implementation's name in transformers' registry
# more (token, expert) pairs than this (a prompt, a batch of sessions) take grouped_mm's grouped product: on a Zen 4 a
# 9-token prompt's 18 pairs one by one came out a float rounding away from grouped_mm's (the tiny MoE models' tail
# logits); a decode step's pairs (up to 8 routed experts) are grouped_mm's bit for bit on both CPUs measured
MAX_PAIRS = 8


def known_layout(experts: torch.nn.Module) -> bool:
    """Experts kept as ``grouped_mm`` keeps Qwen-style ones: one ``[experts, 2 * intermediate, hidden]`` gate/up
    tensor (gate then up), ``[experts, hidden, intermediate]`` down, no biases, no norm after each expert."""
    return (getattr(experts, "has_gate", False) and getattr(experts, "is_concatenated", False)
            and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)  # not quantized to int4
            and not experts.has_bias and not experts.is_transposed and not experts.has_post_expert_norm
            and not experts._is_expert_parallel)


def decode_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """``grouped_mm_experts_forward``'s result for ``hidden_states [tokens, hidden]`` routed to ``top_k_index``
    with ``top_k_weights`` (both ``[tokens, top_k]``), one selected expert at a time."""
    tokens, top_k = top_k_index.shape
    if tokens * top_k > MAX_PAIRS or not known_layout(self):
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    pairs_of = pairs_by_expert(top_k_index)
    weight_dtype = self.gate_up_proj.dtype
    plans = getattr(self, "meshnet_plans", None)  # (gate/up, down), set by plan_experts
    if _all_native(self, plans, pairs_of):
        which = top_k_index.reshape(-1)
        x = hidden_states.to(weight_dtype).repeat_interleave(top_k, dim=0)  # pair p's row: its token's
        h = native.gemv_pairs(self._apply_gate(native.gemv_pairs(x, self.gate_up_proj, which)), self.down_proj, which)
        return weigh_pairs(h, top_k_weights, hidden_states.dtype)
    out = torch.empty(tokens * top_k, hidden_states.shape[-1], dtype=weight_dtype, device=hidden_states.device)
    for expert, pairs in pairs_of.items():
        if len(pairs) == 1:  # one token: rows by slicing, as the grouped product takes them
            token = pairs[0] // top_k
            x = hidden_states[token:token + 1]
        else:
            x = hidden_states[[pair // top_k for pair in pairs]]
        h = self._apply_gate(_product(x.to(weight_dtype), self.gate_up_proj[expert], plans, 0))
        h = _product(h, self.down_proj[expert], plans, 1)
        if len(pairs) == 1:
            out[pairs[0]:pairs[0] + 1] = h
        else:
            out[pairs] = h
    return weigh_pairs(out, top_k_weights, hidden_states.dtype)


def pairs_by_expert(top_k_index: torch.Tensor) -> dict[int, list[int]]:
    """Each expert a step routes to, with its (token, expert) pairs ``token * top_k + slot`` in order."""
    pairs_of: dict[int, list[int]] = {}
    for pair, expert in enumerate(top_k_index.reshape(-1).tolist()):
        pairs_of.setdefault(expert, []).append(pair)
    return pairs_of


def weigh_pairs(out: torch.Tensor, top_k_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each pair's output row ``out [tokens * top_k, hidden]`` times its routing weight (in the weight's dtype,
    as ``grouped_mm``'s), summed over a token's pairs in order, in ``dtype``."""
    tokens, top_k = top_k_weights.shape
    weighted = out * top_k_weights.reshape(-1).unsqueeze(-1)
    return weighted.view(tokens, top_k, -1).sum(dim=1).to(dtype)


def _all_native(experts: torch.nn.Module, plans: tuple[Plan, Plan] | None, pairs_of: dict[int, list[int]]) -> bool:
    """Whether every product of the step is planned on ``gemv.c`` (each expert's for as many rows as its pairs): then
    one call makes each matrix's products for all the pairs, the same outputs as one call per expert. (A plan
    offers gemv.c only where it is built and takes the weights' dtype; a step's pairs are within its rows.)"""
    if plans is None or not (experts.gate_up_proj.is_contiguous() and experts.down_proj.is_contiguous()):
        return False
    counts = {len(pairs) for pairs in pairs_of.values()}
    return all(plan.kernel(n) == "gemv" for plan in plans for n in counts)


def use_decode_experts(model: torch.nn.Module) -> bool:
    """Run ``model``'s experts through :func:`decode_experts_forward` where it runs transformers' ``grouped_mm``
    (whose arithmetic it repeats); any other implementation (``eager`` sums in another order) is left as it is.
    Returns whether it switched."""
    config = getattr(model, "config", None)
    if getattr(config, "_experts_implementation", None) != "grouped_mm" or not hasattr(
            model, "set_experts_implementation"):
        return False
    ALL_EXPERTS_FUNCTIONS.register(NAME, decode_experts_forward)
    model.set_experts_implementation(NAME)
    return config._experts_implementation == NAME


def _product(x: torch.Tensor, weight: torch.Tensor, plans: tuple[Plan, Plan] | None, which: int) -> torch.Tensor:
    return product(x, weight, None, plans[which].kernel(x.shape[0]) if plans is not None else "blas")


def plan_experts(modules, *, max_rows: int, store=None) -> dict[tuple, Plan]:
    """Measure (or read from ``store``) a kernel plan per expert matrix shape of the experts among ``modules``
    that :func:`decode_experts_forward` runs, and per router weight shape of the routers it knows
    (:data:`ROUTER_CLASSES`), for products of up to ``max_rows`` rows, and attach it to them. Returns the plans by
    ``(out, in, dtype)``."""
    experts = [m for m in modules if known_layout(m) and getattr(m.config, "_experts_implementation", None) == NAME
               and m.gate_up_proj.device.type == "cpu" and plannable_dtype(m.gate_up_proj.dtype)]
    weights: dict[tuple, list[torch.Tensor]] = {}
    for module in experts:
        for tensor in (module.gate_up_proj, module.down_proj):
            weights.setdefault(weight_shape(tensor[0]), []).extend(tensor.detach().unbind(0))
    routers = [m for m in modules if type(m).__name__ in ROUTER_CLASSES and m.weight.device.type == "cpu"
               and plannable_dtype(m.weight.dtype) and m.weight.is_contiguous()]
    for module in routers:
        weights.setdefault(weight_shape(module.weight), []).append(module.weight.detach())
    plans = measured_plans(weights, max_rows=max_rows, store=store, plain_only=True)
    for module in experts:
        module.meshnet_plans = (plans[weight_shape(module.gate_up_proj[0])], plans[weight_shape(module.down_proj[0])])
    for module in routers:
        module.meshnet_plan = plans[weight_shape(module.weight)]
        module.forward = types.MethodType(planned_router_forward, module)
    return plans


# the top-k routers whose forward planned_router_forward repeats: softmax over experts in float32, the top k,
# normalised (Qwen3-MoE and Qwen3-Next where norm_topk_prob says so, Qwen3.5-MoE always)
ROUTER_CLASSES = frozenset({"Qwen3MoeTopKRouter", "Qwen3NextTopKRouter", "Qwen3_5MoeTopKRouter"})


def planned_router_forward(self: torch.nn.Module, hidden_states: torch.Tensor):
    """The router's own forward with its product by the kernel its plan chose (a 256x2048 bfloat16 router took
    0.27 ms of a Qwen3.5-MoE-shaped decode step through MKL, 0.04 ms standalone through ``gemv.c``)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = product(hidden_states, self.weight, None, self.meshnet_plan.kernel(hidden_states.shape[0]))
    router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    return router_logits, router_top_value.to(router_logits.dtype), router_indices
