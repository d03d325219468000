"""Prefix reuse in pieces: the head's index, the store's derive and retain, the wire headers, and cutting a
real cache back (``daemon.mesh.prefix``, ``daemon.kvstore``, ``daemon.wire``, ``daemon.model.kvcache``).

The mesh end to end (exact tokens against ``generate``) is in ``test_prefix_mesh.py``.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from daemon import wire
from daemon.api import Hop
from daemon.errors import BadRequest, CacheMiss
from daemon.kvstore import SessionCacheStore
from daemon.mesh.prefix import PrefixIndex, Reuse, common_prefix
from daemon.model.kvcache import GrowingLayer, cut_back

ROUTE = [Hop("http://a", 0, 15, local=True), Hop("http://b", 15, 30)]
OTHER_ROUTE = [Hop("http://a", 0, 15, local=True), Hop("http://c", 15, 30)]
SYSTEM = list(range(100, 140))  # 40 tokens every prompt below starts with


def run(coro):
    return asyncio.run(coro)


# ---- the index -----------------------------------------------------------------------------------

def finished(index: PrefixIndex, session_id: str, tokens: list[int], route=ROUTE, scope=None) -> None:
    """A generation that prefilled ``tokens`` and ended: what the loop tells the index."""
    index.begin(session_id, route, scope, list(tokens))
    index.advance(session_id, len(tokens))
    index.retain(session_id)


def test_common_prefix_is_bounded_by_the_limit():
    assert common_prefix([1, 2, 3, 4], [1, 2, 9], limit=10) == 2
    assert common_prefix([1, 2, 3], [1, 2, 3, 4], limit=2) == 2
    assert common_prefix([], [1], limit=5) == 0


def test_a_conversations_next_turn_takes_its_session_whole():
    async def main():
        index = PrefixIndex()
        turn1 = SYSTEM + [1, 2, 3]
        finished(index, "s1", turn1)
        reuse = await index.find(turn1 + [7, 8, 9], ROUTE, None)
        assert reuse == Reuse("s1", len(turn1), take=True)
        assert index.get("s1") is None  # claimed: nobody else may start from it
        assert await index.find(turn1 + [7, 8, 9], ROUTE, None) is None
    run(main())


def test_a_shared_prefix_is_forked_and_stays():
    async def main():
        index = PrefixIndex()
        finished(index, "s1", SYSTEM + [1, 2, 3])
        reuse = await index.find(SYSTEM + [5, 6], ROUTE, None)
        assert reuse == Reuse("s1", len(SYSTEM), take=False)
        assert index.get("s1") is not None
        assert (await index.find(SYSTEM + [1, 2, 9], ROUTE, None)).keep == len(SYSTEM) + 2  # the longest match
    run(main())


def test_at_least_one_prompt_token_is_always_computed():
    async def main():
        index = PrefixIndex()
        finished(index, "s1", SYSTEM + [1, 2, 3])
        reuse = await index.find(SYSTEM + [1, 2, 3], ROUTE, None)  # the same prompt again
        assert reuse == Reuse("s1", len(SYSTEM) + 2, take=False)
    run(main())


def test_other_routes_short_matches_other_clients_and_off_never_match():
    async def main():
        index = PrefixIndex()
        finished(index, "s1", SYSTEM + [1])
        assert await index.find(SYSTEM + [2], OTHER_ROUTE, None) is None
        assert await index.find(SYSTEM[:10] + [2] * 30, ROUTE, None) is None  # 10 < MIN_REUSE_TOKENS
        scoped = PrefixIndex(policy="client")
        finished(scoped, "s1", SYSTEM + [1], scope="user:ann")
        assert await scoped.find(SYSTEM + [2], ROUTE, "user:bob") is None
        assert (await scoped.find(SYSTEM + [2], ROUTE, "user:ann")).source == "s1"
        off = PrefixIndex(policy="off")
        finished(off, "s1", SYSTEM + [1])
        assert len(off) == 0 and await off.find(SYSTEM + [2], ROUTE, None) is None
        with pytest.raises(ValueError, match="shared, client, off"):
            PrefixIndex(policy="sometimes")
    run(main())


def test_a_route_that_cannot_crop_is_offered_whole_sessions_only():
    async def main():
        index = PrefixIndex()
        finished(index, "s1", SYSTEM + [1, 2, 3])
        index.cannot_crop(ROUTE)
        assert await index.find(SYSTEM + [5, 6], ROUTE, None) is None  # would need a crop
        assert (await index.find(SYSTEM + [1, 2, 3, 4], ROUTE, None)).take  # continues all it holds
    run(main())


def test_a_request_waits_for_a_prefill_of_its_prefix_then_forks_it():
    async def main():
        index = PrefixIndex()
        prompt = SYSTEM + [1, 2]
        index.begin("s1", ROUTE, None, prompt)  # prefilling now
        waiting = asyncio.create_task(index.find(SYSTEM + [3, 4], ROUTE, None))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        index.advance("s1", len(prompt))
        assert await waiting == Reuse("s1", len(SYSTEM), take=False)  # live: copied, never taken
    run(main())


def test_a_prefill_that_fails_releases_its_waiters_to_prefill_themselves():
    async def main():
        index = PrefixIndex()
        index.begin("s1", ROUTE, None, SYSTEM + [1, 2])
        waiting = asyncio.create_task(index.find(SYSTEM + [3, 4], ROUTE, None))
        await asyncio.sleep(0.01)
        index.forget("s1")
        assert await waiting is None
        index.begin("s2", ROUTE, None, SYSTEM + [1, 2])
        index.moved("s2", OTHER_ROUTE)  # a failover: its tokens now live elsewhere, and nowhere yet
        index.advance("s2", 5)
        assert await index.find(SYSTEM + [3], ROUTE, None) is None
    run(main())


def test_a_retained_session_holds_only_the_tokens_the_nodes_hold():
    async def main():
        index = PrefixIndex()
        ids = SYSTEM + [1, 2]
        index.begin("s1", ROUTE, None, ids)
        index.follow("s1", ids)
        index.advance("s1", len(ids))
        ids.append(3)  # the last generated token is never fed: the nodes do not hold it
        index.retain("s1")
        assert index.get("s1").tokens == SYSTEM + [1, 2]
        ids.append(4)  # the generation's list is no longer read
        assert (await index.find(SYSTEM + [1, 2, 3, 4], ROUTE, None)) == Reuse("s1", len(SYSTEM) + 2, take=True)
    run(main())


def test_retained_entries_are_bounded_live_ones_kept():
    index = PrefixIndex(max_entries=3)
    index.begin("live", ROUTE, None, SYSTEM)
    for i in range(5):
        finished(index, f"r{i}", SYSTEM + [i])
    assert len(index) == 3 and index.get("live") is not None and index.get("r4") is not None


# ---- the store -----------------------------------------------------------------------------------

def copy_cut(cache, keep, held, copy):
    """A stand-in for ``cut_back`` over lists: the first ``keep`` items."""
    return list(cache[:keep]) if copy else (cache.__delitem__(slice(keep, None)) or cache)


def test_derive_forks_a_copy_and_keeps_the_source():
    store = SessionCacheStore()
    store.put("src", list(range(10)), past_len=10, start_layer=0, nbytes=10)
    store.derive("new", "src", keep=6, start_layer=0, take=False, cut=copy_cut, nbytes=len)
    assert store.get("new").cache == list(range(6)) and store.get("new").past_len == 6
    assert store.get("src").cache == list(range(10))
    assert store.checkout("new", past_len=6, start_layer=0).nbytes == 6


def test_derive_takes_the_source_over_and_crops_it():
    store = SessionCacheStore()
    cache = list(range(10))
    store.put("src", cache, past_len=10, start_layer=0, nbytes=10)
    store.derive("new", "src", keep=4, start_layer=0, take=True, cut=copy_cut, nbytes=len)
    assert store.get("src") is None and store.get("new").cache is cache and cache == [0, 1, 2, 3]
    assert sum(store.stats().evictions.values()) == 0  # moved, not evicted


@pytest.mark.parametrize("source, keep, start_layer", [("gone", 4, 0), ("src", 11, 0), ("src", 4, 3)])
def test_derive_from_a_missing_short_or_misplaced_session_is_a_prefix_miss(source, keep, start_layer):
    store = SessionCacheStore()
    store.put("src", list(range(10)), past_len=10, start_layer=0, nbytes=10)
    with pytest.raises(CacheMiss) as miss:
        store.derive("new", source, keep=keep, start_layer=start_layer, take=True, cut=copy_cut, nbytes=len)
    assert miss.value.reason == "prefix_unavailable"
    assert store.get("src").cache == list(range(10)) and store.get("new") is None
    assert store.stats().misses_by_reason["prefix_unavailable"] == 1


def test_a_cache_that_cannot_be_cut_is_a_not_croppable_miss_and_stays():
    store = SessionCacheStore()
    store.put("src", [1, 2, 3], past_len=3, start_layer=0, nbytes=3)
    with pytest.raises(CacheMiss) as miss:
        store.derive("new", "src", keep=2, start_layer=0, take=True, cut=lambda *a: None, nbytes=len)
    assert miss.value.reason == "not_croppable" and store.get("src").cache == [1, 2, 3]


def test_retained_prefixes_are_evicted_before_any_live_session():
    store = SessionCacheStore(max_sessions=3, max_bytes=300)
    for name in ("old-live", "prefix", "live"):
        store.put(name, object(), past_len=5, start_layer=0, nbytes=100)
    assert store.retain("prefix") and not store.retain("nobody")
    assert [e.retained for e in store.entries()] == [True, False, False]  # most recently used first
    store.put("new", object(), past_len=5, start_layer=0, nbytes=100)  # one over the count
    assert {e.session_id for e in store.entries()} == {"old-live", "live", "new"}
    assert store.stats().evictions["lru"] == 1
    store.retain("live")
    store.put("big", object(), past_len=5, start_layer=0, nbytes=150)  # over the bytes, and the count
    assert {e.session_id for e in store.entries()} == {"new", "big"}  # the prefix first, then the oldest live


# ---- the wire ------------------------------------------------------------------------------------

def parse(**headers):
    base = {wire.SESSION: "s2", wire.CACHE: "decode", wire.PAST_LEN: "5", wire.SHAPE: "1,2,4"}
    return wire.parse_forward(base | headers, bytes(2 * 4 * 4), hidden_size=4, first_layer=0, end_layer=2)


def test_prefix_headers_round_trip():
    activation = wire.Activation("float32", (1, 2, 4), bytes(32))
    for take in (False, True):
        headers = wire.forward_headers(activation, mode="decode", session_id="s2", past_len=5, start_layer=0,
                                       hop_index=0, prefix="s1", take_prefix=take)
        request = wire.parse_forward(headers, bytes(32), hidden_size=4, first_layer=0, end_layer=2)
        assert (request.prefix, request.take_prefix, request.past_len) == ("s1", take, 5)
    assert parse().prefix is None


@pytest.mark.parametrize("headers, param", [
    ({wire.PREFIX: "bad id!"}, wire.PREFIX),
    ({wire.PREFIX: "s2"}, wire.PREFIX),  # its own session
    ({wire.PREFIX: "s1", wire.PREFIX_MODE: "borrow"}, wire.PREFIX_MODE),
    ({wire.PREFIX_MODE: "take"}, wire.PREFIX_MODE),
    ({wire.PREFIX: "s1", wire.CACHE: "prefill"}, wire.PREFIX),
])
def test_bad_prefix_headers_are_400s_that_name_them(headers, param):
    with pytest.raises(BadRequest) as bad:
        parse(**headers)
    assert bad.value.param == param


# ---- cutting a real cache back -------------------------------------------------------------------

def kv(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, tokens, 4, generator=g), torch.randn(1, 2, tokens, 4, generator=g)


def filled_cache(layers: list, tokens: int = 10) -> DynamicCache:
    cache = DynamicCache()
    cache.layers = layers
    for i, layer in enumerate(layers):
        layer.update(*kv(tokens, seed=i))
    return cache


def test_a_fork_copies_the_prefix_and_shares_no_storage():
    source = filled_cache([GrowingLayer(), DynamicLayer()])
    before = [(layer.keys.clone(), layer.values.clone()) for layer in source.layers]
    fork = cut_back(source, 6, 10, True)
    for layer, (keys, values) in zip(fork.layers, before):
        assert torch.equal(layer.keys, keys[..., :6, :]) and torch.equal(layer.values, values[..., :6, :])
    for layer in fork.layers:
        layer.update(*kv(3, seed=9))  # the fork grows; the source must not see it
    for layer, (keys, values) in zip(source.layers, before):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    assert fork.get_seq_length() == 9 and source.get_seq_length() == 10


def test_take_crops_in_place_and_the_whole_session_is_deep_copied():
    source = filled_cache([GrowingLayer()])
    assert cut_back(source, 4, 10, False) is source and source.get_seq_length() == 4
    whole = cut_back(source, 4, 4, True)
    assert whole is not source and whole.layers[0].keys.data_ptr() != source.layers[0].keys.data_ptr()
    assert torch.equal(whole.layers[0].keys, source.layers[0].keys)


def test_a_filled_sliding_window_cannot_be_cut_back_but_one_within_its_window_can():
    from transformers import LlamaConfig

    def window(tokens: int):
        layer = DynamicSlidingWindowLayer(sliding_window=8)
        layer.update(*kv(tokens, seed=1))
        cache = DynamicCache(config=LlamaConfig(num_hidden_layers=1))
        cache.layers = [layer]
        return cache

    assert cut_back(window(10), 4, 10, True) is None
    assert cut_back(window(10), 10, 10, True) is not None  # all of it: a copy
    cut = cut_back(window(6), 4, 6, True)
    assert cut.layers[0].get_seq_length() == 4 and cut.layers[0].keys.shape[-2] == 4
    assert cut_back(window(6), 0, 6, True) is None and cut_back(window(6), 7, 6, True) is None


# ---- shards: a session continued from another one gives generate's tokens --------------------------------------


def shard_route(folder, split: int):
    from daemon.model.shard import ModelShard

    torch.set_num_threads(1)
    return [(ModelShard(folder, 0, split, sessions=SessionCacheStore(max_sessions=16)), 0),
            (ModelShard(folder, split, 4, head=False, sessions=SessionCacheStore(max_sessions=16)), split)]


def step(route, token_ids, *, mode, session, past_len, prefix=None, take=False) -> int:
    from daemon.api import Sampling

    hidden = route[0][0].embed(token_ids)
    for shard, start_layer in route:
        result = shard.step(hidden, mode=mode, session_id=session, past_len=past_len, start_layer=start_layer,
                            sampling=Sampling(0.0, 1.0, 0, 0), prefix=prefix, take_prefix=take)
        hidden = result.hidden
    return result.token_id


def greedy_reference(folder, ids: list[int], tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=2)
    return out[0, len(ids):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("arch, split", [("llama", 2), ("qwen3_next", 3), ("qwen3_5", 3)])
def test_a_session_taken_or_forked_whole_continues_as_generate_would(tiny_model, arch, split):
    folder = tiny_model(arch)
    route = shard_route(folder, split)
    first = list(range(300, 320))
    tokens = [step(route, first, mode="prefill", session="s1", past_len=0)]
    for _ in range(3):
        tokens.append(step(route, tokens[-1:], mode="decode", session="s1", past_len=len(first) + len(tokens) - 1))
    held = first + tokens[:-1]  # the last token was never fed
    turn = held + [tokens[-1], 400, 401, 402]  # the next turn: what the nodes hold, then new tokens
    want = greedy_reference(folder, turn, 4)
    for session, take in (("fork", False), ("take", True)):  # the fork first: the take moves s1 away
        got = [step(route, turn[len(held):], mode="decode", session=session, past_len=len(held), prefix="s1",
                    take=take)]
        while len(got) < 4:
            got.append(step(route, got[-1:], mode="decode", session=session, past_len=len(turn) + len(got) - 1))
        assert got == want, (session, got, want)
    assert all(shard.sessions.get("s1") is None for shard, _ in route)  # taken


@pytest.mark.parametrize("arch, split, croppable", [("llama", 2, True),
                                                    pytest.param("qwen3_next", 3, False, marks=pytest.mark.slow)])
def test_a_fork_of_part_of_a_session_is_exact_where_the_layers_can_be_cut_back(tiny_model, arch, split, croppable):
    folder = tiny_model(arch)
    route = shard_route(folder, split)
    shared, mine = list(range(300, 316)), [500, 501, 502]
    step(route, shared + [450, 451, 452, 453], mode="prefill", session="s1", past_len=0)  # another user's turn
    if not croppable:
        with pytest.raises(CacheMiss) as miss:
            step(route, mine, mode="decode", session="s2", past_len=len(shared), prefix="s1")
        assert miss.value.reason == "not_croppable"
        return
    got = [step(route, mine, mode="decode", session="s2", past_len=len(shared), prefix="s1")]
    while len(got) < 4:
        got.append(step(route, got[-1:], mode="decode", session="s2", past_len=len(shared) + len(mine) + len(got) - 1))
    assert got == greedy_reference(folder, shared + mine, 4)


# ---- the head's wiring: what a generation leaves in the index and on its own node -----------------------------

class FakeTokenizer:
    eos_token_ids = {0}
    eos_texts = {"<eos>"}

    def encode_chat(self, messages):
        return SYSTEM + [len(m["content"]) for m in messages]

    def encode_text(self, text):
        return [1]

    def decode(self, ids):
        return " ".join(map(str, ids))

    def default_sampling(self):
        return {"temperature": 0.0, "top_p": 1.0, "top_k": 0}


class FakeOwnLayers:
    """A single local node holding every layer: each step answers token 7, and sessions are recorded."""

    hidden_size = 4
    context_length = 4096

    def __init__(self):
        self.requests, self.retained, self.dropped = [], [], []

    async def ensure_head(self):
        return FakeTokenizer()

    async def embed(self, token_ids, *, dtype):
        raise AssertionError("the local first hop embeds in its own step")

    async def forward(self, request, *, token_ids=None, then=None):
        self.requests.append((request, token_ids))
        return wire.ForwardReply(token_id=7, text="7")

    def drop_session(self, session_id):
        self.dropped.append(session_id)
        return True

    def retain_session(self, session_id, past_len=None):
        self.retained.append(session_id)
        return True


class FakePlanner:
    failover_wait = 30.0
    clock = staticmethod(time.monotonic)

    async def plan_for_request(self):
        return [Hop("http://self", 0, 4, local=True)]

    def observe(self, *args, **kwargs):
        pass


def fake_head():
    from daemon.api import StoreStats
    from daemon.mesh.head import Head, HeadSettings
    from daemon.metrics import Metrics

    own = FakeOwnLayers()
    head = Head(own, FakePlanner(), Metrics(StoreStats), model_name="m", settings=HeadSettings())
    head.connect(None, None)  # a route of the head's own layers only: no HTTP
    return head, own


def test_a_finished_generation_is_retained_and_its_next_turn_extends_it():
    from daemon.mesh.head import ChatRequest

    async def main():
        head, own = fake_head()
        async with head.generate(ChatRequest([{"role": "user", "content": "hi"}], max_tokens=3)) as gen:
            assert [e.token_id async for e in gen] == [7, 7, 7]
        first = gen.stats.session_id
        assert own.retained == [first] and own.dropped == []
        held = head.prefixes.get(first)
        assert not held.live and held.tokens == SYSTEM + [2, 7, 7]  # the prompt and two fed tokens
        turn2 = ChatRequest([{"role": "user", "content": "hi"}], max_tokens=1)  # the same prompt: a fork
        async with head.generate(turn2) as gen:
            [e async for e in gen]
        request, token_ids = own.requests[-1]
        assert (request.mode, request.prefix, request.take_prefix, request.past_len) == \
               ("decode", first, False, len(SYSTEM))
        assert token_ids == [2] and gen.stats.cached_tokens == len(SYSTEM)
    run(main())


def test_a_generation_never_iterated_leaves_nothing_to_wait_for():
    from daemon.mesh.head import ChatRequest

    async def main():
        head, own = fake_head()
        async with head.generate(ChatRequest([{"role": "user", "content": "hi"}], max_tokens=3)) as gen:
            pass  # the client went away before the first token
        assert head.prefixes.get(gen.stats.session_id) is None and own.requests == []
    run(main())
