"""Golden tests: a real mesh of meshd processes on 127.0.0.1 splitting SmolLM2-135M-Instruct must
produce exactly the tokens of transformers' own ``generate`` in one process."""

from __future__ import annotations

import threading

import pytest

from tests.support.http_client import http_json
from tests.support.meshd import Daemon, start_mesh

PROMPTS = [
    [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Explain how a hash map works, step by step."}],
    [{"role": "user", "content": "List ten fruits and one fact about each."}],
]
NEW_TOKENS = 128


def chat(head: Daemon, messages, max_tokens=NEW_TOKENS, **extra) -> dict:
    status, body = head.chat({"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                              "ignore_eos": True, **extra})
    assert status == 200, body
    return body


@pytest.fixture(scope="module")
def two_nodes(default_model, tmp_path_factory):
    mesh = start_mesh(default_model, [("0-14", []), ("15-29", [])], log_dir=tmp_path_factory.mktemp("logs"))
    yield mesh
    for d in mesh:
        d.stop()


@pytest.mark.slow
@pytest.mark.parametrize("prompt", range(len(PROMPTS)))
def test_two_node_cached_mesh_matches_generate(two_nodes, reference_tokens, prompt):
    head, tail = two_nodes
    body = chat(head, PROMPTS[prompt])
    stats = body["meshnet"]
    assert stats["token_ids"] == reference_tokens(PROMPTS[prompt], NEW_TOKENS, ignore_eos=True)
    assert len(stats["token_ids"]) == NEW_TOKENS
    # one prefill, or one extend step from a session an earlier prompt left (the template's system prompt)
    assert stats["prefills"] == (0 if stats["cached_tokens"] else 1)
    assert stats["reprefills"] == 0 and stats["stateless_steps"] == 0
    assert [h["start_layer"] for h in stats["route"]] == [0, 15]
    # each node kept a session for its layers; the head's own is a retained prefix at once (the tail's is
    # marked in the background)
    assert any(s["past_len"] == body["usage"]["prompt_tokens"] + NEW_TOKENS - 1
               for s in tail.get("/v1/sessions")["sessions"])
    assert any(s["session_id"] == stats["session_id"] and s["retained"] for s in head.get("/v1/sessions")["sessions"])


@pytest.mark.slow
def test_any_node_serves_chat(two_nodes, reference_tokens):
    """The tail can be the head too: it embeds, sends layers 0-14 to its peer, and runs 15-29 itself."""
    _, tail = two_nodes
    body = chat(tail, PROMPTS[2], max_tokens=32)
    stats = body["meshnet"]
    assert [(h["start_layer"], h["local"]) for h in stats["route"]] == [(0, False), (15, True)]
    assert stats["token_ids"] == reference_tokens(PROMPTS[2], NEW_TOKENS, ignore_eos=True)[:32]


@pytest.mark.slow
def test_mesh_stops_at_eos_like_generate(two_nodes, reference_tokens):
    head, _ = two_nodes
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    status, body = head.chat({"messages": messages, "max_tokens": 64, "temperature": 0})
    assert status == 200, body
    expected = reference_tokens(messages, 64)
    assert expected[-1] == 2, "the reference should end with <|im_end|> for this prompt"
    assert body["meshnet"]["token_ids"] == expected
    assert body["choices"][0]["finish_reason"] == "stop"
    assert "Paris" in body["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_eviction_mid_generation_costs_one_reprefill(two_nodes, reference_tokens):
    """Drop the tail's session while a stream runs: one re-prefill, then identical tokens."""
    head, tail = two_nodes
    messages = PROMPTS[0]
    chunks, evicted = [], threading.Event()
    for chunk in head.stream({"messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}):
        chunks.append(chunk)
        if len(chunks) == 20 and not evicted.is_set():
            sessions = tail.get("/v1/sessions")["sessions"]
            assert sessions, "the tail should hold the running session"
            for s in sessions:
                assert http_json("DELETE", f"{tail.url}/v1/sessions/{s['session_id']}")[0] == 200
            evicted.set()
    final = next(c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    stats = final["meshnet"]
    assert evicted.is_set()
    assert stats["cache_misses"] == 1 and stats["reprefills"] == 1
    assert stats["token_ids"] == reference_tokens(messages, NEW_TOKENS, ignore_eos=True)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) \
        == final_text(head, messages)


def final_text(head: Daemon, messages) -> str:
    return chat(head, messages)["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_stateless_node_matches_generate(default_model, reference_tokens, tmp_path):
    mesh = start_mesh(default_model, [("0-14", []), ("15-29", ["--no-kv-cache"])], log_dir=tmp_path)
    try:
        head, tail = mesh
        assert tail.get("/v1/status")["kv_cache_enabled"] is False
        # 40 tokens: each stateless step recomputes the whole sequence, so its cost grows with the square
        body = chat(head, PROMPTS[1], max_tokens=40)
        stats = body["meshnet"]
        assert stats["token_ids"] == reference_tokens(PROMPTS[1], NEW_TOKENS, ignore_eos=True)[:40]
        assert stats["stateless_steps"] == 40 and stats["prefills"] == 0
        assert tail.get("/v1/sessions")["sessions"] == []
    finally:
        for d in mesh:
            d.stop()


@pytest.mark.slow
def test_three_overlapping_nodes_match_generate(default_model, reference_tokens, tmp_path):
    mesh = start_mesh(default_model, [("0-14", []), ("10-24", []), ("20-29", [])], log_dir=tmp_path)
    try:
        head = mesh[0]
        body = chat(head, PROMPTS[2])
        stats = body["meshnet"]
        assert [(h["start_layer"], h["end_layer"]) for h in stats["route"]] == [(0, 15), (15, 25), (25, 30)]
        assert stats["token_ids"] == reference_tokens(PROMPTS[2], NEW_TOKENS, ignore_eos=True)
    finally:
        for d in mesh:
            d.stop()


@pytest.mark.slow
def test_legacy_tail_without_token_ids_prefills_every_step(default_model, reference_model, reference_tokens,
                                                          tmp_path):
    """A tail from before token ids answers text only: the head re-tokenizes and prefills each step."""
    _, tokenizer = reference_model
    messages = [{"role": "user", "content": "Name three colours."}]
    head, tail = start_mesh(default_model, [("0-14", []), ("15-29", [], "legacy-tail")], peers=[[1], []],
                            log_dir=tmp_path)
    try:
        status, body = head.chat({"messages": messages, "max_tokens": 24, "temperature": 0})
        assert status == 200, body
        stats = body["meshnet"]
        assert stats["prefills"] == stats["completion_tokens"] > 1
        expected = tokenizer.decode(reference_tokens(messages, 24), skip_special_tokens=True)
        assert body["choices"][0]["message"]["content"] == expected
    finally:
        head.stop(), tail.stop()


@pytest.mark.slow
def test_half_the_layers_hold_half_the_layer_weights(two_nodes, reference_model):
    model, _ = reference_model
    full_layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    head, tail = (d.get("/v1/status")["weights_bytes"] for d in two_nodes)
    assert head["layers"] == pytest.approx(full_layer_bytes / 2, rel=0.01)
    assert tail["layers"] == pytest.approx(full_layer_bytes / 2, rel=0.01)
    embed_bytes = model.model.embed_tokens.weight.numel() * 4
    assert head["embeddings"] == embed_bytes  # the head embeds prompts
    assert tail["final_norm_and_lm_head"] >= embed_bytes  # tied LM head
    for d in two_nodes:
        rss_kb = int(next(line.split()[1] for line in open(f"/proc/{d.proc.pid}/status") if line.startswith("VmRSS")))
        print(f"meshd {d.layers}: layers {d.get('/v1/status')['weights_bytes']}, RSS {rss_kb / 1024:.0f} MiB")


# ---- bfloat16 ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_bfloat16_nodes(default_model, tmp_path_factory):
    # transformers' own products (no weight plans): bit for bit what generate computes. A plan's faster bfloat16
    # kernel moves logits by rounding and so may move tokens at near ties (tests/unit/test_kernels.py bounds it)
    off = ["--tune-kernels", "off"]
    mesh = start_mesh(default_model, [("0-14", off), ("15-29", off)], log_dir=tmp_path_factory.mktemp("logs"),
                      dtype="bfloat16")
    yield mesh
    for d in mesh:
        d.stop()


@pytest.mark.slow
@pytest.mark.parametrize("prompt", range(2))
def test_two_node_bfloat16_mesh_matches_generate_in_bfloat16(two_bfloat16_nodes, reference_tokens_in, prompt):
    """Computed in bfloat16 and sent over the wire in bfloat16 (the compute dtype: nothing is rounded on the
    way), the mesh emits the tokens ``generate`` gives in bfloat16 with the same weights."""
    head, _ = two_bfloat16_nodes
    body = chat(head, PROMPTS[prompt], max_tokens=64)
    assert body["meshnet"]["token_ids"] == reference_tokens_in("bfloat16")(PROMPTS[prompt], 64, ignore_eos=True)


@pytest.mark.slow
def test_bfloat16_nodes_hold_half_the_bytes_and_say_so(two_bfloat16_nodes, reference_model):
    model, _ = reference_model
    float32_layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    statuses = [d.get("/v1/status") for d in two_bfloat16_nodes]
    assert [(s["dtype"], s["device"]) for s in statuses] == [("bfloat16", "cpu")] * 2
    assert sum(s["weights_bytes"]["layers"] for s in statuses) == float32_layer_bytes // 2
    for status in statuses:
        memory = status["memory"]
        assert memory["peak_rss_bytes"] >= memory["rss_bytes"] > sum(status["weights_bytes"].values())


@pytest.mark.slow
@pytest.mark.parametrize("method, dtype, share", [("int8", "bfloat16", (0.25, 0.26)),
                                                  ("int4", "float32", (0.14, 0.142))])
def test_two_node_quantized_mesh_matches_the_whole_quantized_model(default_model, reference_tokens_in,
                                                                   reference_model, tmp_path, method, dtype, share):
    """Each node quantizes its own layers after loading: together they emit what one process gives with the
    same quantization applied to the whole model, and hold their share of their layers' float32 bytes: int8
    values and a bfloat16 scale per row; 4-bit values and a float16 scale per 32 (and the norms). (The tail's
    LM head is int8 in both.)"""
    flags = ["--quantize", method, "--tune-kernels", "off"]
    mesh = start_mesh(default_model, [("0-14", flags), ("15-29", flags)], log_dir=tmp_path, dtype=dtype)
    try:
        body = chat(mesh[0], PROMPTS[1], max_tokens=48)
        assert body["meshnet"]["token_ids"] == reference_tokens_in(dtype, method)(PROMPTS[1], 48, ignore_eos=True)
        model, _ = reference_model
        float32_layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
        statuses = [d.get("/v1/status") for d in mesh]
        assert [s["quantize"] for s in statuses] == [method, method]
        layer_bytes = sum(s["weights_bytes"]["layers"] for s in statuses)
        assert share[0] <= layer_bytes / float32_layer_bytes < share[1]
    finally:
        for d in mesh:
            d.stop()


@pytest.mark.slow
def test_a_repetition_penalty_matches_generate_on_the_built_in_model(two_nodes, reference_model):
    """Greedy with transformers' repetition penalty, chat and raw completion (and the raw completion without it),
    token for token."""
    import torch

    model, tokenizer = reference_model
    head, _ = two_nodes

    def generate(ids: list[int], n: int, **kwargs) -> list[int]:
        ids = torch.tensor([ids])
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None,
                                 attention_mask=torch.ones_like(ids), **kwargs)
        return out[0, ids.shape[1]:].tolist()

    messages = PROMPTS[2]
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)
    expected = generate(chat_ids, 48, repetition_penalty=1.3)
    assert expected != generate(chat_ids, 48)  # the penalty matters on this prompt
    assert chat(head, messages, max_tokens=48, repetition_penalty=1.3)["meshnet"]["token_ids"] == expected

    prompt = "Once upon a time, in a small village by the sea,"
    status, body = http_json("POST", head.url + "/v1/completions", {"prompt": prompt, "max_tokens": 32,
                             "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    assert body["meshnet"]["token_ids"] == generate(tokenizer(prompt)["input_ids"], 32)  # no template, no penalty
    expected = generate(tokenizer(prompt)["input_ids"], 32, repetition_penalty=1.3)
    status, body = http_json("POST", head.url + "/v1/completions", {"prompt": prompt, "max_tokens": 32,
                             "temperature": 0, "ignore_eos": True, "repetition_penalty": 1.3})
    assert status == 200, body
    assert body["meshnet"]["token_ids"] == expected
    assert body["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)


@pytest.mark.slow
def test_logprobs_are_the_built_in_models_log_softmax(two_nodes, reference_model):
    import torch

    model, tokenizer = reference_model
    head, _ = two_nodes
    messages = PROMPTS[1]
    body = chat(head, messages, max_tokens=16, logprobs=True, top_logprobs=5)
    answer = body["meshnet"]["token_ids"]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with torch.inference_mode():
        logits = model(torch.tensor([ids + answer])).logits[0].float()
    rows = torch.log_softmax(logits[len(ids) - 1:-1], dim=-1)
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 16
    for entry, row, token_id in zip(content, rows, answer):
        assert entry["logprob"] == pytest.approx(float(row[token_id]), abs=1e-3)
        assert entry["token"] == tokenizer.decode([token_id])
        best = torch.topk(row, 5)
        assert [t["token"] for t in entry["top_logprobs"]] == [tokenizer.decode([i]) for i in best.indices.tolist()]
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(best.values.tolist(), abs=1e-3)
