"""Whisper's decoding rules as one logit filter, vectorised over every position being
predicted. The draft and the target call the same filter with the same prefixes, so the
rules hold identically at each verified position (the order and arithmetic follow
transformers' Whisper logits processors, which in turn follow openai/whisper)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Prefix:
    """What the rules need to know about the tokens before each predicted position."""

    generated: Tensor  # [N] tokens generated so far (after the prompt)
    last: Tensor | None = None  # [N] previous token (meaningful when generated >= 1)
    penultimate: Tensor | None = None  # [N] token before it (meaningful when generated >= 2)
    last_timestamp: Tensor | None = None  # [N] last timestamp token generated, -1 if none
    # [N] bool: the first token decoded freely, past a forced prefix (None: generated == 0):
    # where begin_suppress applies, as CTranslate2's after a prefix.
    first_free: Tensor | None = None

    @classmethod
    def at(cls, tokens: Tensor, sample_begin: Tensor, positions: Tensor, timestamp_begin: int,
           timestamps: bool = True, free_begin: Tensor | None = None) -> "Prefix":
        """tokens [B, L] with proposals written in place; sample_begin [B]; positions [B, q]
        are the indices being predicted; free_begin [B]: where the tokens decoded freely start,
        past the generated ones forced (None: at sample_begin). Returns one entry per (row,
        position), row-major; without timestamps only what the rules without them read."""
        generated = (positions - sample_begin[:, None]).reshape(-1)
        first_free = None if free_begin is None else (positions == free_begin[:, None]).reshape(-1)
        if not timestamps:
            return cls(generated, first_free=first_free)
        columns = torch.arange(tokens.shape[1], device=tokens.device)
        generated_region = columns >= sample_begin[:, None]
        timestamps = torch.where(generated_region & (tokens >= timestamp_begin), tokens, -1)
        # Timestamps never decrease under the rules, so the running max is the last one.
        last_timestamp = timestamps.cummax(dim=1).values
        # [B, q, 2]: the index before each position and the one before that, in one gather
        before = (positions[:, :, None] - torch.arange(1, 3, device=tokens.device)).clamp(min=0)
        last = tokens.gather(1, before.flatten(1)).view(-1, 2)
        return cls(
            generated=generated,
            last=last[:, 0],
            penultimate=last[:, 1],
            last_timestamp=last_timestamp.gather(1, before[:, :, 0]).reshape(-1),
            first_free=first_free,
        )


class DecodingRules:
    """Suppressed tokens, begin-suppress, and (with timestamps) the timestamp rules."""

    def __init__(
        self,
        *,
        vocab_size: int,
        eot: int,
        no_timestamps: int,
        suppress: list[int],
        begin_suppress: list[int],
        timestamps: bool,
        max_initial_timestamp_index: int | None = 50,
        device: torch.device | str = "cpu",
    ):
        self.vocab_size = vocab_size
        self.eot = eot
        self.no_timestamps = no_timestamps
        self.timestamp_begin = no_timestamps + 1
        self.timestamps = timestamps
        self.max_initial_timestamp_index = max_initial_timestamp_index
        self.suppress = torch.tensor(sorted(set(suppress)), dtype=torch.long, device=device)
        # With timestamps every text token is suppressed at the beginning (_timestamp_rules):
        # those of begin_suppress need no step of their own.
        begin_suppress = {t for t in begin_suppress if not (timestamps and t < self.timestamp_begin)}
        self.begin_suppress = torch.tensor(sorted(begin_suppress), dtype=torch.long, device=device)
        self._timestamp_offsets = torch.arange(vocab_size - self.timestamp_begin, device=device)

    def prefix(self, tokens: Tensor, sample_begin: Tensor, positions: Tensor, free_begin: Tensor | None = None) -> Prefix:
        """Prefix.at, with what these rules read."""
        return Prefix.at(tokens, sample_begin, positions, self.timestamp_begin, self.timestamps, free_begin)

    def apply(self, logits: Tensor, prefix: Prefix) -> Tensor:
        """Filters logits [N, V] in place and returns them."""
        # Explicit index ops: `logits[:, ids] = NEG_INF` would copy a CPU scalar to the GPU,
        # which CUDA graph capture forbids (tests/test_capture_safety.py).
        if self.suppress.numel():
            logits.index_fill_(1, self.suppress, NEG_INF)
        at_begin = prefix.generated == 0
        if self.begin_suppress.numel():
            first_free = at_begin if prefix.first_free is None else prefix.first_free
            columns = logits.index_select(1, self.begin_suppress).masked_fill_(first_free[:, None], NEG_INF)
            logits.index_copy_(1, self.begin_suppress, columns)
        if self.timestamps:
            self._timestamp_rules(logits, prefix, at_begin)
        return logits

    def _timestamp_rules(self, logits: Tensor, prefix: Prefix, at_begin: Tensor) -> None:
        # Row-wise masks over column slices: no [N, V] temporaries on this hot path.
        ts_begin = self.timestamp_begin
        text, timestamps = logits[:, :ts_begin], logits[:, ts_begin:]
        logits.select(1, self.no_timestamps).fill_(NEG_INF)
        last_is_ts = (prefix.generated >= 1) & (prefix.last >= ts_begin)
        penultimate_is_ts = (prefix.generated < 2) | (prefix.penultimate >= ts_begin)
        closing_pair = last_is_ts & ~penultimate_is_ts
        # Timestamps come in pairs, except directly before end-of-text.
        timestamps.masked_fill_((last_is_ts & penultimate_is_ts)[:, None], NEG_INF)
        logits[:, : self.eot].masked_fill_(closing_pair[:, None], NEG_INF)
        # Timestamps never decrease, and a segment has non-zero length: the lowest allowed is
        # the last one plus one, or the last one itself where the next closes a pair
        # (closing_pair); with none yet (last_timestamp -1) it is 0.
        lowest = (prefix.last_timestamp - closing_pair.long() - (ts_begin - 1)).clamp(min=0)
        timestamps.masked_fill_(self._timestamp_offsets < lowest[:, None], NEG_INF)
        # The first generated token is a timestamp (text is barred below), no later than max_initial_timestamp.
        if self.max_initial_timestamp_index is not None:
            timestamps[:, self.max_initial_timestamp_index + 1 :].masked_fill_(at_begin[:, None], NEG_INF)
        # If the timestamps together are likelier than any text token, emit a timestamp
        # (log-softmax's normaliser cancels out of this comparison): logsumexp(timestamps) >
        # best_text computed as sum(exp(timestamps - best_text)) > 1, in float32 (the
        # subtraction promotes): 4 kernels where logsumexp is 9. Where best_text is -inf, every
        # text logit already is, so the outcome (inf, or NaN where a timestamp is -inf) changes nothing.
        # amax, not max(dim): no indices (8x faster on a CPU); exact in any dtype, so no float copy
        # of the text logits. Rows at the beginning are barred from text whatever best_text is: one
        # fill over the text logits for both rules (each is a pass over [N, 50k] on a CPU).
        best_text = text.amax(dim=-1).float()
        timestamp_mass = (timestamps - best_text[:, None]).exp_().sum(-1)  # relative to best_text
        text.masked_fill_((at_begin | (timestamp_mass > 1))[:, None], NEG_INF)
