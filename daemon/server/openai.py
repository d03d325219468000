"""OpenAI-compatible ``POST /v1/chat/completions`` and ``GET /v1/models``.

Sampling defaults follow the model's generation config (greedy for the built-in
model) rather than OpenAI's temperature 1.0; a request without a seed gets a
random one, so a re-prefill mid-generation still reproduces its tokens.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from dataclasses import dataclass

from aiohttp import web

from daemon.errors import BadRequest, MeshError, TooManyGenerations
from daemon.logs import REQUEST_ID_HEADER, request_id
from daemon.mesh.generation import GenerationRequest, GenerationStats, HopClient, generate
from daemon.server.errors import error_body, read_json
from daemon.server.keys import CLIENT, HOPS, NODE

log = logging.getLogger(__name__)

_ROLES = ("system", "user", "assistant", "developer", "tool")


@dataclass
class ChatRequest:
    messages: list[dict]
    max_tokens: int
    sampling: dict
    stop: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool = False


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


def parse_chat_request(body, *, default_max_tokens: int, max_tokens_cap: int, default_sampling: dict) -> ChatRequest:
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
    max_tokens = _integer(body, "max_tokens", 1, max_tokens_cap, max_tokens or default_max_tokens)
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
    sampling = {
        "temperature": float(_number(body, "temperature", 0.0, 2.0, default_sampling.get("temperature", 0.0))),
        "top_p": float(_number(body, "top_p", 0.0, 1.0, default_sampling.get("top_p", 1.0))),
        "top_k": _integer(body, "top_k", 0, 1_000_000, default_sampling.get("top_k", 0)),
        "seed": seed if seed is not None else secrets.randbits(63),
    }
    ignore_eos = body.get("ignore_eos")
    ignore_eos = False if ignore_eos is None else ignore_eos
    if not isinstance(ignore_eos, bool):
        raise BadRequest("ignore_eos must be true or false", param="ignore_eos")
    if sampling["top_p"] <= 0.0:
        raise BadRequest("top_p must be greater than 0", param="top_p")
    return ChatRequest(messages, max_tokens, sampling, stop, stream, bool(options.get("include_usage")), ignore_eos)


def _usage(stats: GenerationStats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
    }


async def chat_completions(request: web.Request) -> web.StreamResponse:
    node = request.app[NODE]
    if node.active_generations >= node.config.max_generations:
        raise TooManyGenerations(
            f"this node already runs {node.active_generations} generations, its limit (--max-generations); "
            "retry shortly or use another node"
        )
    node.active_generations += 1  # taken before any await, so concurrent requests cannot all slip past the limit
    try:
        return await _chat(request, node)
    finally:
        node.active_generations -= 1


async def _chat(request: web.Request, node) -> web.StreamResponse:
    body = await read_json(request)
    context = node.context_length
    chat = parse_chat_request(
        body,
        default_max_tokens=min(node.config.max_tokens_default, node.config.max_tokens_cap),
        max_tokens_cap=min(context, node.config.max_tokens_cap),
        default_sampling=node.shard.default_sampling(),
    )
    await node.ensure_head()
    prompt_ids = node.encode_chat(chat.messages)
    if len(prompt_ids) >= context:
        raise BadRequest(f"the prompt is {len(prompt_ids)} tokens; the model's context is {context}", param="messages")
    max_tokens = min(chat.max_tokens, context - len(prompt_ids))
    started = time.perf_counter()
    route = await node.planner.plan_for_request()
    client = HopClient(request.app[HOPS], request.app[CLIENT], hidden_size=node.hidden_size,
                       timeout=node.config.hop_timeout_seconds)
    gen_request = GenerationRequest(prompt_ids, max_tokens, chat.sampling, chat.stop, chat.ignore_eos)
    stats = GenerationStats(session_id=secrets.token_hex(12), prompt_tokens=len(prompt_ids))
    completion_id = f"chatcmpl-{stats.session_id}"
    created = int(time.time())
    model = node.shard.info.name
    log.info("generation %s: %d prompt tokens, up to %d new, route %s", stats.session_id, len(prompt_ids),
             max_tokens, " -> ".join(f"{h.url}@{h.start_layer}" for h in route))
    events = generate(node, client, node.planner, route, gen_request, stats=stats)
    # aclosing: a client that goes away mid-stream still ends the generation and frees its sessions now
    async with contextlib.aclosing(events):
        try:
            return await _respond(request, _timed(events, node.metrics, started), stats, chat, completion_id,
                                  created, model)
        finally:
            node.generations += 1
            node.tokens_generated += stats.completion_tokens
            node.metrics.generation_done(stats)
            log.info("generation %s: %s after %d tokens (%s tok/s), %d re-prefills, %d failovers",
                     stats.session_id, stats.finish_reason or "abandoned", stats.completion_tokens,
                     f"{stats.decode_tokens_per_second:.1f}" if stats.decode_tokens_per_second else "-",
                     stats.reprefills, stats.failovers)


async def _timed(events, metrics, started: float):
    """Pass the events through, timing the first token and the gaps between tokens for /metrics."""
    last = None
    async for event in events:
        now = time.perf_counter()
        if last is None:
            metrics.ttft.observe(now - started)
        else:
            metrics.itl.observe(now - last)
        last = now
        yield event


async def _respond(request, events, stats, chat: ChatRequest, completion_id, created, model) -> web.StreamResponse:
    if chat.stream:
        return await _stream(request, events, stats, chat, completion_id, created, model)
    text = "".join([event.text async for event in events])
    return web.json_response({
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": stats.finish_reason,
            "logprobs": None,
        }],
        "usage": _usage(stats),
        "meshnet": stats.to_dict(),
    })


async def _stream(request, events, stats, chat: ChatRequest, completion_id, created, model) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           REQUEST_ID_HEADER: request_id.get()})
    await response.prepare(request)

    def chunk(delta: dict, finish_reason=None, **extra) -> bytes:
        payload = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
        } | extra
        return f"data: {json.dumps(payload)}\n\n".encode()

    await response.write(chunk({"role": "assistant", "content": ""}))
    try:
        async for event in events:
            if event.text:
                await response.write(chunk({"content": event.text}))
        await response.write(chunk({}, stats.finish_reason, meshnet=stats.to_dict()))
        if chat.include_usage:
            usage = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                     "model": model, "choices": [], "usage": _usage(stats)}
            await response.write(f"data: {json.dumps(usage)}\n\n".encode())
    except ConnectionResetError:
        # the client went away (an operator pressed Esc): stop generating; the caller drops the session
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
    node = request.app[NODE]
    return web.json_response({
        "object": "list",
        "data": [{"id": node.shard.info.name, "object": "model", "created": 0, "owned_by": "meshnet"}],
    })
