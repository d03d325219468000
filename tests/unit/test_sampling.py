"""Unit tests of ``daemon.model.sampling``: greedy, seeded per-position sampling, top-k, top-p."""

from __future__ import annotations

import math

import pytest
import torch

from daemon.api import Sampling
from daemon.model.sampling import position_generator, sample_token

VOCAB = 512


def random_logits(seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3.0


def flat_logits(vocab: int = VOCAB) -> torch.Tensor:
    return torch.zeros(vocab)


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs])


# ---- greedy -----------------------------------------------------------------------------------


def test_params_defaults_are_greedy_and_to_dict():
    params = Sampling()
    assert params.greedy is True
    # what a tail is sent when nothing later is asked: exactly the old header, so an older tail reads it
    assert params.to_wire() == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}
    assert params.to_dict() == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, "min_p": 0.0,
                                "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                "logprobs": None}
    assert Sampling(min_p=0.1, logprobs=0).to_wire() == params.to_wire() | {"min_p": 0.1, "logprobs": 0}
    assert Sampling(temperature=0.7).greedy is False
    assert Sampling(temperature=0.7, top_k=1).greedy is True
    assert Sampling(temperature=-1.0).greedy is True


@pytest.mark.parametrize("seed", range(8))
def test_greedy_is_argmax(seed):
    logits = random_logits(seed)
    expected = int(torch.argmax(logits))
    for position in (0, 1, 17, 4096):
        for s in (0, 1, 12345):
            assert sample_token(logits, Sampling(temperature=0.0, seed=s), position) == expected


def test_greedy_picks_a_non_first_maximum():
    logits = torch.full((VOCAB,), -5.0)
    logits[321] = 4.0
    assert sample_token(logits, Sampling(), 0) == 321


@pytest.mark.parametrize("seed", range(8))
def test_top_k_1_equals_greedy(seed):
    logits = random_logits(100 + seed)
    expected = int(torch.argmax(logits))
    for position in range(5):
        params = Sampling(temperature=1.5, top_k=1, seed=seed)
        assert sample_token(logits, params, position) == expected


def test_greedy_works_on_half_precision_logits():
    logits = random_logits(7).to(torch.bfloat16)
    assert sample_token(logits, Sampling(), 0) == int(torch.argmax(logits.float()))


# ---- seeded sampling ----------------------------------------------------------------------------


def test_seeded_sampling_reproducible_regardless_of_call_order():
    logits = flat_logits()
    params = Sampling(temperature=1.0, seed=42)
    positions = list(range(60))
    forward = {p: sample_token(logits, params, p) for p in positions}
    # backwards, interleaved with unrelated draws (other seeds, global RNG use)
    backward = {}
    for p in reversed(positions):
        sample_token(logits, Sampling(temperature=1.0, seed=7), p + 1000)
        torch.rand(3)
        backward[p] = sample_token(logits, params, p)
    assert forward == backward
    # and a fresh params object with the same values
    again = Sampling(temperature=1.0, seed=42)
    assert {p: sample_token(logits, again, p) for p in positions} == forward


def test_seeded_sampling_independent_of_global_torch_seed():
    logits = flat_logits()
    params = Sampling(temperature=1.0, seed=3)
    torch.manual_seed(1)
    first = [sample_token(logits, params, p) for p in range(20)]
    torch.manual_seed(999)
    second = [sample_token(logits, params, p) for p in range(20)]
    assert first == second


def test_different_positions_draw_different_tokens():
    logits = flat_logits()  # uniform over VOCAB tokens
    params = Sampling(temperature=1.0, seed=42)
    tokens = [sample_token(logits, params, p) for p in range(200)]
    # 200 uniform draws from 512 tokens: ~165 distinct expected; a constant stream would give 1
    assert len(set(tokens)) > 120


def test_different_seeds_draw_different_tokens():
    logits = flat_logits()
    tokens = [sample_token(logits, Sampling(temperature=1.0, seed=s), 5) for s in range(200)]
    assert len(set(tokens)) > 120
    # neighbouring seeds are not shifted copies of each other's position streams
    a = [sample_token(logits, Sampling(temperature=1.0, seed=1), p) for p in range(1, 41)]
    b = [sample_token(logits, Sampling(temperature=1.0, seed=2), p) for p in range(0, 40)]
    assert sum(x == y for x, y in zip(a, b)) < 5


def test_position_generator_is_pure_and_distinct():
    g1, g2 = position_generator(5, 9), position_generator(5, 9)
    assert torch.equal(torch.rand(8, generator=g1), torch.rand(8, generator=g2))
    seeds = {position_generator(s, p).initial_seed() for s in range(20) for p in range(100)}
    assert len(seeds) == 20 * 100


