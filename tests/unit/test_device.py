"""``--device`` and ``--dtype`` resolved against this machine (which has no GPU: the CPU path runs everywhere)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from daemon.errors import ModelUnavailable
from daemon.model.device import (
    checkpoint_dtype,
    computes,
    computes_bfloat16,
    dtype_name,
    resolve_device,
    resolve_dtype,
)


def test_auto_takes_a_gpu_only_where_torch_sees_one():
    expected = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_an_absent_cuda_device_is_a_clear_error(name):
    with pytest.raises(ModelUnavailable, match=f"--device {name}: torch sees no CUDA device"):
        resolve_device(name)


@pytest.mark.parametrize("name", ["gpu", "cuda:", "CPU", "cuda:x"])
def test_a_device_torch_does_not_name_is_refused(name):
    with pytest.raises(ModelUnavailable, match="--device must be auto, cpu, cuda, cuda:N or mps"):
        resolve_device(name)


def test_auto_keeps_the_checkpoint_dtype_where_the_device_computes_it(tmp_path):
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu, "float32") == torch.float32  # nothing to convert, generate's own tokens
    assert resolve_dtype("auto", cpu, "bfloat16") == (torch.bfloat16 if computes_bfloat16(cpu) else torch.float32)
    float16 = torch.float16 if computes(torch.float16, cpu) else resolve_dtype("auto", cpu)
    assert resolve_dtype("auto", cpu, "float16") == float16
    (tmp_path / "config.json").write_text('{"model_type": "llama", "dtype": "bfloat16"}')
    assert checkpoint_dtype(tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_5", "text_config": {"torch_dtype": "float16"}}')
    assert checkpoint_dtype(tmp_path) == "float16"
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert checkpoint_dtype(tmp_path) is None


def test_auto_dtype_is_bfloat16_where_the_device_computes_it():
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if computes_bfloat16(cpu) else torch.float32)
    assert resolve_dtype("auto", torch.device("mps")) == torch.float16  # MPS: half precision is its own
    for name in ("float32", "bfloat16", "float16"):
        assert dtype_name(resolve_dtype(name, cpu)) == name
    with pytest.raises(ModelUnavailable, match="--dtype must be"):
        resolve_dtype("int8", cpu)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_meshd_on_an_absent_device_says_so_in_one_line(tmp_path, tiny_model):
    result = subprocess.run([sys.executable, "-m", "daemon.cli", "--model", str(tiny_model("llama")),
                             "--device", "cuda", "--port", "1"], capture_output=True, text=True, timeout=120,
                            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert result.returncode == 1 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("meshd: error: --device cuda: torch sees no CUDA device"), result.stderr
