"""Sampling at temperature > 0 by the Gumbel-max trick, as an exponential race: the token
drawn is the argmax of p / E over the vocabulary, p = softmax(logits / temperature) and E
exponential noise that a hash makes of the row's seed, the position and the token, not a
generator. So:

- the draft proposes with the noise the target verifies with, and verification keeps the
  proposals equal to the target's own draws: speculative decoding keeps exactly the tokens
  that target-only decoding draws with that seed, and these follow the target's distribution;
- a draw moves only at a near-tie of p / E, as a greedy token at a near-tie of its logits:
  float32 logits that differ in rounding (passes of other widths, on a CPU) draw the same
  tokens. (The inverse of the cumulative distribution did not: a uniform in its tail, where
  thousands of tokens of tiny probability lie side by side, moved with any rounding.) In
  float16 a rounding step is coarser (1/64 at 16), which is one reason a GPU's passes all
  have one width;
- a row's draws do not depend on the rows beside it, on the draft's k, or on a hint;
- a step reads no generator: it can be captured as a CUDA graph.

The race runs in two rounds, first over blocks of BLOCK tokens by their summed p, then
inside the winning block: the same distribution, with noise for a few hundred values a
position instead of the whole vocabulary. Rows at temperature 0 stay greedy beside
sampled rows."""

from __future__ import annotations

import torch
from torch import Tensor

MIN_TEMPERATURE = 1e-5  # greedy rows divide by this harmlessly: their draws are never used
MASK = 0xFFFFFFFF
# Odd, below 2**31: a 32-bit value times one fits in int64, on every device.
MULTIPLIERS = ((0x7FEB352D, 15), (0x2C1B3C6D, 12), (0x297A2D39, 15))
GOLDEN = 0x9E3779B9  # spreads consecutive ids before hashing
BLOCK = 256  # tokens a block of the race's first round


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


def exponentials(keys: Tensor, ids: Tensor) -> Tensor:
    """Exponential noise [N, M] (float32) for rows' keys [N] and ids [N, M], all in [0, 2**32)."""
    bits = mix((keys[:, None] + ids * GOLDEN) & MASK)
    # u in (0, 1) on a 2**-23 grid, 1 excluded: a noise of 0 would make 0 / 0 of a token of probability 0.
    return ((bits >> 9).float() + 0.5).mul_(2.0**-23).log_().neg_()  # -log u


def choose(logits: Tensor, temperature: Tensor, seeds: Tensor, positions: Tensor) -> Tensor:
    """A token per row of logits [N, V]: drawn from softmax(logits / temperature) with the
    row's noise at its position (seeds, positions [N]), or the argmax at temperature 0."""
    n, vocab = logits.shape
    blocks = -(-vocab // BLOCK)
    # Padded to whole blocks with tokens of probability 0, in one float32 buffer.
    scaled = torch.full((n, blocks * BLOCK), float("-inf"), device=logits.device)
    scaled[:, :vocab].copy_(logits).div_(temperature.clamp(min=MIN_TEMPERATURE)[:, None])
    probs = torch.softmax(scaled, -1).view(n, blocks, BLOCK)
    keys = mix(seeds ^ mix(positions & MASK))
    # Ids past the vocabulary name the blocks: a block's noise is no token's.
    block_ids = torch.arange(blocks, device=probs.device).add_(blocks * BLOCK).expand(n, -1)
    block = (probs.sum(-1) / exponentials(keys, block_ids)).argmax(-1, keepdim=True)  # [N, 1]
    token_ids = block * BLOCK + torch.arange(BLOCK, device=probs.device)
    inside = probs.gather(1, block[:, :, None].expand(-1, -1, BLOCK))[:, 0]
    drawn = block[:, 0] * BLOCK + (inside / exponentials(keys, token_ids)).argmax(-1)
    return torch.where(temperature > 0, drawn, logits.argmax(-1))


def accepted(chosen: Tensor, proposals: Tensor, proposed: Tensor | None = None) -> Tensor:
    """Verification of proposals [B, k] against the tokens the target chose at each of k+1
    positions [B, k+1]: each is accepted where it is the target's and the ones before it
    were (proposed [1, k]: which of the k are proposals, the first ones; the rest stale).
    Returns the accepted count [B]."""
    right = proposals == chosen[:, : proposals.shape[1]]
    return (right if proposed is None else right & proposed).long().cumprod(1).sum(1)
