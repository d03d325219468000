"""The OpenAI surface tools rely on, on a real two-node mesh, through real clients: the ``openai`` SDK and
LangChain (``langchain_openai``). Legacy completions of a raw prompt, logprobs (chat and legacy shapes),
penalties and min-p, and the parameters meshd refuses with a 400 that names them.

A tiny random 4-layer llama with the built-in model's tokenizer is split over a head (layers 0-1) and a
tail (2-3): the mesh ``test_openai_api`` uses too (``tests.conftest.openai_mesh``). Every greedy answer
is checked token for token against transformers' ``generate`` (or, for OpenAI's penalties, a direct
computation) on the same model loaded whole in this process, and every logprob against its own
log-softmax. The tail is meshd with one twist (``tests.support.meshd_variants`` ``forgetful``): it loses the
session of a request whose id starts ``forget-`` every 4th decode step, so those requests re-prefill
mid-answer and must still come out exact.
"""

from __future__ import annotations

import openai
import pytest
import torch

from tests.support.http_client import http_json
from tests.support.openai_clients import client, head, mesh, model_dir  # noqa: F401 (pytest fixtures)

MESSAGES = [{"role": "user", "content": "Name three colours."}]
PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
TOLERANCE = 1e-4  # logprobs: the split model in float32 against the whole one


@pytest.fixture(scope="module")
def lenient(head):
    """For streamed completions: the SDK types their ``finish_reason`` as never null, yet OpenAI's own stream
    (and vLLM's) sends null until the last chunk, so strict validation refuses OpenAI's API itself there."""
    return openai.OpenAI(base_url=head.url + "/v1", api_key="none", max_retries=0, timeout=300)


class Reference:
    """The tiny model whole, in this process: what the mesh's answers must equal."""

    def __init__(self, model_dir) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def chat_ids(self, messages) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def prompt_ids(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    def generate(self, prompt_ids: list[int], n: int, **kwargs) -> list[int]:
        ids = torch.tensor([prompt_ids])
        with torch.inference_mode():
            out = self.model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None,
                                      attention_mask=torch.ones_like(ids), **kwargs)
        return out[0, ids.shape[1]:].tolist()

    def logprobs(self, prompt_ids: list[int], answer: list[int]) -> torch.Tensor:
        """``[len(answer), vocab]``: the log-softmax of the logits that chose each answer token."""
        with torch.inference_mode():
            logits = self.model(torch.tensor([prompt_ids + answer])).logits[0].float()
        return torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)

    def openai_penalized(self, prompt_ids: list[int], n: int, presence: float, frequency: float) -> list[int]:
        """Greedy under OpenAI's definition: ``logit[j] -= c[j] * frequency + (c[j] > 0) * presence``,
        ``c`` counting the answer's tokens so far."""
        answer: list[int] = []
        for _ in range(n):
            with torch.inference_mode():
                logits = self.model(torch.tensor([prompt_ids + answer])).logits[0, -1].float()
                for token in set(answer):
                    logits[token] -= answer.count(token) * frequency + presence
            answer.append(int(torch.argmax(logits)))
        return answer

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def reference(model_dir):
    return Reference(model_dir)


def meshnet(resp) -> dict:
    """The ``meshnet`` block an answer carries beside OpenAI's fields."""
    return resp.model_extra["meshnet"]


# --- legacy completions -----------------------------------------------------------------------------


def test_a_raw_prompt_completes_as_generate_in_every_form(client, reference):
    ids = reference.prompt_ids(PROMPT)
    expected = reference.generate(ids, 10)
    for prompt in (PROMPT, ids, [PROMPT], [ids]):
        resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, **GREEDY)
        assert resp.object == "text_completion" and resp.model == "tiny"
        assert meshnet(resp)["token_ids"] == expected, prompt
        assert resp.choices[0].text == reference.text(expected)
        assert resp.choices[0].finish_reason == "length"
        assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 10


