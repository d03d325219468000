"""The /forward wire protocol (docs/adr/0022-sessions-and-cache-misses.md), with no torch and no HTTP framework.

A request body is the raw little-endian bytes of a ``[1, T, hidden]`` activation;
its dtype and shape travel in headers. Nothing from the network is ever
unpickled: the bytes are only reinterpreted after their length, dtype, shape and
layer range have been checked here.

Request headers (absent means the old behaviour):

==========================  ==========================================================
``X-Meshnet-Session``       session id, one per generation (required with a cache mode)
``X-Meshnet-Cache``         ``prefill`` or ``decode``; absent: stateless full sequence
``X-Meshnet-Past-Len``      decode only: tokens the node's cache must already hold
``X-Meshnet-Start-Layer``   first layer this node must run (default: its first layer)
``X-Meshnet-Hop-Index``     position of this node on the route, for logs
``X-Meshnet-Dtype``         ``float32`` (exact, default), ``float16`` or ``bfloat16``
``X-Meshnet-Shape``         ``1,T,hidden``
``X-Meshnet-Sampling``      tail only: JSON ``{"temperature", "top_p", "top_k", "seed"}``, and when set
                            ``"min_p"``, the penalties and ``"logprobs"`` (see below)
``X-Meshnet-History``       tail only, with a penalty: ``P,G``, the body ends with P + G ids (below)
``X-Meshnet-Prefix``        decode only: start this session from another session's cache
``X-Meshnet-Prefix-Mode``   ``fork`` (default: copy it, the other stays) or ``take`` (move it)
``X-Meshnet-Draft``         decode only, a **verify** step: ``d1,...,dk``, the k drafted token ids the
                            step's last k positions carry (below)
==========================  ==========================================================

An **extend** step is a ``decode`` step of k >= 1 positions: the session's cache holds
``Past-Len`` positions and the body carries the next k (a new chat turn's suffix; one
token when generating). With ``X-Meshnet-Prefix: S0`` the session is first made from
session S0's cache cut back to ``Past-Len`` positions: a copy (``fork``, for a prefix
other conversations share) or S0 itself, renamed and **cropped** in place (``take``, for
a conversation's own next turn). A node that cannot do that answers 409 with reason
``prefix_unavailable`` (S0 gone, shorter, or cached from another start layer) or
``not_croppable`` (S0's layers keep state that cannot be cut back: linear attention,
a sliding window already past its size). An older node ignores both headers, finds no
such session and answers 409 too: the head then prefills the whole prompt, as after
any miss.

A node that does not host the last layer answers with activation bytes and the
same dtype/shape headers; the tail answers JSON ``{"token_id": int, "text": str}``.
With ``"logprobs": N`` in its sampling it adds ``"logprob"`` (the chosen token's, from
the raw log-softmax of the logits) and ``"top_logprobs"``: ``[[id, logprob], ...]``, the
N best, best first. A tail asked for a penalty needs the tokens so far: the head
appends them to the activation bytes as little-endian int32, ``P`` prompt ids (only
with a repetition penalty; as a set, unordered) then the ``G`` ids generated so far,
and says ``X-Meshnet-History: P,G``. They travel with every step, so a re-prefill or a
new tail after a failover sees exactly what the first one saw. Neither is sent when
not asked for: an older tail reads the same requests as before.
A **verify** step (speculative decoding, :mod:`daemon.mesh.speculation`) is a ``decode`` step of
k+1 positions, the last accepted token then k drafted ones, with ``X-Meshnet-Draft`` naming the
drafted ids. Every node keeps what it needs to drop positions of it again: the session's next
step may say a ``Past-Len`` anywhere from the verify step's own ``Past-Len`` up to what it
holds, and the node first cuts its session back to that. The tail samples position after
position, exactly as single steps would (same seed per position, the drafted tokens before it
in the penalties' history), and stops at the first token that differs from the draft: it
answers ``"tokens": [{"token_id", "text"[, "logprob", "top_logprobs"]}, ...]``, the accepted
drafts and one more, beside ``token_id`` and ``text`` of the last. A node that can do this says
``"speculation": true`` in ``/v1/status``; a head sends verify steps only along routes of such nodes.
Every answer carries ``X-Meshnet-Compute-Ms``, the node's own time on the step,
so the head can tell network overhead from compute when it plans routes.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

from daemon.errors import BadRequest

SESSION = "X-Meshnet-Session"
SESSION_CONTENT_TYPE = "application/vnd.meshnet.session"  # a session's cache handed to another node (a drain)
CACHE = "X-Meshnet-Cache"
PAST_LEN = "X-Meshnet-Past-Len"
START_LAYER = "X-Meshnet-Start-Layer"
HOP_INDEX = "X-Meshnet-Hop-Index"
DTYPE = "X-Meshnet-Dtype"
SHAPE = "X-Meshnet-Shape"
SAMPLING = "X-Meshnet-Sampling"
COMPUTE_MS = "X-Meshnet-Compute-Ms"
PREFIX = "X-Meshnet-Prefix"
PREFIX_MODE = "X-Meshnet-Prefix-Mode"
HISTORY = "X-Meshnet-History"
DRAFT = "X-Meshnet-Draft"

ACTIVATION_CONTENT_TYPE = "application/octet-stream"
BATCH_PATH = "/forward/batch"  # several steps in one request: step frames (daemon.channel), see daemon.server.batch
BATCH_CONTENT_TYPE = "application/vnd.meshnet.steps"
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}
CACHE_MODES = ("prefill", "decode")
PREFIX_MODES = ("fork", "take")
MAX_SEQUENCE = 1 << 20
MAX_TOP_LOGPROBS = 20  # alternatives a tail reports per token, as OpenAI allows
MAX_DRAFT = 32  # drafted tokens one verify step may carry
_SESSION_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def valid_session_id(value: object) -> bool:
    """Whether ``value`` is a session id as the wire takes it: 1-128 characters of ``[A-Za-z0-9._:-]``."""
    return isinstance(value, str) and _SESSION_ID.fullmatch(value) is not None


@dataclass(frozen=True)
class Activation:
    """Raw activation bytes with their dtype and shape, validated against each other."""

    dtype: str
    shape: tuple[int, int, int]
    data: bytes | bytearray | memoryview

    def headers(self) -> dict[str, str]:
        return {DTYPE: self.dtype, SHAPE: ",".join(map(str, self.shape))}


@dataclass(frozen=True)
class History:
    """The tokens a penalty looks at: the prompt's (a set; only a repetition penalty needs them) and the answer's
    so far, in order."""

    prompt: tuple[int, ...] = ()
    generated: tuple[int, ...] = ()

    def header(self) -> str:
        return f"{len(self.prompt)},{len(self.generated)}"

    def to_bytes(self) -> bytes:
        ids = self.prompt + self.generated
        return struct.pack(f"<{len(ids)}i", *ids)


@dataclass(frozen=True)
class ForwardRequest:
    """A parsed and validated ``POST /forward``."""

    activation: Activation
    mode: str | None  # "prefill", "decode" or None (stateless)
    session_id: str | None
    past_len: int
    start_layer: int
    hop_index: int | None
    sampling: dict = field(default_factory=dict)
    prefix: str | None = None  # decode only: the session to start from, cut back to past_len positions
    take_prefix: bool = False  # move that session's cache (crop it in place) rather than copy it
    history: History | None = None  # the tail's, with a penalty
    draft: tuple[int, ...] | None = None  # a verify step: the drafted ids its last positions carry


@dataclass(frozen=True)
class TokenChoice:
    """One token a tail chose, named, with its log-probabilities when they were asked for."""

    token_id: int
    text: str | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # best first

    def to_json(self) -> dict:
        body = {"token_id": self.token_id, "text": self.text}
        if self.logprob is not None:
            body |= {"logprob": self.logprob, "top_logprobs": [list(pair) for pair in self.top_logprobs or []]}
        return body


@dataclass(frozen=True)
class ForwardReply:
    """What a node answers to a ``/forward`` step: activations for the next hop, or (the tail) a token."""

    activation: Activation | None = None
    token_id: int | None = None
    text: str | None = None
    compute_ms: float = 0.0  # the node's own time on the step
    logprob: float | None = None  # asked for with "logprobs" in the sampling
    top_logprobs: list[tuple[int, float]] | None = None
    tokens: list[TokenChoice] | None = None  # a verify step's: the accepted drafts and one more
    then: object = None  # on the head, not sent: what its own step's continuation answered (the channel walk)

    def token_json(self) -> dict:
        """The tail's JSON answer; the log-probabilities only when they were asked for."""
        body = TokenChoice(self.token_id, self.text, self.logprob, self.top_logprobs).to_json()
        if self.tokens is not None:
            body["tokens"] = [token.to_json() for token in self.tokens]
        return body


