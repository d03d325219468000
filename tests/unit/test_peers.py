"""Unit tests of ``daemon.mesh.peers.PeerDirectory`` against stub nodes on 127.0.0.1 serving fixed status JSON."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from daemon.mesh.peers import FORGET_AFTER_SECONDS, PeerDirectory

SELF = "http://127.0.0.1:1"
SELF_ID = "self-node-id"


class Clock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


class StubNode:
    """A fake node: answers /v1/status with whatever ``status`` holds, or 500 when ``failing``."""

    def __init__(self) -> None:
        self.status: dict = {}
        self.failing = False
        app = web.Application()
        app.router.add_get("/v1/status", self._status)
        self.server = TestServer(app, host="127.0.0.1")

    async def _status(self, request: web.Request) -> web.Response:
        if self.failing:
            return web.json_response({"error": "boom"}, status=500)
        return web.json_response(self.status)

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    def serve(self, start: int, end: int, *, node_id: str, peers: list[dict] = (), fingerprint: str = "f") -> None:
        self.status = {"start": start, "end": end, "node_id": node_id, "kv_cache_enabled": True,
                       "supports_kv_cache": True, "busy": 0.25, "peers": list(peers),
                       "model": {"name": "m", "fingerprint": fingerprint}}


@pytest.fixture
async def stubs():
    nodes = [StubNode() for _ in range(3)]
    for n in nodes:
        await n.server.start_server()
    async with aiohttp.ClientSession() as session:
        yield nodes, session
    for n in nodes:
        await n.server.close()


async def test_a_node_learns_the_mesh_from_one_seed(stubs):
    (a, b, c), session = stubs
    a.serve(15, 30, node_id="a", peers=[{"url": b.url, "up": True}, {"url": c.url, "up": False}])
    b.serve(15, 30, node_id="b")
    c.serve(0, 15, node_id="c")
    directory = PeerDirectory([a.url], self_url=SELF, fingerprint="f", node_id=SELF_ID)
    await directory.refresh(session)
    assert set(directory.peers) == {a.url, b.url}  # c was reported down: not learned (yet)
    assert directory.peers[b.url].learned_from == a.url
    assert directory.peers[a.url].learned_from is None
    await directory.refresh(session)
    assert directory.peers[b.url].up
    assert {(x.url, x.start, x.end, x.busy) for x in directory.candidates()} == {
        (a.url, 15, 30, 0.25), (b.url, 15, 30, 0.25)}


async def test_another_address_of_this_node_is_not_a_peer(stubs):
    (a, b, _), session = stubs
    a.serve(0, 15, node_id=SELF_ID)  # e.g. localhost:PORT when this node calls itself 127.0.0.1:PORT
    b.serve(15, 30, node_id="b", peers=[{"url": a.url, "up": True}])
    directory = PeerDirectory([a.url, b.url], self_url=SELF, fingerprint="f", node_id=SELF_ID)
    await directory.refresh(session)
    await directory.refresh(session)
    assert set(directory.peers) == {b.url}


async def test_operator_removed_peers_are_not_relearned(stubs):
    (a, b, _), session = stubs
    a.serve(0, 15, node_id="a", peers=[{"url": b.url, "up": True}])
    b.serve(15, 30, node_id="b")
    directory = PeerDirectory([a.url], self_url=SELF, fingerprint="f", node_id=SELF_ID)
    await directory.refresh(session)
    assert directory.remove(b.url)
    await directory.refresh(session)
    assert b.url not in directory.peers
    directory.add(b.url)  # until the operator adds it again
    assert b.url in directory.peers


async def test_down_then_up_and_learned_peers_are_forgotten_after_a_minute_down(stubs):
    (a, b, _), session = stubs
    clock = Clock()
    a.serve(0, 15, node_id="a", peers=[{"url": b.url, "up": True}])
    b.serve(15, 30, node_id="b")
    directory = PeerDirectory([a.url], self_url=SELF, fingerprint="f", node_id=SELF_ID, clock=clock)
    await directory.refresh(session)
    a.status["peers"] = []  # a no longer vouches for b
    a.failing = b.failing = True
    await directory.refresh(session)
    assert not directory.peers[a.url].up and not directory.peers[b.url].up
    assert "500" in directory.peers[a.url].error
    a.failing = False
    await directory.refresh(session)
    assert directory.peers[a.url].up  # comes back when it answers
    clock.now += FORGET_AFTER_SECONDS + 1
    await directory.refresh(session)
    assert b.url not in directory.peers  # learned second-hand and down for over a minute
    a.failing = True
    await directory.refresh(session)
    assert a.url in directory.peers  # a seed is kept however long it is down


async def test_mark_down_takes_a_peer_out_of_routes_until_it_answers(stubs):
    (a, _, _), session = stubs
    a.serve(15, 30, node_id="a")
    directory = PeerDirectory([a.url], self_url=SELF, fingerprint="f", node_id=SELF_ID)
    await directory.refresh(session)
    directory.mark_down(a.url, "connection reset")
    assert directory.candidates() == []
    await directory.refresh(session)
    assert [c.url for c in directory.candidates()] == [a.url]


async def test_a_node_of_another_model_or_with_junk_status_is_down(stubs):
    (a, b, _), session = stubs
    a.serve(15, 30, node_id="a", fingerprint="other")
    b.status = {"start": "zero", "model": "x", "peers": "nope"}
    directory = PeerDirectory([a.url, b.url], self_url=SELF, fingerprint="f", node_id=SELF_ID)
    await directory.refresh(session)
    assert not directory.peers[a.url].up and "different model" in directory.peers[a.url].error
    assert not directory.peers[b.url].up
    assert directory.candidates() == []


# --- joining by announcing, leaving by saying so -------------------------------------------------------------


def recording(directory: PeerDirectory) -> list[tuple]:
    changes: list[tuple] = []
    directory.on_change = lambda kind, url, sentence, layers: changes.append((kind, url, layers))
    return changes


async def test_an_announced_node_is_polled_gossiped_and_forgotten_when_long_down(stubs):
    (a, _, _), session = stubs
    clock = Clock()
    a.serve(15, 30, node_id="a")
    directory = PeerDirectory([], self_url=SELF, fingerprint="f", node_id=SELF_ID, clock=clock)
    changes = recording(directory)
    assert directory.announced(a.url + "/")  # normalised like any peer address
    await directory.refresh(session)
    assert [c.url for c in directory.candidates()] == [a.url]
    assert [s.url for s in directory.summaries() if s.up] == [a.url]  # what this node's status lists: gossip
    assert changes == [("joined", a.url, (15, 30))]
    a.failing = True
    await directory.refresh(session)
    assert changes[-1][:2] == ("down", a.url)
    clock.now += FORGET_AFTER_SECONDS + 1
    await directory.refresh(session)
    assert a.url not in directory.peers and changes[-1][:2] == ("forgotten", a.url)


async def test_an_announcement_does_not_override_the_operator_or_this_nodes_own_address(stubs):
    (a, _, _), session = stubs
    directory = PeerDirectory([a.url], self_url=SELF, fingerprint="f", node_id=SELF_ID)
    assert not directory.announced(SELF)
    assert directory.remove(a.url)
    assert not directory.announced(a.url) and a.url not in directory.peers
    directory.add(a.url)
    assert directory.announced(a.url) and directory.peers[a.url].learned_from is None  # still a seed


async def test_a_node_that_leaves_is_out_of_routes_at_once_and_not_relearned_from_stale_lists(stubs):
    (a, b, c), session = stubs
    clock = Clock()
    a.serve(0, 15, node_id="a", peers=[{"url": b.url, "up": True}])
    b.serve(15, 30, node_id="b")
    c.serve(15, 30, node_id="c")
    directory = PeerDirectory([a.url, c.url], self_url=SELF, fingerprint="f", node_id=SELF_ID, clock=clock)
    changes = recording(directory)
    await directory.refresh(session)
    await directory.refresh(session)
    assert {x.url for x in directory.candidates()} == {a.url, b.url, c.url}
    assert directory.left(b.url) and directory.left(c.url)
    assert {x.url for x in directory.candidates()} == {a.url}
    assert b.url not in directory.peers  # learned: dropped
    assert c.url in directory.peers and not directory.peers[c.url].up  # a seed: kept for its return
    assert [k for k, *_ in changes[-2:]] == ["left", "left"]
    await directory.refresh(session)  # a still lists b, from before b left
    assert b.url not in directory.peers
    assert directory.announced(b.url)  # b comes back and says so
    await directory.refresh(session)
    assert b.url in {x.url for x in directory.candidates()}
    assert not directory.left("http://127.0.0.1:9")  # never a peer


async def test_a_node_that_left_and_started_again_is_learned_from_a_list_that_shows_its_new_run(stubs):
    """A restarted worker announces only to its seed: the other nodes learn it from the seed's list, which names
    the run it saw there. The run that left stays out; another run is a new start."""
    (a, b, _), session = stubs
    a.serve(0, 15, node_id="a", peers=[{"url": b.url, "up": True, "node_id": "b"}])
    b.serve(15, 30, node_id="b")
    directory = PeerDirectory([a.url], self_url=SELF, fingerprint="f", node_id=SELF_ID, clock=Clock())
    await directory.refresh(session)
    await directory.refresh(session)
    assert directory.peers[b.url].summary().node_id == "b"  # what this node lists for others
    assert directory.left(b.url)
    await directory.refresh(session)
    assert b.url not in directory.peers  # a's list still shows the run that left
    b.serve(15, 30, node_id="b2")  # b started again and announced itself to a
    a.status["peers"] = [{"url": b.url, "up": True, "node_id": "b2"}]
    await directory.refresh(session)
    await directory.refresh(session)
    assert b.url in {x.url for x in directory.candidates()}


async def test_seeds_that_do_not_list_this_node_are_the_ones_to_announce_to(stubs):
    (a, b, c), session = stubs
    a.serve(0, 15, node_id="a")
    b.serve(15, 30, node_id="b", peers=[{"url": SELF, "up": True}])
    c.failing = True
    directory = PeerDirectory([a.url, b.url, c.url], self_url=SELF, fingerprint="f", node_id=SELF_ID)
    assert directory.missing_from() == []  # nothing polled yet
    await directory.refresh(session)
    assert directory.missing_from() == [a.url]  # b lists this node; c does not answer
    a.status["peers"] = [{"url": SELF + "/", "up": True}]
    await directory.refresh(session)
    assert directory.missing_from() == []
