"""OpenAI-compatible ``POST /v1/chat/completions``, ``GET /v1/models`` and ``GET /v1/models/{id}``: OpenAI's
JSON in, the head's API (``daemon.mesh.head``), OpenAI's JSON out. The legacy ``/v1/completions`` is in
``daemon.server.completions``; what both requests share is checked in ``daemon.server.openai_request``.

Sampling a request leaves unnamed follows the model's generation config (greedy for the built-in
model) rather than OpenAI's temperature 1.0; a request without a seed gets a random one from the
head, so a re-prefill mid-generation still reproduces its tokens.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from daemon.api import GenerationStats
from daemon.errors import BadRequest, MeshError, ModelNotFound
from daemon.logs import REQUEST_ID_HEADER, request_id
from daemon.mesh.generation import TokenEvent
from daemon.mesh.head import ChatRequest, Generation, Head
from daemon.server.errors import error_body, read_json
from daemon.server.keys import NODE
from daemon.server.openai_request import (
    StreamOptions,
    boolean,
    check_model,
    generation_fields,
    refuse_unsupported,
    stream_options,
    top_logprobs,
)

log = logging.getLogger(__name__)

_ROLES = ("system", "user", "assistant", "developer", "tool")


def _content_text(content, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"messages[{index}].content: only text parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"messages[{index}].content must be a string or a list of text parts", param="messages")


def parse_chat_request(body, *, max_tokens_cap: int,
                       served: list[str] | None = None) -> tuple[ChatRequest, StreamOptions]:
    """Validate a chat request; every problem is a 400 that names its parameter (an unknown model, a 404)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if served is not None:
        check_model(body, served)
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    messages = []
    for i, m in enumerate(raw_messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise BadRequest(f"messages[{i}] needs a role, one of {list(_ROLES)}", param="messages")
        role = "system" if m["role"] == "developer" else m["role"]
        messages.append({"role": role, "content": _content_text(m.get("content"), i)})
    refuse_unsupported(body)
    fields = generation_fields(body, max_tokens_cap=max_tokens_cap)
    options = stream_options(body)
    logprobs = None
    if boolean(body, "logprobs", False):
        logprobs = top_logprobs(body, "top_logprobs")
    elif body.get("top_logprobs") is not None:
        raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    return ChatRequest(messages, logprobs=logprobs, **fields), options


def usage(stats: GenerationStats) -> dict:
    """OpenAI's ``usage`` block of a finished generation."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


async def chat_completions(request: web.Request) -> web.StreamResponse:
    head = request.app[NODE].head
    chat, options = parse_chat_request(await read_json(request), max_tokens_cap=head.max_tokens_cap,
                                       served=head.model_names)
    chat.client = chat.client or f"address:{request.remote}"  # whose prefixes --prefix-reuse client shares
    async with head.generate(chat) as generation:
        if options.stream:
            return await stream_events(request, generation, _chat_chunks(generation, chat, options))
        events = [event async for event in generation]
        stats = generation.stats
        return web.json_response({
            "id": _completion_id(stats),
            "object": "chat.completion",
            "created": generation.created,
            "model": generation.model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": "".join(event.text for event in events)},
                "finish_reason": stats.finish_reason,
                "logprobs": _chat_logprobs(generation, events) if chat.logprobs is not None else None,
            }],
            "usage": usage(stats),
            "meshnet": stats.to_dict(),
        })


def _completion_id(stats: GenerationStats) -> str:
    return f"chatcmpl-{stats.session_id}"


def _token_entry(generation: Generation, token_id: int, logprob: float) -> dict:
    text = generation.tokenizer.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _chat_logprobs(generation: Generation, events: list[TokenEvent]) -> dict:
    """OpenAI's chat ``logprobs``: one entry per token of the answer, with its best alternatives."""
    content = []
    for event in events:
        if event.logprob is None:
            continue
        entry = _token_entry(generation, event.token_id, event.logprob)
        entry["top_logprobs"] = [_token_entry(generation, i, lp) for i, lp in event.top_logprobs or []]
        content.append(entry)
    return {"content": content}


async def _chat_chunks(generation: Generation, chat: ChatRequest, options: StreamOptions) -> AsyncIterator[dict]:
    stats = generation.stats
    envelope = {"id": _completion_id(stats), "object": "chat.completion.chunk", "created": generation.created,
                "model": generation.model}

    def chunk(delta: dict, finish_reason=None, logprobs=None, **extra) -> dict:
        choices = [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]
        return envelope | {"choices": choices} | extra

    yield chunk({"role": "assistant", "content": ""})
    async for event in generation:
        if event.text or (chat.logprobs is not None and event.logprob is not None):
            logprobs = _chat_logprobs(generation, [event]) if chat.logprobs is not None else None
            yield chunk({"content": event.text}, logprobs=logprobs)
    yield chunk({}, stats.finish_reason, meshnet=stats.to_dict())
    if options.include_usage:
        yield envelope | {"choices": [], "usage": usage(stats)}


async def stream_events(request: web.Request, generation: Generation,
                        chunks: AsyncIterator[dict]) -> web.StreamResponse:
    """Send ``chunks`` as server-sent events, then ``[DONE]``; an error after the headers travels as an event."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           REQUEST_ID_HEADER: request_id.get()})
    await response.prepare(request)
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    except ConnectionResetError:
        # the client went away (an operator pressed Esc): stop generating; the head drops the session
        log.info("client left during generation %s", generation.stats.session_id)
        return response
    except MeshError as exc:
        # headers are gone already: the error travels as an event, as OpenAI's API does
        err = error_body(exc.message, type=exc.type, code=exc.code, param=exc.param)
        await response.write(f"data: {json.dumps(err)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _model_object(name: str, head: Head) -> dict:
    # max_model_len as vLLM reports it: prompt and answer together
    return {"id": name, "object": "model", "created": 0, "owned_by": "meshnet", "max_model_len": head.context_length}


async def models(request: web.Request) -> web.Response:
    """Every name this node serves the model under, the one its answers report first."""
    head = request.app[NODE].head
    return web.json_response({"object": "list", "data": [_model_object(name, head) for name in head.model_names]})


async def model(request: web.Request) -> web.Response:
    head = request.app[NODE].head
    name = request.match_info["model_id"]
    if name not in head.model_names:
        raise ModelNotFound(f"The model {name[:200]!r} does not exist on this node; it serves {head.model_names}")
    return web.json_response(_model_object(name, head))
