"""Speculative decoding, piece by piece: drafting by lookup, how many to draft, the tail's rule, the protocol
fields, the store's rewind window, a shard taking a verify step's positions back on every kind of layer, and the
head's loop taking a verify step's tokens.

The mesh as a whole (real daemons, delay proxies, ``generate``'s tokens) is in ``tests/mesh/test_speculation_mesh.py``.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from daemon import wire
from daemon.api import Hop, Sampling
from daemon.errors import BadRequest, CacheMiss, UpstreamError
from daemon.kvstore import SessionCacheStore
from daemon.mesh.generation import GenerationLoop, GenerationRequest
from daemon.mesh.hops import HopReply
from daemon.mesh.speculation import (
    CARRIED_STEPS,
    EXPLORE_EVERY,
    PLAIN_SAMPLES,
    PLAIN_WINDOW,
    PROBE_SHARE,
    REFRESH_EVERY,
    SpeculationMemory,
    SpeculationPolicy,
    lookup,
)
from daemon.model.sampling import sample_token, verify_draft
from daemon.wire import History
from tests.unit.test_generation import HEAD, PROMPT, R1, FixedRouter, OwnLayers

# --- drafting by lookup ----------------------------------------------------------------------------------


def test_lookup_continues_the_latest_earlier_occurrence_of_the_longest_suffix():
    ids = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # "2 3" occurs at 1 and 6; "5 2 3" nowhere earlier: the latest "2 3" (at 6) is followed by 7 8 5
    assert lookup(ids, 3) == [7, 8, 5]
    assert lookup([4, 1, 2, 3, 6, 6, 1, 2, 3, 5, 0, 2, 3], 2) == [5, 0]  # "0 2 3" nowhere: "2 3", latest at 7
    assert lookup([1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]  # "1 2 3" at 0 beats the shorter matches


def test_lookup_drafts_nothing_without_a_repeat_and_at_most_k():
    assert lookup([1, 2, 3, 4], 4) == []
    assert lookup([5, 6, 5, 6, 5, 6], 1) == [5]
    assert lookup([5, 6, 5, 6], 0) == []
    assert lookup([7], 3) == []


# --- how many to draft -------------------------------------------------------------------------------------


def plain(policy: SpeculationPolicy, *times: float) -> SpeculationPolicy:
    for ms in times:
        policy.observe(0, 0, ms)
    return policy


def test_the_policy_steps_plainly_until_plain_steps_are_timed():
    policy = SpeculationPolicy(max_draft=4)
    for ms in [80.0] + [50.0] * (PLAIN_SAMPLES - 1):
        assert policy.choose(10) == 0
        policy.observe(0, 0, ms)
    assert policy.plain_ms == 50.0  # the first step after a prompt is the slow one
    assert policy.choose(10) > 0  # the prior acceptance of 0.5 pays on a slow step


def test_good_acceptance_on_a_slow_route_drafts_the_most_and_never_past_the_limit():
    policy = plain(SpeculationPolicy(max_draft=4), *[50.0] * PLAIN_SAMPLES)
    for _ in range(REFRESH_EVERY - 1):
        policy.observe(4, 4, 60.0)
    assert policy.acceptance > 0.9
    assert policy.choose(10) == 4
    assert policy.choose(2) == 2


def run(policy: SpeculationPolicy, steps: int, plain_ms: float, verify_ms, kept=lambda k: 0) -> list[int]:
    """Steps chosen by ``policy``: a plain one takes ``plain_ms``, one with k drafts ``verify_ms(k)``."""
    choices = []
    for _ in range(steps):
        k = policy.choose(10)
        choices.append(k)
        policy.observe(k, kept(k) if k else 0, verify_ms(k) if k else plain_ms)
    return choices


def test_poor_acceptance_on_a_fast_route_drafts_nothing_but_still_probes():
    policy = plain(SpeculationPolicy(max_draft=4), *[5.0] * PLAIN_SAMPLES)
    for _ in range(20):
        policy.observe(2, 0, 9.0)  # each draft costs 2 ms against a 5 ms step, and none is kept
    choices = run(policy, 4 * EXPLORE_EVERY, 5.0, lambda k: 5.0 + 2 * k)
    # a probe costs 2 ms: one every 20 plain steps (100 ms) stays within PROBE_SHARE
    assert set(choices) == {0, 1} and choices.count(1) == 3, choices


def test_probes_that_cost_much_are_rare():
    """A bfloat16 loopback mesh: a plain step 25 ms, one draft verified after plain steps 107 ms (the draft model
    catches up on the tokens since it last drafted, and a bfloat16 node verifies position after position)."""
    policy = plain(SpeculationPolicy(max_draft=4), *[25.0] * PLAIN_SAMPLES)
    policy.observe(2, 2, 180.0)  # the first verify step: after the whole prompt
    policy.observe(2, 1, 95.0)  # drafting on: 35 ms a draft
    choices = run(policy, 400, 25.0, lambda k: 107.0)
    spent = sum(107.0 - 25.0 for k in choices if k)
    assert 1 <= choices.count(1) <= 3 and spent <= PROBE_SHARE * 25.0 * choices.count(0) + 82.0, choices
    assert 0 not in choices[EXPLORE_EVERY - 1:EXPLORE_EVERY]  # the first probe is not delayed: its cost is unknown


def test_a_plain_step_is_priced_at_the_fastest_of_the_last_few():
    """Measured on a bfloat16 loopback mesh: plain steps timed right after verify steps read 34-42 ms, plain
    steps in a row 25-27; verify steps of 1 and 2 drafts took about 60 and 80 ms. Against the slow readings
    drafting looked worth it; against the steps in a row it is slower."""
    policy = plain(SpeculationPolicy(max_draft=4), 26.0, 25.0, 27.0)
    policy.observe(2, 2, 240.0)  # the first: after the whole prompt
    for k, ms in [(1, 60.0), (2, 80.0), (1, 58.0), (2, 82.0)]:
        policy.observe(k, k, ms)
    plain(policy, 42.0, 36.0, 34.0)  # timed right after the verify steps
    assert policy.plain_ms == 25.0
    assert policy.choose(10) == 0
    plain(policy, *[40.0] * PLAIN_WINDOW)  # the route itself became slower: the old readings age out
    assert policy.plain_ms == 40.0


def test_a_run_of_drafts_starts_for_a_clear_gain_and_goes_on_while_it_pays():
    """Measured on a bfloat16 loopback mesh: plain 30 ms, each draft 26 ms more, acceptance 0.9: one draft a step
    promises 3% over plain steps, within the noise of a step, while its first step costs 40-70 ms extra."""
    policy = plain(SpeculationPolicy(max_draft=4), 30.0, 30.0, 30.0)
    policy.observe(1, 1, 250.0)  # after the whole prompt
    for _ in range(10):
        policy.observe(1, 1, 56.0)  # a run: 26 ms a draft
    assert policy.acceptance > 0.9
    assert policy.choose(10) == 1  # drafting on: 1.9 tokens in 56 ms beats 1 in 30
    plain(policy, 30.0)
    assert policy.choose(10) == 0  # but not enough to start a run again
    for _ in range(10):
        policy.observe(1, 1, 45.0)  # the drafts got cheaper: 15 ms
    plain(policy, 30.0)
    assert policy.choose(10) > 0


def test_a_route_remembers_its_costs_for_the_next_generation():
    memory = SpeculationMemory()
    route = [Hop("http://a:1", 0, 15, local=True), Hop("http://b:1", 15, 30)]
    first = memory.policy(route, 4)
    run(first, 3, 25.0, lambda k: 25.0)
    first.observe(2, 2, 180.0)
    first.observe(2, 1, 95.0)
    memory.keep(route, first)
    second = memory.policy(route, 4)
    assert second.plain_ms == 25.0 and second.per_draft_ms == first.per_draft_ms
    assert second.choose(10) == 0  # no plain steps to time again, no first try: drafting did not pay here
    assert second.checked <= CARRIED_STEPS  # the acceptance is evidence of a few steps only
    assert memory.policy([Hop("http://c:1", 0, 30)], 4).plain_ms is None  # another route starts afresh


def test_the_plain_step_is_timed_again_and_drafting_stops_when_it_no_longer_pays():
    """Measured on a bfloat16 mesh: the first plain steps took 31-38 ms, later ones 25-27. Against the early
    cost, two drafts verified in 78 ms looked worth it (2.6 tokens); against the true one they are slower."""
    policy = plain(SpeculationPolicy(max_draft=4), 38.0, 34.0, 31.0)
    choices = []
    for step in range(3 * REFRESH_EVERY):
        k = policy.choose(10)
        choices.append(k)
        if k:  # every fifth step rejects its last draft; each draft adds 23.5 ms
            policy.observe(k, k - (step % 5 == 4), 31.0 + 23.5 * k)
        else:
            policy.observe(0, 0, 26.0)
    assert choices[0] > 0  # against 34 ms, drafting looked better
    assert 0 in choices[:REFRESH_EVERY + 1]  # a plain step came within REFRESH_EVERY verify steps
    assert set(choices[-REFRESH_EVERY:]) <= {0, 1}  # then plain steps, probing with one draft now and then
    assert choices[-REFRESH_EVERY:].count(0) >= REFRESH_EVERY - 2


# --- the tail's rule -----------------------------------------------------------------------------------------

def test_a_verify_step_takes_drafts_up_to_the_first_greedy_disagreement():
    logits = torch.full((4, 8), -1.0)
    for row, best in enumerate([3, 5, 1, 6]):
        logits[row, best] = 2.0
    greedy = Sampling()
    assert [c.token_id for c in verify_draft(logits, greedy, 10, None, (3, 5, 1))] == [3, 5, 1, 6]
    assert [c.token_id for c in verify_draft(logits, greedy, 10, None, (3, 4, 1))] == [3, 5]
    assert [c.token_id for c in verify_draft(logits, greedy, 10, None, (0, 5, 1))] == [3]


def test_each_position_samples_as_a_step_of_its_own_with_the_drafts_before_it_in_its_history():
    torch.manual_seed(0)
    logits = torch.randn(5, 40)
    params = Sampling(temperature=0.9, top_p=0.95, seed=11, presence_penalty=0.7, frequency_penalty=0.3, logprobs=2)
    history = History((1, 2), (4, 4, 9))
    first = sample_token(logits[0], params, 21, history)  # what position 21 samples: kept
    draft = (first, 39, 38, 37)
    choices = verify_draft(logits, params, 20, history, draft)
    # each position samples as a single step would, with the drafted tokens before it in the answer so far
    expected = [sample_token(logits[i], params, 21 + i, History((1, 2), (4, 4, 9) + draft[:i]))
                for i in range(len(choices))]
    assert [c.token_id for c in choices] == expected
    assert len(choices) >= 2 and all(c.token_id == d for c, d in zip(choices[:-1], draft))
    assert all(c.logprob is not None and len(c.top_logprobs) == 2 for c in choices)


@pytest.mark.parametrize("draft", [0, 2, 5])
def test_with_a_temperature_the_tokens_follow_the_targets_own_distribution(draft):
    """Chi-square over 6000 seeds of a 6-token vocabulary: whatever the (deterministic) draft, the first token of a
    verify step is distributed as the target's softmax, not pulled towards the draft."""
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.8, 0.0, -1.0], [0.0] * 6])
    p = torch.softmax(logits[0], -1)
    counts = torch.zeros(6)
    seeds = 6000
    kept = 0
    for seed in range(seeds):
        choices = verify_draft(logits, Sampling(temperature=1.0, top_p=1.0, top_k=0, seed=seed), 0, None, (draft,))
        counts[choices[0].token_id] += 1
        kept += len(choices) == 2
    expected = p * seeds
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (chi2, counts.tolist(), expected.tolist())  # df 5, p = 0.001
    # the draft is kept as often as the target samples it: p(d)
    assert abs(kept / seeds - float(p[draft])) < 4 * (float(p[draft]) * (1 - float(p[draft])) / seeds) ** 0.5


