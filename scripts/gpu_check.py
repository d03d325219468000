"""The GPU check of ``scripts/gpu_check.sh``: meshd on a device against transformers on the same device.

    python3 scripts/gpu_check.py --tokenizer DIR [--device cuda] [--out DIR]

1. The tiny architecture matrix in process: each model split into two shards on the device, in
   float32 and bfloat16, cached, against ``generate`` on the device in the same dtype.
2. A golden mesh: two ``meshd`` on the device in bfloat16 on a synthetic Llama (random weights,
   hidden 2048, 16 layers), against ``generate`` on the device; then the same model with the head
   on the device and the tail on the CPU (a mixed mesh: it must answer; its tokens are reported
   against both devices' ``generate``).
3. ``meshd bench`` rows on the device for the synthetic model, float32 and bfloat16.

It prints a table and writes ``gpu-check.json`` (and the bench's JSON) into ``--out``. It runs on the
CPU too (``--device cpu``), which is how it is checked where no GPU is.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from daemon.api.launch import MeshdProcess, free_port, node_url  # noqa: E402
from tests.support.tiny_models import build_tiny_model  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_next", "mistral", "phi3", "gemma2", "gemma3_text")
PROMPT = [1, 504, 3158, 1567, 4829, 28, 2117, 314, 17843]
MESSAGES = [{"role": "user", "content": "Write a story about a lighthouse keeper and a storm."}]
SYNTHETIC = dict(num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                 tie_word_embeddings=False)


def generate_ids(model, ids, tokens: int) -> list[int]:
    import torch

    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def split_cached(folder: Path, dtype, device: str, tokens: int) -> list[int]:
    """Two shards on ``device``: a prefill, then one-token decode steps, as a mesh runs them."""
    from daemon.api import Sampling
    from daemon.kvstore import SessionCacheStore
    from daemon.model.shard import ModelShard

    head = ModelShard(folder, 0, 2, sessions=SessionCacheStore(), dtype=dtype, device=device)
    tail = ModelShard(folder, 2, 4, head=False, sessions=SessionCacheStore(), dtype=dtype, device=device)
    out, past, feed, mode = [], 0, list(PROMPT), "prefill"
    while len(out) < tokens:
        hidden = head.step(head.embed(feed), mode=mode, session_id="s", past_len=past, start_layer=0,
                           sampling=Sampling()).hidden
        token = tail.step(hidden, mode=mode, session_id="s", past_len=past, start_layer=2,
                          sampling=Sampling()).token_id
        past += len(feed)
        out.append(token)
        feed, mode = [token], "decode"
    return out


def architecture_matrix(tokenizer: Path, device: str, work: Path) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    rows = []
    for arch in ARCHS:
        folder = build_tiny_model(arch, work / arch, tokenizer)
        for dtype in (torch.float32, torch.bfloat16):
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
            want = generate_ids(model, torch.tensor([PROMPT], device=device), 12)
            got = split_cached(folder, dtype, device, 12)
            rows.append({"arch": arch, "dtype": str(dtype), "same": got == want})
            print(f"{arch:<12} {str(dtype):<15} {'same' if got == want else 'DIFFERENT'}", flush=True)
    return rows


def synthetic_model(tokenizer: Path, dest: Path, hidden: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    vocab = json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"]
    shape = SYNTHETIC | {"hidden_size": hidden, "intermediate_size": hidden * 11 // 4}
    model = LlamaForCausalLM._from_config(LlamaConfig(vocab_size=len(vocab), **shape), dtype=torch.bfloat16)
    model.save_pretrained(dest)
    for file in tokenizer.iterdir():
        (dest / file.name).write_bytes(file.read_bytes())
    return dest


def mesh_tokens(folder: Path, devices: tuple[str, str], dtype: str, tokens: int, logs: Path) -> list[int]:
    """A two-node mesh, head on ``devices[0]`` and tail on ``devices[1]``: the token ids of one greedy answer."""
    import http.client

    ports = [free_port(), free_port()]
    procs = []
    try:
        for i, (layers, device) in enumerate(zip(("0-7", "8-15"), devices)):
            peer = node_url("127.0.0.1", ports[1 - i])
            procs.append(MeshdProcess(["--model", str(folder), "--layers", layers, "--port", str(ports[i]),
                                       "--device", device, "--dtype", dtype, "--peer", peer],
                                      log_path=logs / f"meshd-{device.replace(':', '')}-{i}.log"))
        for proc, port in zip(procs, ports):
            proc.wait_ready(node_url("127.0.0.1", port), timeout=600)
        body = {"messages": MESSAGES, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
        for _ in range(60):  # until the head has seen its peer and plans a route over every layer
            conn = http.client.HTTPConnection("127.0.0.1", ports[0], timeout=600)
            conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            answer = json.loads(resp.read())
            if resp.status == 200:
                return answer["meshnet"]["token_ids"]
            subprocess.run(["sleep", "1"])
        raise RuntimeError(f"the mesh never answered: {answer}")
    finally:
        for proc in procs:
            proc.stop()


def main() -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="a folder with the built-in model's tokenizer")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path("gpu-check-results"))
    parser.add_argument("--hidden", type=int, default=2048, help="the synthetic model's hidden size (default 2048)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    result: dict = {"device": args.device, "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    print(f"device {args.device} ({result['gpu'] or 'no GPU'}), torch {torch.__version__}", flush=True)
    result["architectures"] = architecture_matrix(args.tokenizer, args.device, work)

    folder = synthetic_model(args.tokenizer, work / "synthetic", args.hidden)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    reference = {}
    for device in dict.fromkeys((args.device, "cpu")):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
        reference[device] = generate_ids(model, ids["input_ids"].to(device), 64)
        del model
    golden = mesh_tokens(folder, (args.device, args.device), "bfloat16", 64, args.out)
    mixed = mesh_tokens(folder, (args.device, "cpu"), "bfloat16", 64, args.out)
    result["golden"] = {"same_as_generate_on_device": golden == reference[args.device]}
    result["mixed"] = {"answered": len(mixed) == 64, "same_as_device": mixed == reference[args.device],
                       "same_as_cpu": mixed == reference["cpu"]}
    print(f"golden mesh on {args.device}: {'same' if result['golden']['same_as_generate_on_device'] else 'DIFFERENT'}"
          f"; mixed {args.device}+cpu mesh: {result['mixed']}", flush=True)

    bench = subprocess.run([sys.executable, "-m", "daemon.cli", "bench", "--model", str(folder), "--device",
                            args.device, "--precisions", "float32", "bfloat16", "--tokens", "128", "--setups",
                            "generate", "cached", "--sessions", "0", "--json", str(args.out / "bench.json")],
                           capture_output=True, text=True)
    print(bench.stdout, flush=True)
    result["bench_returncode"] = bench.returncode
    (args.out / "gpu-check.json").write_text(json.dumps(result, indent=1))
    ok = all(r["same"] for r in result["architectures"]) and result["golden"]["same_as_generate_on_device"] \
        and result["mixed"]["answered"] and bench.returncode == 0
    print("GPU check: " + ("passed" if ok else "FAILED"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
