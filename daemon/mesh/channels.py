"""The head's step channels (:mod:`daemon.channel`): opened on the event loop, used on the head's torch thread.

A decode step whose route begins with the head's own layers runs them on the torch thread, and with channels
open to the nodes after it, that thread goes on along the route itself (:func:`walk`): it writes each hop's step
to its node's channel, sleeps (its OpenMP team too, where the cores are shared) until the answer arrives, and
hands the event loop the tail's token at the end. Per token that is one hand-off to the torch thread and one
back, where ``POST /forward`` hops add two on each node and HTTP on both ends (ADR-0049).

While its channels are opening, or for a node reached over TLS, or while the head runs more than one
generation (a walk holds the torch thread through the other nodes' compute, which other generations' steps
could use), steps go on ``POST /forward``. A channel that breaks is dropped and its step sent there instead; a
node that refuses to open one (an older meshd) is asked again after :data:`RETRY_SECONDS`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from daemon import channel, wire
from daemon.api import Hop
from daemon.errors import HopFailed
from daemon.mesh.transport import HopResponse
from daemon.model.worker import poll_readable
from daemon.wire import header_lines

log = logging.getLogger(__name__)

ENV = "MESHNET_STEP_CHANNELS"  # "off": every step goes on POST /forward (to measure what channels do)
OPEN_SECONDS = 5.0  # to connect and upgrade
RETRY_SECONDS = 60.0  # a node that would not open a channel is asked again after this


# writes a step on a socket and sleeps until its answer arrives: True, or False after the timeout (seconds)
Wait = Callable[[socket.socket, bytes, float], bool]


def wait_alone(sock: socket.socket, data: bytes, timeout: float) -> bool:
    """A :data:`Wait` with no torch thread of a node behind it (the thread's own, ``TorchThread.wait_answer``,
    also serves its channels meanwhile and puts its team to sleep)."""
    sock.settimeout(timeout)
    sock.sendall(data)
    return bool(poll_readable([sock.fileno()], timeout))


class StepChannel:
    """One open channel to a node: a blocking socket, one step in flight, used on the head's torch thread."""

    def __init__(self, url: str, sock: socket.socket) -> None:
        self.url = url
        self.sock = sock
        self.busy = False  # a walk holds it
        self.closed = False
        self._last: Mapping[str, str] | None = None  # the headers of the last step the node answered 200

    def exchange(self, headers: Mapping[str, str], body, *, timeout: float, wait: Wait) -> HopResponse:
        """Send one step and read its answer within ``timeout`` seconds, asleep meanwhile (``wait``: the torch
        thread's, which puts its OpenMP team to sleep before the step is written, so the node it wakes finds the
        cores free). :class:`channel.ChannelClosed` when the node hangs up, ``TimeoutError`` when it is late.
        The step after one the node answered goes without its headers (:func:`channel.continues`)."""
        last, self._last = self._last, None
        frame = channel.request_frame({} if last is not None and channel.continues(last, headers) else headers, body)
        try:
            answered = wait(self.sock, frame, timeout)
        except OSError as exc:
            raise channel.ChannelClosed(f"the node stopped taking steps ({exc})") from None
        if not answered:
            raise TimeoutError
        status, reply_headers, reply_body, received = channel.read_reply(self.sock)
        if status == 200 and wire.HISTORY not in headers:
            self._last = headers
        return HopResponse(status, reply_headers, bytes(reply_body), len(frame), received)

    def close(self) -> None:
        self.closed = True
        self.sock.close()


def step_channels_enabled() -> bool:
    return os.environ.get(ENV, "on").strip().lower() not in ("off", "0", "false", "no")


