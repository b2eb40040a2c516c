"""Hints: tokens a row is expected to generate (a stream's previous hypothesis of the
same buffer), proposed in place of the draft's while the row follows them. Like a draft's,
a hint's proposals are only kept where the target agrees, so any hint keeps the output exact."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from asr.slots import Row
    from asr.speculative import Batch

HINT_REALIGN = 3  # a row's last kept tokens that, found in its hint, resume the hint there
# In fitted shapes, a round's hint proposals a row, at most this over its rows (but
# max_draft_tokens a row at least): each position verified is a vocabulary-wide row in several
# float32 buffers, and 16 rows following 224-token hints took gigabytes.
HINT_POSITIONS = 1024


def check(hint: list[int], vocab_size: int) -> None:
    """A hint holds token ids of the vocabulary (1.7 was taken as 1, and text failed in a comparison)."""
    def whole(token) -> bool:  # ints of Python, numpy or a 0-d tensor; not bools, floats or text
        try:
            return not isinstance(token, (bool, np.bool_)) and operator.index(token) == token
        except TypeError:
            return False

    if isinstance(hint, (str, bytes)) or not all(whole(token) and 0 <= token < vocab_size for token in hint):
        raise ValueError(f"hint tokens must be token ids, whole numbers from 0 to {vocab_size - 1}: {hint!r:.80}")


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


@dataclass
class HintRound:
    """A round's proposals from hints, written after each row's kept tokens."""

    proposed: list[int]  # per slot: tokens its hint proposed
    drafted: list[int]  # per slot: tokens the draft proposed (rows not following a hint)
    k: int  # the round's proposals per row (the verification checks k + 1 positions)


def follow_round(batch: Batch) -> list[int] | None:
    """Which rows follow their hints this round: per slot, the hint's tokens left to
    propose (0 for a row that does not follow one); None where no live row follows."""
    s = batch.state
    on, shift = follow(s.hint, s.hint_length, s.hint_shift, s.hint_on, s.tokens, s.length, s.sample_begin)
    s.hint_on.copy_(on & s.live)
    s.hint_shift.copy_(shift)
    offset = s.length - s.sample_begin + s.hint_shift  # index in the hint of the first proposal
    left = torch.where(s.hint_on, s.hint_length - offset, 0).clamp(min=0).tolist()
    live = [n for n, row in zip(left, batch.slots) if row is not None]
    return left if any(live) else None


def propose(batch: Batch, rows: list[Row], left: list[int], drafted: int) -> HintRound:
    """Rows following their hints propose the rest of them (left: follow_round's), written
    over what the draft proposed this round (drafted tokens a row, for the rows that follow
    none; their cache of the hint rows' tokens is cut where the hints begin). In fixed
    shapes at most max_draft_tokens: a row's logits then always come from passes of one
    width, on a GPU target-only's to the bit, and so do its tokens, sampled ones too."""
    s, e = batch.state, batch.engine
    # Up to the furthest limit of a row that follows its hint (a row near its own, a window
    # looping to 224 tokens, held every batchmate's hint to its few last tokens: a stream's
    # update took 5 passes for 1), and within the cache; proposals past a row's limit are
    # never kept, nor counted (below).
    remaining = max(row.limit - row.length for row, n in zip(batch.slots, left) if row is not None and n)
    room = e.capacity - 1 - max(row.length for row in rows)
    k = max(min(max(left), remaining - 1, room), drafted, 0)
    if e.verify_width:
        k = min(k, e.max_draft_tokens)
    k = min(k, max(e.max_draft_tokens, HINT_POSITIONS // len(batch.slots)))
    steps = torch.arange(k, device=e.device)
    offset = s.length - s.sample_begin + s.hint_shift
    positions = s.length[:, None] + steps
    drafts = ~s.hint_on[:, None] & (steps < drafted)  # [R, k] the draft's proposals, kept
    hinted = s.hint.gather(1, (offset[:, None] + steps).clamp(0, e.capacity - 1))
    s.tokens.scatter_(1, positions, torch.where(drafts, s.tokens.gather(1, positions), hinted))
    if drafted:
        s.draft_cached.copy_(torch.where(s.hint_on, torch.minimum(s.draft_cached, s.length), s.draft_cached))
    # Counted up to a row's limit: k may pass it where other rows draft.
    proposed = [0 if row is None else min(n, k, max(row.limit - row.length - 1, 0)) for n, row in zip(left, batch.slots)]
    by_draft = [0 if n or row is None else min(drafted, k) for n, row in zip(left, batch.slots)]
    return HintRound(proposed, by_draft, k)
