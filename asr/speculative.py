"""The speculative decoding loop: the draft proposes k tokens, the target verifies k+1
positions in one pass, and each row keeps its longest agreeing prefix plus one target
token. Rejected positions are rolled back by moving a row's length, never by copying.
Without a draft (k = 0) the same loop is plain target-only decoding.

Greedy output equals the target's alone; at temperature > 0, rejection sampling keeps
the target's distribution (Leviathan et al. 2023, Chen et al. 2023)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from asr.decoder import DecoderRunner, KVCache
from asr.rules import DecodingRules, Prefix


@dataclass
class DecodeStats:
    draft_proposed: int = 0
    draft_accepted: int = 0
    target_passes: int = 0
    draft_passes: int = 0
    tokens: int = 0  # tokens kept (end-of-text included)
    hint_proposed: int = 0  # tokens proposed from a hint (decode's hints), not counted as draft tokens
    hint_accepted: int = 0
    tokens_per_pass: list[int] = field(default_factory=list)  # kept by each target pass: accepted proposals + 1

    @property
    def acceptance_rate(self) -> float:
        return self.draft_accepted / self.draft_proposed if self.draft_proposed else 0.0

    @property
    def tokens_per_target_pass(self) -> float:
        return self.tokens / self.target_passes if self.target_passes else 0.0

    def add(self, other: "DecodeStats") -> None:
        for name in self.__dataclass_fields__:  # counts add up, lists join
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class Sequence:
    """One row's result: generated tokens (end-of-text excluded) and their scores."""

    tokens: list[int]
    sum_logprob: float
    no_speech_prob: float
    stats: DecodeStats = field(default_factory=DecodeStats)

    @property
    def avg_logprob(self) -> float:
        return self.sum_logprob / (len(self.tokens) + 1)


class DraftLength:
    """Chooses k, the draft tokens proposed in a round (0: the target alone). Fixed when asked;
    otherwise it maximises expected tokens per second,

        (1 - a^(k+1)) / (1 - a) / (k * draft_step + plain + k * per_proposal),

    from the measured per-token acceptance a, the measured cost of a draft step, and the cost
    of a target pass measured without proposals (plain) and with them. No drafting (k = 0,
    1 / plain) wins where drafting does not pay: in a large batch on a CPU, verifying k
    proposals for every row costs nearly what k plain passes do. Every EXPLORE-th round goes
    the other way (drafting or not), so that both stay measured. k is the best drafting
    length (>= 1); next_round() says what a round does."""

    EXPLORE = 16

    def __init__(self, fixed: int | None = None, maximum: int = 8, initial: int = 4):
        self.fixed = fixed
        self.maximum = fixed if fixed is not None else maximum
        self.k = fixed if fixed is not None else min(initial, maximum)
        self._accepted = 1.0  # decayed counts, starting from a mild prior
        self._rejected = 1.0
        self._draft_step: float | None = None
        self._verify: float | None = None  # a target pass checking proposals (_proposals on average)
        self._proposals: float | None = None
        self._plain: float | None = None  # a target pass without proposals
        self._plain_wins = False
        self._rounds = 0

    def next_round(self) -> int:
        if self.fixed is not None:
            return self.fixed
        self._rounds += 1
        explore = self._rounds % self.EXPLORE == 0 or (self._plain is None and self._draft_step is not None)
        return self.k if self._plain_wins == explore else 0

    def update(self, k: int, accepted: int, rejected: int, draft_seconds_per_step: float, verify_seconds: float) -> None:
        """A round's outcome: k proposed per row, accepted in all, rows that rejected one."""
        if self.fixed is not None:
            return
        if k == 0:
            self._plain = _average(self._plain, verify_seconds)
        else:
            decay = 0.9
            self._accepted = decay * self._accepted + accepted
            self._rejected = decay * self._rejected + rejected
            self._draft_step = _average(self._draft_step, draft_seconds_per_step)
            self._verify = _average(self._verify, verify_seconds)
            self._proposals = _average(self._proposals, float(k))
        if self._draft_step is None:
            return
        alpha = self._accepted / (self._accepted + self._rejected)
        plain, verify = self._plain, self._verify

        def tokens_per_second(k: int) -> float:
            expected = k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
            if plain is None:
                return expected / (k * self._draft_step + verify)
            per_proposal = max(verify - plain, 0.0) / self._proposals
            return expected / (k * self._draft_step + plain + k * per_proposal)

        self.k = max(range(1, self.maximum + 1), key=tokens_per_second)
        self._plain_wins = plain is not None and tokens_per_second(0) > tokens_per_second(self.k)


