"""OpenAI's legacy ``POST /v1/completions``: a raw prompt (text or token ids, no chat template) in, its
continuation out, at once or as server-sent ``text_completion`` events, with the legacy ``logprobs``
(``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from daemon.api import GenerationStats
from daemon.errors import BadRequest
from daemon.mesh.generation import TokenEvent
from daemon.mesh.head import ChatRequest, Generation
from daemon.server.errors import read_json
from daemon.server.keys import NODE
from daemon.server.openai import stream_events, usage
from daemon.server.openai_request import (
    StreamOptions,
    boolean,
    check_model,
    generation_fields,
    integer,
    refuse_unsupported,
    stream_options,
)
from daemon.wire import MAX_TOP_LOGPROBS


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(i, int) and not isinstance(i, bool)
                                                           for i in value)


def _prompt(body: dict) -> str | list[int]:
    """One prompt: a string or a list of token ids, or a list holding exactly one of them."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or _is_ids(prompt[0])):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt is empty", param="prompt")
        return prompt
    if _is_ids(prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        raise BadRequest("only one prompt per request is supported", param="prompt")
    raise BadRequest("prompt must be a string or a list of token ids", param="prompt")


def parse_completion_request(body, *, max_tokens_cap: int,
                             served: list[str] | None = None) -> tuple[ChatRequest, StreamOptions]:
    """Validate a legacy completion request; every problem is a 400 that names its parameter."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if served is not None:
        check_model(body, served)
    prompt = _prompt(body)
    refuse_unsupported(body)
    if boolean(body, "echo", False):
        raise BadRequest("echo is not supported", param="echo")
    if body.get("suffix"):
        raise BadRequest("suffix (insertion) is not supported", param="suffix")
    fields = generation_fields(body, max_tokens_cap=max_tokens_cap)
    if fields["max_tokens"] is None:
        fields["max_tokens"] = min(16, max_tokens_cap)  # OpenAI's default for this endpoint
    logprobs = integer(body, "logprobs", 0, MAX_TOP_LOGPROBS, None)
    return ChatRequest(prompt=prompt, logprobs=logprobs, **fields), stream_options(body)


async def completions(request: web.Request) -> web.StreamResponse:
    head = request.app[NODE].head
    completion, options = parse_completion_request(await read_json(request), max_tokens_cap=head.max_tokens_cap,
                                                   served=head.model_names)
    completion.client = completion.client or f"address:{request.remote}"
    async with head.generate(completion) as generation:
        logprobs = _LegacyLogprobs(generation) if completion.logprobs is not None else None
        if options.stream:
            return await stream_events(request, generation, _chunks(generation, options, logprobs))
        events = [event async for event in generation]
        stats = generation.stats
        return web.json_response(_envelope(generation) | {
            "choices": [{
                "index": 0,
                "text": "".join(event.text for event in events),
                "finish_reason": stats.finish_reason,
                "logprobs": logprobs.block(events) if logprobs else None,
            }],
            "usage": usage(stats),
            "meshnet": stats.to_dict(),
        })


def _completion_id(stats: GenerationStats) -> str:
    return f"cmpl-{stats.session_id}"


def _envelope(generation: Generation) -> dict:
    return {"id": _completion_id(generation.stats), "object": "text_completion", "created": generation.created,
            "model": generation.model}


async def _chunks(generation: Generation, options: StreamOptions,
                  logprobs: _LegacyLogprobs | None) -> AsyncIterator[dict]:
    envelope = _envelope(generation)
    stats = generation.stats

    def chunk(text: str, finish_reason=None, block=None, **extra) -> dict:
        return envelope | {"choices": [{"index": 0, "text": text, "finish_reason": finish_reason,
                                        "logprobs": block}]} | extra

    async for event in generation:
        if event.text or (logprobs and event.logprob is not None):
            yield chunk(event.text, block=logprobs.block([event]) if logprobs else None)
    yield chunk("", stats.finish_reason, meshnet=stats.to_dict())
    if options.include_usage:
        yield envelope | {"choices": [], "usage": usage(stats)}


class _LegacyLogprobs:
    """The legacy ``logprobs`` block, built event by event: ``text_offset`` counts on across stream chunks."""

    def __init__(self, generation: Generation) -> None:
        self._text = generation.tokenizer.token_text
        self._offset = 0

    def block(self, events: list[TokenEvent]) -> dict:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for event in events:
            if event.logprob is None:
                continue
            text = self._text(event.token_id)
            tokens.append(text)
            token_logprobs.append(event.logprob)
            alternatives = {self._text(i): lp for i, lp in reversed(event.top_logprobs or [])}  # the best wins a tie
            top.append(dict(sorted(alternatives.items(), key=lambda item: -item[1])))
            offsets.append(self._offset)
            self._offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
