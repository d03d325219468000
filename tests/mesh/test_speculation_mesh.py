"""Speculative decoding on real meshes: meshd processes on 127.0.0.1, every remote hop behind a delay proxy of
10 ms round trip (``daemon.bench.delay``), the head drafting with an int8 copy of the built-in model. Every answer
is checked against transformers' own ``generate`` or against the same request with speculation off."""

from __future__ import annotations

import threading

import pytest

from daemon.api.launch import free_ports, node_url
from daemon.bench.delay import DelayProxy
from tests.support.meshd import Daemon

HELD_OUT = [  # prompts no other test (and no tuning) used
    [{"role": "user", "content": "Describe the water cycle to a ten-year-old."}],
    [{"role": "system", "content": "Answer in lists."}, {"role": "user", "content": "Name the planets in order."}],
    [{"role": "user", "content": "Write a Python function that reverses a linked list."}],
]
DRAFT = ["--draft-model", "built-in", "--draft-quantize", "int8"]


class WanMesh:
    """Nodes 0-9 (the head, drafting), 10-19 and 20-29 (or ``ranges``); every node reached through a delay proxy
    but the head."""

    def __init__(self, model, log_dir, rtt_ms: float = 10.0, head_extra=DRAFT, tail_variant=None,
                 ranges=("0-9", "10-19", "20-29")) -> None:
        ports = free_ports(3)
        self.proxies = [DelayProxy(port, rtt_ms) for port in ports[1:]]
        urls = [node_url("127.0.0.1", ports[0])] + [node_url("127.0.0.1", p.port) for p in self.proxies]
        specs = [(ranges[0], list(head_extra), None), (ranges[1], [], None), (ranges[2], [], tail_variant)]
        self.daemons: list[Daemon] = []
        try:
            for i, ((layers, extra, variant), port) in enumerate(zip(specs, ports)):
                public = ["--public-url", urls[i]] if i else []
                self.daemons.append(Daemon(model, layers, port=port, log_dir=log_dir, variant=variant,
                                           extra=extra + public, peer_urls=[u for j, u in enumerate(urls) if j != i]))
            for d in self.daemons:
                d.wait_ready()
            for d in self.daemons:
                d.wait_peers(2)
        except BaseException:
            self.stop()
            raise
        self.head, self.plain = self.daemons[0], self.daemons[1]  # node 10-19 heads too, with no draft model

    def stop(self) -> None:
        for d in self.daemons:
            d.stop()
        for p in self.proxies:
            p.close()


@pytest.fixture(scope="module")
def wan(default_model, tmp_path_factory):
    mesh = WanMesh(default_model, tmp_path_factory.mktemp("logs"))
    yield mesh
    mesh.stop()


def chat(node: Daemon, messages, max_tokens: int, **extra) -> dict:
    status, body = node.chat({"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
                             | extra)
    assert status == 200, body
    return body["meshnet"] | {"logprobs": (body["choices"][0].get("logprobs") or {}).get("content")}


@pytest.mark.slow
@pytest.mark.parametrize("prompt", range(len(HELD_OUT)))
def test_greedy_answers_over_10_ms_hops_are_generates_with_drafts_accepted(wan, reference_tokens, prompt):
    stats = chat(wan.head, HELD_OUT[prompt], 64)
    assert stats["token_ids"] == reference_tokens(HELD_OUT[prompt], 64, ignore_eos=True)
    assert stats["verify_steps"] > 0 and stats["accepted_tokens"] > 0, stats
    assert stats["accepted_tokens"] <= stats["drafted_tokens"]
    assert stats["reprefills"] == 0 and stats["cache_misses"] == 0
    assert all(hop["verifies"] for hop in stats["route"])


@pytest.mark.slow
def test_sampled_answers_with_logprobs_and_penalties_are_the_same_tokens_as_without_speculation(wan):
    messages = HELD_OUT[0]
    asked = {"temperature": 0.8, "top_p": 0.9, "seed": 42, "logprobs": True, "top_logprobs": 3,
             "presence_penalty": 0.4, "frequency_penalty": 0.2, "repetition_penalty": 1.1}
    drafted = chat(wan.head, messages, 48, **asked)
    plain = chat(wan.plain, messages, 48, **asked)
    assert drafted["route"][0]["local"] and not plain["route"][0]["local"]  # two heads, the same layers
    assert drafted["verify_steps"] > 0 and plain["verify_steps"] == 0
    assert drafted["token_ids"] == plain["token_ids"]
    for ours, theirs in zip(drafted["logprobs"], plain["logprobs"], strict=True):
        assert ours["token"] == theirs["token"]
        assert ours["logprob"] == pytest.approx(theirs["logprob"], abs=1e-4)
        assert [t["token"] for t in ours["top_logprobs"]] == [t["token"] for t in theirs["top_logprobs"]]


@pytest.mark.slow
def test_a_conversation_reuses_its_prefix_and_concurrent_streams_stay_exact(wan, reference_tokens):
    first = HELD_OUT[1]
    answer = chat(wan.head, first, 24)
    assert answer["token_ids"] == reference_tokens(first, 24, ignore_eos=True)
    text = wan.head.chat({"messages": first, "max_tokens": 24, "temperature": 0, "ignore_eos": True})[1]
    second = first + [{"role": "assistant", "content": text["choices"][0]["message"]["content"]},
                      {"role": "user", "content": "And their moons?"}]
    follow = chat(wan.head, second, 24)
    assert follow["cached_tokens"] > 0 and follow["token_ids"] == reference_tokens(second, 24, ignore_eos=True)

    results: dict[int, dict] = {}

    def run(i: int) -> None:
        results[i] = chat(wan.head, HELD_OUT[i], 32)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(HELD_OUT))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, stats in results.items():
        assert stats["token_ids"] == reference_tokens(HELD_OUT[i], 64, ignore_eos=True)[:32]


