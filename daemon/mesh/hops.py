"""The head's ``/forward`` client: one step sent to a remote node and its answer read.

:class:`HopClient` speaks the protocol (``daemon.wire``) over the keep-alive connections of
:mod:`daemon.mesh.transport` and turns every answer into a :class:`HopReply` or one of the loop's
errors: a 409 is a :class:`CacheMiss` (one re-prefill), a node that is gone, too slow or answers 5xx
is a :class:`HopFailed` (a failover) that says which of these it was, and anything else unusable is
an :class:`UpstreamError`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass

import aiohttp

from daemon import wire
from daemon.api import Hop
from daemon.errors import BadRequest, CacheMiss, HopFailed, UpstreamError
from daemon.logs import REQUEST_ID_HEADER, request_id
from daemon.mesh.channels import StepChannels
from daemon.mesh.hop_batches import HopBatches
from daemon.mesh.transport import HopResponse, HopTransport, TransportError


@dataclass
class HopReply:
    """What a hop answered: activations for the next hop, or the tail's token."""

    activation: wire.Activation | None = None
    token_id: int | None = None
    text: str | None = None
    compute_ms: float | None = None  # the node's own time on the step, as it reports
    logprob: float | None = None  # the tail's, when the sampling asked for logprobs
    top_logprobs: list[tuple[int, float]] | None = None  # best first
    tokens: list[wire.TokenChoice] | None = None  # a verify step's: the accepted drafts and one more
    payload_bytes: int = 0  # activation bytes sent to a remote hop
    sent_bytes: int = 0  # the whole request on the wire: request line, headers, body
    received_bytes: int = 0  # the whole response: status line, headers, body
    then: object = None  # the head's own hop: its walk of the rest of the route (:class:`channels.Walked`)


