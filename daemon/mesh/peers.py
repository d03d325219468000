"""What this node knows of the other nodes: their layer ranges, cache support and health."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp

from daemon.api import PeerSummary
from daemon.mesh.routing import Candidate


@dataclass
class PeerState:
    url: str
    status: dict | None = None
    up: bool = False
    last_seen: float | None = None
    error: str | None = None

    def summary(self) -> PeerSummary:
        return PeerSummary(
            url=self.url,
            up=self.up,
            start=self.status.get("start") if self.status else None,
            end=self.status.get("end") if self.status else None,
            last_seen=self.last_seen,
            error=self.error,
        )


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


class PeerDirectory:
    """Peers from ``--peer`` seeds, refreshed from their ``/v1/status``."""

    def __init__(self, seeds: list[str], *, self_url: str, fingerprint: str, timeout: float = 2.0) -> None:
        self.self_url = normalize_url(self_url)
        self.fingerprint = fingerprint
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self.peers: dict[str, PeerState] = {}
        for seed in seeds:
            self.add(seed)

    def add(self, url: str) -> None:
        url = normalize_url(url)
        if url != self.self_url and url not in self.peers:
            self.peers[url] = PeerState(url)

    def remove(self, url: str) -> bool:
        return self.peers.pop(normalize_url(url), None) is not None

    async def refresh(self, session: aiohttp.ClientSession) -> None:
        """Ask every peer for its status at once; a peer that does not answer is down."""
        await asyncio.gather(*(self._refresh_one(session, p) for p in list(self.peers.values())))

    async def _refresh_one(self, session: aiohttp.ClientSession, peer: PeerState) -> None:
        try:
            async with session.get(peer.url + "/v1/status", timeout=self._timeout) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                status = await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            peer.up, peer.error = False, f"{exc.__class__.__name__}: {exc}".strip(": ")
            return
        model = status.get("model", {})
        if model.get("fingerprint") != self.fingerprint:
            peer.up, peer.status = False, status
            peer.error = f"serves a different model ({model.get('name')}, {model.get('fingerprint')})"
            return
        peer.status, peer.up, peer.error, peer.last_seen = status, True, None, time.time()

    def candidates(self) -> list[Candidate]:
        return [
            Candidate(
                url=p.url,
                start=p.status["start"],
                end=p.status["end"],
                kv_cache=bool(p.status.get("kv_cache_enabled") and p.status.get("supports_kv_cache")),
            )
            for p in self.peers.values()
            if p.up and p.status
        ]

    def summaries(self) -> list[PeerSummary]:
        return [p.summary() for p in self.peers.values()]