def _int_header(headers, name: str, *, minimum: int = 0, maximum: int = MAX_SEQUENCE) -> int | None:
    raw = headers.get(name)
    if raw is None:
        return None
    raw = raw.strip()
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 9:
        raise BadRequest(f"{name} must be a non-negative integer, got {raw[:40]!r}", param=name)
    value = int(raw)
    if not minimum <= value <= maximum:
        raise BadRequest(f"{name} must be between {minimum} and {maximum}, got {value}", param=name)
    return value


def parse_shape(raw: str | None, *, hidden_size: int) -> tuple[int, int, int]:
    if raw is None:
        raise BadRequest(f"missing {SHAPE} header (expected 1,T,{hidden_size})", param=SHAPE)
    parts = raw.split(",")
    if len(parts) != 3 or not all(p.strip().isascii() and p.strip().isdigit() and len(p.strip()) <= 9 for p in parts):
        raise BadRequest(f"{SHAPE} must be three integers 1,T,{hidden_size}, got {raw[:60]!r}", param=SHAPE)
    batch, seq, hidden = (int(p) for p in parts)
    if batch != 1:
        raise BadRequest(f"{SHAPE}: batch size must be 1, got {batch}", param=SHAPE)
    if not 1 <= seq <= MAX_SEQUENCE:
        raise BadRequest(f"{SHAPE}: sequence length must be at least 1, got {seq}", param=SHAPE)
    if hidden != hidden_size:
        raise BadRequest(f"{SHAPE}: hidden size {hidden} does not match the model's {hidden_size}", param=SHAPE)
    return batch, seq, hidden