class StepChannels:
    """The head's open channels, one per node URL. ``headers`` go on each upgrade (the mesh token);
    ``allowed()`` says whether walks may use them now (the head runs one generation); ``wait`` is how the torch
    thread sends a step and sleeps until its answer (:meth:`daemon.model.worker.TorchThread.wait_answer`)."""

    def __init__(self, *, headers: Mapping[str, str] | None = None, enabled: bool = True) -> None:
        self._headers = header_lines(headers or {})
        self.enabled = enabled
        self.allowed: Callable[[], bool] = lambda: True
        self.wait: Wait = wait_alone
        self._open: dict[str, StepChannel] = {}
        self._opening: dict[str, asyncio.Task] = {}
        self._refused: dict[str, float] = {}  # url -> when a node last would not open one

    def for_hops(self, hops: list[Hop]) -> list[StepChannel] | None:
        """A channel to each node of ``hops`` (in order, each free), taken for a walk; else None, and the
        missing ones start opening."""
        if not self.enabled or not hops or not self.allowed():
            return None
        found = []
        for hop in hops:
            chan = self._open.get(hop.url)
            if chan is None or chan.closed:
                self._open.pop(hop.url, None)
                self._start_opening(hop.url)
                return None
            if chan.busy:
                return None
            found.append(chan)
        for chan in found:
            chan.busy = True
        return found

    def give_back(self, channels: list[StepChannel]) -> None:
        for chan in channels:
            chan.busy = False
            if chan.closed and self._open.get(chan.url) is chan:
                del self._open[chan.url]

    def close(self) -> None:
        for task in self._opening.values():
            task.cancel()
        for chan in self._open.values():
            chan.close()
        self._open.clear()

    def _start_opening(self, url: str) -> None:
        if url in self._opening or time.monotonic() - self._refused.get(url, -RETRY_SECONDS) < RETRY_SECONDS:
            return
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:  # TLS nodes take their steps on POST /forward
            self._refused[url] = float("inf")
            return
        task = asyncio.get_running_loop().create_task(self._open_one(url, parts.hostname, parts.port or 80,
                                                                     parts.netloc.rpartition("@")[2]))
        self._opening[url] = task
        task.add_done_callback(lambda _: self._opening.pop(url, None))

    async def _open_one(self, url: str, host: str, port: int, host_header: str) -> None:
        writer = None
        try:
            async with asyncio.timeout(OPEN_SECONDS):
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(f"GET {channel.PATH} HTTP/1.1\r\nHost: {host_header}\r\nConnection: Upgrade\r\n"
                             f"Upgrade: {channel.UPGRADE}\r\n".encode() + self._headers + b"\r\n")
                head = await reader.readuntil(b"\r\n\r\n")
            status_line = head.split(b"\r\n", 1)[0]
            if status_line.split(b" ")[1:2] != [b"101"] or reader.at_eof() or len(reader._buffer):  # noqa: SLF001
                raise OSError(f"it answered {status_line.decode('latin-1')[:80]!r}")
            sock = socket.socket(fileno=os.dup(writer.get_extra_info("socket").fileno()))
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, IndexError) as exc:
            log.info("no step channel to %s (%s): its steps go on POST /forward", url, exc or type(exc).__name__)
            self._refused[url] = time.monotonic()
            return
        finally:
            if writer is not None:
                writer.transport.abort()  # the loop lets go of its descriptor; the channel keeps the duplicate
        self.add(url, sock)

    def add(self, url: str, sock: socket.socket) -> StepChannel:
        """Use ``sock``, a connection already switched to frames, as the channel to ``url``."""
        sock.setblocking(True)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        chan = self._open[url] = StepChannel(url, sock)
        return chan


@dataclass
class Leg:
    """One remote hop of a walk: its place in the route, its channel, and its step's headers for an input."""

    index: int
    hop: Hop
    chan: StepChannel
    headers: Callable[[wire.Activation], dict[str, str]]
    history: wire.History | None = None  # the tail's, after the activation's bytes


@dataclass
class Walked:
    """What a walk got: each hop's ``(index, input, total ms, reply)``, and where it stopped, if it did:
    ``(index, input, error)``, the error what the hop raised (a :class:`channel.ChannelClosed`: the loop sends
    that hop's step on ``POST /forward``)."""

    answered: list[tuple[int, wire.Activation, float, object]] = field(default_factory=list)
    stopped: tuple[int, wire.Activation, Exception] | None = None
    started: float = field(default_factory=time.perf_counter)  # when the head's own layers were done


def walk(activation: wire.Activation, legs: list[Leg], convert, *, timeout: float, wait: Wait) -> Walked:
    """On the head's torch thread: the rest of a step's route from ``activation`` (the head's own layers' output)
    over the legs' channels. ``convert(hop, response, activation)`` makes a reply of an answer or raises what the
    loop raises for it (a cache miss, a failed hop)."""
    walked = Walked()
    for leg in legs:
        started = time.perf_counter()
        body = activation.data if leg.history is None else bytes(activation.data) + leg.history.to_bytes()
        try:
            try:
                response = leg.chan.exchange(leg.headers(activation), body, timeout=timeout, wait=wait)
            except TimeoutError:
                leg.chan.close()
                raise HopFailed(leg.hop.url, f"{leg.hop.url} is unreachable: timed out after {timeout:.0f} s",
                                reason="timed_out") from None
            except channel.ChannelClosed:
                leg.chan.close()
                raise
            reply = convert(leg.hop, response, activation)
        except Exception as exc:  # noqa: BLE001 - the loop raises it, as it would a POST /forward hop's
            walked.stopped = leg.index, activation, exc
            return walked
        walked.answered.append((leg.index, activation, (time.perf_counter() - started) * 1000.0, reply))
        if reply.activation is None:
            return walked
        activation = reply.activation
    return walked