class HopClient:
    """Sends one step to a remote node over keep-alive connections (:class:`HopTransport`).

    A decode step (one token) must answer within ``timeout`` seconds; a step
    over T tokens gets ``timeout * T / 32`` when that is longer, so a long
    prefill is not mistaken for a dead node. ``session`` (aiohttp) carries the
    rare requests off the hot path: releasing a session on a node left behind.
    ``channels``: the head's step channels, along which its torch thread walks a decode step
    (:mod:`daemon.mesh.channels`); their answers become replies here too (:meth:`reply_from`). With ``batches``,
    the one-position decode steps for a node that are ready in the same turn of the loop leave together
    (:mod:`daemon.mesh.hop_batches`).
    """

    def __init__(self, transport: HopTransport, session: aiohttp.ClientSession, *, hidden_size: int,
                 timeout: float = 10.0, channels: StepChannels | None = None, batches: bool = True) -> None:
        self._transport = transport
        self._session = session
        self._hidden_size = hidden_size
        self.timeout = timeout
        self.channels = channels  # decode steps after the head's own hop, where open (daemon.mesh.channels)
        # decode steps for one node ready in the same turn of the loop go in one request (daemon.mesh.hop_batches)
        self.batches = HopBatches(self._post) if batches else None

    async def step(self, hop: Hop, activation: wire.Activation, headers: dict[str, str],
                   history: wire.History | None = None) -> HopReply:
        """One step on ``hop``; ``history`` (the tail's, for a penalty) travels after the activation bytes."""
        headers = headers | {REQUEST_ID_HEADER: request_id.get()}  # one id across every node of a generation
        seconds = self.timeout * max(1.0, activation.shape[1] / 32)
        body = activation.data if history is None else bytes(activation.data) + history.to_bytes()
        url = hop.url.rstrip("/")
        try:
            if self.batches is not None and activation.shape[1] == 1 and headers.get(wire.CACHE) == "decode" \
                    and self.batches.takes(url):
                resp = await self.batches.send(url, headers, body, seconds)  # with the others for it this turn
            else:
                resp = await self._post(url + "/forward", headers, body, seconds)
        except TimeoutError:
            raise HopFailed(hop.url, f"{hop.url} is unreachable: timed out after {seconds:.0f} s",
                            reason="timed_out") from None
        except TransportError as exc:
            raise HopFailed(hop.url, f"{hop.url} is unreachable: {exc}", reason="unreachable") from None
        return self.reply_from(hop, resp, activation)

    async def _post(self, url: str, headers: Mapping[str, str], body, seconds: float) -> HopResponse:
        return await self._transport.post(url, body, headers=headers, timeout=seconds,
                                          connect_timeout=min(seconds, 5.0))

    def reply_from(self, hop: Hop, resp: HopResponse, activation: wire.Activation) -> HopReply:
        """The reply a node's answer to a step on ``activation`` makes, or what the loop raises for it (a cache
        miss, a failed hop, an unusable answer): for ``POST /forward`` and step channels alike."""
        body = resp.body
        if resp.status == 409:
            info = _json_or_empty(body)
            reason = info.get("reason", "unknown_session")
            raise CacheMiss(reason, info.get("message", f"{hop.url}: cache miss ({reason})"))
        if resp.status != 200:
            info = _json_or_empty(body)
            message = info.get("error", {})
            message = message.get("message") if isinstance(message, dict) else message
            text = f"{hop.url} answered {resp.status}: {message or body[:200]!r}"
            # a 5xx is the node's trouble (a crash, a draining node): another may serve; a 4xx is ours
            if resp.status >= 500:
                moved_to = info.get("moved_to")  # a draining node handed the session to this node
                raise HopFailed(hop.url, text, reason="http_status", status=resp.status,
                                moved_to=moved_to if isinstance(moved_to, str) else None)
            raise UpstreamError(text)
        compute_ms = _float_or_none(resp.headers.get(wire.COMPUTE_MS))
        if resp.content_type == wire.ACTIVATION_CONTENT_TYPE:
            try:
                answer = wire.parse_activation(resp.headers, body, hidden_size=self._hidden_size)
            except BadRequest as exc:
                raise UpstreamError(f"{hop.url} sent a malformed activation: {exc.message}") from None
            reply = HopReply(activation=answer, compute_ms=compute_ms)
        else:
            token = _json_or_empty(body)
            if "text" not in token and "token_id" not in token:
                raise UpstreamError(f"{hop.url} sent neither activations nor a token")
            reply = HopReply(token_id=token.get("token_id"), text=token.get("text", ""), compute_ms=compute_ms)
            reply.logprob, reply.top_logprobs = _logprobs(token)
            if "tokens" in token:
                reply.tokens = _tokens(token["tokens"], hop.url)
        reply.payload_bytes = len(activation.data)
        reply.sent_bytes, reply.received_bytes = resp.sent_bytes, resp.received_bytes
        return reply

    def release(self, url: str, session_id: str) -> None:
        """Drop a session on a node the generation left (best effort, in the background)."""
        self._spawn(self._session_call("DELETE", f"{url.rstrip('/')}/v1/sessions/{session_id}"))

    def retain(self, url: str, session_id: str, past_len: int) -> None:
        """Keep a finished generation's session on a node as a prefix, of the ``past_len`` positions the generation
        kept (best effort, in the background)."""
        where = f"{url.rstrip('/')}/v1/sessions/{session_id}/retain?past_len={past_len}"
        self._spawn(self._session_call("POST", where))

    async def _session_call(self, method: str, url: str) -> None:
        try:
            async with self._session.request(method, url, timeout=aiohttp.ClientTimeout(total=2.0)):
                pass
        except (aiohttp.ClientError, TimeoutError):
            pass  # the node is gone or busy: its TTL (and LRU) bound the session anyway

    @staticmethod
    def _spawn(coro: Coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        _BACKGROUND.add(task)  # a reference until it ends, or the loop may collect it mid-way
        task.add_done_callback(_BACKGROUND.discard)


_BACKGROUND: set[asyncio.Task] = set()


def _float_or_none(raw: str | None) -> float | None:
    try:
        value = float(raw) if raw is not None else None
    except ValueError:
        return None
    return value if value is not None and 0.0 <= value < 1e9 else None


def _logprobs(token: dict) -> tuple[float | None, list[tuple[int, float]] | None]:
    """A tail's ``logprob`` and ``top_logprobs``, or nothing when absent or malformed."""
    logprob, top = token.get("logprob"), token.get("top_logprobs")
    if not isinstance(logprob, (int, float)) or isinstance(logprob, bool) or not isinstance(top, list):
        return None, None
    pairs = [(p[0], float(p[1])) for p in top
             if isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and isinstance(p[1], (int, float))]
    return float(logprob), pairs


def _tokens(raw, url: str) -> list[wire.TokenChoice]:
    """A verify step's tokens, each a ``{"token_id", "text"[, "logprob", "top_logprobs"]}``."""
    if not isinstance(raw, list) or not raw or len(raw) > wire.MAX_DRAFT + 1:
        raise UpstreamError(f"{url} answered a verify step with a malformed token list")
    tokens = []
    for item in raw:
        if not isinstance(item, dict) or not isinstance(item.get("token_id"), int) \
                or isinstance(item.get("token_id"), bool):
            raise UpstreamError(f"{url} answered a verify step with a malformed token")
        logprob, top = _logprobs(item)
        text = item.get("text")
        tokens.append(wire.TokenChoice(item["token_id"], text if isinstance(text, str) else "", logprob, top))
    return tokens


def _json_or_empty(body: bytes) -> dict:
    try:
        value = json.loads(body)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