def parse_activation(headers, body: bytes, *, hidden_size: int) -> Activation:
    """Check dtype, shape and byte length of an activation body."""
    dtype = headers.get(DTYPE, "float32").strip().lower()
    if dtype not in DTYPE_SIZES:
        raise BadRequest(f"{DTYPE} must be one of {sorted(DTYPE_SIZES)}, got {dtype[:40]!r}", param=DTYPE)
    shape = parse_shape(headers.get(SHAPE), hidden_size=hidden_size)
    expected = shape[0] * shape[1] * shape[2] * DTYPE_SIZES[dtype]
    if len(body) != expected:
        raise BadRequest(
            f"body is {len(body)} bytes but {dtype} {SHAPE} {shape} needs {expected}", param="body"
        )
    return Activation(dtype=dtype, shape=shape, data=body)


def parse_sampling(raw: str | None) -> dict:
    if raw is None:
        return {}
    if len(raw) > 1024:
        raise BadRequest(f"{SAMPLING} is {len(raw)} characters; at most 1024", param=SAMPLING)
    try:
        value = json.loads(raw)
    except ValueError:
        raise BadRequest(f"{SAMPLING} must be a JSON object", param=SAMPLING) from None
    if not isinstance(value, dict):
        raise BadRequest(f"{SAMPLING} must be a JSON object", param=SAMPLING)
    allowed = {"temperature": (int, float), "top_p": (int, float), "top_k": (int,), "seed": (int,),
               "min_p": (int, float), "repetition_penalty": (int, float), "presence_penalty": (int, float),
               "frequency_penalty": (int, float), "logprobs": (int,)}
    for key, val in value.items():
        if key not in allowed:
            raise BadRequest(f"{SAMPLING}: unknown field {key!r}", param=SAMPLING)
        if isinstance(val, bool) or not isinstance(val, allowed[key]):
            raise BadRequest(f"{SAMPLING}: {key} has the wrong type", param=SAMPLING)
    # NaN fails every comparison, so each check is written to reject it
    if "temperature" in value and not 0.0 <= value["temperature"] <= 100.0:
        raise BadRequest(f"{SAMPLING}: temperature must be between 0 and 100", param=SAMPLING)
    if "top_p" in value and not 0.0 < value["top_p"] <= 1.0:
        raise BadRequest(f"{SAMPLING}: top_p must be in (0, 1]", param=SAMPLING)
    if "top_k" in value and value["top_k"] < 0:
        raise BadRequest(f"{SAMPLING}: top_k must be at least 0", param=SAMPLING)
    if "seed" in value and not -(2**63) <= value["seed"] < 2**63:
        raise BadRequest(f"{SAMPLING}: seed must fit in 64 bits", param=SAMPLING)
    if "min_p" in value and not 0.0 <= value["min_p"] <= 1.0:
        raise BadRequest(f"{SAMPLING}: min_p must be between 0 and 1", param=SAMPLING)
    if "repetition_penalty" in value and not 0.0 < value["repetition_penalty"] <= 100.0:
        raise BadRequest(f"{SAMPLING}: repetition_penalty must be in (0, 100]", param=SAMPLING)
    for name in ("presence_penalty", "frequency_penalty"):
        if name in value and not -2.0 <= value[name] <= 2.0:
            raise BadRequest(f"{SAMPLING}: {name} must be between -2 and 2", param=SAMPLING)
    if "logprobs" in value and not 0 <= value["logprobs"] <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"{SAMPLING}: logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param=SAMPLING)
    return value


