"""Shared fixtures: the built-in model (fetched and converted once per machine) and its reference."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# the test process computes references with torch next to daemons: never let them fight for cores
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The built-in SmolLM2-135M-Instruct as a safetensors folder (cached in the user cache)."""
    from daemon.model.source import resolve_model

    return resolve_model(None, progress=lambda line: print(f"[model] {line}"))


@pytest.fixture(scope="session")
def reference_models(default_model):
    """``reference_models(dtype)`` -> the whole model in this process in ``dtype`` ("float32", "bfloat16",
    "float16"), as transformers loads it, with its tokenizer: the references of the golden tests."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    models: dict = {}

    def load(dtype: str = "float32", quantize: str | None = None):
        if (dtype, quantize) not in models:
            model = AutoModelForCausalLM.from_pretrained(default_model, dtype=getattr(torch, dtype)).eval()
            if quantize:  # the same weight-only quantization the nodes apply: every decoder layer, the LM head
                from daemon.model.quantize import quantize_model

                quantize_model(model, quantize)
            models[dtype, quantize] = (model, tokenizer)
        return models[dtype, quantize]

    return load


@pytest.fixture(scope="session")
def reference_model(reference_models):
    """The whole model in this process in float32: the reference for every float32 golden test."""
    return reference_models("float32")


@pytest.fixture(scope="session")
def reference_tokens_in(reference_models):
    """``reference_tokens_in(dtype, quantize=None)(messages, n, ignore_eos)`` -> greedy token ids from
    ``model.generate`` run in ``dtype`` (with its decoder layers quantized)."""
    import torch

    memo: dict = {}

    def in_dtype(dtype: str, quantize: str | None = None):
        model, tokenizer = reference_models(dtype, quantize)

        def generate(messages: list[dict], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
            key = (dtype, quantize, repr(messages), max_new_tokens, ignore_eos)
            if key not in memo:
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
                ids = ids["input_ids"] if hasattr(ids, "keys") else ids
                extra = {"eos_token_id": None} if ignore_eos else {}
                with torch.inference_mode():
                    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                         attention_mask=torch.ones_like(ids), **extra)
                memo[key] = out[0, ids.shape[1]:].tolist()
            return memo[key]

        return generate

    return in_dtype


@pytest.fixture(scope="session")
def reference_tokens(reference_tokens_in):
    """``reference_tokens(messages, n, ignore_eos)`` -> greedy token ids from ``model.generate`` in float32."""
    return reference_tokens_in("float32")


@pytest.fixture(scope="session")
def tiny_model(default_model, tmp_path_factory):
    """``tiny_model(arch)`` -> folder of a tiny random-weight model of that architecture (built once)."""
    from tests.support.tiny_models import build_tiny_model

    built: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in built:
            built[arch] = build_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"), default_model)
        return built[arch]

    return make


@pytest.fixture(scope="session")
def openai_mesh(tiny_model, tmp_path_factory):
    """``(head, tail)``: the two-node mesh the OpenAI client tests share (one start for both modules).

    A tiny random 4-layer llama with the built-in model's tokenizer: the head runs layers 0-1 and answers to
    ``tiny`` (the name its answers report) and ``tiny-alias``; the tail runs 2-3, answers to its folder's name,
    and is meshd's ``forgetful`` variant (``tests.support.meshd_variants``): it loses the session of a request whose
    ``X-Request-Id`` starts ``forget-`` every 4th decode step, so those requests re-prefill mid-answer.
    """
    from tests.support.meshd import start_mesh

    names = ["--served-model-name", "tiny", "--served-model-name", "tiny-alias"]
    mesh = start_mesh(tiny_model("llama"), [("0-1", names), ("2-3", [], "forgetful")],
                      log_dir=tmp_path_factory.mktemp("openai-logs"))
    try:
        yield tuple(mesh)
    finally:
        for d in mesh:
            d.stop()


@pytest.fixture
def rebuilt(tmp_path, monkeypatch):
    """``native.library()`` looked up afresh, building into an empty cache."""
    from daemon.model import native

    monkeypatch.setattr("daemon.model.source.cache_dir", lambda: tmp_path / "models")
    native.library.cache_clear()
    yield tmp_path / "native"
    native.library.cache_clear()
