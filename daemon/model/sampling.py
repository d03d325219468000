"""Choosing the next token on the tail.

Sampling is seeded per position: the random draw for the token at absolute
position ``p`` depends only on ``(seed, p)``, so a re-prefill after a cache miss
or a re-route reproduces exactly the tokens an uninterrupted run would have.
"""

from __future__ import annotations

import math

import torch

from daemon.api import Sampling
from daemon.errors import BadRequest

_MASK64 = (1 << 63) - 1


def position_generator(seed: int, position: int) -> torch.Generator:
    """A generator whose state is a pure function of the seed and the token position."""
    # splitmix-style mixing so that neighbouring (seed, position) pairs are unrelated streams
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) & _MASK64
    x ^= x >> 31
    return torch.Generator().manual_seed(x & _MASK64)


def sample_token(logits: torch.Tensor, params: Sampling, position: int) -> int:
    """Pick the token at absolute ``position`` from ``logits`` of shape ``[vocab]``.

    Non-finite logits come from non-finite activations a caller sent: a 400, not a crash in the sampler.
    """
    # one reduction, not an elementwise pass: a NaN or infinity anywhere makes the sum non-finite
    # (the logits of any real hidden state are many orders of magnitude from overflowing it)
    if not math.isfinite(float(logits.sum())):
        raise BadRequest("the activations give non-finite logits (NaN or infinity): not a valid hidden state",
                         param="body")
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
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=position_generator(params.seed, position)).item())