@pytest.mark.slow
def test_the_head_reports_drafted_and_accepted_tokens_in_prometheus(wan):
    chat(wan.head, HELD_OUT[2], 16)
    metrics = wan.head.metrics()
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith(("meshnet_draft_tokens_total", "meshnet_verify_steps_total"))}
    assert values['meshnet_draft_tokens_total{outcome="drafted"}'] >= values[
        'meshnet_draft_tokens_total{outcome="accepted"}'] > 0
    assert values["meshnet_verify_steps_total"] > 0


@pytest.mark.slow
def test_a_route_with_an_older_node_gets_no_verify_steps_and_the_same_answer(default_model, reference_tokens,
                                                                           tmp_path):
    mesh = WanMesh(default_model, tmp_path, rtt_ms=0.0, tail_variant="no-speculation")
    try:
        stats = chat(mesh.head, HELD_OUT[0], 32)
        assert stats["verify_steps"] == 0 and stats["drafted_tokens"] == 0
        assert not stats["route"][-1]["verifies"]
        assert stats["token_ids"] == reference_tokens(HELD_OUT[0], 64, ignore_eos=True)[:32]
    finally:
        mesh.stop()


@pytest.mark.slow
def test_a_gguf_draft_model_is_converted_and_drafts_exactly(default_model, reference_tokens, tmp_path):
    """``--draft-model FILE.gguf``: the built-in model's own GGUF file, converted whole as a node's range would be
    and quantized to int8 on the head."""
    from daemon.model.source import default_gguf_path

    gguf = default_gguf_path()
    assert gguf.is_file(), "the built-in model's GGUF is taken out of its wheel when the model is first resolved"
    mesh = WanMesh(default_model, tmp_path, head_extra=["--draft-model", str(gguf), "--draft-quantize", "int8"])
    try:
        stats = chat(mesh.head, HELD_OUT[1], 32)
        assert stats["token_ids"] == reference_tokens(HELD_OUT[1], 64, ignore_eos=True)[:32]
        assert stats["verify_steps"] > 0 and stats["accepted_tokens"] > 0, stats
        assert "speculative decoding: drafting up to 4 tokens with" in mesh.head.log()
    finally:
        mesh.stop()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_hybrid_models_stay_exact_with_speculation_on(tiny_model, arch, tmp_path):
    """Linear-attention layers on every node take rejected positions back from copies of their state: the draft
    is the same tiny model in bfloat16, which mostly agrees, so steps keep some drafts and drop the rest. The hops
    take 10 ms, so drafting pays and the head drafts."""
    from tests.mesh.test_prefix_mesh import reference_generate

    folder = tiny_model(arch)
    draft = ["--draft-model", str(folder), "--draft-dtype", "bfloat16", "--draft-max", "4"]
    mesh = WanMesh(folder, tmp_path, head_extra=draft, ranges=("0-1", "2-2", "3-3"))
    try:
        head = mesh.head
        for question in ("one two three", "the quick brown fox"):
            messages = [{"role": "user", "content": question}]
            stats = chat(head, messages, 40)
            assert stats["token_ids"] == reference_generate(folder, messages, 40)
            assert stats["verify_steps"] > 0, stats
        assert sum(chat(head, [{"role": "user", "content": q}], 40)["accepted_tokens"] for q in ("a", "b")) > 0
    finally:
        mesh.stop()