def _average(mean: float | None, value: float) -> float:
    """An exponential moving average (the machine's speed drifts; batches shrink)."""
    return value if mean is None else 0.7 * mean + 0.3 * value


@dataclass
class _Model:
    runner: DecoderRunner
    cache: KVCache


class SpeculativeDecoder:
    """Decodes a batch of windows with a target decoder and an optional draft decoder."""

    def __init__(self, target: DecoderRunner, draft: DecoderRunner | None = None):
        if draft is not None and draft.vocab_size != target.vocab_size:
            raise ValueError(f"the draft's vocabulary ({draft.vocab_size}) differs from the target's ({target.vocab_size})")
        self.target = target
        self.draft = draft
        # Layers whose cross-attention K/V the draft can take from the target's cache.
        self._shared_cross = draft.cross_layers_shared_with(target) if draft is not None else None

    @torch.inference_mode()
    def decode(
        self,
        target_encoder_output: Tensor,
        prompts: list[list[int]],
        rules: DecodingRules,
        *,
        sot_index: list[int] | None = None,
        no_speech_token: int | None = None,
        draft_encoder_output: Tensor | None = None,
        max_new_tokens: int = 224,
        temperature: float = 0.0,
        draft_length: DraftLength | None = None,
        generator: torch.Generator | None = None,
        hints: list[list[int]] | None = None,
    ) -> list[Sequence]:
        """prompts[b] is row b's decoder prompt (previous text, <|startoftranscript|>, ...).
        sot_index[b] is where <|startoftranscript|> sits in it: the no-speech probability is
        read from the target's prediction there.

        hints[b]: tokens row b is expected to generate (e.g. the previous hypothesis of a
        re-transcribed stream). While the row follows its hint, a round proposes all the rest
        of it instead of running the draft; where the row departs from it, or once it is used
        up, the draft takes over, until the hint can be followed again (_follow_hint). Like a
        draft's, a hint's proposals are only ever kept where the target agrees, so any hint
        keeps the output exact."""
        device = target_encoder_output.device
        batch = len(prompts)
        use_draft = self.draft is not None and (draft_length is None or draft_length.maximum > 0)
        draft_length = draft_length if draft_length is not None else DraftLength()
        k_max = draft_length.maximum if use_draft else 0
        lengths = [len(p) for p in prompts]
        capacity = max(lengths) + max_new_tokens + k_max + 2
        max_positions = min(r.max_positions for r in self._runners(use_draft))
        if max(lengths) + max_new_tokens > max_positions - 1:
            raise ValueError(f"prompt plus {max_new_tokens} new tokens exceeds the decoder's {max_positions} positions")

        tokens = torch.zeros(batch, capacity, dtype=torch.long, device=device)
        for b, prompt in enumerate(prompts):
            tokens[b, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        length = torch.tensor(lengths, device=device)
        sample_begin = length.clone()
        limit = length + max_new_tokens
        sot = torch.tensor(sot_index if sot_index is not None else [0] * batch, device=device)
        hint, hint_length = _pad_hints(hints or [[]] * batch, rules.eot, self.target.vocab_size, device)
        hint_shift, hint_on = torch.zeros_like(hint_length), hint_length > 0
        hinted = bool(hints) and any(hints)  # else no hint work at all (and no host sync for it)

        target = _Model(self.target, self.target.new_cache(target_encoder_output, capacity))
        no_speech = torch.full((batch,), float("nan"), device=device)
        self._prefill(target, tokens, length, sot, no_speech, no_speech_token)
        draft = None
        draft_cached = length - 1
        if use_draft:
            encoder_output = draft_encoder_output if draft_encoder_output is not None else target_encoder_output
            shared = self._shared_cross if draft_encoder_output is None else None
            cache = self.draft.new_cache(encoder_output, capacity, cross_from=target.cache if shared else None, cross_layers=shared)
            draft = _Model(self.draft, cache)
            self._prefill(draft, tokens, length, sot, None, None)

        rows = torch.arange(batch, device=device)  # original index of each live row
        sum_logprob = torch.zeros(batch, dtype=torch.float64, device=device)
        stats = [DecodeStats() for _ in range(batch)]
        results: list[Sequence | None] = [None] * batch
        first_round = True

        while rows.numel():
            live = rows.numel()
            remaining = int((limit - length).min())
            hint_round = False
            if hinted:
                hint_on, hint_shift = _follow_hint(hint, hint_length, hint_shift, hint_on, tokens, length, sample_begin)
                hint_round = bool(hint_on.any())
            draft_probs = None
            started = time.perf_counter()
            if hint_round:
                offset = length - sample_begin + hint_shift  # index in the hint of the first proposal
                k = min(int((hint_length - offset)[hint_on].max()), remaining - 1)
                hint_proposed = torch.where(hint_on, (hint_length - offset).clamp(max=k), 0)
                if k > 0:
                    # Rows not hinting propose whatever lies in their padded hint: never kept unless right.
                    proposals = hint.gather(1, (offset[:, None] + torch.arange(k, device=device)).clamp(max=hint.shape[1] - 1))
                    tokens.scatter_(1, length[:, None] + torch.arange(k, device=device), proposals)
                    if temperature > 0:  # a fixed proposal is a draft distribution with all its mass on it
                        draft_probs = torch.nn.functional.one_hot(proposals, self.target.vocab_size).float()
            else:
                k = min(draft_length.next_round(), remaining - 1) if use_draft else 0
                if k > 0:
                    k, draft_probs = self._propose(draft, tokens, length, draft_cached, sample_begin, rules, k, temperature, generator)
                    draft_cached = length + k - 1
            drafted = time.perf_counter()

            positions = length[:, None] + torch.arange(k + 1, device=device)  # predicted indices
            verify_tokens = tokens.gather(1, positions - 1)
            logits = self.target.forward(verify_tokens, length - 1, target.cache)
            if first_round and no_speech_token is not None:
                # Rows whose prompt ends in <|startoftranscript|> read it from this pass.
                at_sot = (sot == length - 1)
                probs = logits[:, 0].float().softmax(-1)[:, no_speech_token]
                no_speech = torch.where(at_sot, probs.to(no_speech.dtype), no_speech)
            first_round = False
            flat = logits.reshape(live * (k + 1), -1)
            rules.apply(flat, Prefix.at(tokens, sample_begin, positions, rules.timestamp_begin))
            logits = flat.view(live, k + 1, -1)
            proposals = tokens.gather(1, positions[:, :k])
            if temperature > 0:
                accepted, chosen = _rejection_sample(logits, draft_probs, proposals, temperature, generator)
            else:
                chosen = logits.argmax(-1)
                accepted = (proposals == chosen[:, :k]).long().cumprod(1).sum(1)
            correction = chosen.gather(1, accepted[:, None])[:, 0]
            tokens[torch.arange(live, device=device), length + accepted] = correction

            # Keep accepted + 1 tokens, cut at end-of-text and at the length limit.
            new = accepted + 1
            window = tokens.gather(1, positions)
            is_eot = (window == rules.eot) & (torch.arange(k + 1, device=device) < new[:, None])
            ends_with_eot = is_eot.any(1)
            new = torch.where(ends_with_eot, is_eot.long().argmax(1) + 1, new)
            new = torch.minimum(new, limit - length)
            token_logprobs = torch.log_softmax(logits.float(), -1).gather(2, window[:, :, None])[:, :, 0]
            kept = torch.arange(k + 1, device=device) < new[:, None]
            sum_logprob += torch.where(kept, token_logprobs, 0.0).sum(1).double()  # -inf * 0 would be NaN
            eot_kept = ends_with_eot & (is_eot & kept).any(1)
            length = length + new
            if draft is not None:
                draft_cached = torch.minimum(draft_cached, length - 1)
            verified = time.perf_counter()

            accepted_list, new_list = accepted.tolist(), new.tolist()
            if hint_round:
                hinted_list = hint_proposed.tolist()
            for i, row in enumerate(rows.tolist()):
                s = stats[row]
                if hint_round:
                    s.hint_proposed += hinted_list[i]
                    s.hint_accepted += min(accepted_list[i], hinted_list[i])
                else:
                    s.draft_proposed += k
                    s.draft_accepted += accepted_list[i]
                    s.draft_passes += k
                s.target_passes += 1
                s.tokens += new_list[i]
                s.tokens_per_pass.append(new_list[i])
            if use_draft and not hint_round:
                rejected = sum(1 for a in accepted_list if a < k)
                draft_length.update(k, sum(accepted_list), rejected, (drafted - started) / max(k, 1), verified - drafted)

            finished = eot_kept | (length >= limit)
            if bool(finished.any()):
                done_at = finished.nonzero()[:, 0]
                for i in done_at.tolist():
                    row = int(rows[i])
                    end = int(length[i]) - (1 if bool(eot_kept[i]) else 0)
                    results[row] = Sequence(
                        tokens=tokens[i, int(sample_begin[i]) : end].tolist(),
                        sum_logprob=float(sum_logprob[i]),
                        no_speech_prob=float(no_speech[i]),
                        stats=stats[row],
                    )
                keep = (~finished).nonzero()[:, 0]
                rows, tokens, length, sample_begin, limit, sot = (
                    t.index_select(0, keep) for t in (rows, tokens, length, sample_begin, limit, sot)
                )
                sum_logprob, no_speech, draft_cached = (t.index_select(0, keep) for t in (sum_logprob, no_speech, draft_cached))
                hint, hint_length, hint_shift, hint_on = (t.index_select(0, keep) for t in (hint, hint_length, hint_shift, hint_on))
                target.cache.keep_rows(keep)
                if draft is not None:
                    draft.cache.keep_rows(keep)
        return results  # type: ignore[return-value]

    def _runners(self, use_draft: bool) -> list[DecoderRunner]:
        return [self.target, self.draft] if use_draft else [self.target]

    def _prefill(
        self, model: _Model, tokens: Tensor, length: Tensor, sot: Tensor, no_speech: Tensor | None, no_speech_token: int | None
    ) -> None:
        """Caches every prompt token but the last, which each round feeds as the pending token."""
        width = int(length.max()) - 1
        if width <= 0:
            return
        start = torch.zeros_like(length)
        logits = model.runner.forward(tokens[:, :width], start, model.cache, logits_at=sot.clamp(max=width - 1)[:, None])
        if no_speech is not None and no_speech_token is not None:
            probs = logits[:, 0].float().softmax(-1)[:, no_speech_token]
            no_speech.copy_(torch.where(sot < length - 1, probs.to(no_speech.dtype), no_speech))

    def _propose(
        self,
        draft: _Model,
        tokens: Tensor,
        length: Tensor,
        draft_cached: Tensor,
        sample_begin: Tensor,
        rules: DecodingRules,
        k: int,
        temperature: float,
        generator: torch.Generator | None,
    ) -> tuple[int, Tensor | None]:
        """Writes up to k proposals per row into tokens[length : length + k]. The draft first
        catches up on the tokens it has not seen (one, two after a full acceptance, many after
        a hint), and stops early once every row has proposed end-of-text. Returns how many it
        proposed, and the draft's distributions [B, k, V] when sampling."""
        live = tokens.shape[0]
        arange_rows = torch.arange(live, device=tokens.device)
        width = int((length - draft_cached).max())
        # Every row's catch-up ends at its pending token: a row with less to catch up re-feeds
        # cached tokens (same keys and values) rather than running past its length, which
        # a long catch-up beside a row near its limit could take beyond the cache.
        start = (length - width).clamp(min=0)
        feed = tokens.gather(1, start[:, None] + torch.arange(width, device=tokens.device))
        last = (length - 1 - start)[:, None]
        ended = torch.zeros(live, dtype=torch.bool, device=tokens.device)
        probs = []
        for i in range(k):
            logits = draft.runner.forward(feed, start, draft.cache, logits_at=last)[:, 0]
            position = length + i
            rules.apply(logits, Prefix.at(tokens, sample_begin, position[:, None], rules.timestamp_begin))
            if temperature > 0:
                p = torch.softmax(logits.float() / temperature, -1)
                proposal = torch.multinomial(p, 1, generator=generator)[:, 0]
                probs.append(p)
            else:
                proposal = logits.argmax(-1)
            tokens[arange_rows, position] = proposal
            ended |= proposal == rules.eot
            if bool(ended.all()):
                k = i + 1
                break
            start = position
            feed = proposal[:, None]
            last = torch.zeros_like(last)
        return k, torch.stack(probs, 1) if probs else None


def _pad_hints(hints: list[list[int]], pad: int, vocab_size: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Hints as one [B, H] tensor (padded with `pad`, H >= 1) and their lengths [B]."""
    if any(not 0 <= t < vocab_size for row in hints for t in row):
        raise ValueError(f"hint tokens must be token ids below the vocabulary's {vocab_size}")
    width = max(1, max(map(len, hints)))
    padded = torch.full((len(hints), width), pad, dtype=torch.long, device=device)
    for b, row in enumerate(hints):
        padded[b, : len(row)] = torch.tensor(row, dtype=torch.long)
    return padded, torch.tensor([len(row) for row in hints], device=device)


HINT_REALIGN = 3  # a row's last kept tokens that, found in its hint, resume the hint there


def _follow_hint(
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


def _rejection_sample(
    logits: Tensor, draft_probs: Tensor | None, proposals: Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """Accepts proposal j with probability min(1, p_j / q_j); at the first rejection draws
    from normalise(max(p - q, 0)), and after k acceptances from p_k. Returns the accepted
    count [B] and the chosen token at every position [B, k+1] (only index `accepted` of
    which is used)."""
    live, width, _ = logits.shape
    k = width - 1
    target_probs = torch.softmax(logits.float() / temperature, -1)
    if k == 0:
        accepted = torch.zeros(live, dtype=torch.long, device=logits.device)
        return accepted, torch.multinomial(target_probs[:, 0], 1, generator=generator)
    index = proposals[:, :, None]
    p = target_probs[:, :k].gather(2, index)[:, :, 0]
    q = draft_probs.gather(2, index)[:, :, 0]
    u = torch.rand(live, k, generator=generator, device=logits.device)
    accepted = (u * q < p).long().cumprod(1).sum(1)
    residual = target_probs.clone()
    residual[:, :k] = (target_probs[:, :k] - draft_probs).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    # p == q exactly leaves no residual mass; then the target's own distribution is exact.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), target_probs)
    chosen = torch.multinomial(residual.view(live * width, -1), 1, generator=generator).view(live, width)
    return accepted, chosen