# --- the protocol ---------------------------------------------------------------------------------------------

def verify_headers(**changes) -> dict:
    activation = wire.Activation("float32", (1, 3, 4), bytes(3 * 4 * 4))
    headers = wire.forward_headers(activation, mode="decode", session_id="s1", past_len=7, start_layer=0,
                                   hop_index=0, draft=[11, 12])
    return {k: v for k, v in (headers | changes).items() if v is not None}


def parse(headers: dict, positions: int = 3):
    return wire.parse_forward(headers, bytes(positions * 4 * 4), hidden_size=4, first_layer=0, end_layer=4)


def test_a_verify_step_round_trips_its_drafted_ids():
    assert parse(verify_headers()).draft == (11, 12)
    assert parse(verify_headers(**{wire.DRAFT: None})).draft is None


@pytest.mark.parametrize(("changes", "positions"), [
    ({wire.DRAFT: "11"}, 3),  # two drafted positions, one id
    ({wire.DRAFT: "11,12,13"}, 3),
    ({wire.DRAFT: "11,x"}, 3),
    ({wire.DRAFT: ""}, 3),
    ({wire.DRAFT: "-1,12"}, 3),
    ({wire.DRAFT: ",".join(["1"] * (wire.MAX_DRAFT + 1))}, wire.MAX_DRAFT + 2),
    ({wire.CACHE: "prefill", wire.PAST_LEN: None}, 3),  # a draft continues a held session
    ({wire.PREFIX: "s0"}, 3),
    ({wire.DRAFT: "11"}, 1),  # no drafted position at all
])
def test_a_malformed_draft_is_a_400_naming_it(changes, positions):
    headers = verify_headers(**changes)
    headers[wire.SHAPE] = f"1,{positions},4"
    with pytest.raises(BadRequest) as info:
        parse(headers, positions)
    assert info.value.param in (wire.DRAFT, wire.PREFIX)


