"""The head's connections to the nodes on its route: keep-alive HTTP/1.1, parsed by httptools.

Every other request meshd makes (peer polls, session releases, the console) goes
through aiohttp's client. The ``/forward`` hop does not, because it runs once per
hop per generated token right after tens of milliseconds of layer compute, when
the code that sends it is cold in the CPU's caches; there every instruction on the
path shows. Measured on a 2-vCPU VM against the same aiohttp server, after 70 ms
of compute, a round trip took 2.5 ms through aiohttp's client and 1.65 ms through
this one (``meshd bench`` gives the figures in the mesh). The wire is the same
HTTP/1.1 request the node's aiohttp server answers for any client; only the
client is lean: one request per connection at a time, no redirects, cookies,
proxies or tracing, and the response parsed by llhttp (httptools).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from daemon.wire import header_lines

IDLE_SECONDS = 30.0  # an idle connection is dropped before the node's own keep-alive limit (75 s in aiohttp)
MAX_IDLE_PER_NODE = 8  # more concurrent hops than this to one node open connections that are not kept
MAX_RESPONSE_BYTES = 1 << 30  # a prefill reply is T x hidden x 4 bytes at most: far below this


class TransportError(ConnectionError):
    """The hop could not be sent or its answer not read: the node is unreachable or broke the exchange."""


@dataclass
class HopResponse:
    status: int
    headers: CIMultiDictProxy[str]
    body: bytes
    sent_bytes: int  # the request as written: request line, headers, body
    received_bytes: int  # the response as read: status line, headers, body

    @property
    def content_type(self) -> str:
        return self.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()


@dataclass(frozen=True)
class _Address:
    host: str
    port: int
    tls: bool
    host_header: str


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time on it."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = time.monotonic()
        self._waiter: asyncio.Future[HopResponse] | None = None
        self._headers: list[tuple[str, str]] = []
        self._body: list[bytes] = []
        self._body_size = 0
        self._received = 0
        self._sent = 0

    # -- asyncio.Protocol --
    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        detail = f": {exc}" if exc else ""
        self._fail(TransportError(f"the node closed the connection before answering{detail}"))

    def data_received(self, data: bytes) -> None:
        if self._waiter is None:  # bytes nobody asked for: the connection cannot be trusted any more
            self.close()
            return
        self._received += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(TransportError(f"the node sent a malformed HTTP response ({exc})"))
            self.close()

    # -- httptools callbacks --
    def on_message_begin(self) -> None:
        if self._waiter is None:  # a second answer to one request: what follows cannot be trusted
            self.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_body(self, chunk: bytes) -> None:
        if self.closed:
            return
        self._body_size += len(chunk)
        if self._body_size > MAX_RESPONSE_BYTES:
            self._fail(TransportError(f"the node's answer is over {MAX_RESPONSE_BYTES} bytes"))
            self.close()
            return
        self._body.append(chunk)

    def on_message_complete(self) -> None:
        if self.closed:
            return
        waiter, self._waiter = self._waiter, None
        response = HopResponse(
            status=self.parser.get_status_code(),
            headers=CIMultiDictProxy(CIMultiDict(self._headers)),
            body=b"".join(self._body),
            sent_bytes=self._sent,
            received_bytes=self._received,
        )
        if not self.parser.should_keep_alive():
            self.close()
        if waiter is not None and not waiter.done():
            waiter.set_result(response)

    # -- used by the pool --
    async def exchange(self, head: bytes, body) -> HopResponse:
        self._waiter = asyncio.get_running_loop().create_future()
        self._headers, self._body, self._body_size, self._received = [], [], 0, 0
        self._sent = len(head) + len(body)
        if self.transport.is_closing():
            self._waiter = None
            raise TransportError("the node closed the connection")
        try:
            self.transport.writelines((head, body))
        except RuntimeError as exc:  # uvloop refuses a write to a transport closed under us
            self._waiter = None
            raise TransportError(f"the node closed the connection ({exc})") from None
        return await self._waiter

    @property
    def answered_nothing(self) -> bool:
        return self._received == 0

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _fail(self, exc: Exception) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)


class HopTransport:
    """Keep-alive connections to the nodes of a route, a few idle ones kept per node.

    ``headers`` go on every request (the mesh token). Not thread-safe: one event loop.
    """

    def __init__(self, *, headers: Mapping[str, str] | None = None, ssl_context: ssl.SSLContext | None = None) -> None:
        self._headers = header_lines(headers or {})
        self._idle: dict[_Address, list[_Connection]] = {}
        self._addresses: dict[str, tuple[_Address, str]] = {}
        self._ssl = ssl_context  # verifies https:// nodes; None: the system's trust store, made on first use

    async def post(self, url: str, body, *, headers: Mapping[str, str], timeout: float,
                   connect_timeout: float) -> HopResponse:
        """POST ``body`` to ``url`` and read the whole answer within ``timeout`` seconds.

        Raises :class:`TransportError` when the node cannot be reached or breaks the exchange, and
        ``TimeoutError`` when it does not answer in time. Any status is returned, not raised.
        """
        address, path = self._address(url)
        head = b"".join((
            f"POST {path} HTTP/1.1\r\nHost: {address.host_header}\r\nContent-Length: {len(body)}\r\n".encode(),
            self._headers, header_lines(headers), b"\r\n",
        ))
        async with asyncio.timeout(timeout):
            conn = self._reuse(address)
            if conn is not None:
                try:
                    return await self._exchange(address, conn, head, body)
                except TransportError:
                    if not conn.answered_nothing:
                        raise
                    # the node closed an idle connection as the request went out: the node saw none of it
                    # (a step it did see and lost would answer 409 on the retry, and cost one re-prefill)
            conn = await self._connect(address, connect_timeout)
            return await self._exchange(address, conn, head, body)

    async def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    async def _exchange(self, address: _Address, conn: _Connection, head: bytes, body) -> HopResponse:
        done = False
        try:
            response = await conn.exchange(head, body)
            done = True
            return response
        finally:  # a timed-out, cancelled or broken exchange leaves the connection mid-message: never reused
            if done and not conn.closed:
                conn.idle_since = time.monotonic()
                idle = self._idle.setdefault(address, [])
                if len(idle) < MAX_IDLE_PER_NODE:
                    idle.append(conn)
                else:
                    conn.close()
            else:
                conn.close()

    def _reuse(self, address: _Address) -> _Connection | None:
        idle = self._idle.get(address)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_SECONDS:
                return conn
            conn.close()
        return None

    async def _connect(self, address: _Address, timeout: float) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = None
        if address.tls:  # verified: the certificate must chain to a trusted CA and name address.host
            self._ssl = self._ssl or ssl.create_default_context()
            tls = self._ssl
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(
                    _Connection, address.host, address.port, ssl=tls,
                    server_hostname=address.host if tls else None)
        except TimeoutError:
            raise TransportError(f"could not connect within {timeout:g} s") from None
        except ssl.SSLCertVerificationError as exc:
            raise TransportError(f"TLS: its certificate is not trusted ({exc.verify_message or exc})") from None
        except OSError as exc:  # ssl.SSLError too: a handshake that failed
            raise TransportError(f"cannot connect: {exc.strerror or exc}") from None
        return conn

    def _address(self, url: str) -> tuple[_Address, str]:
        """Where ``url`` points: the node and the path on it."""
        known = self._addresses.get(url)
        if known is None:
            try:
                parts = urlsplit(url)
                port = parts.port
            except ValueError:
                parts = port = None
            if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
                raise TransportError(f"not an http:// or https:// address: {url!r}")
            tls = parts.scheme == "https"
            host_header = parts.netloc.rpartition("@")[2]
            known = _Address(parts.hostname, port or (443 if tls else 80), tls, host_header), parts.path or "/"
            self._addresses[url] = known
        return known
