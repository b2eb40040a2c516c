"""An oracle draft for benchmarks: proposals at a chosen acceptance rate.

A random-weight draft agrees with a random-weight target almost never, so speed at a
realistic acceptance cannot be measured with one. The oracle's proposals are the target's
own greedy tokens (from a target-only decode of the same rows), each replaced, with
probability 1 - acceptance, by a different token, which the target then rejects. The draft
model still runs every forward pass it would run (OracleDraft only overrides its choice),
so a round costs what it costs with a real draft of that size.

The acceptance here is per token, as in Leviathan et al. (2023): each proposal is right
with probability alpha, independently. The share of proposals the loop keeps is lower,
since a round keeps only the proposals before its first wrong one:
accepted / proposed = (alpha - alpha^(k+1)) / ((1 - alpha) k), and a target pass keeps
(1 - alpha^(k+1)) / (1 - alpha) tokens."""

from __future__ import annotations

import torch
from torch import Tensor

from asr.decoder import DecoderRunner, KVCache
from asr.draft_length import expected_tokens_per_pass

ORACLE_LOGIT = 1e4  # above any real logit, and within float16's range


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


class OracleDraft:
    """A draft runner (DecoderRunner's interface) whose proposals are given: the draft model
    runs every pass, then the logit of the given token at each predicted index is raised
    above all others. table [R, C]: the proposal for each token index of each cache row
    (R and C those of the engine's batch state: oracle_table). Its rows are the batch's
    slots, so they must stay in place: fixed shapes, or rows that end together (in fitted
    shapes, rows that finish early are dropped and the rest move up: Slots._resize)."""

    def __init__(self, runner: DecoderRunner, table: Tensor):
        self.runner = runner
        self.table = table

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def forward(self, tokens: Tensor, start: Tensor, cache: KVCache, logits_at: Tensor | None = None,
                window: int | None = None, rows: Tensor | None = None, by_lengths: bool | str = False,
                fused: bool = False) -> Tensor:
        logits = self.runner.forward(tokens, start, cache, logits_at, window, rows, by_lengths, fused)
        at = torch.arange(tokens.shape[1], device=tokens.device).expand(len(tokens), -1) if logits_at is None else logits_at
        predicted = (start[:, None] + at + 1).clamp(max=self.table.shape[1] - 1)
        table = self.table if rows is None else self.table.index_select(0, rows)
        return logits.scatter_(-1, table.gather(1, predicted)[:, :, None], ORACLE_LOGIT)


def oracle_table(proposals: list[list[int]], prompt_lengths: list[int], rows: int, capacity: int,
                 device: torch.device | str) -> Tensor:
    """oracle_proposals' rows laid out by token index, for OracleDraft: row b's proposals
    start at its prompt's length; rows past len(proposals) (a batch padded to `rows`) get none."""
    table = torch.zeros(rows, capacity, dtype=torch.long)
    for row, (tokens, begin) in enumerate(zip(proposals, prompt_lengths)):
        tokens = tokens[: capacity - begin]
        table[row, begin : begin + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    return table.to(device)