def test_a_tails_verify_answer_lists_its_tokens():
    reply = wire.ForwardReply(token_id=6, text="f", tokens=[wire.TokenChoice(5, "e"), wire.TokenChoice(6, "f")])
    assert reply.token_json() == {"token_id": 6, "text": "f", "tokens": [{"token_id": 5, "text": "e"},
                                                                          {"token_id": 6, "text": "f"}]}


# --- the store's window for taking positions back -----------------------------------------------------------

def test_after_a_verify_step_the_next_may_start_anywhere_in_it_and_only_there():
    store = SessionCacheStore()
    store.put("s", object(), past_len=10, start_layer=0, nbytes=1)
    store.commit("s", past_len=15, nbytes=1, undo="undo", rewind_from=10)
    for kept in (10, 12, 15):
        assert store.checkout("s", past_len=kept, start_layer=0).undo == "undo"
    with pytest.raises(CacheMiss):
        store.checkout("s", past_len=9, start_layer=0)


def test_any_other_step_ends_the_window():
    store = SessionCacheStore()
    store.put("s", object(), past_len=10, start_layer=0, nbytes=1)
    store.commit("s", past_len=15, nbytes=1, undo="undo", rewind_from=10)
    store.commit("s", past_len=13, nbytes=1)  # a step after the verify step, from 12
    with pytest.raises(CacheMiss) as info:
        store.checkout("s", past_len=12, start_layer=0)
    assert info.value.reason == "past_len_mismatch"


