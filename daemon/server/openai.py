"""OpenAI-compatible ``POST /v1/chat/completions`` and ``GET /v1/models``: OpenAI's JSON in, the head's
API (``daemon.mesh.head``), OpenAI's JSON out.

Sampling a request leaves unnamed follows the model's generation config (greedy for the built-in
model) rather than OpenAI's temperature 1.0; a request without a seed gets a random one from the
head, so a re-prefill mid-generation still reproduces its tokens.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from aiohttp import web

from daemon.api import GenerationStats
from daemon.errors import BadRequest, MeshError
from daemon.logs import REQUEST_ID_HEADER, request_id
from daemon.mesh.head import ChatRequest, Generation
from daemon.server.errors import error_body, read_json
from daemon.server.keys import NODE

log = logging.getLogger(__name__)

_ROLES = ("system", "user", "assistant", "developer", "tool")


@dataclass
class StreamOptions:
    """How the answer travels: at once, or as server-sent events (with a last usage event)."""

    stream: bool = False
    include_usage: bool = False


def _number(body: dict, name: str, lo: float, hi: float, default):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise BadRequest(f"{name} must be a number between {lo} and {hi}", param=name)
    return value


def _integer(body: dict, name: str, lo: int, hi: int, default):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BadRequest(f"{name} must be an integer between {lo} and {hi}", param=name)
    return value


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


def parse_chat_request(body, *, max_tokens_cap: int) -> tuple[ChatRequest, StreamOptions]:
    """Validate a chat request; every problem is a 400 that names its parameter."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    messages = []
    for i, m in enumerate(raw_messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise BadRequest(f"messages[{i}] needs a role, one of {list(_ROLES)}", param="messages")
        role = "system" if m["role"] == "developer" else m["role"]
        messages.append({"role": role, "content": _content_text(m.get("content"), i)})
    if body.get("n") not in (None, 1):
        raise BadRequest("only n=1 is supported", param="n")
    max_tokens = _integer(body, "max_completion_tokens", 1, max_tokens_cap, None)
    max_tokens = _integer(body, "max_tokens", 1, max_tokens_cap, max_tokens)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a string or a list of up to 4 non-empty strings", param="stop")
    stream = body.get("stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", param="stream_options")
    seed = _integer(body, "seed", -(2**63), 2**63 - 1, None)
    temperature = _number(body, "temperature", 0.0, 2.0, None)
    top_p = _number(body, "top_p", 0.0, 1.0, None)
    top_k = _integer(body, "top_k", 0, 1_000_000, None)
    ignore_eos = body.get("ignore_eos")
    ignore_eos = False if ignore_eos is None else ignore_eos
    if not isinstance(ignore_eos, bool):
        raise BadRequest("ignore_eos must be true or false", param="ignore_eos")
    if top_p is not None and top_p <= 0.0:
        raise BadRequest("top_p must be greater than 0", param="top_p")
    user = body.get("user")
    if user is not None and not (isinstance(user, str) and 0 < len(user) <= 256):
        raise BadRequest("user must be a string of 1 to 256 characters", param="user")
    chat = ChatRequest(
        messages, max_tokens=max_tokens, temperature=None if temperature is None else float(temperature),
        top_p=None if top_p is None else float(top_p), top_k=top_k, seed=seed, stop=stop, ignore_eos=ignore_eos,
        client=None if user is None else f"user:{user}",
    )
    return chat, StreamOptions(stream, bool(options.get("include_usage")))


def _usage(stats: GenerationStats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


async def chat_completions(request: web.Request) -> web.StreamResponse:
    head = request.app[NODE].head
    chat, options = parse_chat_request(await read_json(request), max_tokens_cap=head.max_tokens_cap)
    chat.client = chat.client or f"address:{request.remote}"  # whose prefixes --prefix-reuse client shares
    async with head.generate(chat) as generation:
        if options.stream:
            return await _stream(request, generation, options)
        text = "".join([event.text async for event in generation])
        stats = generation.stats
        return web.json_response({
            "id": _completion_id(stats),
            "object": "chat.completion",
            "created": generation.created,
            "model": generation.model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": stats.finish_reason,
                "logprobs": None,
            }],
            "usage": _usage(stats),
            "meshnet": stats.to_dict(),
        })


def _completion_id(stats: GenerationStats) -> str:
    return f"chatcmpl-{stats.session_id}"


async def _stream(request: web.Request, generation: Generation, options: StreamOptions) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           REQUEST_ID_HEADER: request_id.get()})
    await response.prepare(request)
    stats = generation.stats
    envelope = {"id": _completion_id(stats), "object": "chat.completion.chunk", "created": generation.created,
                "model": generation.model}

    def chunk(delta: dict, finish_reason=None, **extra) -> bytes:
        choices = [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
        return f"data: {json.dumps(envelope | {'choices': choices} | extra)}\n\n".encode()

    await response.write(chunk({"role": "assistant", "content": ""}))
    try:
        async for event in generation:
            if event.text:
                await response.write(chunk({"content": event.text}))
        await response.write(chunk({}, stats.finish_reason, meshnet=stats.to_dict()))
        if options.include_usage:
            usage = envelope | {"choices": [], "usage": _usage(stats)}
            await response.write(f"data: {json.dumps(usage)}\n\n".encode())
    except ConnectionResetError:
        # the client went away (an operator pressed Esc): stop generating; the head drops the session
        log.info("client left during generation %s", stats.session_id)
        return response
    except MeshError as exc:
        # headers are gone already: the error travels as an event, as OpenAI's API does
        err = error_body(exc.message, type=exc.type, code=exc.code, param=exc.param)
        await response.write(f"data: {json.dumps(err)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def models(request: web.Request) -> web.Response:
    head = request.app[NODE].head
    return web.json_response({
        "object": "list",
        "data": [{"id": head.model_name, "object": "model", "created": 0, "owned_by": "meshnet",
                  "max_model_len": head.context_length}],  # as vLLM reports it: prompt and answer together
    })