def test_a_streamed_completion_equals_the_whole_one(client, lenient):
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, **GREEDY)
    chunks = list(lenient.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_a_completion_defaults_to_16_tokens_and_honours_stop(client):
    resp = client.completions.create(model="tiny", prompt=PROMPT, **GREEDY)
    assert resp.usage.completion_tokens == 16
    full = resp.choices[0].text
    stop = next(full[i:i + 2] for i in range(4, len(full) - 2)
                if full[i:i + 2].strip() and "\ufffd" not in full[i:i + 2] and full.find(full[i:i + 2]) == i)
    cut = client.completions.create(model="tiny", prompt=PROMPT, stop=stop, **GREEDY)
    assert cut.choices[0].text == full[:full.find(stop)] and cut.choices[0].finish_reason == "stop"


def test_seeded_completions_reproduce(client):
    def sample(seed):
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0.9, top_p=0.95,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


# --- logprobs -----------------------------------------------------------------------------------------


def check_entry(entry, row: torch.Tensor, token_id: int, top: int, tokenizer) -> None:
    """One token's logprobs against the reference's log-softmax ``row``."""
    assert entry.logprob == pytest.approx(float(row[token_id]), abs=TOLERANCE)
    assert entry.token == tokenizer.decode([token_id])
    assert entry.bytes == list(entry.token.encode("utf-8"))
    best = torch.topk(row, top)
    assert [t.logprob for t in entry.top_logprobs] == pytest.approx(best.values.tolist(), abs=TOLERANCE)
    assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([i]) for i in best.indices.tolist()]
    logprobs = [t.logprob for t in entry.top_logprobs]
    assert logprobs == sorted(logprobs, reverse=True)


def test_chat_logprobs_are_the_models_log_softmax(client, reference):
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, logprobs=True,
                                          top_logprobs=5, **GREEDY)
    answer = meshnet(resp)["token_ids"]
    assert answer == reference.generate(reference.chat_ids(MESSAGES), 8)
    rows = reference.logprobs(reference.chat_ids(MESSAGES), answer)
    content = resp.choices[0].logprobs.content
    assert len(content) == 8
    for entry, row, token_id in zip(content, rows, answer):
        check_entry(entry, row, token_id, 5, reference.tokenizer)
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the chosen is the best

    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, logprobs=True,
                                                 top_logprobs=5, stream=True, **GREEDY))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    for entry, row, token_id in zip(streamed, rows, answer):
        check_entry(entry, row, token_id, 5, reference.tokenizer)
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_sampled_tokens_report_their_own_logprob(client, reference):
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, logprobs=True,
                                          temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    answer = meshnet(resp)["token_ids"]
    rows = reference.logprobs(reference.chat_ids(MESSAGES), answer)
    for entry, row, token_id in zip(resp.choices[0].logprobs.content, rows, answer):
        assert entry.logprob == pytest.approx(float(row[token_id]), abs=TOLERANCE)
        assert entry.top_logprobs == []


def test_completion_logprobs_in_the_legacy_shape(client, lenient, reference):
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, logprobs=3, **GREEDY)
    answer = meshnet(resp)["token_ids"]
    rows = reference.logprobs(reference.prompt_ids(PROMPT), answer)
    block = resp.choices[0].logprobs
    assert block.tokens == [reference.tokenizer.decode([i]) for i in answer]
    assert block.token_logprobs == pytest.approx([float(r[i]) for r, i in zip(rows, answer)], abs=TOLERANCE)
    assert block.text_offset == [sum(len(t) for t in block.tokens[:k]) for k in range(6)]
    for top, row in zip(block.top_logprobs, rows):
        best = torch.topk(row, 3)
        assert list(top.values()) == pytest.approx(best.values.tolist(), abs=TOLERANCE)
    streamed = list(lenient.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, logprobs=3, stream=True,
                                              **GREEDY))
    offsets = [o for c in streamed if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == block.text_offset


# --- penalties and min-p ------------------------------------------------------------------------------


def test_greedy_with_a_repetition_penalty_is_generates(client, reference):
    # on this random model, a penalty above 1 changes the raw prompt's answer; the chat's changes below 1 only
    for kind, ids, penalty in [("completion", reference.prompt_ids(PROMPT), 1.5),
                               ("chat", reference.chat_ids(MESSAGES), 0.8)]:
        expected = reference.generate(ids, 16, repetition_penalty=penalty)
        assert expected != reference.generate(ids, 16), kind  # the penalty matters here
        extra = {"extra_body": {"ignore_eos": True, "repetition_penalty": penalty}, "temperature": 0}
        if kind == "chat":
            resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, **extra)
        else:
            resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, **extra)
        assert meshnet(resp)["token_ids"] == expected, kind