# --- a shard taking positions back -------------------------------------------------------------------------

# the fast subset takes one cropping and one replaying architecture; the others run with the whole suite
ARCHITECTURES = ["llama", "qwen3_5", *(pytest.param(arch, marks=pytest.mark.slow)
                                      for arch in ("qwen3_next", "gemma3_text", "mistral"))]


def greedy_steps(shard, prompt: list[int], count: int) -> list[int]:
    """``count`` greedy tokens from single steps: the reference every verify schedule must reproduce."""
    greedy = Sampling()
    result = shard.step(shard.embed(prompt), mode="prefill", session_id="plain", past_len=0, start_layer=0,
                        sampling=greedy)
    tokens = [result.token_id]
    while len(tokens) < count:
        past = len(prompt) + len(tokens) - 1
        result = shard.step(shard.embed(tokens[-1:]), mode="decode", session_id="plain", past_len=past,
                            start_layer=0, sampling=greedy)
        tokens.append(result.token_id)
    return tokens


def speculate(shard, prompt: list[int], count: int, drafts) -> tuple[list[int], list[int]]:
    """Tokens from verify steps whose drafts ``drafts(answer so far)`` proposes; and how many each step kept."""
    greedy = Sampling()
    result = shard.step(shard.embed(prompt), mode="prefill", session_id="spec", past_len=0, start_layer=0,
                        sampling=greedy)
    tokens, kept = [result.token_id], []
    while len(tokens) < count:
        draft = tuple(drafts(tokens))
        past = len(prompt) + len(tokens) - 1
        result = shard.step(shard.embed(tokens[-1:] + list(draft)), mode="decode", session_id="spec",
                            past_len=past, start_layer=0, sampling=greedy, draft=draft)
        got = [t.token_id for t in result.tokens]
        assert got[:-1] == list(draft[:len(got) - 1])
        kept.append(len(got) - 1)
        tokens += got
    return tokens[:count], kept


