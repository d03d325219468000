"""The fuzz test's cases: valid requests to a node of the built-in model, and mutations that each break one.

Every mutation alone makes a request invalid and none repairs another, so any answer but a 4xx
is a bug in the node (see ``tests/mesh/test_fuzz.py``).
"""

from __future__ import annotations

import json
import math
import random
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import quote, quote_from_bytes

from tests.support.headers import CACHE, DTYPE, HOP_INDEX, PAST_LEN, SAMPLING, SESSION, SHAPE, START_LAYER

SEED = 5_2026
HIDDEN = 576  # the built-in SmolLM2-135M
CONTEXT = 8192
LAYERS = 30
MAX_SEQUENCE = 1 << 20  # what the protocol accepts in a length header at all
MAX_TOKENS_CAP = 4096
MAX_BODY = 64 * 1024 * 1024  # the default --max-body-bytes

CHAT_PROMPTS = ["Hello!", "What is 2+2?", "Name a colour.", "Say something short."]


@dataclass
class Case:
    """One request, and how it was made malformed (for the failure report)."""

    node: str  # "head" or "tail"
    kind: str
    method: str
    path: str
    headers: dict[str, str | bytes] = field(default_factory=dict)
    body: bytes = b""
    mutations: list[str] = field(default_factory=list)
    tokens: int = 0  # /forward: T of the valid request this one started from

    def __str__(self) -> str:
        headers = {k: (v if len(v) <= 80 else v[:80] + (b"..." if isinstance(v, bytes) else "..."))
                   for k, v in self.headers.items()}
        return (f"{self.node} {self.kind} {self.method} {self.path[:100]} mutations={self.mutations} "
                f"headers={headers} body[{len(self.body)}]={self.body[:120]!r}")


# --- /forward ------------------------------------------------------------------------------------


def activation(rng: random.Random, tokens: int) -> bytes:
    """Finite float32 values: random bytes could spell NaN, which is a valid (if useless) activation."""
    return struct.pack(f"<{tokens * HIDDEN}f", *(rng.uniform(-2.0, 2.0) for _ in range(tokens * HIDDEN)))


