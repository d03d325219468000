"""Conversations reuse the mesh's KV (issue 14), end to end: real meshd processes on 127.0.0.1, the tokens of
every answer checked against ``transformers``' ``generate`` on the whole prompt, cold.

Reused K/V was computed by an earlier step over a different number of rows than one cold prefill would use,
and CPU matmuls are not batch-invariant: measured on the built-in model in float32, the last position's
logits after a reused prefix differ from a cold prefill's by at most 3.7e-5 (logits of magnitude ~20;
``test_reused_prefix_logits_stay_within_the_documented_bound`` holds it to 1e-4). Greedy tokens match.
"""

from __future__ import annotations

import pytest

from tests.support.http_client import http_json
from tests.support.meshd import Daemon, start_mesh

SYSTEM = {"role": "system", "content": "You are a patient tutor who answers in two short sentences. " * 6}
QUESTIONS = ["What is the capital of France?", "And of Spain?", "Name a river there."]
TOKENS = 16


def ask(head: Daemon, messages: list[dict], **extra) -> dict:
    status, body = head.chat({"messages": messages, "max_tokens": TOKENS, "temperature": 0} | extra)
    assert status == 200, body
    return body


def check(body: dict, reference_tokens, messages: list[dict]) -> None:
    """The answer is generate's, cold; its usage says how many prompt tokens were reused."""
    stats, usage = body["meshnet"], body["usage"]
    assert stats["token_ids"] == reference_tokens(messages, TOKENS)[:len(stats["token_ids"])]
    assert usage["prompt_tokens_details"]["cached_tokens"] == stats["cached_tokens"]
    if stats["cached_tokens"]:
        assert stats["prompt_computed_tokens"] == usage["prompt_tokens"] - stats["cached_tokens"]


def converse(head: Daemon, reference_tokens, questions=QUESTIONS, system=SYSTEM) -> tuple[list[dict], list[dict]]:
    messages, bodies = [system], []
    for question in questions:
        messages.append({"role": "user", "content": question})
        body = ask(head, messages)
        check(body, reference_tokens, messages)
        bodies.append(body)
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return messages, bodies


def reused_tokens(daemon: Daemon) -> float:
    """The head's ``meshnet_prompt_tokens_total{kind="reused"}``."""
    from daemon.bench.mesh import counter_value

    return counter_value(daemon.metrics(), "meshnet_prompt_tokens_total", kind="reused")


@pytest.fixture(scope="module")
def mesh(default_model, tmp_path_factory):
    daemons = start_mesh(default_model, [("0-14", []), ("15-29", [])], log_dir=tmp_path_factory.mktemp("logs"))
    yield daemons
    for d in daemons:
        d.stop()


@pytest.mark.slow
def test_each_turn_of_a_conversation_reuses_the_last_and_answers_as_cold(mesh, reference_tokens):
    head, tail = mesh
    reused_before = reused_tokens(head)
    messages, bodies = converse(head, reference_tokens)
    first, *later = bodies
    assert first["meshnet"]["cached_tokens"] == 0 or first["meshnet"]["cached_tokens"] < 60  # maybe the system
    for before, body in zip(bodies, later):
        # the whole previous prompt at least: the nodes held it, and the new prompt starts with it
        assert body["meshnet"]["cached_tokens"] >= before["usage"]["prompt_tokens"], body["usage"]
        assert body["meshnet"]["prompt_computed_tokens"] < 40
    reused = sum(b["meshnet"]["cached_tokens"] for b in bodies)
    assert reused_tokens(head) - reused_before == reused
    # each finished generation's session stays on both nodes, marked as a retained prefix
    for node in mesh:
        sessions = node.get("/v1/sessions")["sessions"]
        assert any(s["retained"] and s["past_len"] > bodies[-1]["usage"]["prompt_tokens"] for s in sessions), sessions