def test_position_generator_accepts_large_and_negative_seeds():
    for seed in (2**64 + 5, -1, -(2**40)):
        a = torch.rand(4, generator=position_generator(seed, 3))
        b = torch.rand(4, generator=position_generator(seed, 3))
        assert torch.equal(a, b)


def test_sampling_follows_the_distribution():
    logits = logits_from_probs([0.7, 0.2, 0.1])
    params = Sampling(temperature=1.0, seed=11)
    counts = [0, 0, 0]
    n = 600
    for p in range(n):
        counts[sample_token(logits, params, p)] += 1
    assert abs(counts[0] / n - 0.7) < 0.07
    assert abs(counts[1] / n - 0.2) < 0.06
    assert counts[2] > 0


def test_low_temperature_sharpens():
    logits = torch.tensor([1.0, 0.0, 0.0, 0.0])  # at T=1 the best token has p ~ 0.48
    cold = [sample_token(logits, Sampling(temperature=0.05, seed=1), p) for p in range(200)]
    warm = [sample_token(logits, Sampling(temperature=1.0, seed=1), p) for p in range(200)]
    assert cold.count(0) == 200  # p(best) = 1 - 3e-9 at T=0.05
    assert warm.count(0) < 150


# ---- top-k -----------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 5])
def test_top_k_restricts_to_k_best(k):
    logits = random_logits(31)
    allowed = set(torch.topk(logits, k).indices.tolist())
    # a high temperature flattens the distribution so the tail would show up without top-k
    seen = {sample_token(logits, Sampling(temperature=5.0, top_k=k, seed=s), s % 7) for s in range(300)}
    assert seen <= allowed
    assert seen == allowed  # every one of the k best gets drawn sometimes


def test_without_top_k_the_tail_is_drawn():
    """Guard for the test above: the same draws without top_k leave the top 5."""
    logits = random_logits(31)
    top5 = set(torch.topk(logits, 5).indices.tolist())
    seen = {sample_token(logits, Sampling(temperature=5.0, seed=s), s % 7) for s in range(300)}
    assert seen - top5


def test_top_k_larger_than_vocab_is_harmless():
    logits = logits_from_probs([0.5, 0.3, 0.2])
    seen = {sample_token(logits, Sampling(temperature=1.0, top_k=10, seed=s), 0) for s in range(200)}
    assert seen == {0, 1, 2}


# ---- top-p -----------------------------------------------------------------------------------


def dominant_logits(vocab: int = 64, top: int = 13, p_top: float = 0.95) -> torch.Tensor:
    probs = [(1 - p_top) / (vocab - 1)] * vocab
    probs[top] = p_top
    return logits_from_probs(probs)


def test_top_p_keeps_only_the_nucleus():
    logits = dominant_logits()
    draws = [sample_token(logits, Sampling(temperature=1.0, top_p=0.5, seed=s), s) for s in range(400)]
    assert set(draws) == {13}


def test_without_top_p_the_rest_is_drawn():
    """Guard for the test above: the same 400 draws without top_p pick other tokens (~20 expected)."""
    logits = dominant_logits()
    draws = [sample_token(logits, Sampling(temperature=1.0, seed=s), s) for s in range(400)]
    assert sum(d != 13 for d in draws) >= 5


def test_top_p_boundary():
    logits = logits_from_probs([0.5, 0.3, 0.2])
    # 0.7: token 0 (0.5) does not reach it, token 1 gets in, token 2 (0.5+0.3 before it) is out
    at_07 = {sample_token(logits, Sampling(temperature=1.0, top_p=0.7, seed=s), 1) for s in range(300)}
    assert at_07 == {0, 1}
    at_09 = {sample_token(logits, Sampling(temperature=1.0, top_p=0.9, seed=s), 1) for s in range(300)}
    assert at_09 == {0, 1, 2}


def test_top_p_order_independent_of_token_ids():
    # the nucleus is chosen by probability, not by index: put the best token last
    logits = logits_from_probs([0.02, 0.03, 0.05, 0.9])
    draws = {sample_token(logits, Sampling(temperature=1.0, top_p=0.6, seed=s), 2) for s in range(200)}
    assert draws == {3}


def test_tiny_top_p_keeps_the_best_token():
    logits = random_logits(5)
    expected = int(torch.argmax(logits))
    for s in range(20):
        assert sample_token(logits, Sampling(temperature=1.0, top_p=1e-6, seed=s), s) == expected


