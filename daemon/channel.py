"""The step channel: ``POST /forward``'s one-position decode steps over one upgraded connection, in frames.

A two-node mesh on one 2-core host lost most of what separates it from one node between the two torch threads:
each token woke an event loop and handed a step between it and a torch thread four times, and built and read
HTTP twice (ADR-0048, ADR-0049). On a step channel the head's torch thread, having run its own layers, writes the
step straight to the next node's socket, and that node's torch thread reads it, runs its layers and answers on
the same socket: no event loop and no hand-off on either side.

The channel is opened as an HTTP upgrade (``GET /v1/steps`` with ``Upgrade: meshnet-steps/1``), so the node's
token and its draining refusal apply as to any request; after ``101 Switching Protocols`` the connection carries
frames. A request frame is a ``/forward`` request, a reply frame its answer, with the same header names and
bodies (:mod:`daemon.wire`); only the framing differs:

- request: ``>II`` (length of the header block, length of the body), the header block, the body;
- reply: ``>HII`` (HTTP status, the two lengths), the header block, the body.

A header block is ``Name: value`` lines, each ended by CRLF, in latin-1. One step is in flight on a channel at a
time. Only one-position decode steps travel this way (a prompt's long steps stay on ``POST /forward``); the node
answers anything else with a 400 frame. The channel is plain TCP: a node reached over TLS is sent its steps on
``POST /forward``.

A request frame with an empty header block *continues* the channel's last step: its headers again, with
``X-Meshnet-Past-Len`` one more (:func:`continues`). A head's decode steps differ from one token to the next in
that header alone, and reading a header block and checking it again is Python that runs cold after a step's
layers, once per hop per token. A node takes a continuation only after its last step on the channel answered
200 and carried no penalty history (:mod:`daemon.server.channel`).

The same frames, one after another, make the body of ``POST /forward/batch`` and its answer: several sessions'
steps for one node in one request (:func:`requests_in`, :func:`replies_in`; :mod:`daemon.server.batch`).
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Mapping

from multidict import CIMultiDict, CIMultiDictProxy

from daemon import wire
from daemon.wire import header_lines

PATH = "/v1/steps"
UPGRADE = "meshnet-steps/1"
REQUEST = struct.Struct(">II")
REPLY = struct.Struct(">HII")
MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 16 * 1024 * 1024  # a one-position step with a long penalty history is far below this
FIRST_READ = 64 * 1024  # a frame's first read takes up to this much
FRAME_SECONDS = 5.0  # a frame whose first bytes came must be whole within this: a slow peer cannot hold the thread


class ChannelClosed(ConnectionError):
    """The peer hung up, broke the framing, or was too slow: the channel cannot carry another step."""


def parse_headers(block: bytes) -> CIMultiDictProxy[str]:
    headers: CIMultiDict[str] = CIMultiDict()
    for line in block.decode("latin-1").split("\r\n"):
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise ChannelClosed(f"a malformed header line in a frame: {line[:80]!r}")
        headers.add(name, value.strip())
    return CIMultiDictProxy(headers)


def request_frame(headers: Mapping[str, str], body: bytes | bytearray | memoryview) -> bytes:
    """A request frame, whole: written in one call, by the thread that then sleeps on the answer."""
    block = header_lines(headers)
    return b"".join((REQUEST.pack(len(block), len(body)), block, body))


def reply_frame(status: int, headers: Mapping[str, str], body: bytes | bytearray | memoryview) -> bytes:
    """A reply frame, whole: written by the node's torch thread as its team goes to sleep."""
    block = header_lines(headers)
    return b"".join((REPLY.pack(status, len(block), len(body)), block, body))


def continues(last: Mapping[str, str], headers: Mapping[str, str]) -> bool:
    """Whether a step with ``headers`` is the step after one sent with ``last``: the same headers, with
    ``X-Meshnet-Past-Len`` one more. Its frame then goes with an empty header block."""
    past, before = headers.get(wire.PAST_LEN), last.get(wire.PAST_LEN)
    if past is None or before is None or not before.isdigit() or past != str(int(before) + 1):
        return False
    return len(headers) == len(last) and all(last.get(name) == value for name, value in headers.items()
                                             if name != wire.PAST_LEN)


def read_request(sock: socket.socket) -> tuple[CIMultiDictProxy[str] | None, bytearray] | None:
    """The next request frame, its first bytes already arrived: its headers (None for an empty header block, a
    continuation) and body; None where the peer closed between frames."""
    frame = _read_frame(sock, REQUEST, first=True)
    if frame is None:
        return None
    _, block, body = frame
    return (parse_headers(block) if block else None), body


