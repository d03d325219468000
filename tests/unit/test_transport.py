"""The head's hop transport against real servers on 127.0.0.1: aiohttp's, and raw sockets that misbehave.

Every test runs on both event loops meshd can run on: uvloop (its default) and asyncio's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import aiohttp
import pytest
import uvloop
from aiohttp import web

from daemon import wire
from daemon.api import Hop
from daemon.errors import HopFailed, UpstreamError
from daemon.mesh import transport as transport_module
from daemon.mesh.hops import HopClient
from daemon.mesh.transport import HopTransport, TransportError


@pytest.fixture(params=["uvloop", "asyncio"])
def run(request):
    return uvloop.run if request.param == "uvloop" else asyncio.run


class Server:
    """An aiohttp server that records which connection (client port) each request came on."""

    def __init__(self, *, keepalive_timeout: float = 75.0, ssl_context=None) -> None:
        self.ssl_context = ssl_context  # serve HTTPS with it
        self.peers: list[int] = []
        self.requests: list[tuple[dict, bytes]] = []
        self.keepalive_timeout = keepalive_timeout
        self.app = web.Application()
        self.app.router.add_post("/echo", self.echo)
        self.app.router.add_post("/close", self.close_after)
        self.app.router.add_post("/slow", self.slow)
        self.app.router.add_post("/chunked", self.chunked)
        self.app.router.add_post("/status/{code}", self.status)
        # where HopClient sends a step: the hop's URL plus /forward
        self.app.router.add_post("/slow/forward", self.slow)
        self.app.router.add_post("/status/{code}/forward", self.status)

    async def __aenter__(self) -> Server:
        self.runner = web.AppRunner(self.app, access_log=None, keepalive_timeout=self.keepalive_timeout)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0, ssl_context=self.ssl_context)
        await site.start()
        scheme = "https" if self.ssl_context else "http"
        self.url = f"{scheme}://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()

    def _record(self, request: web.Request, body: bytes) -> None:
        self.peers.append(request.transport.get_extra_info("peername")[1])
        self.requests.append((dict(request.headers), body))

    async def echo(self, request: web.Request) -> web.Response:
        body = await request.read()
        self._record(request, body)
        return web.Response(body=body[::-1], headers={"X-Length": str(len(body))},
                            content_type="application/octet-stream")

    async def close_after(self, request: web.Request) -> web.Response:
        self._record(request, await request.read())
        return web.Response(text="bye", headers={"Connection": "close"})

    async def slow(self, request: web.Request) -> web.Response:
        self._record(request, await request.read())
        await asyncio.sleep(2.0)
        return web.Response(text="late")

    async def chunked(self, request: web.Request) -> web.StreamResponse:
        self._record(request, await request.read())
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        for part in (b"one,", b"two,", b"three"):
            await response.write(part)
        await response.write_eof()
        return response

    async def status(self, request: web.Request) -> web.Response:
        self._record(request, await request.read())
        return web.json_response({"error": "nope"}, status=int(request.match_info["code"]))


async def raw_server(handle) -> tuple[asyncio.Server, str]:
    """A TCP server whose connections ``handle(reader, writer, index)`` answers by hand."""
    count = 0

    async def serve(reader, writer):
        nonlocal count
        count += 1
        try:
            await handle(reader, writer, count)
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def read_request(reader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length"))
    return head + await reader.readexactly(length)


def post(hops: HopTransport, url: str, body=b"x", *, timeout: float = 5.0, **headers):
    return hops.post(url, body, headers=headers, timeout=timeout, connect_timeout=2.0)


def test_a_connection_is_reused_and_every_byte_is_counted(run):
    async def main():
        async with Server() as server:
            hops = HopTransport(headers={"Authorization": "Bearer secret-token-123"})
            body = memoryview(bytes(range(256)) * 9)  # activations travel as a view of the tensor's memory
            first = await post(hops, server.url + "/echo", body, **{"X-Thing": "1"})
            second = await post(hops, server.url + "/echo", b"abc")
            await hops.close()
        assert first.status == 200 and first.body == bytes(body)[::-1] and first.headers["x-length"] == "2304"
        assert second.body == b"cba"
        assert server.peers[0] == server.peers[1]  # one connection, kept alive
        headers, received = server.requests[0]
        assert received == bytes(body)
        assert headers["Authorization"] == "Bearer secret-token-123" and headers["X-Thing"] == "1"
        assert headers["Host"] == server.url.removeprefix("http://")
        request_line = len("POST /echo HTTP/1.1\r\n") + 2
        assert first.sent_bytes == request_line + sum(len(k) + len(v) + 4 for k, v in headers.items()) + len(body)
        response_head = len("HTTP/1.1 200 OK\r\n") + 2 + sum(len(k) + len(v) + 4 for k, v in first.headers.items())
        assert first.received_bytes == response_head + len(body)
        assert first.content_type == "application/octet-stream"
    run(main())


def test_any_status_is_returned_with_its_body(run):
    async def main():
        async with Server() as server:
            hops = HopTransport()
            conflict = await post(hops, server.url + "/status/409")
            failed = await post(hops, server.url + "/status/503")
            await hops.close()
        assert (conflict.status, failed.status) == (409, 503)
        assert failed.body == b'{"error": "nope"}' and failed.content_type == "application/json"
        assert server.peers[0] == server.peers[1]  # an error answer does not cost the connection
    run(main())


def test_connection_close_opens_a_new_connection_next_time(run):
    async def main():
        async with Server() as server:
            hops = HopTransport()
            bye = await post(hops, server.url + "/close")
            after = await post(hops, server.url + "/echo", b"hi")
            await hops.close()
        assert bye.body == b"bye" and after.body == b"ih"
        assert server.peers[0] != server.peers[1]
    run(main())


def test_a_connection_the_node_closed_while_idle_is_not_used(run):
    async def main():
        async with Server(keepalive_timeout=0.2) as server:
            hops = HopTransport()
            await post(hops, server.url + "/echo", b"1")
            await asyncio.sleep(0.6)  # the server drops the idle connection
            again = await post(hops, server.url + "/echo", b"2")
            await hops.close()
        assert again.body == b"2" and server.peers[0] != server.peers[1]
    run(main())


def test_a_request_that_meets_a_closing_idle_connection_is_sent_again_on_a_new_one(run):
    seen = []

    async def handle(reader, writer, index):
        seen.append(await read_request(reader))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        if index == 1:  # the first connection reads the next request, then closes without a word
            with contextlib.suppress(asyncio.IncompleteReadError):
                seen.append(await read_request(reader))

    async def main():
        server, url = await raw_server(handle)
        async with server:
            hops = HopTransport()
            await post(hops, url + "/f", b"a")
            retried = await post(hops, url + "/f", b"b")
            await hops.close()
        return retried

    assert run(main()).body == b"ok"
    assert [r.endswith(b"\r\n\r\n" + body) for r, body in zip(seen, (b"a", b"b", b"b"), strict=True)] == [True] * 3


def test_a_broken_answer_on_a_used_connection_is_not_sent_again(run):
    async def handle(reader, writer, index):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b")  # then the node dies
        await writer.drain()

    async def main():
        server, url = await raw_server(handle)
        async with server:
            hops = HopTransport()
            await post(hops, url + "/f")
            with pytest.raises(TransportError, match="closed the connection"):
                await post(hops, url + "/f")
            await hops.close()

    run(main())


def test_a_connection_that_answers_more_than_was_asked_is_dropped(run):
    async def handle(reader, writer, index):
        await read_request(reader)
        if index == 1:  # a whole answer, then the start of one nobody asked for
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirst"
                         b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nsta")
            with contextlib.suppress(asyncio.IncompleteReadError):
                await read_request(reader)
                writer.write(b"le")  # would complete the stray answer on a connection still in use
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nright")
        await writer.drain()

    async def main():
        server, url = await raw_server(handle)
        async with server:
            hops = HopTransport()
            first = await post(hops, url + "/f")
            await asyncio.sleep(0.2)
            second = await post(hops, url + "/f")
            await hops.close()
        return first.body, second.body

    assert run(main()) == (b"first", b"right")


@pytest.mark.parametrize("answer", [b"garbage\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n"])
def test_a_malformed_answer_is_a_clear_error(run, answer):
    async def handle(reader, writer, index):
        await read_request(reader)
        writer.write(answer)
        await writer.drain()
        await asyncio.sleep(1.0)

    async def main():
        server, url = await raw_server(handle)
        async with server:
            hops = HopTransport()
            with pytest.raises(TransportError, match="malformed HTTP response"):
                await post(hops, url + "/f")
            await hops.close()

    run(main())


def test_an_answer_over_the_limit_is_refused(run, monkeypatch):
    monkeypatch.setattr(transport_module, "MAX_RESPONSE_BYTES", 1000)

    async def main():
        async with Server() as server:
            hops = HopTransport()
            small = await post(hops, server.url + "/echo", b"x" * 1000)
            with pytest.raises(TransportError, match="over 1000 bytes"):
                await post(hops, server.url + "/echo", b"x" * 1001)
            await hops.close()
        assert len(small.body) == 1000

    run(main())


def test_a_chunked_answer_is_put_together(run):
    async def main():
        async with Server() as server:
            hops = HopTransport()
            answer = await post(hops, server.url + "/chunked")
            await hops.close()
        assert answer.body == b"one,two,three"
    run(main())


@pytest.mark.slow
def test_a_timeout_raises_and_the_connection_is_not_kept(run):
    async def main():
        async with Server() as server:
            hops = HopTransport()
            with pytest.raises(TimeoutError):
                await post(hops, server.url + "/slow", timeout=0.3)
            answer = await post(hops, server.url + "/echo", b"ok")
            await hops.close()
        assert answer.body == b"ko"
        assert server.peers[0] != server.peers[1]  # the late answer would have landed on the old one
    run(main())


@pytest.mark.slow
def test_a_cancelled_request_does_not_leave_its_connection_behind(run):
    async def main():
        async with Server() as server:
            hops = HopTransport()
            task = asyncio.ensure_future(post(hops, server.url + "/slow"))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            answer = await post(hops, server.url + "/echo", b"ok")
            await hops.close()
        assert answer.body == b"ko" and server.peers[0] != server.peers[1]
    run(main())


def test_concurrent_requests_each_get_a_connection_and_leave_it_for_the_next(run):
    async def main():
        async with Server() as server:
            hops = HopTransport()
            answers = await asyncio.gather(*(post(hops, server.url + "/echo", bytes([i]) * 3) for i in range(4)))
            more = await asyncio.gather(*(post(hops, server.url + "/echo", b"again") for _ in range(4)))
            await hops.close()
        assert [a.body for a in answers] == [bytes([i]) * 3 for i in range(4)]
        assert {a.body for a in more} == {b"niaga"}
        assert len(set(server.peers[:4])) == 4 and set(server.peers[4:]) == set(server.peers[:4])
    run(main())


def test_an_unreachable_node_is_a_clear_error(run):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main():
        hops = HopTransport()
        with pytest.raises(TransportError, match="cannot connect"):
            await post(hops, f"http://127.0.0.1:{port}/forward")
        with pytest.raises(TransportError, match="not an http"):
            await post(hops, "ftp://127.0.0.1/forward")
        with pytest.raises(TransportError, match="not an http"):
            await post(hops, "http://127.0.0.1:99999999/forward")

    run(main())


@pytest.mark.parametrize("headers", [{"X-A": "1\r\nX-Injected: 2"}, {"X:A": "1"}, {"X-A": "snow \u2603"}])
def test_headers_that_http_cannot_carry_are_refused_before_anything_is_sent(run, headers):
    async def main():
        async with Server() as server:
            hops = HopTransport()
            with pytest.raises(ValueError, match="HTTP/1.1"):
                await hops.post(server.url + "/echo", b"x", headers=headers, timeout=2.0, connect_timeout=1.0)
            await hops.close()
        assert server.requests == []
    run(main())


# ---- TLS -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls():
    """(server context for 127.0.0.1, a client context trusting its CA, one trusting another CA only)."""
    import ssl

    trustme = pytest.importorskip("trustme")
    ca, other = trustme.CA(), trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server)
    trusting, untrusting = ssl.create_default_context(), ssl.create_default_context()
    ca.configure_trust(trusting)
    other.configure_trust(untrusting)
    return server, trusting, untrusting


def test_https_hops_are_verified_and_kept_alive(run, tls):
    server_context, trusting, untrusting = tls

    async def main():
        async with Server(ssl_context=server_context) as server:
            hops = HopTransport(headers={"Authorization": "Bearer secret-token-123"}, ssl_context=trusting)
            body = memoryview(bytes(range(256)) * 9)
            first = await post(hops, server.url + "/echo", body)
            second = await post(hops, server.url + "/echo", b"abc")
            await hops.close()
            refusing = HopTransport(ssl_context=untrusting)
            with pytest.raises(TransportError, match="certificate is not trusted"):
                await post(refusing, server.url + "/echo")
            await refusing.close()
        assert first.body == bytes(body)[::-1] and second.body == b"cba"
        assert len(server.peers) == 2 and server.peers[0] == server.peers[1]  # one TLS connection, kept alive
        assert server.requests[0][0]["Authorization"] == "Bearer secret-token-123"
    run(main())


def test_a_certificate_for_another_name_is_refused(run, tls):
    import ssl

    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("node-b.example").configure_cert(server_context)  # valid, but not for 127.0.0.1
    client = ssl.create_default_context()
    ca.configure_trust(client)

    async def main():
        async with Server(ssl_context=server_context) as server:
            hops = HopTransport(ssl_context=client)
            with pytest.raises(TransportError, match="not trusted"):
                await post(hops, server.url + "/echo")
            await hops.close()
        assert server.requests == []
    run(main())


# ---- the hop client on top: a failed hop says how it failed, for the head's route events ----------------------

async def hop_step(url: str, *, timeout: float = 5.0):
    """One decode step (a 4-wide activation) to the node at ``url``, through :class:`HopClient`."""
    hops = HopTransport()
    try:
        async with aiohttp.ClientSession() as session:
            client = HopClient(hops, session, hidden_size=4, timeout=timeout)
            return await client.step(Hop(url, 0, 1), wire.Activation("float32", (1, 1, 4), bytes(16)), {})
    finally:
        await hops.close()


def test_a_node_that_answers_5xx_is_a_failed_hop_that_names_the_status(run):
    async def main():
        async with Server() as server:
            with pytest.raises(HopFailed) as failed:
                await hop_step(server.url + "/status/503")
            with pytest.raises(UpstreamError) as refused:
                await hop_step(server.url + "/status/400")
        assert (failed.value.reason, failed.value.status) == ("http_status", 503)
        assert failed.value.message.startswith(f"{server.url}/status/503 answered 503")
        assert not isinstance(refused.value, HopFailed)  # a 4xx is the head's own doing: no failover
    run(main())


def test_a_node_nothing_listens_on_is_an_unreachable_hop(run):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"

    async def main():
        with pytest.raises(HopFailed) as failed:
            await hop_step(url)
        assert (failed.value.reason, failed.value.status, failed.value.url) == ("unreachable", None, url)
        assert failed.value.message.startswith(f"{url} is unreachable: cannot connect")
    run(main())


@pytest.mark.slow
def test_a_node_that_answers_too_late_is_a_timed_out_hop(run):
    async def main():
        async with Server() as server:
            with pytest.raises(HopFailed) as failed:
                await hop_step(server.url + "/slow", timeout=0.3)
        assert (failed.value.reason, failed.value.status) == ("timed_out", None)
        assert failed.value.message == f"{server.url}/slow is unreachable: timed out after 0 s"
    run(main())
