"""Tests for the session cache store, with a fake clock instead of sleeping."""

from __future__ import annotations

import json
import threading

import pytest

from daemon.errors import CACHE_MISS_REASONS, CacheMiss
from daemon.kvstore import SessionCacheStore, SessionEntry, StoreStats


class FakeClock:
    """A clock the test advances by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make_store(clock: FakeClock, **kwargs) -> SessionCacheStore:
    return SessionCacheStore(clock=clock, **kwargs)


def put(store: SessionCacheStore, session_id: str, *, past_len=5, start_layer=0, nbytes=100) -> SessionEntry:
    return store.put(session_id, object(), past_len=past_len, start_layer=start_layer, nbytes=nbytes)


def ids(store: SessionCacheStore) -> list[str]:
    return [e.session_id for e in store.entries()]


def miss_reason(store: SessionCacheStore, session_id: str, *, past_len=5, start_layer=0) -> CacheMiss:
    with pytest.raises(CacheMiss) as info:
        store.checkout(session_id, past_len=past_len, start_layer=start_layer)
    return info.value


def test_put_then_checkout_returns_the_same_cache_and_refreshes_times(clock):
    store = make_store(clock, ttl_seconds=60)
    cache = object()
    entry = store.put("s", cache, past_len=7, start_layer=3, nbytes=42)
    assert entry == SessionEntry("s", cache, 7, 3, 42, 1000.0, 1000.0, 1060.0)
    clock.advance(10)
    got = store.checkout("s", past_len=7, start_layer=3)
    assert got.cache is cache
    assert (got.created_at, got.last_used, got.expires_at) == (1000.0, 1010.0, 1070.0)
    assert store.stats().hits == 1


def test_ttl_expiry_removes_entry_and_counts_ttl_eviction(clock):
    store = make_store(clock, ttl_seconds=60)
    put(store, "s")
    clock.advance(59.9)
    assert store.get("s") is not None
    clock.advance(0.1)
    assert store.get("s") is None
    assert len(store) == 0
    miss = miss_reason(store, "s")
    assert miss.reason == "unknown_session"
    assert miss.status == 409
    stats = store.stats()
    assert stats.evictions["ttl"] == 1
    assert stats.misses_by_reason["unknown_session"] == 1


def test_checkout_and_commit_extend_the_ttl(clock):
    store = make_store(clock, ttl_seconds=60)
    put(store, "s", past_len=5)
    clock.advance(50)
    store.checkout("s", past_len=5, start_layer=0)
    clock.advance(50)
    store.commit("s", past_len=6, nbytes=120)
    clock.advance(59)
    entry = store.get("s")
    assert entry is not None and entry.past_len == 6 and entry.nbytes == 120
    assert entry.expires_at == 1000.0 + 50 + 50 + 60


def test_commit_after_ttl_elapsed_keeps_the_session_it_just_used(clock):
    store = make_store(clock, ttl_seconds=10)
    put(store, "s", past_len=5)
    store.checkout("s", past_len=5, start_layer=0)
    clock.advance(30)  # a step slower than the TTL
    store.commit("s", past_len=6, nbytes=100)
    assert store.checkout("s", past_len=6, start_layer=0).past_len == 6
    assert store.stats().evictions["ttl"] == 0


def test_lru_count_eviction_follows_recency(clock):
    store = make_store(clock, max_sessions=3)
    for sid in ("a", "b", "c"):
        put(store, sid)
        clock.advance(1)
    store.checkout("a", past_len=5, start_layer=0)  # a is now the most recent; b the least
    clock.advance(1)
    put(store, "d")
    assert ids(store) == ["d", "a", "c"]
    clock.advance(1)
    put(store, "e")
    assert ids(store) == ["e", "d", "a"]
    assert store.stats().evictions == {"ttl": 0, "lru": 2, "bytes": 0, "dropped": 0}
    assert miss_reason(store, "b").reason == "unknown_session"


def test_get_does_not_refresh_recency_or_count(clock):
    store = make_store(clock, max_sessions=2)
    put(store, "a")
    clock.advance(1)
    put(store, "b")
    clock.advance(1)
    assert store.get("a").last_used == 1000.0
    put(store, "c")
    assert ids(store) == ["c", "b"]
    stats = store.stats()
    assert (stats.hits, stats.misses) == (0, 0)


def test_byte_budget_evicts_least_recently_used_others(clock):
    store = make_store(clock, max_bytes=1000)
    put(store, "a", nbytes=400)
    clock.advance(1)
    put(store, "b", nbytes=400)
    clock.advance(1)
    put(store, "c", nbytes=300)  # 1100 > 1000: a goes
    assert ids(store) == ["c", "b"]
    assert store.stats().bytes == 700
    assert store.stats().evictions["bytes"] == 1


def test_byte_budget_applies_to_growth_via_commit(clock):
    store = make_store(clock, max_bytes=1000)
    put(store, "a", nbytes=300)
    clock.advance(1)
    put(store, "b", nbytes=300)
    clock.advance(1)
    put(store, "c", nbytes=300)
    clock.advance(1)
    store.checkout("a", past_len=5, start_layer=0)
    store.commit("a", past_len=6, nbytes=650)  # 1250: b then c are older than a
    assert ids(store) == ["a", "c"]
    clock.advance(1)
    store.commit("c", past_len=6, nbytes=360)  # 1010: a is now the least recently used
    assert ids(store) == ["c"]
    stats = store.stats()
    assert stats.bytes == 360
    assert stats.evictions["bytes"] == 2


def test_a_single_oversized_entry_is_evicted_alone(clock):
    store = make_store(clock, max_bytes=1000)
    put(store, "a", nbytes=500)
    put(store, "huge", nbytes=1001)
    assert ids(store) == ["a"]
    assert store.stats().evictions["bytes"] == 1
    assert miss_reason(store, "huge").reason == "unknown_session"
    store.commit("a", past_len=6, nbytes=5000)  # growing past the budget alone also evicts it
    assert len(store) == 0
    assert store.stats().evictions["bytes"] == 2


def test_an_oversized_entry_does_not_push_out_others_by_count(clock):
    store = make_store(clock, max_sessions=1, max_bytes=1000)
    put(store, "a", nbytes=500)
    put(store, "huge", nbytes=2000)
    assert ids(store) == ["a"]
    assert store.stats().evictions == {"ttl": 0, "lru": 0, "bytes": 1, "dropped": 0}


def test_past_len_mismatch_drops_the_stale_entry(clock):
    store = make_store(clock)
    put(store, "s", past_len=5)
    miss = miss_reason(store, "s", past_len=9)
    assert miss.reason == "past_len_mismatch"
    assert "5" in miss.message and "9" in miss.message
    assert store.get("s") is None
    assert miss_reason(store, "s", past_len=5).reason == "unknown_session"
    stats = store.stats()
    assert stats.misses_by_reason["past_len_mismatch"] == 1
    assert stats.misses_by_reason["unknown_session"] == 1
    assert stats.evictions["dropped"] == 1


def test_start_layer_mismatch_drops_the_stale_entry(clock):
    store = make_store(clock)
    put(store, "s", start_layer=15)
    miss = miss_reason(store, "s", start_layer=10)
    assert miss.reason == "start_layer_mismatch"
    assert "15" in miss.message and "10" in miss.message
    assert store.get("s") is None
    assert store.stats().misses_by_reason["start_layer_mismatch"] == 1


def test_record_miss_counts_outside_reasons_and_rejects_unknown_ones(clock):
    store = make_store(clock)
    store.record_miss("cache_disabled")
    store.record_miss("cache_disabled")
    stats = store.stats()
    assert stats.misses == 2
    assert stats.misses_by_reason["cache_disabled"] == 2
    with pytest.raises(ValueError):
        store.record_miss("bogus")


def test_put_replaces_an_entry_without_counting_an_eviction(clock):
    store = make_store(clock, max_sessions=2)
    put(store, "s", past_len=5, nbytes=100)
    put(store, "other")
    clock.advance(5)
    cache = object()
    entry = store.put("s", cache, past_len=12, start_layer=4, nbytes=250)
    assert entry.created_at == 1005.0
    assert len(store) == 2
    got = store.checkout("s", past_len=12, start_layer=4)
    assert got.cache is cache
    stats = store.stats()
    assert stats.bytes == 350
    assert sum(stats.evictions.values()) == 0


def test_drop_removes_and_counts(clock):
    store = make_store(clock)
    put(store, "a")
    put(store, "b")
    assert store.drop("a") is True
    assert store.drop("a") is False
    assert store.drop("b", reason="lru") is True
    assert store.stats().evictions == {"ttl": 0, "lru": 1, "bytes": 0, "dropped": 1}
    assert len(store) == 0
    with pytest.raises(ValueError):
        store.drop("a", reason="bogus")


def test_commit_of_an_evicted_session_does_not_resurrect_it(clock):
    store = make_store(clock)
    put(store, "s")
    store.drop("s")
    store.commit("s", past_len=6, nbytes=100)
    assert store.get("s") is None


def test_returned_entries_are_snapshots(clock):
    store = make_store(clock)
    put(store, "s", past_len=5)
    snapshot = store.get("s")
    snapshot.past_len = 99
    assert store.get("s").past_len == 5


def test_stats_and_to_dict(clock):
    store = make_store(clock, ttl_seconds=30, max_sessions=4, max_bytes=10_000)
    put(store, "a", nbytes=100)
    put(store, "b", nbytes=200)
    store.checkout("a", past_len=5, start_layer=0)
    miss_reason(store, "zzz")
    stats = store.stats()
    assert isinstance(stats, StoreStats)
    expected = {
        "sessions": 2,
        "bytes": 300,
        "max_sessions": 4,
        "max_bytes": 10_000,
        "ttl_seconds": 30.0,
        "hits": 1,
        "misses": 1,
        "misses_by_reason": {reason: int(reason == "unknown_session") for reason in CACHE_MISS_REASONS},
        "evictions": {"ttl": 0, "lru": 0, "bytes": 0, "dropped": 0},
    }
    as_dict = stats.to_dict()
    assert as_dict == expected
    assert json.loads(json.dumps(as_dict)) == expected
    as_dict["evictions"]["ttl"] = 5  # a copy, not the store's counters
    assert store.stats().evictions["ttl"] == 0


def test_concurrent_put_checkout_commit_keeps_invariants():
    store = SessionCacheStore(max_sessions=5, max_bytes=5_000)
    errors: list[BaseException] = []
    steps_per_thread = 300

    def worker(n: int) -> None:
        try:
            for i in range(steps_per_thread):
                sid = f"t{n}-{i % 7}"
                store.put(sid, object(), past_len=1, start_layer=0, nbytes=100 + i % 50)
                try:
                    entry = store.checkout(sid, past_len=1, start_layer=0)
                except CacheMiss as miss:
                    assert miss.reason == "unknown_session"  # evicted by another thread in between
                    continue
                store.commit(sid, past_len=entry.past_len + 1, nbytes=entry.nbytes + 10)
                store.entries()
                store.stats()
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    stats = store.stats()
    live = store.entries()
    assert stats.sessions == len(live) <= 5
    assert stats.bytes == sum(e.nbytes for e in live) <= 5_000
    assert stats.hits + stats.misses_by_reason["unknown_session"] == 8 * steps_per_thread
    assert stats.misses == stats.misses_by_reason["unknown_session"]
    assert all(e.past_len == 2 for e in live)