@pytest.fixture(scope="module")
def shards(tiny_model):
    from daemon.kvstore import SessionCacheStore
    from daemon.model.shard import ModelShard

    def make(arch: str):
        folder = tiny_model(arch)
        from daemon.model.checkpoint import read_model_info

        n = read_model_info(folder).num_layers
        return ModelShard(folder, 0, n, sessions=SessionCacheStore(max_sessions=8), dtype=torch.float32)
    return make


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_verify_steps_that_keep_some_drafts_give_the_tokens_of_single_steps(shards, arch):
    """Drafts right for a while and then wrong, every schedule of kept positions, over attention caches that crop
    and linear-attention or filled sliding-window layers that are copied and replayed."""
    shard = shards(arch)
    prompt = [1, 400, 2000, 31, 8, 77, 4242, 9]
    reference = greedy_steps(shard, prompt, 40)
    rng = random.Random(arch)

    def drafts(answer: list[int]) -> list[int]:
        k = rng.randint(1, 5)
        right = reference[len(answer):len(answer) + k]
        wrong_at = rng.randint(0, k)  # k: every draft right
        return [t if i != wrong_at else (t + 1) % 49152 for i, t in enumerate(right)]

    tokens, kept = speculate(shard, prompt, 40, drafts)
    assert tokens == reference
    assert 0 in kept and any(0 < k < 5 for k in kept)  # rejected at once, and cut back mid-step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_a_verify_steps_outputs_are_bit_for_bit_those_of_single_steps(tiny_model, arch, dtype):
    """On a shard that is not the tail: the hidden states a verify step passes on, row by row, are exactly those of
    one-position steps, and so is the cache it leaves (the next step's outputs agree too), in either dtype."""
    from daemon.model.checkpoint import read_model_info
    from daemon.model.shard import ModelShard

    folder = tiny_model(arch)
    shard = ModelShard(folder, 0, read_model_info(folder).num_layers - 1, sessions=SessionCacheStore(),
                       dtype=dtype)
    greedy = Sampling()
    prompt, new = shard.embed([7, 8, 9, 10, 11]), shard.embed([12, 13, 14, 15])
    for session in ("one", "rows"):
        shard.step(prompt, mode="prefill", session_id=session, past_len=0, start_layer=0, sampling=greedy)
    singles = torch.cat([shard.step(new[:, i:i + 1], mode="decode", session_id="one", past_len=5 + i,
                                    start_layer=0, sampling=greedy).hidden for i in range(4)], dim=1)
    rows = shard.step(new, mode="decode", session_id="rows", past_len=5, start_layer=0, sampling=greedy,
                      draft=(13, 14, 15)).hidden
    assert torch.equal(rows, singles)
    after = shard.embed([16])
    assert torch.equal(shard.step(after, mode="decode", session_id="rows", past_len=9, start_layer=0,
                                  sampling=greedy).hidden,
                       shard.step(after, mode="decode", session_id="one", past_len=9, start_layer=0,
                                  sampling=greedy).hidden)