def split_history(headers, body: bytes) -> tuple[bytes, History | None]:
    """The activation bytes of a body and the token history after them (``X-Meshnet-History``)."""
    raw = headers.get(HISTORY)
    if raw is None:
        return body, None
    parts = raw.split(",")
    if len(parts) != 2 or not all(p.strip().isascii() and p.strip().isdigit() and len(p.strip()) <= 9 for p in parts):
        raise BadRequest(f"{HISTORY} must be two counts P,G, got {raw[:60]!r}", param=HISTORY)
    prompt, generated = (int(p) for p in parts)
    count = prompt + generated
    if count > MAX_SEQUENCE or 4 * count > len(body):
        raise BadRequest(f"{HISTORY} names {count} ids; the body cannot hold them", param=HISTORY)
    split = len(body) - 4 * count
    ids = struct.unpack(f"<{count}i", body[split:])
    if any(i < 0 for i in ids):
        raise BadRequest(f"{HISTORY}: token ids cannot be negative", param=HISTORY)
    return body[:split], History(ids[:prompt], ids[prompt:])


def parse_forward(
    headers, body: bytes, *, hidden_size: int, first_layer: int, end_layer: int
) -> ForwardRequest:
    """Validate every header and the body of a ``POST /forward`` before any model work."""
    mode = headers.get(CACHE)
    if mode is not None:
        mode = mode.strip().lower()
        if mode not in CACHE_MODES:
            raise BadRequest(f"{CACHE} must be 'prefill' or 'decode', got {mode[:40]!r}", param=CACHE)
    session_id = headers.get(SESSION)
    if session_id is not None and not _SESSION_ID.fullmatch(session_id):
        raise BadRequest(f"{SESSION} must be 1-128 characters of [A-Za-z0-9._:-]", param=SESSION)
    if mode is not None and session_id is None:
        raise BadRequest(f"{CACHE}: {mode} needs an {SESSION} header", param=SESSION)
    past_len = _int_header(headers, PAST_LEN)
    if mode == "decode" and past_len is None:
        raise BadRequest(f"{CACHE}: decode needs an {PAST_LEN} header", param=PAST_LEN)
    start_layer = _int_header(headers, START_LAYER, maximum=end_layer)
    if start_layer is None:
        start_layer = first_layer
    if not first_layer <= start_layer < end_layer:
        raise BadRequest(
            f"{START_LAYER} {start_layer} is outside this node's layers {first_layer}-{end_layer - 1}",
            param=START_LAYER,
        )
    prefix, take_prefix = _parse_prefix(headers, mode=mode, session_id=session_id)
    body, history = split_history(headers, body)
    activation = parse_activation(headers, body, hidden_size=hidden_size)
    draft = parse_draft(headers.get(DRAFT), mode=mode, positions=activation.shape[1], prefix=prefix)
    return ForwardRequest(
        activation=activation,
        mode=mode,
        session_id=session_id,
        past_len=past_len or 0,
        start_layer=start_layer,
        hop_index=_int_header(headers, HOP_INDEX, maximum=1024),
        sampling=parse_sampling(headers.get(SAMPLING)),
        prefix=prefix,
        take_prefix=take_prefix,
        history=history,
        draft=draft,
    )


