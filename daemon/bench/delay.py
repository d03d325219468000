"""A wide-area network on loopback: a TCP proxy that holds every byte for half a round trip each way.

Traffic shaping (``tc netem``) needs privileges a benchmark does not have; this proxy puts the round trip of
machines in different rooms or cities (``meshd bench --hop-rtt-ms``) on a hop between processes of one host.
Bytes keep their order and are never coalesced into later sends: each chunk read is written once its time
has come, so a request and its answer each wait ``rtt_ms / 2``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

from daemon.api.launch import LOOPBACK


class DelayProxy:
    """Listens on a free loopback port (:attr:`port`) and forwards to ``target_port``, ``rtt_ms / 2`` each way.

    Runs its own event loop on a thread; :meth:`close` stops it.
    """

    def __init__(self, target_port: int, rtt_ms: float) -> None:
        self.target_port = target_port
        self.delay = rtt_ms / 2000.0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._serve, name=f"delay-proxy-{target_port}", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the delay proxy did not start")
        self.port = self._server.sockets[0].getsockname()[1]

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._connection, LOOPBACK, 0))
        self._ready.set()
        self._loop.run_forever()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(LOOPBACK, self.target_port)
        except OSError:
            writer.close()
            return
        for stream in (writer, up_writer):
            sock = stream.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy ``reader`` to ``writer``, each chunk ``delay`` seconds after it arrived."""
        due: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                at, chunk = await due.get()
                if not chunk:
                    break
                wait = at - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(chunk)
                await writer.drain()

        sender = asyncio.create_task(send())
        try:
            while chunk := await reader.read(1 << 16):
                due.put_nowait((time.monotonic() + self.delay, chunk))
        except OSError:
            pass
        finally:
            due.put_nowait((0.0, b""))
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await sender
            with contextlib.suppress(OSError):
                writer.close()

    def close(self) -> None:
        if self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