@pytest.mark.parametrize("arch", ["qwen3_next", "llama"])
def test_a_long_run_of_partly_kept_steps_replays_apart_past_the_held_inputs_bound(shards, arch, monkeypatch):
    import daemon.model.speculation as node_speculation

    monkeypatch.setattr(node_speculation, "MAX_HELD_INPUTS", 6)
    shard = shards(arch)
    prompt = [3, 14, 15, 92, 65]
    reference = greedy_steps(shard, prompt, 30)

    def one_right(answer: list[int]) -> list[int]:  # keep one of three drafts, every step
        nxt = reference[len(answer):len(answer) + 3]
        return [nxt[0]] + [(t + 7) % 49152 for t in nxt[1:]]

    tokens, kept = speculate(shard, prompt, 30, one_right)
    assert tokens == reference and set(kept) <= {1, 2}
    entry = shard.sessions.get("spec")
    if entry.undo is not None and entry.undo.inputs is not None:
        assert entry.undo.inputs.shape[1] <= 6


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_settling_a_session_left_by_a_verify_step_keeps_only_what_the_generation_kept(shards, arch):
    """A generation that ends inside a verify step (an end of sequence, a stop string) retains its session cut back
    to the positions it kept, so the next turn can continue it whole; continuing it gives single steps' tokens."""
    shard = shards(arch)
    prompt = [11, 12, 13, 14, 15]
    reference = greedy_steps(shard, prompt, 8)
    greedy = Sampling()
    shard.step(shard.embed(prompt), mode="prefill", session_id="end", past_len=0, start_layer=0, sampling=greedy)
    draft = (reference[1], reference[2], (reference[3] + 1) % 49152)
    verified = shard.step(shard.embed([reference[0], *draft]), mode="decode", session_id="end", past_len=5,
                          start_layer=0, sampling=greedy, draft=draft)
    assert [t.token_id for t in verified.tokens] == reference[:4][1:] and shard.sessions.get("end").past_len == 9
    shard.settle("end", 7)  # the answer ended at reference[2]: positions 0-6 are what it kept
    entry = shard.sessions.get("end")
    assert entry.past_len == 7 and entry.undo is None
    after = shard.step(shard.embed([reference[2]]), mode="decode", session_id="end", past_len=7, start_layer=0,
                       sampling=greedy)
    assert after.token_id == reference[3]


def test_a_step_outside_the_verify_steps_positions_misses(shards):
    shard = shards("qwen3_next")
    prompt = [5, 6, 7, 8]
    greedy = Sampling()
    first = shard.step(shard.embed(prompt), mode="prefill", session_id="x", past_len=0, start_layer=0,
                       sampling=greedy)
    shard.step(shard.embed([first.token_id, 1, 2]), mode="decode", session_id="x", past_len=4, start_layer=0,
               sampling=greedy, draft=(1, 2))
    with pytest.raises(CacheMiss) as info:
        shard.step(shard.embed([1]), mode="decode", session_id="x", past_len=3, start_layer=0, sampling=greedy)
    assert info.value.reason == "past_len_mismatch"


# --- the head's loop -----------------------------------------------------------------------------------------

class VerifyingTail:
    """A remote tail that knows the answer (token i of it is ``100 + i``) and checks drafts against it."""

    def __init__(self) -> None:
        self.steps: list[tuple[str | None, int, str | None]] = []  # (mode, positions, draft header)
        self.channels = None  # no step channels: every remote hop goes through step()

    async def step(self, hop, activation, headers, history=None) -> HopReply:
        self.steps.append((headers.get(wire.CACHE), activation.shape[1], headers.get(wire.DRAFT)))
        past = int(headers.get(wire.PAST_LEN, 0))
        start = past + activation.shape[1] - len(PROMPT)  # the answer's index of the first token to choose
        if headers.get(wire.DRAFT) is None:
            return HopReply(token_id=100 + start)
        draft = [int(d) for d in headers[wire.DRAFT].split(",")]
        start -= len(draft)
        tokens = []
        for i in range(len(draft) + 1):
            tokens.append(wire.TokenChoice(100 + start + i, "t"))
            if i == len(draft) or draft[i] != 100 + start + i:
                break
        return HopReply(token_id=tokens[-1].token_id, text="t", tokens=tokens)

    def release(self, url, session_id) -> None:
        pass

    def retain(self, url, session_id, past_len) -> None:
        pass