def parse_draft(raw: str | None, *, mode: str | None, positions: int, prefix: str | None) -> tuple[int, ...] | None:
    """A verify step's drafted ids: one for each position after the first, on a decode step of a held session."""
    if raw is None:
        return None
    if mode != "decode" or prefix is not None:
        raise BadRequest(f"{DRAFT} goes with {CACHE}: decode of a held session, without {PREFIX}", param=DRAFT)
    parts = raw.split(",")
    if len(parts) > MAX_DRAFT or not all(p.strip().isascii() and p.strip().isdigit() and len(p.strip()) <= 9
                                        for p in parts):
        raise BadRequest(f"{DRAFT} must be 1-{MAX_DRAFT} token ids, got {raw[:60]!r}", param=DRAFT)
    if len(parts) != positions - 1:
        raise BadRequest(f"{DRAFT} names {len(parts)} drafted tokens; a step of {positions} positions carries "
                         f"{positions - 1}", param=DRAFT)
    return tuple(int(p) for p in parts)


def _parse_prefix(headers, *, mode: str | None, session_id: str | None) -> tuple[str | None, bool]:
    prefix = headers.get(PREFIX)
    take = headers.get(PREFIX_MODE)
    if prefix is None:
        if take is not None:
            raise BadRequest(f"{PREFIX_MODE} needs an {PREFIX} header", param=PREFIX_MODE)
        return None, False
    if not _SESSION_ID.fullmatch(prefix):
        raise BadRequest(f"{PREFIX} must be 1-128 characters of [A-Za-z0-9._:-]", param=PREFIX)
    if mode != "decode":
        raise BadRequest(f"{PREFIX} goes with {CACHE}: decode (an extend step), not {mode or 'a stateless step'}",
                         param=PREFIX)
    if prefix == session_id:
        raise BadRequest(f"{PREFIX} names the step's own session; a session continues without it", param=PREFIX)
    take = (take or "fork").strip().lower()
    if take not in PREFIX_MODES:
        raise BadRequest(f"{PREFIX_MODE} must be 'fork' or 'take', got {take[:40]!r}", param=PREFIX_MODE)
    return prefix, take == "take"


def forward_headers(
    activation: Activation,
    *,
    mode: str | None,
    session_id: str | None,
    past_len: int,
    start_layer: int,
    hop_index: int,
    sampling: dict | None = None,
    prefix: str | None = None,
    take_prefix: bool = False,
    history: History | None = None,
    draft: tuple[int, ...] | list[int] | None = None,
) -> dict[str, str]:
    """Headers for one hop of a step, the client side of :func:`parse_forward` (``history``: its bytes go after
    the activation's, see :meth:`History.to_bytes`)."""
    headers = activation.headers() | {START_LAYER: str(start_layer), HOP_INDEX: str(hop_index)}
    headers["Content-Type"] = ACTIVATION_CONTENT_TYPE
    if session_id is not None:
        headers[SESSION] = session_id
    if mode is not None:
        headers[CACHE] = mode
    if mode == "decode":
        headers[PAST_LEN] = str(past_len)
    if sampling:
        headers[SAMPLING] = json.dumps(sampling, separators=(",", ":"))
    if prefix is not None:
        headers[PREFIX] = prefix
        headers[PREFIX_MODE] = "take" if take_prefix else "fork"
    if history is not None:
        headers[HISTORY] = history.header()
    if draft:
        headers[DRAFT] = ",".join(map(str, draft))
    return headers


def header_lines(headers: Mapping[str, str]) -> bytes:
    """``Name: value`` lines, each ended by CRLF: an HTTP/1.1 request's and a step channel's header block."""
    lines = []
    for name, value in headers.items():
        if not name or ":" in name or any(c in name or c in value for c in "\r\n\0"):
            raise ValueError(f"header {name!r} cannot be sent in HTTP/1.1 (or a step channel's frame)")
        lines.append(f"{name}: {value}\r\n")
    try:
        return "".join(lines).encode("latin-1")
    except UnicodeEncodeError:
        raise ValueError("HTTP/1.1 headers must be latin-1 text") from None
