"""Weight-only int8 against float ``nn.Linear`` for one decode step: batch 1, one token, on this CPU.

Prints one row per path, compute dtype and shape: the median milliseconds per call, the ratio to the
float32 ``nn.Linear`` of the same shape, and the host's load averages when the row was measured
(other processes on the host make every number noisy: compare rows measured under similar load).

Paths: ``nn.Linear`` in float32 and bfloat16; every int8 weight-only configuration of the installed
torchao that builds here (``Int8WeightOnlyConfig`` per row, per tensor, per group, its deprecated
version 1 where the installed torchao still has it; ``IntxWeightOnlyConfig`` with int8); and, for
reference, PyTorch's own CPU kernel for int8 weights, ``aten._weight_int8pack_mm``; last, meshd's
``int8`` method (daemon/model/quantize.py: that kernel in bfloat16, float32 inputs cast to it and back).

    .venv/bin/python scripts/int8_matmul.py                 # built-in model's shapes and a larger one
    .venv/bin/python scripts/int8_matmul.py --threads 2 --repeats 9
    PYTHONPATH=/tmp/torchao-0.17 .venv/bin/python scripts/int8_matmul.py   # another torchao version
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
import warnings
from collections.abc import Callable

import torch

# SmolLM2-135M's projections (q/o, up/gate, down) and a larger model's MLP
SHAPES = [(576, 576), (576, 1536), (1536, 576), (2048, 8192), (8192, 2048)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def torchao_configs() -> dict[str, Callable[[], object]]:
    """Every int8 weight-only configuration the installed torchao can build, by a readable name."""
    import inspect

    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, PerAxis, PerGroup, PerRow, PerTensor

    takes = inspect.signature(Int8WeightOnlyConfig).parameters
    configs: dict[str, Callable[[], object]] = {}

    def int8_weight_only(**kwargs) -> Callable[[], object]:
        return lambda: Int8WeightOnlyConfig(set_inductor_config=False, **kwargs)  # nothing here is compiled

    if "granularity" in takes:
        configs["Int8WeightOnly per-row"] = int8_weight_only(granularity=PerRow())
        configs["Int8WeightOnly per-tensor"] = int8_weight_only(granularity=PerTensor())
        configs["Int8WeightOnly per-group 64"] = int8_weight_only(granularity=PerGroup(64))
    if "version" in takes or "granularity" not in takes:
        # version 1 (AffineQuantizedTensor) is the only one before torchao 0.15 and gone in 0.18
        configs["Int8WeightOnly version 1"] = int8_weight_only(**({"version": 1} if "version" in takes else {}))
    configs["IntxWeightOnly int8 per-row"] = lambda: IntxWeightOnlyConfig(weight_dtype=torch.int8,
                                                                         granularity=PerAxis(0))
    configs["IntxWeightOnly int8 per-group 64"] = lambda: IntxWeightOnlyConfig(weight_dtype=torch.int8,
                                                                              granularity=PerGroup(64))
    return configs


def linear(in_features: int, out_features: int, dtype: torch.dtype) -> torch.nn.Linear:
    torch.manual_seed(0)  # every path of a shape quantizes the same weights
    return torch.nn.Linear(in_features, out_features, bias=False).to(dtype).eval()


def torchao_path(config: Callable[[], object]) -> Callable:
    def build(in_features: int, out_features: int, dtype: torch.dtype) -> Callable:
        from torchao.quantization import quantize_

        module = linear(in_features, out_features, dtype)
        quantize_(module, config())
        return module

    return build


def float_path(in_features: int, out_features: int, dtype: torch.dtype) -> Callable:
    return linear(in_features, out_features, dtype)


def aten_int8pack_path(in_features: int, out_features: int, dtype: torch.dtype) -> Callable:
    """PyTorch's CPU int8-weight kernel on torchao's per-row int8 data and scales."""
    from torchao.quantization import Int8Tensor, PerRow

    weight = Int8Tensor.from_hp(linear(in_features, out_features, dtype).weight.detach(), PerRow())
    qdata, scale = weight.qdata.contiguous(), weight.scale.flatten().to(dtype)
    return lambda x: torch._weight_int8pack_mm(x.reshape(-1, in_features), qdata, scale)


def meshnet_path(method: str) -> Callable:
    def build(in_features: int, out_features: int, dtype: torch.dtype) -> Callable:
        from daemon.model.quantize import quantize_layers

        module = torch.nn.Sequential(linear(in_features, out_features, dtype))
        quantize_layers([module], method)
        return module

    return build


def time_calls(run: Callable, x: torch.Tensor, *, repeats: int, calls: int, round_seconds: float) -> float:
    """Median milliseconds of one call over ``repeats`` rounds of up to ``calls`` calls (at least 3, and
    no more than ``round_seconds`` of calls: slow paths would otherwise take minutes), after a warm-up."""
    for _ in range(3):
        run(x)
    per_call = []
    for _ in range(repeats):
        round_began = time.perf_counter()
        for done in range(calls):
            began = time.perf_counter()
            run(x)
            per_call.append(time.perf_counter() - began)
            if done >= 2 and time.perf_counter() - round_began > round_seconds:
                break
    return statistics.median(per_call) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a meshd node runs one by default)")
    parser.add_argument("--repeats", type=int, default=7, help="rounds per row")
    parser.add_argument("--calls", type=int, default=50, help="timed calls per round, at most")
    parser.add_argument("--round-seconds", type=float, default=0.3, help="time per round, at most (3 calls at least)")
    args = parser.parse_args()

    # torchao logs, at import, that its CUDA-only extensions do not load on a CPU build of torch
    logging.getLogger("torchao").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*[Dd]eprecat")
    import torchao

    torch.set_num_threads(args.threads)
    paths: dict[str, Callable] = {"nn.Linear": float_path}
    paths |= {name: torchao_path(config) for name, config in torchao_configs().items()}
    paths["aten._weight_int8pack_mm"] = aten_int8pack_path
    paths["meshnet quantize_layers int8"] = meshnet_path("int8")
    print(f"torch {torch.__version__}, torchao {torchao.__version__}, {args.threads} thread(s), {os.cpu_count()} CPUs, "
          f"median of {args.repeats} rounds of up to {args.calls} calls or {args.round_seconds} s")
    print(f"{'path':34} {'compute':9} {'shape':>11} {'ms/call':>9} {'vs f32':>7}   load 1/5/15 min")
    with torch.inference_mode():
        for in_features, out_features in SHAPES:
            baseline = None
            for name, build in paths.items():
                for dtype_name, dtype in DTYPES.items():
                    x = torch.randn(1, 1, in_features, dtype=dtype)
                    try:
                        run = build(in_features, out_features, dtype)
                        run(x)
                    except Exception as exc:  # noqa: BLE001 - a path this host cannot run is a row too
                        print(f"{name:34} {dtype_name:9} {'':>11} fails: {type(exc).__name__}: {str(exc)[:60]}")
                        continue
                    ms = time_calls(run, x, repeats=args.repeats, calls=args.calls, round_seconds=args.round_seconds)
                    baseline = ms if (name, dtype) == ("nn.Linear", torch.float32) else baseline
                    load = "/".join(f"{v:.1f}" for v in os.getloadavg())
                    shape = f"{in_features}>{out_features}"
                    print(f"{name:34} {dtype_name:9} {shape:>11} {ms:9.3f} {ms / baseline:6.2f}x   {load}",
                          flush=True)


if __name__ == "__main__":
    main()