class Drafts:
    """Drafts the answer right for ``right`` tokens, then one wrong, for every step."""

    def __init__(self, right: int) -> None:
        self.right, self.closed = right, False

    async def propose(self, ids: list[int], k: int) -> list[int]:
        nxt = 100 + len(ids) - len(PROMPT)
        return [nxt + i if i < self.right else 0 for i in range(k)]

    def close(self) -> None:
        self.closed = True


def speculative_run(route: list[Hop], drafts: Drafts, max_tokens: int = 12, *, eos: int | None = None):
    own = OwnLayers()
    if eos is not None:
        own.eos_token_ids = {eos}
    request = GenerationRequest(PROMPT, max_tokens, Sampling(), ignore_eos=eos is None, drafter=drafts, max_draft=3)
    tail = VerifyingTail()
    loop = GenerationLoop(own, tail, FixedRouter(route), route, request)
    loop.policy.observe(0, 0, 100.0)  # a slow route: drafting pays from the first decode step

    async def collect():
        return [event.token_id async for event in loop.run()]
    return asyncio.run(collect()), loop.stats, tail


VERIFYING = [Hop(HEAD, 0, 15, local=True, verifies=True), Hop(R1, 15, 30, verifies=True)]


def test_the_loop_takes_every_token_of_a_verify_step_and_counts_them():
    ids, stats, tail = speculative_run(VERIFYING, Drafts(right=2))
    assert ids == [100 + i for i in range(12)]
    assert stats.completion_tokens == 12 and stats.token_ids == ids
    verify = [len(draft.split(",")) for _, positions, draft in tail.steps if draft is not None]
    assert all(positions == len(draft.split(",")) + 1 for _, positions, draft in tail.steps if draft is not None)
    assert stats.verify_steps == len(verify) > 0 and stats.drafted_tokens == sum(verify)
    assert stats.accepted_tokens == sum(min(2, k) for k in verify)  # the first two drafts of each are right


def test_a_verify_step_never_runs_past_max_tokens_or_the_end_of_sequence():
    ids, stats, _ = speculative_run(VERIFYING, Drafts(right=3), max_tokens=7)
    assert ids == [100 + i for i in range(7)] and stats.finish_reason == "length"
    ids, stats, _ = speculative_run(VERIFYING, Drafts(right=3), max_tokens=20, eos=105)
    assert ids[-1] != 105 and 105 not in ids and stats.finish_reason == "stop"
    assert stats.token_ids[-1] == 105 and len(stats.token_ids) == 6


def test_a_route_with_a_node_that_does_not_verify_gets_plain_steps():
    route = [Hop(HEAD, 0, 15, local=True, verifies=True), Hop(R1, 15, 30)]
    drafts = Drafts(right=2)
    ids, stats, tail = speculative_run(route, drafts)
    assert ids == [100 + i for i in range(12)] and stats.verify_steps == 0
    assert all(draft is None for _, _, draft in tail.steps) and drafts.closed


def test_a_verify_answer_that_does_not_follow_the_draft_is_an_upstream_error():
    class Liar(VerifyingTail):
        async def step(self, hop, activation, headers, history=None) -> HopReply:
            reply = await super().step(hop, activation, headers, history)
            if reply.tokens and len(reply.tokens) > 1:
                reply.tokens[0] = wire.TokenChoice(7, "x")
            return reply

    request = GenerationRequest(PROMPT, 8, Sampling(), ignore_eos=True, drafter=Drafts(right=3), max_draft=3)
    loop = GenerationLoop(OwnLayers(), Liar(), FixedRouter(VERIFYING), VERIFYING, request)
    loop.policy.observe(0, 0, 100.0)

    async def collect():
        return [event.token_id async for event in loop.run()]
    with pytest.raises(UpstreamError, match="do not follow"):
        asyncio.run(collect())