def test_zero_top_p_keeps_the_best_token():
    # reachable from the wire: X-Meshnet-Sampling values are type-checked, not range-checked
    logits = random_logits(5)
    assert sample_token(logits, Sampling(temperature=1.0, top_p=0.0, seed=1), 0) == int(torch.argmax(logits))


def test_top_k_and_top_p_combine():
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.1])
    # top_k=3 drops token 3 and renormalises to 4/9, 3/9, 2/9; top_p=0.5 keeps tokens 0 and 1
    draws = {sample_token(logits, Sampling(temperature=1.0, top_k=3, top_p=0.5, seed=s), 0) for s in range(300)}
    assert draws == {0, 1}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("params", [Sampling(), Sampling(temperature=0.7, seed=3)])
def test_non_finite_logits_are_a_bad_request_not_a_crash(bad, params):
    from daemon.errors import BadRequest

    logits = torch.zeros(32)
    logits[5] = bad
    with pytest.raises(BadRequest) as info:
        sample_token(logits, params, position=0)
    assert info.value.status == 400


# ---- penalties, min-p, logprobs ---------------------------------------------------------------------


def test_presence_and_frequency_penalties_are_openais_formula():
    from daemon.model.sampling import penalized
    from daemon.wire import History

    logits = random_logits(11)
    generated = (3, 3, 3, 7, 9, 9)
    params = Sampling(presence_penalty=0.5, frequency_penalty=0.25)
    got = penalized(logits, params, History((), generated))
    expected = logits.clone()
    for token in set(generated):  # mu[j] - c[j] * frequency - (c[j] > 0) * presence, over the answer only
        expected[token] -= generated.count(token) * 0.25 + 0.5
    assert torch.allclose(got, expected)
    assert torch.equal(logits, random_logits(11))  # the raw logits stay as they were (they give the logprobs)


def test_presence_and_frequency_ignore_the_prompt_and_repetition_uses_it():
    from daemon.model.sampling import penalized
    from daemon.wire import History

    logits = random_logits(12)
    assert torch.equal(penalized(logits, Sampling(presence_penalty=1.0), History((4, 5), ())), logits)
    got = penalized(logits, Sampling(repetition_penalty=2.0), History((4,), (6,)))
    expected = logits.clone()
    for token in (4, 6):  # transformers' rule: a positive logit divided, a negative one multiplied
        expected[token] = expected[token] / 2.0 if expected[token] > 0 else expected[token] * 2.0
    assert torch.allclose(got, expected)


def test_a_penalty_changes_the_greedy_choice():
    from daemon.wire import History

    logits = logits_from_probs([0.5, 0.3, 0.2])
    assert sample_token(logits, Sampling(), 0) == 0
    assert sample_token(logits, Sampling(frequency_penalty=2.0), 0, History((), (0,))) == 1
    assert sample_token(logits, Sampling(repetition_penalty=10.0), 0, History((0, 1), ())) == 2


def test_a_penalty_without_the_history_is_a_bad_request():
    from daemon.errors import BadRequest
    from daemon.wire import History

    with pytest.raises(BadRequest):
        sample_token(random_logits(1), Sampling(presence_penalty=1.0), 0)
    with pytest.raises(BadRequest):  # an id past the vocabulary
        sample_token(random_logits(1), Sampling(presence_penalty=1.0), 0, History((), (VOCAB,)))


def test_min_p_drops_tokens_below_its_share_of_the_best():
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05])
    # min_p 0.35: the threshold is 0.175 (0.35 x 0.5): tokens 0 and 1 stay
    draws = {sample_token(logits, Sampling(temperature=1.0, min_p=0.35, seed=s), 0) for s in range(300)}
    assert draws == {0, 1}
    assert {sample_token(logits, Sampling(temperature=1.0, seed=s), 0) for s in range(300)} == {0, 1, 2, 3}


def test_logprobs_are_the_raw_log_softmax_best_first():
    from daemon.model.sampling import choose_token
    from daemon.wire import History

    logits = random_logits(13)
    reference = torch.log_softmax(logits, dim=-1)
    # a penalty and a temperature change the choice, never the reported logprobs
    choice = choose_token(logits, Sampling(temperature=0.7, seed=4, frequency_penalty=1.0, logprobs=5), 9,
                          History((), (int(torch.argmax(logits)),)))
    assert choice.logprob == pytest.approx(float(reference[choice.token_id]), abs=1e-6)
    best = torch.topk(reference, 5)
    assert [i for i, _ in choice.top_logprobs] == best.indices.tolist()
    assert [lp for _, lp in choice.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-6)
    assert choose_token(logits, Sampling(logprobs=0), 0).top_logprobs == []
    assert choose_token(logits, Sampling(), 0).logprob is None
