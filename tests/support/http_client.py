"""The tests' one HTTP client, for talking to real meshd processes: any request byte for byte, JSON in and out,
and a streamed chat read event by event.

Built on ``http.client`` so a test can send what no polite client would: header values as raw bytes, a
Content-Length for a body a node refuses before reading it, any method on any path.
"""

from __future__ import annotations

import http.client
import json as jsonlib
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

# methods that send a Content-Length even without a body, as http.client's own request() does
_METHODS_WITH_BODY = {"POST", "PUT", "PATCH"}


@dataclass
class Reply:
    """One answer: its status, headers (case-insensitive) and body. Unpacks as ``(status, headers, data)``."""

    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def json(self):
        """The body as JSON (raises if it is not)."""
        return jsonlib.loads(self.body)

    @property
    def data(self) -> dict:
        """The body as JSON, ``{}`` when empty, or ``{"raw": text}`` when it is not JSON (a parser's plain refusal)."""
        if not self.body.strip():
            return {}
        try:
            return jsonlib.loads(self.body)
        except ValueError:
            return {"raw": self.body.decode(errors="replace")}

    def __iter__(self):
        return iter((self.status, self.headers, self.data))

    def __repr__(self) -> str:
        return f"Reply({self.status}, {self.headers.get('Content-Type')}, {self.body[:300]!r})"


def connect(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    """A connection to ``url``'s host (HTTPS for an https:// URL, trusting the default store and
    ``SSL_CERT_FILE``), and the path and query to ask it for."""
    parts = urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return kind(parts.hostname, parts.port, timeout=timeout), path


def send(method: str, url: str, body: bytes | None = None, headers: dict | None = None, *,
         json=None, timeout: float = 120.0) -> Reply:
    """Send one request and read the whole answer. Header values may be raw bytes, sent as they are; ``json``
    is sent as a JSON body (with its Content-Type unless ``headers`` name one)."""
    headers = dict(headers or {})
    if json is not None:
        body = jsonlib.dumps(json).encode()
        headers.setdefault("Content-Type", "application/json")
    if body is None and method in _METHODS_WITH_BODY:
        body = b""
    conn, path = connect(url, timeout)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in headers.items():
            conn.putheader(name, value)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        try:
            conn.endheaders(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # a node may answer a body over its limit before reading it all: that answer still counts
        resp = conn.getresponse()
        return Reply(resp.status, resp.headers, resp.read())
    finally:
        conn.close()


def bearer(token: str | None) -> dict:
    """The Authorization header for ``token``, or none."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def http_json(method: str, url: str, body: dict | None = None, timeout: float = 300.0,
              token: str | None = None) -> tuple[int, dict]:
    """``(status, JSON body)`` of a request with an optional JSON body; an empty body reads as ``{}``."""
    headers = {"Content-Type": "application/json"} | bearer(token)
    data = jsonlib.dumps(body).encode() if body is not None else None
    reply = send(method, url, data, headers, timeout=timeout)
    return reply.status, jsonlib.loads(reply.body or b"{}")


def stream_events(url: str, body: dict, headers: dict | None = None, timeout: float = 600.0) -> Iterator[dict]:
    """POST ``body`` and yield each server-sent event's JSON as it arrives, until ``[DONE]``; the answer must be
    a 200. Closing the generator early closes the connection, as a client that leaves does."""
    conn, path = connect(url, timeout)
    try:
        conn.request("POST", path, jsonlib.dumps(body), {"Content-Type": "application/json"} | (headers or {}))
        resp = conn.getresponse()
        assert resp.status == 200, (resp.status, resp.read())
        while line := resp.readline():
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                return
            yield jsonlib.loads(line[len(b"data: "):])
    finally:
        conn.close()
