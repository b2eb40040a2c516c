"""Hints: tokens a row is expected to generate (a stream's previous hypothesis of the
same buffer), proposed in place of the draft's while the row follows them. Like a draft's,
a hint's proposals are only kept where the target agrees, so any hint keeps the output exact."""

from __future__ import annotations

import torch
from torch import Tensor

HINT_REALIGN = 3  # a row's last kept tokens that, found in its hint, resume the hint there


def follow(
    hint: Tensor, hint_length: Tensor, shift: Tensor, on: Tensor, tokens: Tensor, length: Tensor, sample_begin: Tensor
) -> tuple[Tensor, Tensor]:
    """Which rows propose from their hint this round [B], given which did last round (on
    [B]) and shift [B] (the hint index of a row's next token minus its count of generated
    tokens); returns them with the updated shift. A row follows its hint while everything it
    kept is the hint's: its last kept token is the hint's at that place. Where it departs (a
    stream's hypothesis changed a word or a timestamp, and goes on as before), the hint
    resumes where the row's last HINT_REALIGN kept tokens occur in it (the occurrence
    nearest its place)."""
    generated = length - sample_begin
    at = generated + shift
    width, rows = hint.shape[1], torch.arange(len(length), device=length.device)
    last = tokens[rows, length - 1]
    follows = on & ((generated == 0) | ((at >= 1) & (hint[rows, (at - 1).clamp(0, width - 1)] == last)))
    if width >= HINT_REALIGN:
        recent = tokens.gather(1, (length[:, None] - HINT_REALIGN + torch.arange(HINT_REALIGN, device=length.device)).clamp(min=0))
        ends = torch.arange(HINT_REALIGN, width + 1, device=length.device)  # hint index just past each window
        found = (hint.unfold(1, HINT_REALIGN, 1) == recent[:, None]).all(-1) & (ends <= hint_length[:, None])
        found &= (generated >= HINT_REALIGN)[:, None]
        nearest = torch.where(found, (ends - at[:, None]).abs(), width + 1).argmin(1)
        realign = ~follows & found.any(1)
        shift = torch.where(realign, ends[nearest] - generated, shift)
        follows |= realign
    return follows & (generated + shift < hint_length), shift