def read_reply(sock: socket.socket) -> tuple[int, CIMultiDictProxy[str], bytearray, int]:
    """The reply frame now arriving: status, headers, body and the frame's size in bytes."""
    status, block, body = _read_frame(sock, REPLY)
    return status, parse_headers(block), body, REPLY.size + len(block) + len(body)


def requests_in(data: bytes | bytearray) -> list[tuple[CIMultiDictProxy[str], bytearray]]:
    """The request frames that make up ``data`` exactly, in order (a batch's body, ``POST /forward/batch``)."""
    return [(headers, body) for _, headers, body, _ in _frames(data, REQUEST)]


def replies_in(data: bytes | bytearray) -> list[tuple[int, CIMultiDictProxy[str], bytearray, int]]:
    """The reply frames that make up ``data`` exactly, in order: status, headers, body and each frame's size."""
    return _frames(data, REPLY)


def _frames(data: bytes | bytearray, layout: struct.Struct) -> list[tuple[int, CIMultiDictProxy[str], bytearray, int]]:
    """Frames laid out with ``layout`` one after another; :class:`ChannelClosed` where they do not fill ``data``."""
    view, at, frames = memoryview(data), 0, []
    while at < len(view):
        if len(view) - at < layout.size:
            raise ChannelClosed(f"{len(view) - at} bytes after the last whole frame")
        *status, header_bytes, body_bytes = layout.unpack_from(view, at)
        _check(header_bytes, body_bytes)
        start, end = at + layout.size, at + layout.size + header_bytes + body_bytes
        if end > len(view):
            raise ChannelClosed(f"a frame of {end - at} bytes cut short at {len(view) - at}")
        headers = parse_headers(bytes(view[start:start + header_bytes]))
        frames.append((status[0] if status else 0, headers, bytearray(view[start + header_bytes:end]), end - at))
        at = end
    return frames


def _check(header_bytes: int, body_bytes: int) -> None:
    if header_bytes > MAX_HEADER_BYTES or body_bytes > MAX_BODY_BYTES:
        raise ChannelClosed(f"a frame of {header_bytes} header and {body_bytes} body bytes is over the limits "
                            f"({MAX_HEADER_BYTES} and {MAX_BODY_BYTES})")


def _read_frame(sock: socket.socket, layout: struct.Struct, *, first: bool = False
                ) -> tuple[int, bytearray, bytearray] | None:
    """A whole frame: its status (0 for a request), header block and body. A step's frame is a few KiB and most
    often all there: one read takes it, the rest (a long body) is read after it."""
    try:
        got = sock.recv(FIRST_READ, socket.MSG_DONTWAIT)
    except BlockingIOError:
        got = b""
    except OSError as exc:
        raise ChannelClosed(f"the peer broke the channel ({exc})") from None
    if not got and first:  # nothing yet (woken early) or a clean close: the slow path tells which
        rest = _read(sock, layout.size, first=True)
        if rest is None:
            return None
        got = bytes(rest)
    if len(got) < layout.size:
        got += _read(sock, layout.size - len(got))
    *status, header_bytes, body_bytes = layout.unpack_from(got)
    _check(header_bytes, body_bytes)
    size = layout.size + header_bytes + body_bytes
    if len(got) > size:
        raise ChannelClosed(f"{len(got) - size} bytes after a frame: one step is in flight at a time")
    frame = bytearray(got) + _read(sock, size - len(got)) if len(got) < size else bytearray(got)
    view = memoryview(frame)
    block, body = bytes(view[layout.size:layout.size + header_bytes]), bytearray(view[layout.size + header_bytes:])
    return (status[0] if status else 0), block, body


def _read(sock: socket.socket, size: int, *, first: bool = False) -> bytearray | None:
    """Exactly ``size`` bytes within :data:`FRAME_SECONDS`; None for a clean close before a frame's first byte."""
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    deadline = None  # set once the bytes are not there yet: most often they are, and no timeout (a system call) is set
    while got < size:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise ChannelClosed(f"a frame stopped arriving: {got} of {size} bytes in {FRAME_SECONDS:g} s")
        try:
            if left is None:
                n = sock.recv_into(view[got:], size - got, socket.MSG_DONTWAIT)
            else:
                sock.settimeout(left)
                n = sock.recv_into(view[got:])
        except BlockingIOError:
            deadline = time.monotonic() + FRAME_SECONDS
            continue
        except TimeoutError:
            continue
        except OSError as exc:
            raise ChannelClosed(f"the peer broke the channel ({exc})") from None
        if n == 0:
            if first and got == 0:
                return None
            raise ChannelClosed(f"the peer hung up inside a frame ({got} of {size} bytes)")
        got += n
    return buffer