def forward_base(rng: random.Random, node: str, layers: range) -> Case:
    """A valid stateless or prefill step for ``node`` (its layers are ``layers``)."""
    tokens = rng.randint(1, 4)
    case = Case(node, "forward", "POST", "/forward", tokens=tokens, body=activation(rng, tokens), headers={
        "Content-Type": "application/octet-stream", DTYPE: "float32", SHAPE: f"1,{tokens},{HIDDEN}",
        START_LAYER: str(rng.randrange(layers.start, layers.stop)), HOP_INDEX: str(rng.randint(0, 3)),
    })
    if rng.random() < 0.5:
        case.headers |= {CACHE: "prefill", SESSION: f"fuzz-{rng.getrandbits(48):012x}"}
    if layers.stop == LAYERS and rng.random() < 0.5:
        case.headers[SAMPLING] = json.dumps({"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 7})
    return case


BAD_INTS = ["", "abc", "-1", "+1", "1.5", "1e3", "0x10", "1 2", "9999999999", "1" * 40, "NaN", "0b1",
            "١٢".encode(), "²".encode(), b"\xff"]
BAD_SESSIONS = ["a b", "a/b", "a,b", "a@b", "%41", "<script>", "id;drop", "ünï".encode(), b"\xff\xfe"]
BAD_SAMPLING = [
    "{", "temperature=1", "{'temperature': 1}", "NaN", "[]", "1", '"x"', "null", "true", "[1,2]",
    '{"temp": 1}', '{"max_tokens": 5}', '{"temperature": 1, "foo": null}', '{"": 1}',
    '{"temperature": "1"}', '{"top_k": 1.5}', '{"seed": "1"}', '{"temperature": true}', '{"top_k": null}',
    '{"top_p": [1]}', '{"seed": 1.0}', '{"temperature": NaN}', '{"top_p": NaN}', '{"temperature": Infinity}',
    '{"temperature": -Infinity}', '{"temperature": -0.1}', '{"temperature": 100.5}', '{"top_p": 0}',
    '{"top_p": 1.0001}', '{"top_k": -1}', f'{{"seed": {2**63}}}', f'{{"seed": {-(2**63) - 1}}}',
    '{"temperature": 0.' + "1" * 1100 + "}", '{"seed": 1' + " " * 1030 + "}",
]


def _shape_missing(rng, case, layers):
    case.headers.pop(SHAPE, None)


def _shape_garbled(rng, case, layers):
    case.headers[SHAPE] = rng.choice(["", "abc", "1,2", "1,2,3,4", f"1;{case.tokens};{HIDDEN}",
                                      f"1,-{case.tokens},{HIDDEN}", f"1,{case.tokens},{HIDDEN}.0",
                                      f"1,{case.tokens},{HIDDEN}0000000000", f"[1,{case.tokens},{HIDDEN}]",
                                      "١,٤,٥٧٦".encode(), b"\xff,\xfe,\xfd"])


def _shape_batch(rng, case, layers):
    case.headers[SHAPE] = f"{rng.choice([0, 2, 3, 64])},{case.tokens},{HIDDEN}"


def _shape_no_tokens(rng, case, layers):
    case.headers[SHAPE] = f"1,0,{HIDDEN}"


def _shape_hidden(rng, case, layers):
    case.headers[SHAPE] = f"1,{case.tokens},{rng.choice([0, 1, 575, 577, 1152, 4096])}"


def _body_length(rng, case, layers):
    # a length no dtype and shape can ask for: valid bodies are whole multiples of HIDDEN * 2 bytes
    length = max(0, len(case.body) + rng.choice([-1, 1]) * rng.randint(1, 2 * HIDDEN - 1))
    if length % (2 * HIDDEN) == 0 and length:
        length += 1
    case.body = (case.body + rng.randbytes(2 * HIDDEN))[:length]


def _dtype_unknown(rng, case, layers):
    case.headers[DTYPE] = rng.choice(["float64", "int8", "uint8", "fp32", "bf16", "half", "", "float 32",
                                      "float32;", "bfloat16x", "ｆｌｏａｔ３２".encode(), b"\xff"])


def _dtype_mismatch(rng, case, layers):
    case.headers[DTYPE] = rng.choice(["float16", "bfloat16"])  # the body stays float32-sized


def _int_garbage(rng, case, layers):
    case.headers[rng.choice([PAST_LEN, START_LAYER, HOP_INDEX])] = rng.choice(BAD_INTS)


def _past_len_too_big(rng, case, layers):
    case.headers[PAST_LEN] = str(rng.randint(MAX_SEQUENCE + 1, 999_999_999))


def _start_layer_outside(rng, case, layers):
    outside = [n for n in range(LAYERS + 2) if n not in layers] + [100, 999_999_999]
    case.headers[START_LAYER] = str(rng.choice(outside))


def _hop_index_too_big(rng, case, layers):
    case.headers[HOP_INDEX] = str(rng.randint(1025, 999_999_999))


def _cache_garbage(rng, case, layers):
    case.headers[CACHE] = rng.choice(["pre-fill", "decoded", "none", "stateless", "", "1", "true",
                                      "prefill,decode", "décode".encode(), "PREFILL2"])


def _decode_without_session(rng, case, layers):
    case.headers[CACHE] = "decode"
    case.headers.pop(SESSION, None)


def _prefill_without_session(rng, case, layers):
    case.headers[CACHE] = "prefill"
    case.headers.pop(SESSION, None)


def _decode_without_past_len(rng, case, layers):
    case.headers[CACHE] = "decode"
    case.headers.setdefault(SESSION, f"fuzz-{rng.getrandbits(48):012x}")
    case.headers.pop(PAST_LEN, None)


def _session_bad(rng, case, layers):
    case.headers[SESSION] = rng.choice(BAD_SESSIONS + ["", "s" * rng.randint(129, 4000)])


def _sampling_bad(rng, case, layers):
    case.headers[SAMPLING] = rng.choice(BAD_SAMPLING)


def _beyond_context(rng, case, layers):
    # checked against the model's context before any cache or compute, whatever the mode
    case.headers[PAST_LEN] = str(rng.choice([CONTEXT - case.tokens + rng.randint(1, 8),
                                             rng.randint(CONTEXT, MAX_SEQUENCE)]))


FORWARD_MUTATIONS: dict[str, Callable] = {
    f.__name__.lstrip("_"): f for f in [
        _shape_missing, _shape_garbled, _shape_batch, _shape_no_tokens, _shape_hidden, _body_length,
        _dtype_unknown, _dtype_mismatch, _int_garbage, _past_len_too_big, _start_layer_outside,
        _hop_index_too_big, _cache_garbage, _decode_without_session, _prefill_without_session,
        _decode_without_past_len, _session_bad, _sampling_bad, _beyond_context,
    ]
}


def forward_random_bytes(rng: random.Random, node: str, layers: range) -> Case:
    """Random bytes under a random subset of headers, each valid or garbage."""
    length = rng.randint(1, 6 * HIDDEN * 4)
    if length % (2 * HIDDEN) == 0:
        length += 1  # no dtype and shape can match it, so no header combination makes it valid
    pools = {
        DTYPE: ["float32", "float16", "bfloat16", "float64", ""], CACHE: ["prefill", "decode", "x"],
        SHAPE: [f"1,{rng.randint(1, 6)},{HIDDEN}", "1,1", "x"], SESSION: ["fuzz-1", "a b", ""],
        PAST_LEN: ["0", "5", "-1", "x"], START_LAYER: [str(layers.start), "99", "x"],
        HOP_INDEX: ["0", "2000", "x"], SAMPLING: ['{"temperature": 0.5}', "{", "[]"],
        "Content-Type": ["application/octet-stream", "application/json", "text/plain"],
    }
    headers = {name: rng.choice(values) for name, values in pools.items() if rng.random() < 0.5}
    return Case(node, "forward-bytes", "POST", "/forward", headers, rng.randbytes(length), ["random bytes"])


# --- chat ----------------------------------------------------------------------------------------


def chat_base(rng: random.Random) -> dict:
    body = {"messages": [{"role": "user", "content": rng.choice(CHAT_PROMPTS)}], "max_tokens": rng.randint(1, 4)}
    if rng.random() < 0.5:
        body |= {"temperature": 0.5, "top_p": 0.9, "top_k": 20, "seed": 3, "stop": ["\n\n"]}
    if rng.random() < 0.3:
        body["stream"] = True
    return body


BAD_PARAMS = {
    "temperature": ["0.5", -0.1, 2.01, 1e9, math.nan, math.inf, -math.inf, True, [], {}, "hot"],
    "top_p": [0, 0.0, -1, 1.5, "1", math.nan, True, [0.5]],
    "top_k": [-1, 1.5, "5", 1_000_001, 10**12, True],
    "max_tokens": [0, -5, MAX_TOKENS_CAP + 1, 10**12, 1.5, "16", True, [], {}, math.nan],
    "max_completion_tokens": [0, -5, MAX_TOKENS_CAP + 1, CONTEXT + 1, 2.5, "16", False],
    "seed": [2**63, -(2**63) - 1, 1.5, "7", True, [], math.nan],
    "stop": [5, [5], [""], "", ["a", "b", "c", "d", "e"], {"a": 1}, [None], True],
    "n": [2, 0, -1, "1", [1], 10],
    "stream": ["true", 1, 0, "yes", [], {}],
    "stream_options": ["x", 5, [1], True],
    "ignore_eos": ["yes", 1, 0, [], "true"],
}


def _messages(body: dict) -> list[dict]:
    """The body's messages, replaced by a valid one-message list when they are not a list of objects."""
    msgs = body.get("messages")
    if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) for m in msgs)):
        body["messages"] = msgs = [{"role": "user", "content": "hi"}]
    return msgs


