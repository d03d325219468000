"""The OpenAI-compatible chat API of a real two-node mesh, driven by the official ``openai`` SDK.

A tiny random 4-layer llama with the built-in model's tokenizer is split over a head (layers
0-1) and a tail (2-3), shared with ``test_openai_surface`` (``tests.conftest.openai_mesh``). Greedy
answers are checked against ``model.generate`` of the same model loaded whole in this process; the SDK
validates every response strictly against its types.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch

from tests.support.http_client import send
from tests.support.openai_clients import client, head, mesh, model_dir  # noqa: F401 (pytest fixtures)

MESSAGES = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def reference(model_dir):
    """``reference(messages, n)`` -> (prompt ids, greedy completion ids) from transformers' ``generate``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def run(messages, n):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None,
                                 attention_mask=torch.ones_like(ids))
        return ids[0].tolist(), out[0, ids.shape[1]:].tolist()

    run.tokenizer = tokenizer
    return run


def raw_post(url: str, path: str, body: bytes) -> tuple[int, dict]:
    """POST ``body`` as it is, labelled JSON; the answer must be JSON, whatever its status."""
    reply = send("POST", url + path, body, {"Content-Type": "application/json"}, timeout=300)
    assert reply.headers.get("Content-Type", "").startswith("application/json"), (reply.status, reply.body[:300])
    return reply.status, reply.json()


def assert_openai_error(status: int, body: dict, param: str | None = None) -> None:
    assert status == 400, body
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert error["type"] == "invalid_request_error", error
    if param is not None:
        assert error["param"] == param, error


@pytest.fixture(scope="module")
def greedy16(client):
    """A greedy 16-token answer (ignoring EOS): the baseline several tests compare with."""
    return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, **GREEDY)


# --- plain requests -----------------------------------------------------------------------------


def test_health(head):
    reply = send("GET", head.url + "/health", timeout=30)
    assert reply.status == 200
    assert reply.json()["status"] == "ok"


def test_models_list_shows_the_model(client, mesh, model_dir):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny", "tiny-alias"]
    assert models.data[0].object == "model"
    # without --served-model-name: the model folder's name, never a hash
    assert [m["id"] for m in mesh[1].get("/v1/models")["data"]] == [model_dir.name]


def test_models_retrieve_and_an_unknown_model_is_openais_404(client):
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-5")
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-5", messages=MESSAGES, max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    assert info.value.body["param"] == "model" and info.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-5", prompt="Hello", max_tokens=2)


def test_an_alias_or_no_model_at_all_is_served(client, head):
    resp = client.chat.completions.create(model="tiny-alias", messages=MESSAGES, max_tokens=2, **GREEDY)
    assert resp.model == "tiny"  # answers report the first name
    status, reply = raw_post(head.url, "/v1/chat/completions",
                             json.dumps({"messages": MESSAGES, "max_tokens": 2}).encode())
    assert status == 200 and reply["model"] == "tiny", reply


def test_non_streaming_greedy_matches_generate(client, reference, model_dir):
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, **GREEDY)
    prompt_ids, expected_ids = reference(MESSAGES, 8)
    assert resp.object == "chat.completion"
    assert resp.model == "tiny"
    assert len(resp.choices) == 1
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason == "length"
    assert choice.message.content == reference.tokenizer.decode(expected_ids, skip_special_tokens=True)
    assert resp.usage.completion_tokens == 8
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_streaming_equals_non_streaming_and_ends_with_usage(client, greedy16):
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert len(chunks) >= 3
    assert len({c.id for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy16.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == 16
    assert last.usage.prompt_tokens == greedy16.usage.prompt_tokens
    assert last.usage.total_tokens == last.usage.prompt_tokens + 16
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_without_include_usage_has_no_usage_chunk(client):
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, stream=True,
                                                 **GREEDY))
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_max_completion_tokens_is_honoured(client, greedy16):
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=5, **GREEDY)
    assert resp.usage.completion_tokens == 5
    assert resp.choices[0].finish_reason == "length"
    assert greedy16.choices[0].message.content.startswith(resp.choices[0].message.content)


