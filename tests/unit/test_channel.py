"""The step channel's frames (``daemon.channel``) over real socket pairs, and the torch thread serving channels
(``daemon.model.worker.TorchThread.serve``) between the work submitted to it."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from daemon import channel
from daemon.model import native
from daemon.model.worker import TorchThread
from daemon.wire import header_lines
from tests.support.watch import wait_for

needs_library = pytest.mark.skipif(native.library() is None, reason="no C compiler here: nothing parks")


@pytest.fixture
def parking():
    """A torch thread that parks its team whenever it is idle, as where another daemon shares the cores."""
    thread = TorchThread()
    thread.park_when_idle = lambda: True
    yield thread
    thread.shutdown()


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_a_request_frame_arrives_whole_with_its_headers_read_case_blind(pair):
    a, b = pair
    body = bytes(range(256)) * 40
    frame = channel.request_frame({"X-Meshnet-Session": "s1", "Content-Type": "x/y"}, body)
    a.sendall(frame)
    sent = len(frame)
    headers, got = channel.read_request(b)
    assert got == body and sent == channel.REQUEST.size + len(header_lines(
        {"X-Meshnet-Session": "s1", "Content-Type": "x/y"})) + len(body)
    assert headers["x-meshnet-session"] == "s1" and headers["Content-Type"] == "x/y"


def test_a_reply_frame_carries_its_status_and_its_size(pair):
    a, b = pair
    frame = channel.reply_frame(409, {"Content-Type": "application/json"}, b'{"error": "cache_miss"}')
    b.sendall(frame)
    sent = len(frame)
    status, headers, body, size = channel.read_reply(a)
    assert (status, headers["content-type"], bytes(body), size) == (409, "application/json",
                                                                     b'{"error": "cache_miss"}', sent)


def test_a_peer_that_closes_between_frames_ends_the_channel_quietly(pair):
    a, b = pair
    a.close()
    assert channel.read_request(b) is None


def test_a_peer_that_hangs_up_inside_a_frame_breaks_it(pair):
    a, b = pair
    a.sendall(channel.REQUEST.pack(10, 100) + b"X-A: 1\r\n")
    a.close()
    with pytest.raises(channel.ChannelClosed, match="hung up inside a frame"):
        channel.read_request(b)


def test_a_frame_over_the_limits_is_refused_before_its_bytes_are_read(pair):
    a, b = pair
    a.sendall(channel.REQUEST.pack(16, channel.MAX_BODY_BYTES + 1))
    with pytest.raises(channel.ChannelClosed, match="over the limits"):
        channel.read_request(b)
    a.sendall(channel.REPLY.pack(200, channel.MAX_HEADER_BYTES + 1, 0))
    with pytest.raises(channel.ChannelClosed, match="over the limits"):
        channel.read_reply(b)


def test_a_malformed_header_line_breaks_the_frame(pair):
    a, b = pair
    block = b"no colon here\r\n"
    a.sendall(channel.REQUEST.pack(len(block), 0) + block)
    with pytest.raises(channel.ChannelClosed, match="malformed header"):
        channel.read_request(b)


def test_a_frame_that_stops_arriving_is_given_up_after_its_deadline(pair, monkeypatch):
    monkeypatch.setattr(channel, "FRAME_SECONDS", 0.3)
    a, b = pair
    a.sendall(struct.pack(">I", 5))  # half the lengths, then nothing
    started = time.monotonic()
    with pytest.raises(channel.ChannelClosed, match="stopped arriving"):
        channel.read_request(b)
    assert 0.25 < time.monotonic() - started < 3


def test_headers_that_cannot_be_framed_are_refused_before_anything_is_sent():
    with pytest.raises(ValueError, match="cannot be sent"):
        channel.request_frame({"X-Bad": "a\r\nX-Injected: 1"}, b"")


def test_a_batch_body_is_read_back_as_its_frames_in_order():
    requests = [({"X-Meshnet-Session": f"s{i}"}, bytes([i]) * (i * 3)) for i in range(4)]
    body = b"".join(channel.request_frame(h, b) for h, b in requests)
    read = channel.requests_in(body)
    assert [(dict(h), bytes(b)) for h, b in read] == [(h, b) for h, b in requests]
    replies = [(200, {"Content-Type": "application/json"}, b'{"token_id": 7}'), (409, {}, b"gone")]
    frames = [channel.reply_frame(*r) for r in replies]
    read = channel.replies_in(b"".join(frames))
    assert [(status, dict(h), bytes(b), size) for status, h, b, size in read] == \
        [(status, h, b, len(frame)) for (status, h, b), frame in zip(replies, frames)]
    assert channel.requests_in(b"") == []


@pytest.mark.parametrize("cut", [1, 7, 9])
def test_a_batch_body_that_is_not_whole_frames_is_refused(cut):
    body = channel.request_frame({"A": "b"}, b"xyz") * 2
    with pytest.raises(channel.ChannelClosed):
        channel.requests_in(body[:-cut])
    with pytest.raises(channel.ChannelClosed, match="over the limits"):
        channel.requests_in(struct.pack(">II", 0, channel.MAX_BODY_BYTES + 1))
    with pytest.raises(channel.ChannelClosed, match="malformed header"):
        channel.requests_in(struct.pack(">II", 6, 0) + b"nocolo")


# --- the torch thread serving channels --------------------------------------------------------------------------


def echo_steps(served: list[str]):
    """A channel handler that answers each request frame with its body, on the thread that calls it."""

    def handle(sock: socket.socket) -> bytes | None:
        frame = channel.read_request(sock)
        if frame is None:
            return None
        headers, body = frame
        served.append(threading.current_thread().name)
        if headers is not None and headers.get("X-Stop"):
            return None
        return channel.reply_frame(200, {}, body)

    return handle


def exchange(sock: socket.socket, body: bytes, headers: dict | None = None) -> bytes:
    sock.sendall(channel.request_frame(headers or {"X-Step": "1"}, body))
    return bytes(channel.read_reply(sock)[2])


def test_the_torch_thread_answers_a_channel_between_the_work_submitted_to_it():
    thread = TorchThread("test-torch")
    ours, theirs = socket.socketpair()
    served: list[str] = []
    try:
        assert thread.serve(theirs, echo_steps(served))
        for i in range(20):
            assert exchange(ours, b"step %d" % i) == b"step %d" % i
            assert thread.submit(lambda n=i: n + 1).result(timeout=5) == i + 1
        assert set(served) == {"test-torch"} and len(served) == 20
        assert thread.channels == 1
    finally:
        thread.shutdown()
        ours.close()


def test_a_channel_its_handler_ends_or_its_peer_leaves_is_closed_and_the_thread_goes_on():
    thread = TorchThread()
    served: list[str] = []
    first, second = socket.socketpair(), socket.socketpair()
    try:
        thread.serve(first[1], echo_steps(served))
        thread.serve(second[1], echo_steps(served))
        assert exchange(first[0], b"a") == b"a" and exchange(second[0], b"b") == b"b"
        first[0].sendall(channel.request_frame({"X-Stop": "1"}, b""))
        assert first[0].recv(1) == b""  # the handler said no more: the thread closed its end
        second[0].close()  # the peer hung up
        wait_for(lambda: thread.channels == 0, timeout=5, interval=0.01)
        assert thread.submit(lambda: "still working").result(timeout=5) == "still working"
    finally:
        thread.shutdown()
        first[0].close()


def test_a_failing_handler_closes_its_channel_only():
    thread = TorchThread()
    ours, theirs = socket.socketpair()

    def broken(sock):
        sock.recv(100)
        raise RuntimeError("a bug in a handler")

    try:
        thread.serve(theirs, broken)
        ours.sendall(b"anything")
        assert ours.recv(1) == b""
        assert thread.submit(lambda: 3).result(timeout=5) == 3
    finally:
        thread.shutdown()
        ours.close()


def test_shutting_the_thread_down_closes_its_channels_and_refuses_new_ones():
    thread = TorchThread()
    ours, theirs = socket.socketpair()
    thread.serve(theirs, echo_steps([]))
    assert exchange(ours, b"x") == b"x"
    thread.shutdown()
    assert ours.recv(1) == b""
    late_ours, late_theirs = socket.socketpair()
    assert not thread.serve(late_theirs, echo_steps([]))
    assert late_ours.recv(1) == b""  # refused: closed at once
    ours.close()
    late_ours.close()


@needs_library
def test_an_idle_thread_with_a_channel_parks_and_the_channel_wakes_it(parking):
    ours, theirs = socket.socketpair()
    try:
        parking.serve(theirs, echo_steps([]))
        for i in range(10):
            wait_for(lambda i=i: parking.parks > i, timeout=5, interval=0.005)  # asleep on the channel and the queue
            assert exchange(ours, b"%d" % i) == b"%d" % i
    finally:
        ours.close()


@needs_library
def test_a_thread_told_its_next_step_is_coming_waits_for_it_without_parking_the_team(parking):
    parking.submit(lambda: None).result(timeout=5)
    wait_for(lambda: parking.parks >= 1, timeout=5, interval=0.005)
    for _ in range(5):
        parks = parking.parks
        parking.submit(parking.linger, 1.0).result(timeout=5)  # as a walk's job does
        time.sleep(0.05)
        assert parking.parks == parks  # waiting alone, the team not parked
        parking.submit(lambda: None).result(timeout=5)
    parking.submit(parking.linger, 0.05).result(timeout=5)
    wait_for(lambda: parking.parks > parks, timeout=5, interval=0.005)  # after the linger, it parks


def test_an_answer_the_peer_cannot_take_closes_its_channel():
    thread = TorchThread()
    served: list[str] = []
    ours, theirs = socket.socketpair()
    try:
        thread.serve(theirs, echo_steps(served))
        ours.sendall(channel.request_frame({}, b"x" * 100))
        ours.shutdown(socket.SHUT_RD)  # the answer cannot be delivered: writing it fails
        ours.close()
        wait_for(lambda: thread.channels == 0, timeout=5, interval=0.01)
        assert served and thread.submit(lambda: "on").result(timeout=5) == "on"
    finally:
        thread.shutdown()


@needs_library
@pytest.mark.parametrize("team", [False, True])
def test_the_native_wait_writes_first_then_sleeps_until_readable_and_says_when_the_write_fails(team):
    lib = native.library()
    ours, theirs = socket.socketpair()
    try:
        started = time.monotonic()
        assert lib.wait_readable([ours.fileno()], team=team, timeout=0.2, send_fd=ours.fileno(), data=b"ping") == 0
        assert time.monotonic() - started >= 0.15 and theirs.recv(16) == b"ping"  # written, then waited
        theirs.sendall(b"pong")
        assert lib.wait_readable([ours.fileno()], team=team, timeout=5) == 1 and ours.recv(16) == b"pong"
        theirs.close()
        assert lib.wait_readable([ours.fileno()], team=team, timeout=5, send_fd=ours.fileno(), data=b"x") == -2
    finally:
        ours.close()


def test_two_threads_waiting_on_each_others_channels_serve_each_other_meanwhile():
    """Two heads whose walks go through each other's layers at once: each thread, waiting for its answer, serves
    the step the other sent it (waiting alone, each would wait out its timeout on the other)."""
    first, second = TorchThread("first"), TorchThread("second")
    first_out, second_in = socket.socketpair()  # first's walk -> a channel second serves
    second_out, first_in = socket.socketpair()
    served: list[str] = []
    try:
        second.serve(second_in, echo_steps(served))
        first.serve(first_in, echo_steps(served))
        started = threading.Barrier(2)

        def walk(thread, sock, body):
            started.wait(5)  # both threads are in their walks before either step is written
            frame = channel.request_frame({}, body)
            if not thread.wait_answer(sock, frame, 3.0):
                return None
            return bytes(channel.read_reply(sock)[2])

        walks = [first.submit(walk, first, first_out, b"from first"),
                 second.submit(walk, second, second_out, b"from second")]
        assert [w.result(timeout=10) for w in walks] == [b"from first", b"from second"]
        assert sorted(served) == ["first", "second"]
    finally:
        first.shutdown()
        second.shutdown()
        first_out.close()
        second_out.close()


def test_a_wait_for_an_answer_that_never_comes_times_out():
    thread = TorchThread()
    ours, theirs = socket.socketpair()
    try:
        started = time.monotonic()
        assert thread.submit(thread.wait_answer, ours, b"step", 0.3).result(timeout=5) is False
        assert 0.25 < time.monotonic() - started < 3 and theirs.recv(16) == b"step"
    finally:
        thread.shutdown()
        ours.close()
        theirs.close()
