"""What this node knows of the other nodes: their layer ranges, cache support, load and health.

A node starts from its ``--peer`` seeds and learns the rest of the mesh from
them: every peer's ``/v1/status`` lists the peers it sees up, and those join
this directory too. A node also **announces** itself to its seeds
(``POST /v1/peers/announce``) whenever a seed that answers does not list it, so
a worker started with only ``--peer HEAD`` joins the head, and through the
head's status every other node, within a poll or two. A node that stops
gracefully says it leaves, and is dropped at once. A peer that stops answering
is marked down at once (by a poll, or by the head when a hop to it fails) and up
again when it answers; one that was not a seed is forgotten after a minute down.

Every change the directory sees (a peer joined, left, stopped answering, was
forgotten) goes to ``on_change``: the head keeps them with its route's events,
where the console shows them.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from daemon.api import PeerSummary, format_layers, normalize_url
from daemon.api.tls import untrusted_certificate
from daemon.mesh.routing import Candidate

FORGET_AFTER_SECONDS = 60.0  # a learned peer down this long is dropped; seeds are kept for good
MAX_URL_LENGTH = 2048
ANNOUNCED = "announced"  # a peer's ``learned_from`` when it told this node of itself

# what ``on_change`` is told: kind (joined, left, down, forgotten), url, a sentence, and a joined peer's layers
PeerChange = Callable[[str, str, str, "tuple[int, int] | None"], None]


@dataclass
class PeerState:
    url: str
    learned_from: str | None = None  # None: a seed or added by the operator; ANNOUNCED; else the peer that listed it
    status: dict | None = None
    up: bool = False
    last_seen: float | None = None
    down_since: float | None = None
    error: str | None = None

    def summary(self) -> PeerSummary:
        return PeerSummary(
            url=self.url,
            up=self.up,
            start=self.status.get("start") if self.status else None,
            end=self.status.get("end") if self.status else None,
            last_seen=self.last_seen,
            error=self.error,
            learned_from=self.learned_from,
            node_id=self.status.get("node_id") if self.status else None,
        )

    def mark_down(self, error: str, now: float) -> None:
        if self.up or self.down_since is None:
            self.down_since = now
        self.up, self.error = False, error


def _plausible_url(value) -> bool:
    return isinstance(value, str) and value.startswith(("http://", "https://")) and len(value) <= MAX_URL_LENGTH


class PeerDirectory:
    """Peers from ``--peer`` seeds and from what those peers know, refreshed from their ``/v1/status``."""

    def __init__(self, seeds: list[str], *, self_url: str, fingerprint: str, node_id: str = "",
                 timeout: float = 2.0, clock=time.time, on_change: PeerChange | None = None) -> None:
        self.self_url = normalize_url(self_url)
        self.fingerprint = fingerprint
        self.node_id = node_id
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._clock = clock
        self.on_change = on_change
        self.peers: dict[str, PeerState] = {}
        self._self_aliases: set[str] = {self.self_url}  # other addresses that turned out to be this node
        self._removed: set[str] = set()  # removed by the operator: not re-learned from gossip
        # nodes that said they leave, and when: not re-learned from another node's stale list until they announce
        self._left: dict[str, tuple[float, str | None]] = {}  # url -> (when it said it leaves, its run then)
        self.seeds = [normalize_url(seed) for seed in seeds]
        for seed in seeds:
            self.add(seed)

    def add(self, url: str) -> None:
        """A seed, or a peer the operator added: kept until removed."""
        url = normalize_url(url)
        self._removed.discard(url)
        if url in self._self_aliases:
            return
        peer = self.peers.setdefault(url, PeerState(url))
        peer.learned_from = None

    def learn(self, url: str, *, source: str, node_id: str | None = None) -> None:
        """A peer another node reported up (``node_id``: the run it saw there); kept while it answers."""
        url = normalize_url(url)
        if url in self._self_aliases or url in self._removed or url in self.peers:
            return
        left, left_run = self._left.get(url, (None, None))
        started_again = node_id is not None and left_run is not None and node_id != left_run
        if left is not None and self._clock() - left < FORGET_AFTER_SECONDS and not started_again:
            return  # it said it leaves: the other node's list is older than that
        self._left.pop(url, None)
        self.peers[url] = PeerState(url, learned_from=source)

    def announced(self, url: str) -> bool:
        """A node told this one it serves at ``url``: a peer from now on, polled like any other and forgotten
        after a while down unless it is a seed. False where it is not taken: this node's own address, or one the
        operator removed (until the operator adds it again)."""
        url = normalize_url(url)
        if url in self._self_aliases or url in self._removed:
            return False
        self._left.pop(url, None)
        peer = self.peers.get(url)
        if peer is None:
            self.peers[url] = PeerState(url, learned_from=ANNOUNCED)
        elif peer.learned_from is not None:
            peer.learned_from = ANNOUNCED  # told by itself now, not second-hand
        return True

    def left(self, url: str) -> bool:
        """A node said it stops: out of every route at once. A seed stays known, down, for its return; any other
        peer is dropped. False when it was not a peer."""
        url = normalize_url(url)
        peer = self.peers.get(url)
        if peer is None:
            return False
        self._left[url] = (self._clock(), peer.status.get("node_id") if peer.status else None)
        if peer.learned_from is None:
            peer.mark_down("left the mesh", self._clock())
        else:
            del self.peers[url]
        self._changed("left", url, f"{url} left the mesh")
        return True

    def missing_from(self) -> list[str]:
        """Seeds that answer but do not list this node among their peers: the ones to announce it to."""
        missing = []
        for url in self.seeds:
            peer = self.peers.get(url)
            if peer is None or not peer.up or not peer.status:
                continue
            listed = {normalize_url(p["url"]) for p in peer.status.get("peers") or []
                      if isinstance(p, dict) and _plausible_url(p.get("url"))}
            if not listed & self._self_aliases:
                missing.append(url)
        return missing

    def up_urls(self) -> list[str]:
        return [p.url for p in self.peers.values() if p.up]

    def _changed(self, kind: str, url: str, sentence: str, layers: tuple[int, int] | None = None) -> None:
        if self.on_change is not None:
            self.on_change(kind, url, sentence, layers)

    def remove(self, url: str) -> bool:
        url = normalize_url(url)
        self._removed.add(url)
        return self.peers.pop(url, None) is not None

    def mark_down(self, url: str, error: str) -> None:
        """The head saw a hop to ``url`` fail: leave it out of routes until it answers a poll again."""
        peer = self.peers.get(normalize_url(url))
        if peer is not None:
            peer.mark_down(error, self._clock())

    async def refresh(self, session: aiohttp.ClientSession) -> None:
        """Ask every peer for its status at once; a peer that does not answer is down."""
        await asyncio.gather(*(self._refresh_one(session, p) for p in list(self.peers.values())))
        now = self._clock()
        for peer in list(self.peers.values()):
            if peer.learned_from and not peer.up and peer.down_since and now - peer.down_since > FORGET_AFTER_SECONDS:
                del self.peers[peer.url]
                self._changed("forgotten", peer.url, f"{peer.url} forgotten after {FORGET_AFTER_SECONDS:g} s down")

    async def _refresh_one(self, session: aiohttp.ClientSession, peer: PeerState) -> None:
        was_up = peer.up
        await self._poll(session, peer)
        if peer.url not in self.peers:
            return  # this node's own other address
        if peer.up and not was_up:
            layers = (peer.status["start"], peer.status["end"]) if _has_range(peer.status) else None
            serves = f", serving layers {format_layers(*layers)}" if layers else ""
            self._changed("joined", peer.url, f"{peer.url} joined{serves}", layers)
        elif was_up and not peer.up:
            self._changed("down", peer.url, f"{peer.url} stopped answering: {peer.error}")

    async def _poll(self, session: aiohttp.ClientSession, peer: PeerState) -> None:
        try:
            async with session.get(peer.url + "/v1/status", timeout=self._timeout) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                status = await resp.json()
            if not isinstance(status, dict) or not isinstance(status.get("model"), dict):
                raise ValueError("its /v1/status is not a meshd status")
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            # an untrusted certificate is said as such: the operator must fix trust, not the network
            error = untrusted_certificate(exc) or f"{exc.__class__.__name__}: {exc}".strip(": ")
            peer.mark_down(error, self._clock())
            return
        if self.node_id and status.get("node_id") == self.node_id:
            # another address of this very node (localhost vs 127.0.0.1, a public URL): not a peer
            self._self_aliases.add(peer.url)
            self.peers.pop(peer.url, None)
            return
        model = status["model"]
        if model.get("fingerprint") != self.fingerprint:
            peer.status = status
            peer.mark_down(f"serves a different model ({model.get('name')}, {model.get('fingerprint')})",
                           self._clock())
            return
        peer.status, peer.up, peer.error, peer.last_seen, peer.down_since = status, True, None, self._clock(), None
        self.learn_listed(status.get("peers"), source=peer.url)

    def learn_listed(self, listed, *, source: str) -> None:
        """Learn the peers another node lists up (its status's ``peers``, or its answer to an announcement)."""
        for other in listed if isinstance(listed, list) else []:
            if isinstance(other, dict) and other.get("up") and _plausible_url(other.get("url")):
                run = other.get("node_id")
                self.learn(other["url"], source=source, node_id=run if isinstance(run, str) else None)

    def candidates(self) -> list[Candidate]:
        return [
            Candidate(
                url=p.url,
                start=p.status["start"],
                end=p.status["end"],
                kv_cache=bool(p.status.get("kv_cache_enabled") and p.status.get("supports_kv_cache")),
                verifies=p.status.get("speculation") is True,
                busy=_share(p.status.get("busy")),
            )
            for p in self.peers.values()
            if p.up and _has_range(p.status)
            and not p.status.get("draining")  # a node shutting down takes no new generations
        ]

    def summaries(self) -> list[PeerSummary]:
        return [p.summary() for p in self.peers.values()]


def _has_range(status: dict | None) -> bool:
    return bool(status) and isinstance(status.get("start"), int) and isinstance(status.get("end"), int)


def _share(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return 0.0
    return min(max(float(value), 0.0), 1.0)