def test_seeded_sampling_is_reproducible(client):
    def sample(seed):
        resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0.8,
                                              seed=seed, extra_body={"ignore_eos": True})
        assert resp.usage.completion_tokens == 12
        return resp.choices[0].message.content

    first, again, other = sample(1234), sample(1234), sample(98765)
    assert first == again
    assert first != other  # a random tiny model: 12 tokens at temperature 0.8 practically never agree


def test_stop_string_cuts_the_text(client, greedy16):
    full = greedy16.choices[0].message.content
    # a stop string that really occurs, first at position k, in the middle of the greedy answer
    stop, k = None, None
    for i in range(max(1, len(full) // 3), len(full) - 3):
        candidate = full[i : i + 3]
        if candidate.strip() and "\ufffd" not in candidate and full.find(candidate) == i:
            stop, k = candidate, i
            break
    assert stop is not None, full
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, stop=[stop], **GREEDY)
    assert resp.choices[0].message.content == full[:k]
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens < 16

    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, stop=stop,
                                                 stream=True, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full[:k]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_tiny_temperature_is_greedy_or_rejected(client, greedy16):
    try:
        resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=1e-300,
                                              seed=3, extra_body={"ignore_eos": True})
    except openai.BadRequestError as exc:
        assert exc.param == "temperature"
        return
    assert resp.choices[0].message.content == greedy16.choices[0].message.content


# --- bad parameters -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, param",
    [
        pytest.param({"temperature": 5}, "temperature", id="temperature-5"),
        pytest.param({"temperature": -0.1}, "temperature", id="temperature-negative"),
        pytest.param({"top_p": 0}, "top_p", id="top-p-0"),
        pytest.param({"top_p": 1.5}, "top_p", id="top-p-1.5"),
        pytest.param({"max_tokens": 0}, "max_tokens", id="max-tokens-0"),
        pytest.param({"max_tokens": 10**7}, "max_tokens", id="max-tokens-past-context"),
        pytest.param({"max_completion_tokens": 0}, "max_completion_tokens", id="max-completion-tokens-0"),
        pytest.param({"messages": []}, "messages", id="messages-empty"),
        pytest.param({"messages": [{"content": "hi"}]}, "messages", id="messages-missing-role"),
        pytest.param({"messages": [{"role": "wizard", "content": "hi"}]}, "messages", id="messages-unknown-role"),
        pytest.param({"messages": [{"role": "user", "content": 5}]}, "messages", id="messages-content-number"),
        pytest.param({"stop": ["a", "b", "c", "d", "e"]}, "stop", id="stop-5-items"),
        pytest.param({"stop": [""]}, "stop", id="stop-empty-string"),
        pytest.param({"n": 2}, "n", id="n-2"),
        pytest.param({"seed": 1.5}, "seed", id="seed-float"),
        pytest.param({"extra_body": {"ignore_eos": "yes"}}, "ignore_eos", id="ignore-eos-string"),
    ],
)
def test_bad_parameters_are_400(client, kwargs, param):
    request = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4} | kwargs
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**request)
    exc = info.value
    assert exc.status_code == 400
    assert isinstance(exc.body, dict), exc.body
    assert isinstance(exc.body.get("message"), str) and exc.body["message"], exc.body
    assert exc.type == "invalid_request_error"
    assert exc.param == param, exc.body


@pytest.mark.parametrize("stream", ["yes", 1, "true"])
def test_stream_must_be_a_boolean(head, stream):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "stream": stream}
    status, reply = raw_post(head.url, "/v1/chat/completions", json.dumps(body).encode())
    assert_openai_error(status, reply, "stream")


@pytest.mark.parametrize("name", ["n", "stream"])
def test_null_means_the_default(head, name):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, name: None}
    status, reply = raw_post(head.url, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, reply
    assert reply["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b'{"model": "tiny", "messages": [', id="truncated-json"),
        pytest.param(b"not json at all", id="not-json"),
        pytest.param(b"", id="empty"),
        pytest.param(b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', id="invalid-utf8"),
        pytest.param(b'[{"role": "user", "content": "hi"}]', id="json-list"),
        pytest.param(b'"hello"', id="json-string"),
    ],
)
def test_invalid_json_body_is_a_400_in_openai_shape(head, body):
    status, reply = raw_post(head.url, "/v1/chat/completions", body)
    assert_openai_error(status, reply)


def test_the_head_still_answers_after_bad_requests(client):
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, **GREEDY)
    assert resp.usage.completion_tokens == 2