def test_presence_and_frequency_penalties_as_openai_defines_them(client, reference):
    ids = reference.chat_ids(MESSAGES)
    # this random model never repeats itself unprompted: a negative presence penalty makes it, and the
    # frequency penalty then counts the repeats, so the answer depends on every token so far
    expected = reference.openai_penalized(ids, 16, presence=-0.5, frequency=0.2)
    assert expected != reference.generate(ids, 16)
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, presence_penalty=-0.5,
                                          frequency_penalty=0.2, **GREEDY)
    assert meshnet(resp)["token_ids"] == expected


def test_penalties_and_logprobs_stay_exact_across_re_prefills(client, reference):
    ids = reference.chat_ids(MESSAGES)
    expected = reference.generate(ids, 14, repetition_penalty=0.8)
    forgetful = client.with_options(default_headers={"X-Request-Id": "forget-penalty"})
    resp = forgetful.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=14, logprobs=True,
                                             top_logprobs=2, temperature=0,
                                             extra_body={"ignore_eos": True, "repetition_penalty": 0.8})
    stats = meshnet(resp)
    assert stats["reprefills"] >= 2, stats  # the tail lost the session twice, at least
    assert stats["token_ids"] == expected
    rows = reference.logprobs(ids, expected)
    for entry, row, token_id in zip(resp.choices[0].logprobs.content, rows, expected):
        check_entry(entry, row, token_id, 2, reference.tokenizer)

    openai_expected = reference.openai_penalized(ids, 14, presence=-0.5, frequency=0.2)
    resp = forgetful.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=14, presence_penalty=-0.5,
                                             frequency_penalty=0.2, **GREEDY)
    assert meshnet(resp)["reprefills"] >= 2 and meshnet(resp)["token_ids"] == openai_expected


def test_min_p_of_one_keeps_only_the_best_token(client, reference):
    expected = reference.generate(reference.chat_ids(MESSAGES), 10)
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=1.5, seed=3,
                                          extra_body={"ignore_eos": True, "min_p": 1.0})
    assert meshnet(resp)["token_ids"] == expected
    loose = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=1.5, seed=3,
                                           extra_body={"ignore_eos": True, "min_p": 0.0})
    assert meshnet(loose)["token_ids"] != expected


# --- what meshd refuses, by name ----------------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("extra, param", [
    ({"tools": [TOOL]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"logit_bias": {"42": 5}}, "logit_bias"),
    ({"n": 2}, "n"),
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"model": 5}, "model"),
])
def test_chat_refuses_by_name(head, extra, param):
    status, body = http_json("POST", head.url + "/v1/chat/completions",
                             {"model": "tiny", "messages": MESSAGES, "max_tokens": 2} | extra)
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error", body


@pytest.mark.parametrize("extra, param", [
    ({"prompt": ["one", "two"]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, "x"]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"echo": True}, "echo"),
    ({"suffix": "end"}, "suffix"),
    ({"best_of": 2}, "best_of"),
    ({"n": 3}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"logit_bias": {"1": -100}}, "logit_bias"),
    ({"stream": "yes"}, "stream"),
])
def test_completions_refuse_by_name(head, extra, param):
    status, body = http_json("POST", head.url + "/v1/completions",
                             {"model": "tiny", "prompt": PROMPT, "max_tokens": 2} | extra)
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error", body


