"""An oracle draft for benchmarks: proposals at a chosen acceptance rate.

A random-weight draft agrees with a random-weight target almost never, so speed at a
realistic acceptance cannot be measured with one. The oracle's proposals are the target's
own greedy tokens (from a target-only decode of the same rows), each replaced, with
probability 1 - acceptance, by a different token, which the target then rejects. The draft
model still runs every forward pass it would run (asr/graphs.py discards only its argmax),
so a round costs what it costs with a real draft of that size.

The acceptance here is per token, as in Leviathan et al. (2023): each proposal is right
with probability alpha, independently. The share of proposals the loop keeps is lower,
since a round keeps only the proposals before its first wrong one:
accepted / proposed = (alpha - alpha^(k+1)) / ((1 - alpha) k), and a target pass keeps
(1 - alpha^(k+1)) / (1 - alpha) tokens."""

from __future__ import annotations

import torch


def oracle_proposals(reference: list[list[int]], acceptance: float, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """reference[b]: the target's greedy tokens of row b. Returns row b's proposal for each
    generated index: the reference token, or with probability 1 - acceptance another one.

    Each index gets one draw, reused whenever it is proposed again: a round reads the draws
    of its indices up to the first wrong one, and the next round starts after it, so every
    draw decides at most one verification and the decisions stay independent."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance must lie in [0, 1], not {acceptance}")
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for tokens in reference:
        right = torch.tensor(tokens, dtype=torch.long)
        wrong = (right + torch.randint(1, vocab_size, right.shape, generator=generator)) % vocab_size  # never `right`
        keep = torch.rand(right.shape, generator=generator) < acceptance
        rows.append(torch.where(keep, right, wrong).tolist())
    return rows


def expected_tokens_per_pass(acceptance: float, k: int) -> float:
    """Tokens a target pass keeps when each of k proposals is right with probability alpha."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def acceptance_from_tokens_per_pass(tokens_per_pass: float, k: int) -> float:
    """The per-token acceptance alpha that expected_tokens_per_pass maps to tokens_per_pass
    (it rises with alpha), so drafts measured at different k compare on one scale."""
    low, high = 0.0, 1.0
    if tokens_per_pass <= 1.0:
        return 0.0
    if tokens_per_pass >= k + 1:
        return 1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if expected_tokens_per_pass(middle, k) < tokens_per_pass else (low, middle)
    return (low + high) / 2
