"""``POST /forward/batch`` (``daemon.server.batch``) in meshd's own app, over a node that runs no layers: what a
batch is answered while the node drains, and when its body is not frames (the steps a real node computes are in
``tests/mesh/test_forward_protocol.py``)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from daemon import channel, wire
from tests.support.tui_data import MODEL, FakeDaemon

STEP = {wire.DTYPE: "float32", wire.SHAPE: f"1,1,{MODEL.hidden_size}", wire.CACHE: "decode", wire.PAST_LEN: "3"}


@pytest.fixture
async def node():
    daemon = FakeDaemon(0, 3)
    await daemon.start()
    yield daemon
    await daemon.stop()


async def post_batch(daemon: FakeDaemon, body: bytes) -> tuple[int, bytes, str]:
    async with aiohttp.ClientSession() as http, http.post(daemon.url + wire.BATCH_PATH, data=body) as resp:
        return resp.status, await resp.read(), resp.headers.get("Content-Type", "")


def frames(*sessions: str) -> bytes:
    return b"".join(channel.request_frame(STEP | {wire.SESSION: s}, bytes(4 * MODEL.hidden_size)) for s in sessions)


async def test_each_step_is_answered_in_its_own_frame_and_in_order(node):
    status, body, content_type = await post_batch(node, frames("a", "b"))
    assert status == 200 and content_type == wire.BATCH_CONTENT_TYPE
    answers = channel.replies_in(body)
    assert [s for s, *_ in answers] == [400, 400]  # what this node answers POST /forward: it runs no layers
    assert all("runs no layers" in json.loads(b)["error"]["message"] for _, _, b, _ in answers)
    malformed = channel.request_frame(STEP | {wire.SESSION: "c", wire.PAST_LEN: "x"}, bytes(4 * MODEL.hidden_size))
    status, body, _ = await post_batch(node, frames("a") + malformed)
    answers = [json.loads(b)["error"] for _, _, b, _ in channel.replies_in(body)]
    assert "runs no layers" in answers[0]["message"] and answers[1]["param"] == wire.PAST_LEN


async def test_a_draining_node_refuses_each_step_with_where_its_session_went(node):
    moved = {"a": "http://10.0.0.2:7070"}

    async def session_moved_to(session_id):  # as a real node's: once the steps taken before the drain have ended
        for _ in range(100):
            if node.node.forwards_in_flight == 0:
                return moved.get(session_id)
            await asyncio.sleep(0.01)
        raise AssertionError("the batch waited for itself: it was counted as a step under way")

    node.node.draining = True
    node.node.session_moved_to = session_moved_to
    status, body, _ = await post_batch(node, frames("a", "b"))
    assert status == 200
    answers = [(s, json.loads(b)) for s, _, b, _ in channel.replies_in(body)]
    assert [s for s, _ in answers] == [503, 503]
    assert answers[0][1]["moved_to"] == "http://10.0.0.2:7070" and "moved_to" not in answers[1][1]
    assert all(a["error"]["code"] == "draining" for _, a in answers)
    assert node.node.forwards_in_flight == 0


@pytest.mark.parametrize("body", [b"", b"junk", frames("a")[:-1], frames(*["s"] * 257)])
async def test_a_body_not_of_one_to_256_whole_frames_is_refused_whole(node, body):
    status, answer, _ = await post_batch(node, body)
    assert status == 400, answer
    assert json.loads(answer)["error"]["type"] == "invalid_request_error"
