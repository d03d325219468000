"""HTTP access to meshd daemons for the console. Knows HTTP and ``daemon.api`` shapes, no widgets.

Every call has a timeout, so a node that hangs shows as down instead of freezing a poll.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from daemon.api import GenerationStats, NodeStatus, RouteInfo, SessionList, auth_headers
from daemon.api.tls import client_context, untrusted_certificate

if TYPE_CHECKING:
    import aiohttp

# aiohttp is imported on first use: `meshtui --connect` paints its first frame before it loads


def _aiohttp():
    import aiohttp

    return aiohttp


UNAUTHORIZED = "401: wrong or missing API key — set MESHNET_API_KEY"
CA_FILE_VARIABLE = "MESHNET_SSL_CA_FILE"  # meshd's variable for the CAs https:// nodes must chain to


class DaemonError(Exception):
    """A daemon could not be reached or answered with an error; the message is fit for the screen.

    ``status`` is the HTTP status when the daemon answered one (401: the mesh token was refused)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Usage:
    """The OpenAI ``usage`` block of a chat answer: its tokens, and how many of the prompt's the mesh reused."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # ``prompt_tokens_details.cached_tokens``: held by the nodes from an earlier answer

    @classmethod
    def from_dict(cls, data: dict) -> Usage:
        details = data.get("prompt_tokens_details") or {}  # absent or null from servers that reuse nothing
        return cls(prompt_tokens=data.get("prompt_tokens") or 0, completion_tokens=data.get("completion_tokens") or 0,
                   cached_tokens=details.get("cached_tokens") or 0)


@dataclass
class ChatChunk:
    """One event of a streamed chat answer."""

    text: str = ""
    finish_reason: str | None = None
    stats: GenerationStats | None = None  # the daemon's ``meshnet`` block, on the last chunk
    usage: Usage | None = None  # on the event after it, asked for with ``stream_options.include_usage``


class DaemonClient:
    """One keep-alive session for every daemon the console talks to.

    With a mesh ``token`` every request carries ``Authorization: Bearer <token>``: one mesh, one token."""

    def __init__(self, *, timeout: float = 3.0, chat_timeout: float = 600.0, token: str | None = None,
                 ssl_ca_file: str | None = None) -> None:
        self._timeout_seconds = timeout
        self._chat_timeout_seconds = chat_timeout
        self._headers = auth_headers(token)
        self._session: aiohttp.ClientSession | None = None
        # https:// nodes are verified against these CAs (as meshd's --ssl-ca-file), else the system's store
        self._ssl_ca_file = ssl_ca_file or os.environ.get(CA_FILE_VARIABLE) or None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            aiohttp = _aiohttp()
            connector = aiohttp.TCPConnector(ssl=client_context(self._ssl_ca_file)) if self._ssl_ca_file else None
            self._session = aiohttp.ClientSession(headers=self._headers, connector=connector)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _json(self, method: str, url: str, **kwargs) -> dict:
        aiohttp = _aiohttp()
        timeout = aiohttp.ClientTimeout(total=self._timeout_seconds)
        try:
            async with self.session.request(method, url, timeout=timeout, **kwargs) as resp:
                if resp.status == 401:
                    raise DaemonError(UNAUTHORIZED, 401)
                body = await resp.json(content_type=None)
                if resp.status >= 400:
                    raise DaemonError(_error_message(body, resp.status), resp.status)
                return body
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise DaemonError(_describe(exc)) from None

    async def status(self, url: str) -> NodeStatus:
        return NodeStatus.from_dict(await self._json("GET", f"{url}/v1/status"))

    async def sessions(self, url: str) -> SessionList:
        return SessionList.from_dict(await self._json("GET", f"{url}/v1/sessions"))

    async def route(self, url: str, *, refresh: bool = False) -> RouteInfo:
        params = {"refresh": "1"} if refresh else {}
        return RouteInfo.from_dict(await self._json("GET", f"{url}/v1/route", params=params))

    async def evict(self, url: str, session_id: str) -> None:
        await self._json("DELETE", f"{url}/v1/sessions/{session_id}")

    async def add_peer(self, url: str, peer: str) -> None:
        await self._json("POST", f"{url}/v1/peers", json={"url": peer})

    async def remove_peer(self, url: str, peer: str) -> None:
        await self._json("DELETE", f"{url}/v1/peers", params={"url": peer})

    async def chat_stream(self, url: str, messages: list[dict], **params) -> AsyncIterator[ChatChunk]:
        """Stream ``/v1/chat/completions``; ``params`` are OpenAI parameters (max_tokens, temperature, ...)."""
        body = {"messages": messages, "stream": True, "stream_options": {"include_usage": True}} | params
        aiohttp = _aiohttp()
        timeout = aiohttp.ClientTimeout(total=self._chat_timeout_seconds, sock_read=120.0)
        try:
            async with self.session.post(f"{url}/v1/chat/completions", json=body, timeout=timeout) as resp:
                if resp.status == 401:
                    raise DaemonError(UNAUTHORIZED, 401)
                if resp.status != 200:
                    raise DaemonError(_error_message(await resp.json(content_type=None), resp.status), resp.status)
                async for raw in resp.content:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        return
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise DaemonError(_error_message(event, 0))
                    yield _chunk(event)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise DaemonError(_describe(exc)) from None


def _chunk(event: dict) -> ChatChunk:
    usage = event.get("usage")
    usage = Usage.from_dict(usage) if isinstance(usage, dict) else None
    if not event.get("choices"):
        return ChatChunk(usage=usage)
    choice = event["choices"][0]
    stats = event.get("meshnet")
    return ChatChunk(
        text=choice.get("delta", {}).get("content") or "",
        finish_reason=choice.get("finish_reason"),
        stats=GenerationStats.from_dict(stats) if isinstance(stats, dict) else None,
        usage=usage,
    )


def _error_message(body, status: int) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return error.get("message") or f"HTTP {status}"
    if isinstance(error, str):
        return f"{error}: {body.get('reason', '')}".strip(": ")
    return f"HTTP {status}"


def _describe(exc: Exception) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    untrusted = untrusted_certificate(exc)  # a ClientConnectorError too, but no refusal: say what to fix
    if untrusted:
        return f"{untrusted}; the console trusts the CAs of --ssl-ca-file or {CA_FILE_VARIABLE}, else the system's"
    if isinstance(exc, _aiohttp().ClientConnectorError):
        return "connection refused"
    return f"{exc.__class__.__name__}: {exc}".rstrip(": ")
