"""Sampling at temperature > 0 by the inverse of the cumulative distribution, at a uniform
that a hash makes of the row's seed and the token's position, not a generator. So:

- the draft proposes at the uniform the target verifies with, and verification keeps the
  proposals equal to the target's own draws: speculative decoding keeps exactly the tokens
  that target-only decoding draws with that seed, and these follow the target's distribution;
- a row's draws do not depend on the rows beside it, on the draft's k, or on a hint;
- a step reads no generator: it can be captured as a CUDA graph.

Rows at temperature 0 stay greedy beside sampled rows."""

from __future__ import annotations

import torch
from torch import Tensor

MIN_TEMPERATURE = 1e-5  # greedy rows divide by this harmlessly: their draws are never used
MASK = 0xFFFFFFFF
# Odd, below 2**31: a 32-bit value times one fits in int64, on every device.
MULTIPLIERS = ((0x7FEB352D, 15), (0x2C1B3C6D, 12), (0x297A2D39, 15))


def mix(x):
    """A 32-bit hash (xorshift-multiply rounds) of x in [0, 2**32): a Python int or an int64 tensor."""
    x = x ^ (x >> 16)
    for multiplier, shift in MULTIPLIERS:
        x = (x * multiplier) & MASK
        x = x ^ (x >> shift)
    return x


def seed_of(*parts: int) -> int:
    """One row seed from several integers (a run's seed, a window's place, its attempt)."""
    seed = 0
    for part in parts:
        seed = mix(seed ^ mix(part & MASK))
    return seed


def uniforms(seeds: Tensor, positions: Tensor) -> Tensor:
    """A uniform in (0, 1] (float32) for each row seed [N] at its token position [N]."""
    bits = mix(seeds ^ mix(positions & MASK))
    return ((bits >> 8).float() + 1) * 2.0**-24


def draw(weights: Tensor, u: Tensor) -> Tensor:
    """One index per row of weights [..., V] (non-negative, not necessarily normalised),
    by the inverse of its cumulative sum, with uniforms u [...] in (0, 1]: an index whose
    weight is zero is never drawn."""
    cumulative = weights.cumsum(-1)
    index = torch.searchsorted(cumulative, (u * cumulative[..., -1]).unsqueeze(-1)).squeeze(-1)
    return index.clamp(max=weights.shape[-1] - 1)


def choose(logits: Tensor, temperature: Tensor, seeds: Tensor, positions: Tensor) -> Tensor:
    """A token per row of logits [N, V]: drawn from softmax(logits / temperature) at the
    row's uniform for its position (seeds, positions [N]), or the argmax at temperature 0."""
    probs = torch.softmax(logits.float() / temperature.clamp(min=MIN_TEMPERATURE)[:, None], -1)
    return torch.where(temperature > 0, draw(probs, uniforms(seeds, positions)), logits.argmax(-1))


def accepted(chosen: Tensor, proposals: Tensor, proposed: Tensor | None = None) -> Tensor:
    """Verification of proposals [B, k] against the tokens the target chose at each of k+1
    positions [B, k+1]: each is accepted where it is the target's and the ones before it
    were (proposed [1, k]: which of the k are proposals, the first ones; the rest stale).
    Returns the accepted count [B]."""
    right = proposals == chosen[:, : proposals.shape[1]]
    return (right if proposed is None else right & proposed).long().cumprod(1).sum(1)
