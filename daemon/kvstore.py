"""The per-node session cache store: session id -> this node's cache for its layers.

Cache objects are opaque (a ``DynamicCache`` in practice): no torch, no K/V shape assumed.
Bounds are checked on every access: a TTL, a session count (LRU) and a byte budget. The torch
worker thread writes and the aiohttp event loop reads, so every public method takes one lock.

A session whose generation has ended stays as a **retained prefix** (:meth:`SessionCacheStore.retain`)
that a later step can continue, copy or take over (:meth:`SessionCacheStore.derive`). Retained
sessions count against the same bounds, and when a bound is hit they go first, least recently
used first: a live generation is never evicted to keep an idle prefix.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from daemon.api import StoreStats
from daemon.errors import CACHE_MISS_REASONS, CacheMiss

EVICTION_REASONS = ("ttl", "lru", "bytes", "dropped")
Derive = Callable[[object, int, int, bool], object | None]  # (cache, keep, held, copy) -> cache, or None: cannot


@dataclass
class SessionEntry:
    """One session's cache on this node, with what the store needs to bound and report it."""

    session_id: str
    cache: object  # opaque: never inspected here
    past_len: int  # kept here because some caches (linear attention only) have no sequence axis
    start_layer: int  # a decode that starts at another layer cannot reuse this cache
    nbytes: int
    created_at: float  # clock() seconds; wall-clock epoch by default so a console can show them
    last_used: float
    expires_at: float  # last_used + ttl
    retained: bool = False  # its generation ended: an idle prefix, evicted before any live session
    # after a verify step (speculative decoding): what cuts the session back to any length from ``rewind_from``
    # up to ``past_len`` (opaque here, see daemon.model.speculation); None: only ``past_len`` continues
    undo: object | None = None
    rewind_from: int = 0

    def can_rewind_to(self, past_len: int) -> bool:
        return self.undo is not None and self.rewind_from <= past_len < self.past_len


