"""A decode step walked along step channels by the head's torch thread (``daemon.mesh.route_step.run_step`` with
``daemon.mesh.channels``), against a tail that speaks frames on the other end of a real socket pair.

The head's own layers are a stand-in that runs ``then`` on the thread that calls it, as the torch thread does;
the HTTP transport is a stand-in that records what falls back to ``POST /forward``. Everything between (the
frames, the conversion of answers, the fallback, the errors) is the daemon's own.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import types

import pytest

from daemon import channel, wire
from daemon.api import Hop, Sampling
from daemon.errors import CacheMiss, HopFailed, UpstreamError
from daemon.mesh.channels import StepChannels
from daemon.mesh.hops import HopClient, HopReply
from daemon.mesh.route_step import run_step
from daemon.mesh.transport import HopResponse

TAIL = "http://127.0.0.1:7072"
ROUTE = [Hop("http://head", 0, 2, local=True), Hop(TAIL, 2, 4)]
H = 4


class Head:
    """The head's own layers 0-1: the step's output is its input's zeros; ``then`` runs as on the torch thread."""

    hidden_size = H

    def __init__(self) -> None:
        self.steps = 0

    async def local_step(self, activation, *, then=None, token_ids=None, **step) -> HopReply:
        self.steps += 1
        out = wire.Activation("float32", (1, 1, H), bytes(4 * H))
        walked = then(types.SimpleNamespace(out=out)) if then is not None else None
        return HopReply(activation=out, then=walked)


class Transport:
    """``POST /forward`` hops that fall back from a channel: each answers token 99."""

    def __init__(self) -> None:
        self.posts: list[dict] = []

    async def post(self, url, body, *, headers, timeout, connect_timeout) -> HopResponse:
        self.posts.append(headers)
        from multidict import CIMultiDict, CIMultiDictProxy

        return HopResponse(200, CIMultiDictProxy(CIMultiDict({"Content-Type": "application/json"})),
                           b'{"token_id": 99, "text": "x"}', len(body), 30)


class Seen(list):
    """The headers of each step a tail read (a continuation's made from the step before it, as a node makes them),
    and whether each came without its own (``continued``)."""

    def __init__(self) -> None:
        super().__init__()
        self.continued: list[bool] = []


def tail_thread(sock: socket.socket, answers: list, delay: float = 0.0) -> Seen:
    """Answer request frames from ``answers`` in turn, ``delay`` seconds after each arrives: ``(status, json)``, or
    ``"close"`` to hang up unread."""
    seen = Seen()

    def serve():
        last = None
        for answer in answers:
            frame = channel.read_request(sock)
            if frame is None:
                return
            if frame[0] is None:
                assert last is not None, "a continuation with no step the tail answered 200 before it"
                headers = last | {wire.PAST_LEN: str(int(last[wire.PAST_LEN]) + 1)}
            else:
                headers = dict(frame[0])
            seen.append(headers)
            seen.continued.append(frame[0] is None)
            if answer == "close":
                break
            status, body = answer
            last = headers if status == 200 else None
            time.sleep(delay)
            sock.sendall(channel.reply_frame(status, {"Content-Type": "application/json"}, json.dumps(body).encode()))
        sock.close()

    threading.Thread(target=serve, daemon=True).start()
    return seen


def step(head, client, past_len, inputs=None):
    return run_step(head, client, ROUTE, [5], mode="decode", session_id="s", past_len=past_len,
                    sampling=Sampling(temperature=0.0), inputs=inputs)


@pytest.fixture
def mesh():
    ours, theirs = socket.socketpair()
    transport = Transport()
    channels = StepChannels()
    channels.add(TAIL, ours)
    client = HopClient(transport, None, hidden_size=H, timeout=2.0, channels=channels)
    yield Head(), client, transport, theirs
    channels.close()
    theirs.close()


def test_decode_steps_go_over_the_channel_with_the_headers_post_forward_would_carry(mesh):
    head, client, transport, tail = mesh
    seen = tail_thread(tail, [(200, {"token_id": 10 + i, "text": "t"}) for i in range(3)])

    async def main():
        return [await step(head, client, 7 + i) for i in range(3)]

    replies = asyncio.run(main())
    assert [r.token_id for r in replies] == [10, 11, 12]
    assert transport.posts == []
    assert [(h[wire.CACHE], h[wire.PAST_LEN], h[wire.START_LAYER], h[wire.HOP_INDEX]) for h in seen] == \
        [("decode", str(7 + i), "2", "1") for i in range(3)]
    assert all(wire.SAMPLING in h and h[wire.SHAPE] == f"1,1,{H}" for h in seen)
    assert replies[0].sent_bytes > 0 and replies[0].received_bytes > 0
    # each step after one the tail answered goes without its headers, which differ in the past length alone
    assert seen.continued == [False, True, True]
    assert replies[1].sent_bytes == replies[0].sent_bytes - len(wire.header_lines(seen[0]))


