"""llama.cpp on the same weights: the program users would run instead, measured in the same run.

The bench writes the model's GGUF again at the precision it compares (:func:`gguf_file`): every tensor
dequantized from the source file, then stored as F32 (the weights a float32 node computes with), BF16,
Q8_0 (next to ``--quantize int8``) or Q4_0 (next to ``--quantize int4``, its embeddings and LM head in Q8_0 as that
node's LM head is int8). The source file itself (the built-in model ships as Q4_1) is a row too.
llama.cpp runs in a process of its own (``python -m daemon.bench.llama_cpp``), one per measurement, so its
threads never share a process with torch's, and a machine without the ``bench`` extra
(``pip install "meshnet[bench]"``, which builds llama.cpp from source) gets one line saying so.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

INSTALL_HINT = ('llama.cpp is not installed here: pip install "meshnet[bench]" (builds llama.cpp from source, '
                "a few minutes) to measure it in the same run")

# a node's precision -> the GGUF type llama.cpp runs at the same precision
SAME_PRECISION = {"float32": "F32", "bfloat16": "BF16", "int8": "Q8_0", "int4": "Q4_0"}
WIDE_TENSORS = ("token_embd.weight", "output.weight")  # kept in Q8_0 in a Q4_0 file


def installed() -> bool:
    """Whether ``llama_cpp`` (llama-cpp-python) can be imported here."""
    return importlib.util.find_spec("llama_cpp") is not None


def gguf_file(source: Path, kind: str, folder: Path) -> Path:
    """``source`` as a GGUF of type ``kind`` (F32, BF16, Q8_0, Q4_0, or ``source`` for the file itself), written
    once into ``folder`` under a name keyed by the source's path, size and time, and reused after."""
    if kind == "source":
        return source
    stat = source.stat()
    key = hashlib.sha256(f"{source.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = folder / f"{source.stem}-{key}.{kind}.gguf"
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.partial")
        try:
            rewrite_gguf(source, partial, kind)
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)
    return target


def rewrite_gguf(source: Path, target: Path, kind: str) -> None:
    """Write ``source``'s metadata and tensors to ``target``, every tensor dequantized and stored as ``kind``:
    F32 or BF16 for all; Q8_0 or Q4_0 for matrices whose rows are whole blocks (one-dimensional tensors, such as
    norms, stay F32, as llama.cpp's own quantizer keeps them; a Q4_0 file's embeddings and LM head are Q8_0)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[kind]
    file_type = {"F32": LlamaFileType.ALL_F32, "BF16": LlamaFileType.MOSTLY_BF16,
                 "Q8_0": LlamaFileType.MOSTLY_Q8_0, "Q4_0": LlamaFileType.MOSTLY_Q4_0}[kind]
    reader = GGUFReader(source)
    architecture = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(target, architecture)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue  # the writer's own header, and what this rewrite changes
        if name == "general.alignment":
            writer.data_alignment = int(field.contents())
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type)
    writer.add_file_type(file_type)
    for tensor in reader.tensors:
        weights = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        wide = qtype == GGMLQuantizationType.Q4_0 and tensor.name in WIDE_TENSORS
        keep = GGMLQuantizationType.Q8_0 if wide else qtype
        if weights.ndim < 2 or weights.shape[-1] % GGML_QUANT_SIZES[keep][0]:
            keep = GGMLQuantizationType.F32
        data = quantize(weights, keep)
        writer.add_tensor(tensor.name, data, raw_dtype=keep if keep != GGMLQuantizationType.F32 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def measure(gguf: Path, prompt_ids: Sequence[int], tokens: int, threads: int, *, timeout: float = 600.0) -> dict:
    """One greedy generation of exactly ``tokens`` new tokens by llama.cpp on ``threads`` threads, in a process
    of its own (after a short warm-up there): prefill time, decode tokens/s, each step's time and the tokens."""
    if not installed():
        raise RuntimeError(INSTALL_HINT)
    request = {"gguf": str(gguf), "prompt_ids": list(prompt_ids), "tokens": tokens, "threads": threads}
    done = _child(request, timeout)
    if done.returncode < 0:
        # killed by a signal: llama.cpp 0.3.36's AMX path repacks Q8_0 weights and then segfaults in its first
        # evaluation on a Xeon with AMX here; its weights as they are (no extra buffer types) run
        done = _child(request | {"extra_bufts": False}, timeout)
    last = done.stdout.strip().splitlines()[-1:] if done.stdout.strip() else []
    if done.returncode != 0 or not last:
        lines = [line for line in done.stderr.strip().splitlines() if "RuntimeWarning" not in line]
        tail = lines[-1] if lines else f"exit status {done.returncode}"
        raise RuntimeError(f"llama.cpp on {gguf.name} with {threads} thread(s) failed: {tail}")
    return json.loads(last[0])


def _child(request: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "daemon.bench.llama_cpp"], input=json.dumps(request),
                          capture_output=True, text=True, timeout=timeout)


def _generate(request: dict) -> dict:
    """In the child: load the file, warm up, then one timed greedy generation."""
    import llama_cpp.llama_cpp as bindings
    from llama_cpp import Llama, __version__

    prompt, tokens, threads = request["prompt_ids"], request["tokens"], request["threads"]
    extra_bufts = request.get("extra_bufts", True)
    if not extra_bufts:  # Llama() takes no such argument: the parameters it starts from
        defaults = bindings.llama_model_default_params

        def without_repacking():
            params = defaults()
            params.use_extra_bufts = False
            return params

        bindings.llama_model_default_params = without_repacking
    llm = Llama(model_path=request["gguf"], n_ctx=len(prompt) + tokens + 8, n_batch=max(len(prompt), 8),
                n_threads=threads, n_threads_batch=threads, verbose=False)

    def run(count: int) -> tuple[list[int], list[float]]:
        ids: list[int] = []
        times = [time.perf_counter()]
        # top_k=1, temperature 0: greedy, the same choice as generate(do_sample=False); no EOS stops it
        for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                  reset=True):
            times.append(time.perf_counter())
            ids.append(int(token))
            if len(ids) == count:
                break
        return ids, times

    run(4)  # warm-up: the first evaluation maps the file and sizes the buffers
    ids, times = run(tokens)
    decode_s = times[-1] - times[1]
    return {"prefill_ms": (times[1] - times[0]) * 1000.0,
            "decode_tps": (len(ids) - 1) / decode_s if decode_s > 0 else None,
            "step_ms": [(b - a) * 1000.0 for a, b in zip(times[1:], times[2:])],
            "token_ids": ids, "llama_cpp_version": __version__, "extra_bufts": extra_bufts,
            "system_info": bindings.llama_print_system_info().decode(errors="replace").strip()}


if __name__ == "__main__":
    print(json.dumps(_generate(json.loads(sys.stdin.read()))))