class SessionCacheStore:
    """Session caches bounded by TTL, session count (LRU) and total bytes; thread-safe."""

    def __init__(
        self,
        *,
        ttl_seconds: float = 600.0,
        max_sessions: int = 8,
        max_bytes: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be > 0, got {ttl_seconds}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes}")
        self.ttl_seconds = float(ttl_seconds)
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        self._clock = clock
        self._lock = threading.Lock()
        # Least recently used first, so eviction pops from the front.
        self._entries: OrderedDict[str, SessionEntry] = OrderedDict()
        self._hits = 0
        self._misses_by_reason = dict.fromkeys(CACHE_MISS_REASONS, 0)
        self._evictions = dict.fromkeys(EVICTION_REASONS, 0)

    def put(
        self, session_id: str, cache: object, *, past_len: int, start_layer: int, nbytes: int
    ) -> SessionEntry:
        """Store a freshly prefilled cache, replacing any entry under the id, then enforce bounds."""
        with self._lock:
            now = self._clock()
            self._entries.pop(session_id, None)  # a replacement is not an eviction
            expires_at = now + self.ttl_seconds
            entry = SessionEntry(session_id, cache, past_len, start_layer, nbytes, now, now, expires_at)
            self._entries[session_id] = entry
            self._enforce_bounds(now)
            return dataclasses.replace(entry)

    def checkout(self, session_id: str, *, past_len: int, start_layer: int) -> SessionEntry:
        """Return the entry for a decode step, or raise :class:`CacheMiss` saying why not."""
        with self._lock:
            now = self._clock()
            self._enforce_bounds(now)
            entry = self._entries.get(session_id)
            if entry is None:
                raise self._miss("unknown_session", f"no cached session {session_id!r} on this node")
            # Start layer first: a changed route makes the cache useless whatever its length.
            if entry.start_layer != start_layer:
                what = f"was cached from layer {entry.start_layer}, the step starts at layer {start_layer}"
                raise self._drop_stale(entry, "start_layer_mismatch", what)
            if entry.past_len != past_len and not entry.can_rewind_to(past_len):
                what = f"holds {entry.past_len} tokens, the step expects {past_len}"
                raise self._drop_stale(entry, "past_len_mismatch", what)
            self._hits += 1
            self._touch(entry, now)
            return dataclasses.replace(entry)

    def commit(self, session_id: str, *, past_len: int, nbytes: int, undo: object | None = None,
               rewind_from: int = 0) -> None:
        """Record a successful step's new length and size, then enforce bounds (bytes may have grown). A verify
        step's ``undo`` lets the next step start anywhere from ``rewind_from`` to ``past_len``; any other step
        ends what an earlier one allowed."""
        with self._lock:
            now = self._clock()
            entry = self._entries.get(session_id)
            if entry is not None:  # one evicted while its step ran stays evicted; its next decode misses
                # Refresh before expiring, so a step longer than the TTL does not lose its own cache.
                entry.past_len = past_len
                entry.nbytes = nbytes
                entry.undo, entry.rewind_from = undo, rewind_from
                self._touch(entry, now)
            self._enforce_bounds(now)

    def derive(self, session_id: str, source_id: str, *, keep: int, start_layer: int, take: bool,
               cut: Derive, nbytes: Callable[[object], int]) -> None:
        """Make ``session_id`` from the first ``keep`` positions of ``source_id``'s cache: ``cut(cache, keep,
        held, copy)`` copies them (``take`` False: the source stays) or crops the source in place and the entry
        moves to the new id. Raises :class:`CacheMiss` when the source is gone, shorter than ``keep``, cached
        from another start layer, or cannot be cut back (``cut`` returns None); the source is then untouched.
        """
        with self._lock:
            now = self._clock()
            self._enforce_bounds(now)
            source = self._entries.get(source_id)
            if source is None:
                raise self._miss("prefix_unavailable", f"no cached session {source_id!r} to start from on this node")
            if source.start_layer != start_layer or source.past_len < keep:
                raise self._miss("prefix_unavailable", f"session {source_id!r} holds {source.past_len} tokens from "
                                 f"layer {source.start_layer}; the step needs {keep} from layer {start_layer}")
            # cutting runs under the lock: a copy of a few hundred positions, far below a step's compute
            cache = cut(source.cache, keep, source.past_len, not take)
            if cache is None:
                raise self._miss("not_croppable", f"session {source_id!r} holds {source.past_len} tokens in layers "
                                 f"that cannot be cut back to {keep} (linear attention or a filled sliding window)")
            if take:
                del self._entries[source_id]  # moved, not evicted
            self._entries.pop(session_id, None)
            self._entries[session_id] = SessionEntry(session_id, cache, keep, start_layer, nbytes(cache), now, now,
                                                     now + self.ttl_seconds)
            self._enforce_bounds(now)

    def retain(self, session_id: str) -> bool:
        """Mark a session whose generation ended as a retained prefix; False if it is not here."""
        with self._lock:
            now = self._clock()
            entry = self._entries.get(session_id)
            if entry is None:
                return False
            entry.retained = True
            self._touch(entry, now)
            return True

    def drop(self, session_id: str, reason: str = "dropped") -> bool:
        """Remove a session, counting it as an eviction for ``reason``; False if it was not here."""
        if reason not in EVICTION_REASONS:
            raise ValueError(f"unknown eviction reason {reason!r}")
        with self._lock:
            self._enforce_bounds(self._clock())
            return self._evict(session_id, reason)

    def record_miss(self, reason: str) -> None:
        """Count a miss decided outside the store, e.g. ``"cache_disabled"``."""
        if reason not in CACHE_MISS_REASONS:
            raise ValueError(f"unknown cache miss reason {reason!r}")
        with self._lock:
            self._misses_by_reason[reason] += 1

    def get(self, session_id: str) -> SessionEntry | None:
        """A snapshot of the live entry, without hit/miss accounting or refreshing its use time."""
        with self._lock:
            self._enforce_bounds(self._clock())
            entry = self._entries.get(session_id)
            return None if entry is None else dataclasses.replace(entry)

    def entries(self) -> list[SessionEntry]:
        """Snapshots of the live entries, most recently used first."""
        with self._lock:
            self._enforce_bounds(self._clock())
            return [dataclasses.replace(e) for e in reversed(self._entries.values())]

    def stats(self) -> StoreStats:
        """Size, limits and counters after expiring stale entries."""
        with self._lock:
            self._enforce_bounds(self._clock())
            return StoreStats(
                sessions=len(self._entries),
                bytes=sum(e.nbytes for e in self._entries.values()),
                max_sessions=self.max_sessions,
                max_bytes=self.max_bytes,
                ttl_seconds=self.ttl_seconds,
                hits=self._hits,
                misses=sum(self._misses_by_reason.values()),
                misses_by_reason=dict(self._misses_by_reason),
                evictions=dict(self._evictions),
            )

    def __len__(self) -> int:
        with self._lock:
            self._enforce_bounds(self._clock())
            return len(self._entries)

    # Helpers below assume the lock is held.

    def _miss(self, reason: str, message: str) -> CacheMiss:
        self._misses_by_reason[reason] += 1
        return CacheMiss(reason, message)

    def _drop_stale(self, entry: SessionEntry, reason: str, what: str) -> CacheMiss:
        self._evict(entry.session_id, "dropped")
        return self._miss(reason, f"session {entry.session_id!r} {what}; its cache was dropped")

    def _touch(self, entry: SessionEntry, now: float) -> None:
        entry.last_used = now
        entry.expires_at = now + self.ttl_seconds
        self._entries.move_to_end(entry.session_id)

    def _evict(self, session_id: str, reason: str) -> bool:
        if self._entries.pop(session_id, None) is None:
            return False
        self._evictions[reason] += 1
        return True

    def _enforce_bounds(self, now: float) -> None:
        for session_id in [s for s, e in self._entries.items() if e.expires_at <= now]:
            self._evict(session_id, "ttl")
        # An entry too big on its own goes first and alone, rather than taking other sessions with it.
        if self.max_bytes is not None:
            for session_id in [s for s, e in self._entries.items() if e.nbytes > self.max_bytes]:
                self._evict(session_id, "bytes")
        while len(self._entries) > self.max_sessions:
            self._evict(self._next_victim(), "lru")
        total = sum(e.nbytes for e in self._entries.values())
        while self.max_bytes is not None and total > self.max_bytes:
            victim = self._next_victim()  # never the newest: it fits alone, so the loop stops first
            total -= self._entries[victim].nbytes
            self._evict(victim, "bytes")

    def _next_victim(self) -> str:
        """The least recently used retained prefix, else the least recently used session."""
        return next((s for s, e in self._entries.items() if e.retained), None) or next(iter(self._entries))
