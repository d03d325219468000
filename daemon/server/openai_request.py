"""What OpenAI's chat and legacy completion requests share, checked once: the model they name, how the answer
travels, the sampling parameters, and the parameters meshd refuses rather than silently drops.

Every problem is a :class:`BadRequest` naming its parameter (OpenAI's ``param``); a model this node does not
serve is OpenAI's 404 ``model_not_found``.
"""

from __future__ import annotations

from dataclasses import dataclass

from daemon.errors import BadRequest, ModelNotFound
from daemon.wire import MAX_TOP_LOGPROBS


@dataclass
class StreamOptions:
    """How the answer travels: at once, or as server-sent events (with a last usage event)."""

    stream: bool = False
    include_usage: bool = False


def number(body: dict, name: str, lo: float, hi: float, default):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise BadRequest(f"{name} must be a number between {lo} and {hi}", param=name)
    return value


def integer(body: dict, name: str, lo: int, hi: int, default):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BadRequest(f"{name} must be an integer between {lo} and {hi}", param=name)
    return value


def boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false", param=name)
    return value


def check_model(body: dict, served: list[str]) -> None:
    """A request may leave ``model`` out; if it names one, it must be a name this node serves."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise BadRequest("model must be a string", param="model")
    if model not in served:
        raise ModelNotFound(f"The model {model[:200]!r} does not exist on this node; it serves {served}")


def refuse_unsupported(body: dict) -> None:
    """A clear 400 for what meshd does not do, rather than an answer that silently ignored it."""
    if body.get("tools"):
        raise BadRequest("tools (function calling) are not supported", param="tools")
    if body.get("functions"):
        raise BadRequest("functions (function calling) are not supported", param="functions")
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none"):
            raise BadRequest(f"{name} is not supported (there are no tools)", param=name)
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise BadRequest('only response_format {"type": "text"} is supported (no JSON mode or schemas)',
                         param="response_format")
    if body.get("logit_bias"):
        raise BadRequest("logit_bias is not supported", param="logit_bias")
    if body.get("n") not in (None, 1):
        raise BadRequest("only n=1 is supported", param="n")
    if body.get("best_of") not in (None, 1):
        raise BadRequest("only best_of=1 is supported", param="best_of")


def stream_options(body: dict) -> StreamOptions:
    stream = boolean(body, "stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", param="stream_options")
    return StreamOptions(stream, bool(options.get("include_usage")))


def generation_fields(body: dict, *, max_tokens_cap: int) -> dict:
    """The fields of a ``ChatRequest`` both kinds of request set the same way."""
    max_tokens = integer(body, "max_completion_tokens", 1, max_tokens_cap, None)
    max_tokens = integer(body, "max_tokens", 1, max_tokens_cap, max_tokens)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a string or a list of up to 4 non-empty strings", param="stop")
    seed = integer(body, "seed", -(2**63), 2**63 - 1, None)
    temperature = number(body, "temperature", 0.0, 2.0, None)
    top_p = number(body, "top_p", 0.0, 1.0, None)
    top_k = integer(body, "top_k", 0, 1_000_000, None)
    if top_p is not None and top_p <= 0.0:
        raise BadRequest("top_p must be greater than 0", param="top_p")
    repetition_penalty = number(body, "repetition_penalty", 0.0, 10.0, 1.0)
    if repetition_penalty <= 0.0:
        raise BadRequest("repetition_penalty must be greater than 0", param="repetition_penalty")
    user = body.get("user")
    if user is not None and not (isinstance(user, str) and 0 < len(user) <= 256):
        raise BadRequest("user must be a string of 1 to 256 characters", param="user")
    return {
        "max_tokens": max_tokens, "stop": stop, "seed": seed, "top_k": top_k,
        "temperature": None if temperature is None else float(temperature),
        "top_p": None if top_p is None else float(top_p),
        "min_p": float(number(body, "min_p", 0.0, 1.0, 0.0)),
        "repetition_penalty": float(repetition_penalty),
        "presence_penalty": float(number(body, "presence_penalty", -2.0, 2.0, 0.0)),
        "frequency_penalty": float(number(body, "frequency_penalty", -2.0, 2.0, 0.0)),
        "ignore_eos": boolean(body, "ignore_eos", False),
        "client": None if user is None else f"user:{user}",
    }


def top_logprobs(body: dict, name: str) -> int:
    """A count of alternatives per token, 0 to OpenAI's 20."""
    return integer(body, name, 0, MAX_TOP_LOGPROBS, 0)
