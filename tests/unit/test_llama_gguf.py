"""The GGUF files the bench hands llama.cpp: the model's own tensors, dequantized, stored at the precision a
node computes in (F32, BF16) or next to its int8 (Q8_0), with the source's metadata."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from daemon.bench.llama_cpp import gguf_file, rewrite_gguf

Q = GGMLQuantizationType


@pytest.fixture
def source(tmp_path):
    """A small llama-shaped GGUF: two matrices in Q4_1 and Q8_0, a norm in F32, metadata of each kind."""
    rng = np.random.default_rng(0)
    path = tmp_path / "small.Q4_1.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_string("general.name", "small")
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "a", "b"])
    writer.add_array("tokenizer.ggml.scores", [0.0, -1.5, -2.5])
    writer.add_file_type(3)  # MOSTLY_Q4_1
    matrices = {"blk.0.ffn_up.weight": (rng.standard_normal((8, 64)).astype(np.float32), Q.Q4_1),
                "blk.0.attn_q.weight": (rng.standard_normal((4, 96)).astype(np.float32) * 3, Q.Q8_0)}
    for name, (weights, qtype) in matrices.items():
        writer.add_tensor(name, quantize(weights, qtype), raw_dtype=qtype)
    writer.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tensors(path) -> dict:
    return {t.name: t for t in GGUFReader(path).tensors}


def _fields(path) -> dict:
    fields = GGUFReader(path).fields
    return {name: field.contents() for name, field in fields.items() if not name.startswith("GGUF.")}


def test_f32_holds_every_tensor_dequantized_exactly_with_the_metadata(source, tmp_path):
    target = tmp_path / "small.F32.gguf"
    rewrite_gguf(source, target, "F32")
    before, after = _tensors(source), _tensors(target)
    assert list(after) == list(before)
    for name, tensor in after.items():
        assert tensor.tensor_type == Q.F32, name
        assert list(tensor.shape) == list(before[name].shape), name
        np.testing.assert_array_equal(dequantize(tensor.data, Q.F32),
                                      dequantize(before[name].data, before[name].tensor_type))
    fields = _fields(target)
    assert fields.pop("general.file_type") == 0  # ALL_F32
    expected = _fields(source)
    expected.pop("general.file_type")
    assert fields == expected


def test_q8_0_quantizes_the_matrices_within_half_a_step_and_keeps_norms_f32(source, tmp_path):
    target = tmp_path / "small.Q8_0.gguf"
    rewrite_gguf(source, target, "Q8_0")
    before, after = _tensors(source), _tensors(target)
    assert {name: t.tensor_type for name, t in after.items()} == {
        "blk.0.ffn_up.weight": Q.Q8_0, "blk.0.attn_q.weight": Q.Q8_0, "blk.0.attn_norm.weight": Q.F32}
    assert _fields(target)["general.file_type"] == 7  # MOSTLY_Q8_0
    for name, tensor in after.items():
        original = dequantize(before[name].data, before[name].tensor_type)
        stored = dequantize(tensor.data, tensor.tensor_type)
        assert stored.shape == original.shape
        if tensor.tensor_type == Q.F32:
            np.testing.assert_array_equal(stored, original)
            continue
        # Q8_0: blocks of 32 with one scale each, amax / 127 (stored as float16): off by at most half a step
        blocks, got = original.reshape(-1, 32), stored.reshape(-1, 32)
        step = np.abs(blocks).max(axis=1, keepdims=True) / 127
        assert np.all(np.abs(got - blocks) <= 0.6 * step), name
        if before[name].tensor_type == Q.Q8_0:  # already Q8_0: it comes through unchanged
            np.testing.assert_array_equal(tensor.data, before[name].data)
        else:
            assert not np.array_equal(got, blocks)  # it did quantize


def test_bf16_rounds_each_weight_to_bfloat16(source, tmp_path):
    import torch

    target = tmp_path / "small.BF16.gguf"
    rewrite_gguf(source, target, "BF16")
    before = _tensors(source)
    for name, tensor in _tensors(target).items():
        original = dequantize(before[name].data, before[name].tensor_type)
        expected = torch.from_numpy(original.copy()).to(torch.bfloat16).float().numpy()
        if original.ndim > 1:
            assert tensor.tensor_type == Q.BF16, name
        np.testing.assert_array_equal(dequantize(tensor.data, tensor.tensor_type), expected if original.ndim > 1
                                      else original)


def test_a_rewrite_is_written_once_and_named_for_its_source(source, tmp_path):
    folder = tmp_path / "bench"
    first = gguf_file(source, "F32", folder)
    assert first.parent == folder and first.name.startswith("small.Q4_1-") and first.name.endswith(".F32.gguf")
    written = first.stat().st_mtime_ns
    assert gguf_file(source, "F32", folder) == first and first.stat().st_mtime_ns == written  # reused
    assert gguf_file(source, "source", folder) == source
    assert sorted(p.name for p in folder.iterdir()) == [first.name]  # nothing partial left behind
    source.write_bytes(source.read_bytes())  # the source changed: its key changes, a new file is written
    assert gguf_file(source, "F32", folder) != first


def test_a_llama_cpp_killed_by_a_signal_runs_once_more_without_repacking(monkeypatch, tmp_path):
    """llama.cpp's AMX repacking segfaults on some Xeons: the measurement is taken again with the weights as they
    are, and says so; a child that fails with an exit status is not run again, and its own error is said."""
    import subprocess
    import sys

    from daemon.bench import llama_cpp

    requests = []

    def child(request, timeout):  # real processes: one killed by SIGSEGV while it repacks, one that answers
        requests.append(request)
        if request.get("extra_bufts", True):
            code = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
        else:
            code = "import json; print(json.dumps({'decode_tps': 12.5, 'extra_bufts': False}))"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)

    monkeypatch.setattr(llama_cpp, "installed", lambda: True)
    monkeypatch.setattr(llama_cpp, "_child", child)
    result = llama_cpp.measure(tmp_path / "m.Q8_0.gguf", [1, 2], 4, 2)
    assert result == {"decode_tps": 12.5, "extra_bufts": False}
    assert [r.get("extra_bufts", True) for r in requests] == [True, False]

    requests.clear()
    failing = "import sys; print('RuntimeWarning: noise', file=sys.stderr); sys.exit('no such file')"
    monkeypatch.setattr(llama_cpp, "_child", lambda request, timeout: requests.append(request) or subprocess.run(
        [sys.executable, "-c", failing], capture_output=True, text=True, timeout=timeout))
    with pytest.raises(RuntimeError, match="with 2 thread\\(s\\) failed: no such file"):
        llama_cpp.measure(tmp_path / "m.Q8_0.gguf", [1, 2], 4, 2)
    assert len(requests) == 1


def test_q4_0_quantizes_the_layers_and_keeps_the_embeddings_q8_0(source, tmp_path):
    """Next to a node's int4 layers and int8 LM head: the layers' matrices in Q4_0, the embeddings (the tied LM head)
    in Q8_0, norms in F32; each stored value within half a step of the source's (Q4_0: a whole step where its 7 is
    clipped, the block's largest magnitude being -8 steps)."""
    rng = np.random.default_rng(1)
    with_embeddings = tmp_path / "embedded.Q4_1.gguf"
    writer = GGUFWriter(with_embeddings, "llama")
    writer.add_block_count(1)
    for name, tensor in _tensors(source).items():
        writer.add_tensor(name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.add_tensor("token_embd.weight", quantize(rng.standard_normal((3, 64)).astype(np.float32), Q.Q4_1),
                      raw_dtype=Q.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    target = tmp_path / "small.Q4_0.gguf"
    rewrite_gguf(with_embeddings, target, "Q4_0")
    before, after = _tensors(with_embeddings), _tensors(target)
    assert {name: t.tensor_type for name, t in after.items()} == {
        "blk.0.ffn_up.weight": Q.Q4_0, "blk.0.attn_q.weight": Q.Q4_0, "blk.0.attn_norm.weight": Q.F32,
        "token_embd.weight": Q.Q8_0}
    assert _fields(target)["general.file_type"] == 2  # MOSTLY_Q4_0
    for name, tensor in after.items():
        original = dequantize(before[name].data, before[name].tensor_type)
        stored = dequantize(tensor.data, tensor.tensor_type)
        levels, off = {Q.Q4_0: (8, 1.0), Q.Q8_0: (127, 0.5), Q.F32: (None, 0)}[tensor.tensor_type]
        if levels is None:
            np.testing.assert_array_equal(stored, original)
            continue
        step = np.abs(original.reshape(-1, 32)).max(axis=1, keepdims=True) / levels
        error = np.abs(stored - original).reshape(-1, 32)
        assert (error <= step * off * 1.01).all() and (error > 0).any(), name