def _messages_missing(rng, body):
    body.pop("messages", None)


def _messages_not_a_list(rng, body):
    body["messages"] = rng.choice([[], "hi", {"role": "user", "content": "hi"}, 42, None, [None], ["hi"],
                                   [[{"role": "user", "content": "hi"}]], [42], True])


def _role_bad(rng, body):
    msg = rng.choice(_messages(body))
    if rng.random() < 0.2:
        msg.pop("role", None)
    else:
        msg["role"] = rng.choice(["robot", "", "USER", "User", None, 5, ["user"], "system ", "function"])


def _content_bad(rng, body):
    msg = rng.choice(_messages(body))
    if rng.random() < 0.2:
        msg.pop("content", None)
    else:
        msg["content"] = rng.choice([
            None, 5, 1.5, True, {"text": "hi"}, [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
            [{"type": "text"}], [{"type": "text", "text": 5}], ["hi"], [None],
            [{"type": "text", "text": "hi"}, {"type": "input_audio", "input_audio": {}}],
        ])


def _prompt_too_long(rng, body):
    # " hello" is one token: thousands more than the model's context, refused before any work
    body["messages"] = [{"role": "user", "content": "hello " * rng.randint(8300, 12000)}]


def _param_bad(rng, body):
    name = rng.choice(sorted(BAD_PARAMS))
    body[name] = rng.choice(BAD_PARAMS[name])
    return name


CHAT_MUTATIONS: dict[str, Callable] = {
    f.__name__.lstrip("_"): f for f in [
        _messages_missing, _messages_not_a_list, _role_bad, _content_bad, _prompt_too_long, _param_bad,
    ]
}
CHAT_DRAWS = sorted(CHAT_MUTATIONS) + ["param_bad"] * 5  # parameters are many: drawn more often


def chat_case(rng: random.Random) -> Case:
    body = chat_base(rng)
    mutations = []
    for name in rng.sample(CHAT_DRAWS, rng.randint(1, 3)):
        detail = CHAT_MUTATIONS[name](rng, body)
        mutations.append(f"{name}:{detail}" if detail else name)
    raw = json.dumps(body).encode()  # NaN and Infinity as Python writes them: json.loads reads them back
    return Case("head", "chat", "POST", "/v1/chat/completions", {"Content-Type": "application/json"}, raw, mutations)


def chat_body_case(rng: random.Random) -> Case:
    """A body that is not a chat request at all: not JSON, not an object, not UTF-8, nested too deep."""
    valid = json.dumps(chat_base(rng)).encode()
    depth = rng.choice([1500, 10_000, 100_000])
    kind, raw = rng.choice([
        ("empty", b""), ("not json", rng.choice([b"{", b"hello", b"{'messages': []}", b'{"messages": [}'])),
        ("truncated json", valid[:rng.randrange(1, len(valid))]),
        ("json array", b'[{"messages": [{"role": "user", "content": "hi"}]}]'),
        ("json scalar", rng.choice([b'"messages"', b"42", b"null", b"true", b"1e999", b"NaN", b"[]"])),
        ("invalid utf-8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
        ("utf-16 json", valid.decode().encode("utf-16")),
        ("random bytes", rng.randbytes(rng.randint(1, 3000))),
        ("deeply nested json", b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"),
    ])
    return Case("head", "chat-body", "POST", "/v1/chat/completions", {"Content-Type": "application/json"}, raw,
                [kind])


def header_noise(rng: random.Random, case: Case) -> None:
    """Headers no endpoint should choke on, added to a case that is malformed already."""
    name, value = rng.choice([
        ("Content-Type", rng.choice(["application/json; charset=bogus", "application/json; charset=x-unknown-8"])),
        ("Content-Type", rng.choice(["application/json; charset=utf-16", "text/plain; charset=latin-1",
                                     "application/json; charset="])),
        ("Content-Type", rng.choice(["multipart/form-data; boundary=x", "application/x-www-form-urlencoded",
                                     "garbage", ""])),
        ("Content-Encoding", rng.choice(["gzip", "deflate", "identity, gzip", "x-unknown"])),
        ("X-Request-Id", rng.choice([b"\xff" * 30, "a" * 500, "../../etc/passwd", "fuzz-rid-1"])),
        ("Authorization", rng.choice(["Bearer junk", "Basic Zm9vOmJhcg==", b"\xff"])),
        ("Transfer-Encoding", "chunked"),  # with a Content-Length: refused by the HTTP parser
        rng.choice([("Accept", "text/event-stream, garbage/*;q=x"), ("X-Meshnet-Unknown", "1")]),
    ])
    case.headers[name] = value
    case.mutations.append(f"header {name}={value[:40]!r}")


# --- other endpoints -----------------------------------------------------------------------------


def session_delete_case(rng: random.Random) -> Case:
    junk = rng.choice([
        quote("".join(chr(rng.randint(32, 126)) for _ in range(rng.randint(1, 60))), safe=""),
        "s" * rng.randint(129, 5000), quote("ünïcödé"), "%00", "%ZZ", "..%2F..%2Fetc", "%20", "a%2Fb",
        f"fuzz-{rng.getrandbits(48):012x}", quote_from_bytes(rng.randbytes(rng.randint(1, 40)), safe=""),
        "x" * 9000,  # longer than the HTTP parser's request line
    ])
    return Case("head", "sessions", "DELETE", "/v1/sessions/" + junk, mutations=["junk session id"])


def peers_case(rng: random.Random) -> Case:
    """POST /v1/peers with junk, or DELETE /v1/peers naming no peer (never a URL that passes the checks)."""
    if rng.random() < 0.25:
        url = rng.choice(["", "ftp://x", "127.0.0.1:1", "http://nobody.invalid:1", "HTTP://x", "%00"])
        query = rng.choice(["", f"?url={quote(url, safe='')}", "?uri=http://x"])
        return Case("head", "peers", "DELETE", "/v1/peers" + query, mutations=["junk peer url"])
    depth = rng.choice([1500, 50_000])
    raw = rng.choice([
        b"", b"{", b"[]", b'"http://x"', b"5", b"null", b"{}", b'{"url": null}', b'{"url": 5}',
        b'{"url": ["http://x"]}', b'{"url": "ftp://x"}', b'{"url": "127.0.0.1:1"}', b'{"url": ""}',
        b'{"url": "http://x:0"}', b'{"URL": "http://127.0.0.1:1"}', b'{"url": " "}',
        json.dumps({"url": "http://" + "a" * 3000}).encode(), rng.randbytes(rng.randint(1, 200)),
        b'{"url": ' + b"[" * depth + b"]" * depth + b"}",
    ])
    case = Case("head", "peers", "POST", "/v1/peers", {"Content-Type": "application/json"}, raw, ["junk peer"])
    if rng.random() < 0.3:
        header_noise(rng, case)
    return case


def method_case(rng: random.Random) -> Case:
    method, path = rng.choice([
        ("GET", "/forward"), ("PUT", "/forward"), ("DELETE", "/forward"), ("PATCH", "/forward"),
        ("GET", "/v1/chat/completions"), ("PUT", "/v1/chat/completions"), ("POST", "/health"),
        ("POST", "/v1/status"), ("POST", "/forward/"), ("POST", "/FORWARD"), ("POST", "/v1/chat/completion"),
        ("POST", "/v2/chat/completions"), ("GET", "/v1/sessions/"), ("POST", "/v1/sessions"),
    ])
    return Case(rng.choice(["head", "tail"]), "method", method, path, body=rng.randbytes(rng.randint(0, 64)),
                mutations=["wrong method or path"])


# --- the barrage ---------------------------------------------------------------------------------


def costly_cases() -> list[Case]:
    """A few cases by hand, costly to send: one step past the context, and bodies over the limit."""
    long_step = bytes((CONTEXT + 1) * HIDDEN * 4)
    too_big = bytes(MAX_BODY + 1)
    cases = []
    for node in ("head", "tail"):
        cases.append(Case(node, "forward", "POST", "/forward", {SHAPE: f"1,{CONTEXT + 1},{HIDDEN}"}, long_step,
                          ["sequence beyond context"]))
        cases.append(Case(node, "forward", "POST", "/forward", {SHAPE: f"1,1,{HIDDEN}"}, too_big, ["body over limit"]))
    cases.append(Case("head", "chat-body", "POST", "/v1/chat/completions", {"Content-Type": "application/json"},
                      too_big, ["body over limit"]))
    return cases


def build_cases(rng: random.Random) -> list[Case]:
    layers = {"head": range(0, 15), "tail": range(15, 30)}
    cases: list[Case] = []
    for node, count in (("tail", 380), ("head", 300)):
        for _ in range(count):
            case = forward_base(rng, node, layers[node])
            for name in rng.sample(sorted(FORWARD_MUTATIONS), rng.randint(1, 3)):
                FORWARD_MUTATIONS[name](rng, case, layers[node])
                case.mutations.append(name)
            if rng.random() < 0.12:
                header_noise(rng, case)
            cases.append(case)
        cases += [forward_random_bytes(rng, node, layers[node]) for _ in range(50)]
    for _ in range(380):
        case = chat_case(rng)
        if rng.random() < 0.3:
            header_noise(rng, case)
        cases.append(case)
    cases += [chat_body_case(rng) for _ in range(100)]
    cases += [session_delete_case(rng) for _ in range(60)]
    cases += [peers_case(rng) for _ in range(60)]
    cases += [method_case(rng) for _ in range(30)]
    cases += costly_cases()
    rng.shuffle(cases)
    return cases