def test_harmless_defaults_of_refused_parameters_are_accepted(head):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "tool_choice": "none", "tools": [],
            "response_format": {"type": "text"}, "logit_bias": {}, "n": 1, "logprobs": False}
    status, reply = http_json("POST", head.url + "/v1/chat/completions", body)
    assert status == 200, reply
    body = {"prompt": PROMPT, "max_tokens": 2, "echo": False, "suffix": None, "best_of": 1, "logprobs": None}
    status, reply = http_json("POST", head.url + "/v1/completions", body)
    assert status == 200 and reply["choices"][0]["logprobs"] is None, reply


# --- LangChain ----------------------------------------------------------------------------------------


def test_langchain_chat_model_invokes_and_streams(head, reference):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=head.url + "/v1", api_key="none", model="tiny", temperature=0, max_tokens=8,
                      max_retries=0, extra_body={"ignore_eos": True})
    expected = reference.text(reference.generate(reference.chat_ids(MESSAGES), 8))
    message = chat.invoke([("user", MESSAGES[0]["content"])])
    assert message.content == expected
    assert message.response_metadata["model_name"] == "tiny"
    assert "".join(part.content for part in chat.stream([("user", MESSAGES[0]["content"])])) == expected


def test_langchain_completion_model(head, reference):
    from langchain_openai import OpenAI

    llm = OpenAI(base_url=head.url + "/v1", api_key="none", model="tiny", temperature=0, max_tokens=8,
                 max_retries=0, extra_body={"ignore_eos": True})
    expected = reference.text(reference.generate(reference.prompt_ids(PROMPT), 8))
    assert llm.invoke(PROMPT) == expected
    assert "".join(llm.stream(PROMPT)) == expected


def test_the_mesh_logs_no_errors(mesh):
    for d in mesh:
        assert "Traceback" not in d.log(), d.log()[-3000:]


def test_a_head_that_is_its_own_tail_applies_penalties_and_logprobs(mesh, reference):
    """The tail node heads too: its own layers sample, so the history and logprobs never cross HTTP there."""
    _, tail = mesh
    ids = reference.prompt_ids(PROMPT)
    expected = reference.generate(ids, 10, repetition_penalty=1.5)
    status, body = http_json("POST", tail.url + "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "repetition_penalty": 1.5,
        "logprobs": 2})
    assert status == 200, body
    assert body["meshnet"]["token_ids"] == expected
    assert [h["local"] for h in body["meshnet"]["route"]] == [False, True]
    rows = reference.logprobs(ids, expected)
    assert body["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        [float(r[i]) for r, i in zip(rows, expected)], abs=TOLERANCE)


def batched_steps(node) -> float:
    """Steps this node ran in forwards of more than one session (from its ``meshnet_batch_size`` histogram)."""
    total = single = 0.0
    for line in node.metrics().splitlines():
        if line.startswith("meshnet_batch_size_sum"):
            total = float(line.split()[-1])
        elif line.startswith('meshnet_batch_size_bucket{le="1.0"}'):
            single = float(line.split()[-1])
    return total - single


def test_concurrent_penalized_answers_batched_on_the_tail_stay_exact(client, mesh, reference):
    """Decode steps of several sessions run as one forward on the tail: each keeps its own history and logprobs."""
    from concurrent.futures import ThreadPoolExecutor

    batched_before = batched_steps(mesh[1])

    ids = reference.chat_ids(MESSAGES)
    asks = [{"repetition_penalty": 0.8}, {"presence_penalty": -0.5, "frequency_penalty": 0.2}, {}]
    expected = [reference.generate(ids, 12, repetition_penalty=0.8),
                reference.openai_penalized(ids, 12, presence=-0.5, frequency=0.2),
                reference.generate(ids, 12)]

    def ask(extra):
        return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                              logprobs=True, extra_body={"ignore_eos": True} | extra)

    with ThreadPoolExecutor(len(asks)) as pool:
        answers = list(pool.map(ask, asks))
    assert batched_steps(mesh[1]) > batched_before  # some steps did run together
    for resp, tokens in zip(answers, expected):
        assert meshnet(resp)["token_ids"] == tokens
        rows = reference.logprobs(ids, tokens)
        assert [e.logprob for e in resp.choices[0].logprobs.content] == pytest.approx(
            [float(r[i]) for r, i in zip(rows, tokens)], abs=TOLERANCE)
