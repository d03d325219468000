"""The head's batches of decode steps (``daemon.mesh.hop_batches``), against a node stood in by a function that
answers each request as a node would (the requests a real node answers are in ``tests/mesh/test_batch_hops.py``)."""

from __future__ import annotations

import asyncio
import json

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from daemon import channel, wire
from daemon.errors import UpstreamError
from daemon.mesh import hop_batches
from daemon.mesh.hop_batches import HopBatches
from daemon.mesh.transport import HopResponse, TransportError

URL = "http://127.0.0.1:9"


def response(status: int, headers: dict[str, str], body: bytes, sent: int = 0) -> HopResponse:
    return HopResponse(status, CIMultiDictProxy(CIMultiDict(headers)), body, sent, len(body) + 100)


class Node:
    """Answers ``POST /forward`` with the step's session as JSON, and ``POST /forward/batch`` with a reply frame
    per step (``batch_status`` other than 200: the whole batch refused so)."""

    def __init__(self, batch_status: int = 200) -> None:
        self.requests: list[tuple[str, int]] = []  # (path, steps in it)
        self.batch_status = batch_status

    @staticmethod
    def answer(headers) -> tuple[int, dict[str, str], bytes]:
        session = headers["X-Meshnet-Session"]
        if session == "lost":
            return 409, {"Content-Type": "application/json"}, b'{"error": "cache_miss"}'
        return 200, {"Content-Type": "application/json"}, json.dumps({"session": session}).encode()

    async def post(self, url: str, headers, body: bytes, seconds: float) -> HopResponse:
        await asyncio.sleep(0)
        path = url.removeprefix(URL)
        if path == "/forward":
            self.requests.append((path, 1))
            return response(*self.answer(headers), sent=len(body) + 50)
        assert path == wire.BATCH_PATH and headers["Content-Type"] == wire.BATCH_CONTENT_TYPE
        steps = channel.requests_in(body)
        self.requests.append((path, len(steps)))
        if self.batch_status != 200:
            return response(self.batch_status, {"Content-Type": "application/json"}, b'{"error": "refused"}')
        replies = b"".join(channel.reply_frame(*self.answer(h)) for h, _ in steps)
        return response(200, {"Content-Type": wire.BATCH_CONTENT_TYPE}, replies, sent=len(body) + 80)


async def send_at_once(batches: HopBatches, sessions: list[str]) -> list:
    return await asyncio.gather(*(batches.send(URL, {"X-Meshnet-Session": s}, b"x" * 8, 1.0) for s in sessions),
                                return_exceptions=True)


def sessions_of(answers: list) -> list:
    return [json.loads(a.body)["session"] if a.status == 200 else a.status for a in answers]


async def test_steps_ready_in_one_turn_leave_in_one_request_and_each_reads_its_own_answer():
    node = Node()
    batches = HopBatches(node.post)
    answers = await send_at_once(batches, ["a", "b", "lost", "c"])
    assert node.requests == [(wire.BATCH_PATH, 4)]
    assert sessions_of(answers) == ["a", "b", 409, "c"]
    # each step's bytes: its frame, and a quarter of the request's 80 bytes of HTTP head
    frame = len(channel.request_frame({"X-Meshnet-Session": "a"}, b"x" * 8))
    assert answers[0].sent_bytes == frame + 20
    assert [a.received_bytes for a in answers] == \
        [len(channel.reply_frame(*Node.answer({"X-Meshnet-Session": s}))) + 25 for s in ["a", "b", "lost", "c"]]


async def test_a_lone_step_goes_on_post_forward_and_later_turns_make_their_own_batches():
    node = Node()
    batches = HopBatches(node.post)
    assert sessions_of(await send_at_once(batches, ["a"])) == ["a"]
    assert sessions_of(await send_at_once(batches, ["a", "b"])) == ["a", "b"]
    assert node.requests == [("/forward", 1), (wire.BATCH_PATH, 2)]


async def test_a_node_without_the_batch_path_is_sent_each_step_alone_until_asked_again(monkeypatch):
    node = Node(batch_status=404)
    batches = HopBatches(node.post)
    assert sessions_of(await send_at_once(batches, ["a", "b"])) == ["a", "b"]
    assert node.requests == [(wire.BATCH_PATH, 2), ("/forward", 1), ("/forward", 1)]
    assert not batches.takes(URL)
    monkeypatch.setattr(hop_batches.time, "monotonic", lambda: 1e12)  # RETRY_SECONDS later
    assert batches.takes(URL)


@pytest.mark.parametrize("status", [401, 413, 503])
async def test_a_batch_refused_whole_is_that_refusal_for_each_step(status):
    node = Node(batch_status=status)
    answers = await send_at_once(HopBatches(node.post), ["a", "b"])
    assert [a.status for a in answers] == [status, status]
    assert node.requests == [(wire.BATCH_PATH, 2)]


@pytest.mark.parametrize("body", [b"not frames", channel.reply_frame(200, {}, b"one answer for two steps")])
async def test_an_answer_that_is_not_one_frame_per_step_fails_each_step(body):
    async def post(url, headers, sent, seconds):
        return response(200, {"Content-Type": wire.BATCH_CONTENT_TYPE}, body)

    answers = await send_at_once(HopBatches(post), ["a", "b"])
    assert all(isinstance(a, UpstreamError) and "answered a batch of steps" in a.message for a in answers), answers


@pytest.mark.parametrize("failure", [TimeoutError(), TransportError("cannot connect: refused")])
async def test_an_exchange_that_fails_fails_each_of_its_steps(failure):
    async def post(url, headers, sent, seconds):
        raise failure

    answers = await send_at_once(HopBatches(post), ["a", "b", "c"])
    assert [type(a) for a in answers] == [type(failure)] * 3


async def test_a_step_whose_generation_ended_does_not_hold_up_the_others():
    node = Node()
    batches = HopBatches(node.post)
    gone = asyncio.ensure_future(batches.send(URL, {"X-Meshnet-Session": "gone"}, b"", 1.0))
    kept = asyncio.ensure_future(batches.send(URL, {"X-Meshnet-Session": "kept"}, b"", 1.0))
    await asyncio.sleep(0)
    gone.cancel()
    assert sessions_of([await kept]) == ["kept"]
    assert gone.cancelled()


def test_batches_wait_for_others_only_while_others_may_come():
    batches = HopBatches(Node().post)
    assert batches.takes(URL)
    batches.wanted = lambda: False  # the head runs one generation
    assert not batches.takes(URL)
