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

    generated: Tensor  # [N] tokens decoded so far (after the prompt, and a forced prefix)
    last: Tensor | None = None  # [N] previous token (meaningful when generated >= 1)
    penultimate: Tensor | None = None  # [N] token before it (meaningful when generated >= 2)
    last_timestamp: Tensor | None = None  # [N] last timestamp token generated, -1 if none
    # [N] bool: a row whose first generated tokens were forced (a prefix): its first free
    # token may be text, as CTranslate2 decodes after a prefix (None: no row's were).
    forced: Tensor | None = None

    @classmethod
    def at(cls, tokens: Tensor, sample_begin: Tensor, positions: Tensor, timestamp_begin: int,
           timestamps: bool = True, free_begin: Tensor | None = None) -> "Prefix":
        """tokens [B, L] with proposals written in place; sample_begin [B]; positions [B, q]
        are the indices being predicted; free_begin [B]: where the tokens decoded freely
        start, past the generated ones forced (None: at sample_begin). The rules read the
        tokens decoded freely alone, as CTranslate2's after a prefix. Returns one entry per
        (row, position), row-major; without timestamps only what the rules without them read."""
        begin = sample_begin if free_begin is None else free_begin
        generated = (positions - begin[:, None]).reshape(-1)
        if not timestamps:
            return cls(generated)
        forced = None if free_begin is None else (free_begin > sample_begin)[:, None].expand_as(positions).reshape(-1)
        columns = torch.arange(tokens.shape[1], device=tokens.device)
        generated_region = columns >= begin[:, None]
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
            forced=forced,
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
        # (With timestamps every text token is suppressed at the beginning, _timestamp_rules,
        # but after a forced prefix: begin_suppress's text tokens, the blank and end-of-text, then count.)
        self.begin_suppress = torch.tensor(sorted(set(begin_suppress)), dtype=torch.long, device=device)
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
            columns = logits.index_select(1, self.begin_suppress).masked_fill_(at_begin[:, None], NEG_INF)
            logits.index_copy_(1, self.begin_suppress, columns)
        if self.timestamps:
            self._timestamp_rules(logits, prefix, at_begin)
        return logits

    def _timestamp_rules(self, logits: Tensor, prefix: Prefix, at_begin: Tensor) -> None:
        # Row-wise masks over column slices: no [N, V] temporaries on this hot path.
        ts_begin = self.timestamp_begin
        text, timestamps = logits[:, :ts_begin], logits[:, ts_begin:]
        # A row's first token is a timestamp, unless a prefix (with its <|0.00|>) was forced
        # before it: then, as CTranslate2 decodes, any token but begin_suppress's (apply).
        after_prefix = None if prefix.forced is None else at_begin & prefix.forced
        opening = at_begin if after_prefix is None else at_begin & ~after_prefix
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
            timestamps[:, self.max_initial_timestamp_index + 1 :].masked_fill_(opening[:, None], NEG_INF)
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
        likelier = timestamp_mass > 1 if after_prefix is None else (timestamp_mass > 1) & ~after_prefix
        text.masked_fill_((opening | likelier)[:, None], NEG_INF)