@pytest.mark.slow
def test_streaming_reports_the_reused_tokens_in_its_usage_chunk(mesh, reference_tokens):
    head, _ = mesh
    messages, _ = converse(head, reference_tokens, questions=QUESTIONS[:1])
    messages.append({"role": "user", "content": "Say it again, slowly."})
    chunks = list(head.stream({"messages": messages, "max_tokens": TOKENS, "temperature": 0,
                               "stream_options": {"include_usage": True}}))
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert len(usage) == 1 and usage[0]["prompt_tokens_details"]["cached_tokens"] > 100, usage


@pytest.mark.slow
def test_an_edited_last_turn_and_a_second_user_fork_the_shared_part(mesh, reference_tokens):
    head, _ = mesh
    messages, bodies = converse(head, reference_tokens, questions=QUESTIONS[:2])
    edited = messages[:3] + [{"role": "user", "content": "And of Portugal?"}]  # turn 2, asked differently
    body = ask(head, edited)
    check(body, reference_tokens, edited)
    assert bodies[0]["usage"]["prompt_tokens"] <= body["meshnet"]["cached_tokens"] < bodies[1]["usage"]["prompt_tokens"]
    other = [SYSTEM, {"role": "user", "content": "How do plants drink?"}]  # another user, the same system prompt
    body = ask(head, other)
    check(body, reference_tokens, other)
    assert body["meshnet"]["cached_tokens"] > 60


@pytest.mark.slow
def test_a_conversation_whose_session_was_evicted_prefills_again_exactly(mesh, reference_tokens):
    head, tail = mesh
    messages, _ = converse(head, reference_tokens, questions=QUESTIONS[:1], system={"role": "system",
                                                                                     "content": "Be exact. " * 20})
    for session in tail.get("/v1/sessions")["sessions"]:  # the tail loses every kept prefix
        if session["retained"]:
            http_json("DELETE", f"{tail.url}/v1/sessions/{session['session_id']}")
    messages.append({"role": "user", "content": QUESTIONS[1]})
    body = ask(head, messages)
    check(body, reference_tokens, messages)
    assert body["meshnet"]["cached_tokens"] == 0 and body["meshnet"]["cache_misses"] >= 1
    assert body["meshnet"]["prompt_computed_tokens"] == body["usage"]["prompt_tokens"]
    assert tail.get("/v1/status")["store"]["misses_by_reason"]["prefix_unavailable"] >= 1


@pytest.mark.slow
def test_a_new_route_prefills_and_an_old_node_falls_back_exactly(default_model, reference_tokens, tmp_path):
    """After a reroute nothing held on the old route is used; a node from before prefix reuse answers 409."""
    head = Daemon(default_model, "0-14", log_dir=tmp_path)
    tail = Daemon(default_model, "15-29", peers=[head], log_dir=tmp_path)  # loads while the head does
    try:
        head.wait_ready(), tail.wait_ready()
        http_json("POST", f"{head.url}/v1/peers", {"url": tail.url})
        head.wait_peers(1)
        messages, _ = converse(head, reference_tokens, questions=QUESTIONS[:1])
        tail.stop()
        old = Daemon(default_model, "15-29", peers=[head], log_dir=tmp_path, variant="no-prefix").wait_ready()
        try:
            http_json("POST", f"{head.url}/v1/peers", {"url": old.url})
            http_json("DELETE", f"{head.url}/v1/peers", {"url": tail.url})
            messages.append({"role": "user", "content": QUESTIONS[1]})
            body = ask(head, messages)  # a new route: the session on the old tail is not offered
            check(body, reference_tokens, messages)
            assert body["meshnet"]["cached_tokens"] == 0 and body["meshnet"]["cache_misses"] == 0
            assert body["meshnet"]["route"][-1]["url"] == old.url
            messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
            messages.append({"role": "user", "content": QUESTIONS[2]})
            body = ask(head, messages)  # the old tail ignores the prefix headers: a 409, then a full prefill
            check(body, reference_tokens, messages)
            assert body["meshnet"]["cached_tokens"] == 0 and body["meshnet"]["cache_misses"] == 1
            assert old.get("/v1/status")["store"]["misses_by_reason"]["unknown_session"] >= 1
        finally:
            old.stop()
    finally:
        head.stop()
        tail.stop()


