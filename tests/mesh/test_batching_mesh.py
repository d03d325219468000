"""Concurrent streams through a real two-node mesh batch their decode steps and keep their tokens.

Issue 15, "exactness" end to end: several clients at once, each with a prompt of its own, through two
``meshd`` processes on loopback. Every stream's tokens equal ``generate``'s for its prompt alone, while
both nodes' ``/metrics`` show decode steps that ran in batches; with ``--max-batch 1`` every step ran alone.
"""

from __future__ import annotations

import threading

import pytest

from daemon.bench.mesh import counter_value
from tests.support.meshd import start_mesh

pytestmark = pytest.mark.slow  # two meshes of real daemons: in .ci/run, not in the fast subset

PROMPTS = [  # not the prompts the batching was developed on: a held-out set
    "Name two planets.",
    "What is a prime number?",
    "Give me a word that rhymes with cat.",
    "Why do leaves fall in autumn?",
    "Suggest a name for a boat.",
    "How many legs does a spider have?",
]
TOKENS = 20


def streams_at_once(head, prompts: list[str]) -> list[dict]:
    results: list = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def one(i: int, prompt: str) -> None:
        start.wait()
        status, body = head.chat({"messages": [{"role": "user", "content": prompt}], "max_tokens": TOKENS,
                                  "temperature": 0, "ignore_eos": True}, timeout=300)
        results[i] = body if status == 200 else {"error": (status, body)}

    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return results


def batch_counts(daemon) -> tuple[float, float]:
    """(forwards run, steps run in them) on this node."""
    text = daemon.metrics()
    return counter_value(text, "meshnet_batch_size_count"), counter_value(text, "meshnet_batch_size_sum")


def batch_requests(daemon) -> tuple[float, float]:
    """(``POST /forward/batch`` requests answered, ``POST /forward`` ones) by this node."""
    text = daemon.metrics()
    return (counter_value(text, "meshnet_http_requests_total", endpoint="/forward/batch", status="200"),
            counter_value(text, "meshnet_http_requests_total", endpoint="/forward", status="200"))


@pytest.mark.parametrize("max_batch", [16, 1])
def test_streams_at_once_batch_on_both_nodes_and_each_gets_generates_tokens(max_batch, default_model,
                                                                            reference_tokens, tmp_path):
    extra = ["--max-batch", str(max_batch), "--kv-max-sessions", "16"]  # room for both rounds' sessions
    # with --max-batch 1, the head sends each step on its own POST /forward too
    env = {"MESHNET_BATCH_HOPS": "off"} if max_batch == 1 else None
    mesh = start_mesh(default_model, [("0-14", extra), ("15-29", extra)], log_dir=tmp_path, env=env)
    try:
        # the second round's prompts are held: each stream begins with one step from its prompt's cache (the
        # first steps batch too) rather than a prefill
        for round in range(2):
            results = streams_at_once(mesh[0], PROMPTS)
            for prompt, body in zip(PROMPTS, results):
                assert "error" not in body, body
                want = reference_tokens([{"role": "user", "content": prompt}], TOKENS, True)
                assert body["meshnet"]["token_ids"] == want, (round, prompt)
                usage = body["usage"]
                if round == 1:  # all but the last prompt token came from the cache
                    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1, usage
        for node in mesh:
            forwards, steps = batch_counts(node)
            assert steps >= 2 * len(PROMPTS) * TOKENS  # every step of every stream ran on both nodes
            if max_batch == 1:
                assert forwards == steps, (node.layers, forwards, steps)
            else:  # six streams at once: most steps shared a forward with another stream's
                assert steps / forwards >= 1.5, (node.layers, forwards, steps)
            assert "unhandled error" not in node.log()
        batches, singles = batch_requests(mesh[1])
        if max_batch == 1:
            assert batches == 0, batches
        else:  # the head sent the tail most decode steps in batches: far fewer requests than steps
            assert batches > 0 and batches + singles < 0.5 * 2 * len(PROMPTS) * TOKENS, (batches, singles)
    finally:
        for d in mesh:
            d.stop()


# a hybrid (gated delta nets and full attention), windowed attention with per-type RoPE, and windowed attention
# with sinks on eager attention: every layer kind that batches, on both nodes of a mesh
@pytest.mark.parametrize("arch,split", [("qwen3_5", 2), ("gemma3_text", 2), ("gpt_oss", 1)])
def test_tiny_architectures_batch_through_a_mesh_and_each_stream_keeps_its_lone_tokens(arch, split, tiny_model,
                                                                                      tmp_path):
    extra = ["--max-batch", "16", "--kv-max-sessions", "16"]
    mesh = start_mesh(tiny_model(arch), [(f"0-{split - 1}", extra), (f"{split}-3", extra)], log_dir=tmp_path)
    try:
        alone = [streams_at_once(mesh[0], [prompt])[0] for prompt in PROMPTS]
        before = [batch_counts(node) for node in mesh]
        together = streams_at_once(mesh[0], PROMPTS)
        for prompt, lone, body in zip(PROMPTS, alone, together):
            assert "error" not in lone and "error" not in body, (lone, body)
            assert body["meshnet"]["token_ids"] == lone["meshnet"]["token_ids"], (arch, prompt)
        for node, (forwards0, steps0) in zip(mesh, before):
            forwards, steps = (after - first for after, first in zip(batch_counts(node), (forwards0, steps0)))
            assert steps >= len(PROMPTS) * TOKENS
            assert steps / forwards >= 1.5, (arch, node.layers, forwards, steps)  # they ran in shared forwards
            assert "unhandled error" not in node.log()
    finally:
        for d in mesh:
            d.stop()
