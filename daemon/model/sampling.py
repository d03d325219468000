"""Choosing the next token on the tail.

Sampling is seeded per position: the random draw for the token at absolute
position ``p`` depends only on ``(seed, p)``, so a re-prefill after a cache miss
or a re-route reproduces exactly the tokens an uninterrupted run would have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.generation.logits_process import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

from daemon.api import Sampling
from daemon.errors import BadRequest
from daemon.model import native
from daemon.wire import History

_MASK64 = (1 << 63) - 1
NON_FINITE = "the activations give non-finite logits (NaN or infinity): not a valid hidden state"


def position_generator(seed: int, position: int) -> torch.Generator:
    """A generator whose state is a pure function of the seed and the token position."""
    # splitmix-style mixing so that neighbouring (seed, position) pairs are unrelated streams
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) & _MASK64
    x ^= x >> 31
    return torch.Generator().manual_seed(x & _MASK64)


@dataclass
class Choice:
    """The tail's token, with its log-probability and the best alternatives' when they were asked for."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # best first


def choose_token(logits: torch.Tensor, params: Sampling, position: int, history: History | None = None) -> Choice:
    """The token at absolute ``position`` from ``logits [vocab]``, with log-probabilities if ``params`` asks.

    The log-probabilities are the model's own (the raw log-softmax of the logits, before penalties,
    temperature or truncation), as vLLM reports them by default.
    """
    token_id = sample_token(logits, params, position, history)
    if params.logprobs is None:
        return Choice(token_id)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, min(params.logprobs, logprobs.shape[-1])) if params.logprobs else None
    pairs = [] if top is None else [(int(i), float(v)) for v, i in zip(top.values.tolist(), top.indices.tolist())]
    return Choice(token_id, float(logprobs[token_id]), pairs)


def penalized(logits: torch.Tensor, params: Sampling, history: History | None) -> torch.Tensor:
    """``logits [vocab]`` after the repetition penalty (transformers', over prompt and answer) and OpenAI's
    presence and frequency penalties (over the answer): ``logit -= frequency * count + presence * (count > 0)``."""
    if not params.penalized:
        return logits
    if history is None:
        raise BadRequest("a penalty needs the tokens so far (X-Meshnet-History)", param="X-Meshnet-History")
    vocab = logits.shape[-1]
    if any(i >= vocab for i in history.prompt) or any(i >= vocab for i in history.generated):
        raise BadRequest(f"X-Meshnet-History names a token past the vocabulary ({vocab})", param="X-Meshnet-History")
    scores = logits.float().clone()  # the processors may write in place; the raw logits give the logprobs
    if params.repetition_penalty != 1.0:
        seen = torch.tensor([list(history.prompt + history.generated)], dtype=torch.long)
        if seen.numel():
            scores = RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty))(seen, scores[None])[0]
    if history.generated and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(history.generated, dtype=torch.long), minlength=vocab).float()
        scores = scores - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    return scores


def sample_token(logits: torch.Tensor, params: Sampling, position: int, history: History | None = None) -> int:
    """Pick the token at absolute ``position`` from ``logits`` of shape ``[vocab]``: penalties, then
    temperature, top-k, top-p and min-p, in transformers' order.

    Non-finite logits come from non-finite activations a caller sent: a 400, not a crash in the sampler.
    """
    if params.greedy and not params.penalized:  # the check and the pick in one native pass over the row, if built
        picked = native.argmax(logits)
        if picked is not None:
            if picked < 0:
                raise BadRequest(NON_FINITE, param="body")
            return picked
    # one reduction, not an elementwise pass: a NaN or infinity anywhere makes the sum non-finite
    # (the logits of any real hidden state are many orders of magnitude from overflowing it)
    if not math.isfinite(float(logits.sum())):
        raise BadRequest(NON_FINITE, param="body")
    logits = penalized(logits, params, history)
    if params.greedy:
        return int(torch.argmax(logits).item())
    scores = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth_best = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        # drop a token once the tokens before it already reach top_p; the best token always stays
        drop_sorted = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= params.top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:
        scores = MinPLogitsWarper(float(params.min_p))(None, scores[None])[0]
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=position_generator(params.seed, position)).item())


def verify_draft(logits: torch.Tensor, params: Sampling, past_len: int, history: History | None,
                 draft: tuple[int, ...]) -> list[Choice]:
    """A verify step's tokens from ``logits [k+1, vocab]`` (row i: the position after ``past_len + i``), for the
    ``k`` drafted tokens ``draft``: position after position, each chosen exactly as a step of its own would choose
    it (its position's seed, the drafted tokens before it in the answer so far), up to and including the first that
    differs from the draft.

    A drafted token is kept exactly when it is the token that position samples. For a deterministic draft that is
    the standard speculative rule (accept ``d`` with probability ``p(d)``, else sample ``p`` without ``d``), so the
    tokens follow the target's own distribution, and are the very tokens of single steps with the same seed.
    """
    choices: list[Choice] = []
    generated = history.generated if history is not None else ()
    for i in range(logits.shape[0]):
        seen = History(history.prompt, generated + draft[:i]) if history is not None else None
        choice = choose_token(logits[i], params, past_len + i + 1, seen)
        choices.append(choice)
        if i == len(draft) or choice.token_id != draft[i]:
            break
    return choices