@pytest.mark.slow
def test_a_draft_model_with_another_tokenizer_is_refused_in_one_line(tiny_model, tmp_path):
    import json
    import shutil

    from tests.support.meshd import run_meshd

    other = tmp_path / "other"
    shutil.copytree(tiny_model("llama"), other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({"id": 49151, "content": "<|not-the-same|>", "single_word": False,
                                      "lstrip": False, "rstrip": False, "normalized": False, "special": True})
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    done = run_meshd("--model", str(tiny_model("llama")), "--draft-model", str(other), "--port", "1")
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "another tokenizer" in errors[0], done.stderr


@pytest.mark.slow
def test_a_failover_mid_verify_replays_only_what_was_accepted(default_model, reference_tokens, tmp_path):
    """Two slow replicas of 15-29 (every step 150 ms later), so the kill lands while a verify step is on the wire."""
    from tests.mesh.test_failover import holds_session, stop_all
    from tests.support.streams import Stream

    r2 = Daemon(default_model, "15-29", log_dir=tmp_path, variant="slow-150")
    r1 = Daemon(default_model, "15-29", log_dir=tmp_path, variant="slow-150", peers=[r2])
    head = Daemon(default_model, "0-14", log_dir=tmp_path, peers=[r1, r2], extra=DRAFT)
    daemons = [head, r1, r2]
    try:
        for d in daemons:
            d.wait_ready()
        head.wait_peers(2)
        messages = HELD_OUT[2]
        stream = Stream(head, {"messages": messages, "max_tokens": 48, "temperature": 0, "ignore_eos": True})
        stream.read_tokens(8)
        victim = next(r for r in (r1, r2) if holds_session(r, stream.session_id))
        victim.kill()
        stats = stream.finish()
        assert "error" not in stats, stats
        assert stats["token_ids"] == reference_tokens(messages, 48, ignore_eos=True)
        assert stats["failovers"] == 1 and stats["verify_steps"] > 0
        # the replacement alone was prefilled, from the head's inputs for the accepted positions (a rejected
        # draft among them would have changed the tokens); the head computed nothing again
        assert stats["span_replays"] == 1 and stats["reprefills"] == 0
        assert stats["prompt_computed_tokens"] == stats["prompt_tokens"]
        survivor = r2 if victim is r1 else r1
        held = [{s["session_id"]: s["past_len"] for s in d.get("/v1/sessions")["sessions"]} for d in (head, survivor)]
        assert held[0][stream.session_id] == held[1][stream.session_id]
    finally:
        stop_all(daemons)



@pytest.mark.slow
def test_a_retained_session_is_cut_back_to_the_positions_its_generation_kept(tiny_model, tmp_path):
    """Over HTTP, on a hybrid node: a verify step, then the head's retain with the kept length (a generation that
    ended inside the step). The node replays the kept positions on its torch thread and keeps exactly those."""
    import time as clock

    from tests.mesh.test_forward_protocol import forward, random_hidden
    from tests.support.headers import CACHE, PAST_LEN, SESSION
    from tests.support.http_client import send

    node = Daemon(tiny_model("qwen3_5"), "2-3", log_dir=tmp_path)
    try:
        node.wait_ready()
        assert node.get("/v1/status")["speculation"] is True
        assert forward(node.url, random_hidden(6), {SESSION: "s", CACHE: "prefill"}).status == 200
        verify = forward(node.url, random_hidden(4, seed=1), {SESSION: "s", CACHE: "decode", PAST_LEN: "6",
                                                                "X-Meshnet-Draft": "1,2,3"})
        assert verify.status == 200 and 1 <= len(verify.json()["tokens"]) <= 4, verify
        assert send("POST", node.url + "/v1/sessions/s/retain?past_len=x").status == 400
        assert send("POST", node.url + "/v1/sessions/s/retain?past_len=7").status == 200
        deadline = clock.monotonic() + 10
        while clock.monotonic() < deadline:
            held = {s["session_id"]: s for s in node.get("/v1/sessions")["sessions"]}["s"]
            if held["retained"]:
                break
            clock.sleep(0.05)
        assert held["retained"] and held["past_len"] == 7, held
        # the session continues from there: a decode step at 7 is served, one at 10 (the verify step's end) misses
        assert forward(node.url, random_hidden(1, seed=2), {SESSION: "s", CACHE: "decode", PAST_LEN: "7"}).status == 200
    finally:
        node.stop()
