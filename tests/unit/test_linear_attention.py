"""Qwen3.5's gated delta net, one position in one native call (``daemon.model.linear_attention``): within float
rounding of the layer's own forward, step after step, and only where it takes the step."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from daemon.model import native
from daemon.model.linear_attention import use_native_delta_steps
from tests.support.tiny_models import tiny_config

pytestmark = pytest.mark.skipif(native.library() is None, reason="gemv.c does not build here (no C compiler)")

# the largest logit difference over 16 steps, as a share of the logits' scale: float32 sums in another order; in
# bfloat16 that difference sometimes crosses a rounding of an activation (measured: 4e-7 and 6e-3)
BOUND = {torch.float32: 1e-5, torch.bfloat16: 0.02}


def _models(arch: str, dtype: torch.dtype, wide: bool):
    text = tiny_config(arch).text_config
    if wide:  # heads as wide as the released models' (128), four value heads on two key heads
        text.hidden_size, text.linear_key_head_dim, text.linear_value_head_dim = 256, 128, 128
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(text).to(dtype).eval()
    return model, copy.deepcopy(model)


class Counting:
    """The native library with its delta steps counted."""

    def __init__(self, lib) -> None:
        self.lib, self.calls = lib, 0

    def delta_step(self, *args) -> None:
        self.calls += 1
        self.lib.delta_step(*args)


def _count(model) -> Counting:
    counting = None
    for module in model.modules():
        if hasattr(module, "meshnet_delta"):
            lib, layer, keep, dtype = module.meshnet_delta
            counting = counting or Counting(lib)
            module.meshnet_delta = (counting, layer, keep, dtype)
    return counting


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("arch", "wide"), [("qwen3_5_moe", False), ("qwen3_5_moe", True), ("qwen3_5", False)])
def test_native_steps_follow_the_layers_own_forward(arch, dtype, wide):
    own, fast = _models(arch, dtype, wide)
    assert use_native_delta_steps(fast) == 3  # layers 0-2 are linear attention, 3 full attention
    counting = _count(fast)
    prompt = torch.randint(3, 1000, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        out_own, out_fast = own(prompt, use_cache=True), fast(prompt, use_cache=True)
        assert counting.calls == 0  # a prompt runs the layers' own forward
        assert torch.equal(out_own.logits, out_fast.logits)
        caches = out_own.past_key_values, out_fast.past_key_values
        token = out_own.logits[:, -1:].argmax(-1)
        worst = 0.0
        for _ in range(16):
            want = own(token, past_key_values=caches[0], use_cache=True).logits[0, -1].float()
            got = fast(token, past_key_values=caches[1], use_cache=True).logits[0, -1].float()
            worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
            assert got.argmax() == want.argmax()
            token = want.argmax().view(1, 1)
    assert counting.calls == 16 * 3
    assert worst <= BOUND[dtype]
    for i in range(3):  # the states the next step starts from: float32 in both
        want, got = (c.layers[i].recurrent_states[0] for c in caches)
        assert got.dtype == torch.float32 and (got - want).abs().max() <= 1e-5 * want.abs().max()
        want, got = (c.layers[i].conv_states[0] for c in caches)  # the convolution's window of inputs
        assert got.dtype == dtype and (got.float() - want.float()).abs().max() <= BOUND[dtype] * want.abs().max()


def test_steps_it_does_not_take_run_the_layers_own_forward():
    own, fast = _models("qwen3_5_moe", torch.float32, wide=False)
    use_native_delta_steps(fast)
    counting = _count(fast)
    two = torch.randint(3, 1000, (2, 1), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert torch.equal(fast(two).logits, own(two).logits)  # a batch of two, no cache
    assert counting.calls == 0


def test_layers_of_another_form_are_left_as_they_are():
    _, fast = _models("qwen3_5_moe", torch.float32, wide=False)
    layers = [m for m in fast.modules() if type(m).__name__ == "Qwen3_5MoeGatedDeltaNet"]
    layers[0].conv1d.bias = torch.nn.Parameter(torch.zeros(layers[0].conv1d.out_channels))
    assert use_native_delta_steps(fast) == 2
    assert not hasattr(layers[0], "meshnet_delta") and hasattr(layers[1], "meshnet_delta")