def test_a_step_after_a_refusal_or_a_jump_or_with_a_history_carries_its_headers(mesh):
    head, client, transport, tail = mesh
    seen = tail_thread(tail, [(200, {"token_id": 1, "text": "a"}),
                              (400, {"error": {"message": "no", "param": wire.SHAPE}}),
                              (200, {"token_id": 2, "text": "b"}), (200, {"token_id": 3, "text": "c"}),
                              (200, {"token_id": 4, "text": "d"}), (200, {"token_id": 5, "text": "e"})])
    history = wire.History((1, 2), (3,))

    async def main():
        await step(head, client, 3)
        with pytest.raises(UpstreamError):  # the refusal, raised as POST /forward's would be
            await step(head, client, 4)  # after a 200: a continuation
        await step(head, client, 5)  # after a refusal: in full
        await step(head, client, 9)  # a jump in the past length: in full
        await run_step(head, client, ROUTE, [5], mode="decode", session_id="s", past_len=10,
                       sampling=Sampling(temperature=0.0, repetition_penalty=1.2), history=history)
        await run_step(head, client, ROUTE, [5], mode="decode", session_id="s", past_len=11,
                       sampling=Sampling(temperature=0.0, repetition_penalty=1.2), history=history)

    asyncio.run(main())
    assert seen.continued == [False, True, False, False, False, False]
    assert [h[wire.PAST_LEN] for h in seen] == ["3", "4", "5", "9", "10", "11"]


def test_a_channel_that_closes_mid_step_sends_that_step_on_post_forward(mesh):
    head, client, transport, tail = mesh
    tail_thread(tail, [(200, {"token_id": 1, "text": "a"}), "close"])

    async def main():
        first = await step(head, client, 3)
        second = await step(head, client, 4)  # the tail hangs up: the same step goes on POST /forward
        return first, second

    first, second = asyncio.run(main())
    assert (first.token_id, second.token_id) == (1, 99)
    assert len(transport.posts) == 1 and transport.posts[0][wire.PAST_LEN] == "4"
    assert head.steps == 2  # the head's own layers ran once per step: only the tail's hop was sent again


def test_a_cache_miss_over_the_channel_is_raised_with_the_hop_input_kept(mesh):
    head, client, transport, tail = mesh
    tail_thread(tail, [(409, {"error": "cache_miss", "reason": "unknown_session", "message": "gone"})])
    inputs: dict[int, wire.Activation] = {}
    with pytest.raises(CacheMiss) as miss:
        asyncio.run(step(head, client, 3, inputs))
    assert miss.value.reason == "unknown_session" and set(inputs) == {1}
    assert transport.posts == []


def test_a_tail_that_does_not_answer_in_time_is_a_failed_hop(mesh):
    head, client, transport, tail = mesh
    client.timeout = 0.3

    async def main():
        with pytest.raises(HopFailed) as failed:
            await step(head, client, 3)  # the tail reads nothing, answers nothing
        return failed.value, client.channels.for_hops([ROUTE[1]])

    failed, channels = asyncio.run(main())
    assert failed.reason == "timed_out"
    assert channels is None  # that channel is gone (another starts opening)


def test_a_5xx_over_the_channel_is_a_failed_hop_that_names_the_node_it_moved_to(mesh):
    head, client, transport, tail = mesh
    tail_thread(tail, [(503, {"error": {"message": "draining"}, "moved_to": "http://other"})])
    with pytest.raises(HopFailed) as failed:
        asyncio.run(step(head, client, 3))
    assert (failed.value.status, failed.value.moved_to) == (503, "http://other")


def test_steps_that_are_not_one_position_decode_steps_never_take_the_channel(mesh):
    head, client, transport, tail = mesh
    seen = tail_thread(tail, [])

    async def main():
        await run_step(head, client, ROUTE, [5, 6, 7], mode="prefill", session_id="s", past_len=0,
                       sampling=Sampling(temperature=0.0))
        await run_step(head, client, ROUTE, [5], mode="decode", session_id="s", past_len=3,
                       sampling=Sampling(temperature=0.0), draft=[8])

    asyncio.run(main())
    assert len(transport.posts) == 2 and seen == []


def test_while_the_head_runs_several_generations_steps_take_post_forward(mesh):
    head, client, transport, tail = mesh
    client.channels.allowed = lambda: False
    asyncio.run(step(head, client, 3))
    assert len(transport.posts) == 1


def test_each_hop_of_a_walked_step_is_timed_apart(mesh):
    head, client, transport, tail = mesh
    seen = tail_thread(tail, [(200, {"token_id": 1, "text": "a"})], delay=0.2)
    timed: list[tuple[str, float]] = []

    async def main():
        await run_step(head, client, ROUTE, [5], mode="decode", session_id="s", past_len=3,
                       sampling=Sampling(temperature=0.0), on_hop=lambda hop, ms, reply: timed.append((hop.url, ms)))

    asyncio.run(main())
    assert [url for url, _ in timed] == [ROUTE[0].url, TAIL] and len(seen) == 1
    assert timed[0][1] < 100 <= 200 <= timed[1][1]  # the head's own hop ends where the walk to the tail began