@pytest.mark.slow
def test_client_scope_reuses_only_a_clients_own_prefixes(default_model, reference_tokens, tmp_path):
    mesh = start_mesh(default_model, [("0-14", ["--prefix-reuse", "client"]), ("15-29", [])], log_dir=tmp_path)
    try:
        head = mesh[0]
        first = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
        assert ask(head, first, user="ann")["meshnet"]["cached_tokens"] == 0
        bob = ask(head, first, user="bob")
        check(bob, reference_tokens, first)
        assert bob["meshnet"]["cached_tokens"] == 0
        ann = ask(head, first, user="ann")
        check(ann, reference_tokens, first)
        assert ann["meshnet"]["cached_tokens"] == ann["usage"]["prompt_tokens"] - 1
    finally:
        for d in mesh:
            d.stop()
    off = start_mesh(default_model, [("0-29", ["--prefix-reuse", "off"])], log_dir=tmp_path)[0]
    try:
        assert [ask(off, first)["meshnet"]["cached_tokens"] for _ in range(2)] == [0, 0]
    finally:
        off.stop()


# ---- hybrid models: linear attention continues only from exactly what it holds ---------------------------------

_TINY_REFERENCES: dict = {}


def reference_generate(folder, messages: list[dict], tokens: int) -> list[int]:
    """Greedy tokens of the whole tiny model, cold, through ``generate``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if folder not in _TINY_REFERENCES:
        _TINY_REFERENCES[folder] = (AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(),
                                    AutoTokenizer.from_pretrained(folder))
    model, tokenizer = _TINY_REFERENCES[folder]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=2)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_hybrid_models_answer_as_cold_whether_or_not_a_prefix_could_be_used(tiny_model, arch, tmp_path):
    folder = tiny_model(arch)
    mesh = start_mesh(folder, [("0-1", []), ("2-3", [])], log_dir=tmp_path)
    try:
        head, tail = mesh
        messages = [{"role": "system", "content": "Short answers. " * 8}]
        outcomes = []
        for question in ["one", "two", "three", "three and a half"]:
            messages.append({"role": "user", "content": question})
            body = ask(head, messages, ignore_eos=True)
            assert body["meshnet"]["token_ids"] == reference_generate(folder, messages, TOKENS)
            outcomes.append((body["meshnet"]["cached_tokens"], body["meshnet"]["cache_misses"]))
            messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        refused = sum(node.get("/v1/status")["store"]["misses_by_reason"]["not_croppable"] for node in mesh)
        # either the answer re-tokenised exactly and the session was continued, or the layers refused a crop
        assert any(cached for cached, _ in outcomes) or refused >= 1, (outcomes, refused)
    finally:
        for d in mesh:
            d.stop()


@pytest.mark.slow
def test_reused_prefix_logits_stay_within_the_documented_bound(default_model):
    """In one process: the last position's logits after a prefix computed earlier, against a cold prefill."""
    import torch
    from transformers import AutoTokenizer

    from daemon.kvstore import SessionCacheStore
    from daemon.model.shard import ModelShard

    torch.set_num_threads(1)
    text = "The quick brown fox jumps over the lazy dog. " * 12
    ids = AutoTokenizer.from_pretrained(default_model)(text)["input_ids"]
    shard = ModelShard(default_model, 0, 30, sessions=SessionCacheStore())
    cold = shard.logits_last(shard.run_layers(shard.embed(ids), start_layer=0, past_len=0, cache=shard.new_cache()))
    worst = 0.0
    for keep in (len(ids) // 3, len(ids) - 4, len(ids) - 1):
        cache = shard.new_cache()
        shard.run_layers(shard.embed(ids[:keep]), start_layer=0, past_len=0, cache=cache)
        warm = shard.logits_last(shard.run_layers(shard.embed(ids[keep:]), start_layer=0, past_len=keep, cache=cache))
        worst = max(worst, (warm - cold).abs().max().item())
        assert warm.argmax() == cold.argmax()
    assert worst <= 1e-4, worst
