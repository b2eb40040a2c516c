"""The speculative decoding engine, one loop for CPU and GPU: the draft proposes k tokens,
the target verifies k+1 positions in one pass, and each row keeps its longest agreeing
prefix plus one target token. Rejected positions are rolled back by moving a row's
length, never by copying. With k = 0 a round is plain target-only decoding.

A Batch holds rows (windows) in slots of a static KV cache; a row that finishes frees its
slot, and the caller refills it at once (Batch.add). Each round is two steps over the
whole batch, the draft's proposals and the target's verification, which read nothing
back to the host; the host reads one small summary per round. On CUDA (fixed_shapes) the
steps keep fixed shapes (every position of the cache attended under a mask, finished
rows frozen in place, batches padded to a power of two) and run as CUDA graphs
(asr/cudagraphs.py). On a CPU the same steps run eagerly in shapes fitted to the data:
attention over the longest row, finished rows dropped, drafting stopped once every row
has proposed end-of-text.

Greedy output equals the target's alone; at temperature > 0, rejection sampling keeps
the target's distribution (asr/sampling.py); hints (asr/hints.py) are proposed in place
of the draft's tokens where a row follows them."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from asr import hints, sampling
from asr.cudagraphs import StepGraphs
from asr.decoder import DecoderRunner, KVCache
from asr.draft_length import DraftLength
from asr.rules import DecodingRules

IDLE_STATES = 8  # batch states (with their graphs) kept for reuse on a GPU


@dataclass
class DecodeStats:
    draft_proposed: int = 0
    draft_accepted: int = 0
    target_passes: int = 0
    draft_passes: int = 0
    tokens: int = 0  # tokens kept (end-of-text included)
    hint_proposed: int = 0  # tokens proposed from a hint, not counted as draft tokens
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
    seconds: float = 0.0  # the row's share of the time of the steps it took part in

    @property
    def avg_logprob(self) -> float:
        return self.sum_logprob / (len(self.tokens) + 1)


@dataclass
class Window:
    """One window to decode: a row of a Batch."""

    encoded: Tensor  # [frames, width]: the target encoder's output
    prompt: list[int]  # [<|startofprev|> previous text] <|startoftranscript|> <|lang|> <|task|> ...
    sot_index: int = 0  # where <|startoftranscript|> is in the prompt: the no-speech probability is read there
    max_new_tokens: int = 224
    temperature: float = 0.0
    hint: list[int] = field(default_factory=list)  # tokens the row is expected to generate (asr/hints.py)
    draft_encoded: Tensor | None = None  # a draft with its own encoder: its output
    # The target's cross-attention K/V of `encoded` per layer ([heads, frames, head width]),
    # where already computed (language detection): taken over instead of computed again.
    cross: tuple[list[Tensor], list[Tensor]] | None = None


@dataclass
class _State:
    """A batch's tensors for `rows` rows of `frames` encoder frames. On a GPU they are kept
    and reused, since captured graphs point at them."""

    key: tuple  # (rows, frames, draft frames)
    tokens: Tensor  # [R, C] prompt, kept tokens, then proposals
    length: Tensor  # [R] tokens kept, prompt included
    sample_begin: Tensor  # [R] where generated tokens start
    limit: Tensor  # [R] the length at which a row stops
    draft_cached: Tensor  # [R] leading positions the draft has cached
    live: Tensor  # [R] bool: a row being decoded
    eot: Tensor  # [R] bool: ended on end-of-text
    temperature: Tensor  # [R] float32
    sum_logprob: Tensor  # [R] float64
    no_speech: Tensor  # [R] float32
    sot: Tensor  # [R] index of <|startoftranscript|>
    hint: Tensor  # [R, C], padded with end-of-text
    hint_length: Tensor  # [R]
    hint_shift: Tensor  # [R] (asr/hints.py)
    hint_on: Tensor  # [R] bool
    prefill_row: Tensor  # [1] the row a captured prefill reads
    step: Tensor  # [1] the draft step under way: a captured draft step reads (and advances) it
    k: Tensor  # [1] the proposals a captured verification checks
    noise: Tensor  # [R, 3 * max_draft + 1] uniforms in (0, 1] for sampling
    out: Tensor  # [5, R] a round's summary: kept, accepted, finished, draft's gap, ended on end-of-text
    target: KVCache
    draft: KVCache | None
    draft_probs: Tensor | None = None  # [R, max_draft, V] the draft's distributions, when sampling
    graphs: dict = field(default_factory=dict)

    # The per-row tensors a row's move carries over.
    PER_ROW = ("tokens", "length", "sample_begin", "limit", "draft_cached", "live", "eot", "temperature", "sum_logprob",
               "no_speech", "sot", "hint", "hint_length", "hint_shift", "hint_on")

    def changed(self) -> list[Tensor]:
        """What a step may change besides the caches: put back after a capture's warm-up."""
        return [getattr(self, name) for name in self.PER_ROW] + [self.step, self.out]


@dataclass
class _Row:
    """The host's view of a live row."""

    tag: int
    length: int
    limit: int
    sample_begin: int
    temperature: float
    hinted: bool
    gap: int = 1  # kept tokens the draft has not cached yet
    stats: DecodeStats = field(default_factory=DecodeStats)
    seconds: float = 0.0


class SpeculativeDecoder:
    """The engine for one target (and optionally one draft); keeps the states of its batches
    (and their CUDA graphs) for reuse. fixed_shapes: decode in fixed shapes (default: on
    CUDA); cuda_graphs: run those as CUDA graphs on CUDA."""

    def __init__(self, target: DecoderRunner, draft: DecoderRunner | None = None, *, max_draft_tokens: int = 8,
                 fixed_shapes: bool | None = None, cuda_graphs: bool = True):
        if draft is not None and draft.vocab_size != target.vocab_size:
            raise ValueError(f"the draft's vocabulary ({draft.vocab_size}) differs from the target's ({target.vocab_size})")
        self.target = target
        self.draft = draft
        # Layers whose cross-attention K/V the draft can take from the target's cache.
        self.shared_cross = draft.cross_layers_shared_with(target) if draft is not None else None
        self.max_draft_tokens = max_draft_tokens
        weight = target.decoder.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.fixed_shapes = self.device.type == "cuda" if fixed_shapes is None else fixed_shapes
        self.graphs = StepGraphs(cuda_graphs and self.fixed_shapes and self.device.type == "cuda")
        self.max_positions = min(r.max_positions for r in (target, draft) if r is not None)
        # Past the decoder's last position, room for proposals beyond a row's limit (never
        # kept); a multiple of 16, which attention kernels need of a mask's last dimension.
        self.capacity = -(-(self.max_positions + max_draft_tokens + 1) // 16) * 16
        # In fixed shapes every verification computes max_draft_tokens + 1 positions, whatever
        # k is: one graph serves every k, and a position's logits never depend on how many
        # the pass computes (so on a GPU, too, speculative output is the target-only output).
        self.verify_width = max_draft_tokens + 1 if self.fixed_shapes else None
        self._idle: OrderedDict[tuple, _State] = OrderedDict()

    def batch(self, rules: DecodingRules, *, rows: int = 1, no_speech_token: int | None = None,
              draft_length: DraftLength | None = None, generator: torch.Generator | None = None) -> "Batch":
        """An empty batch sized for `rows` rows (it grows if given more)."""
        return Batch(self, rules, rows, no_speech_token, draft_length or DraftLength(maximum=self.max_draft_tokens), generator)

    @torch.inference_mode()
    def decode(self, target_encoder_output: Tensor, prompts: list[list[int]], rules: DecodingRules, *,
               sot_index: list[int] | None = None, no_speech_token: int | None = None,
               draft_encoder_output: Tensor | None = None, max_new_tokens: int = 224, temperature: float = 0.0,
               draft_length: DraftLength | None = None, generator: torch.Generator | None = None,
               hints: list[list[int]] | None = None) -> list[Sequence]:
        """Decodes these rows together until all have finished (Batch for the details):
        target_encoder_output [B, frames, width], prompts[b] and sot_index[b] as Window's."""
        batch = self.batch(rules, rows=len(prompts), no_speech_token=no_speech_token, draft_length=draft_length,
                           generator=generator)
        windows = [Window(target_encoder_output[b], prompt, (sot_index or [0] * len(prompts))[b], max_new_tokens,
                          temperature, (hints or [[]] * len(prompts))[b],
                          None if draft_encoder_output is None else draft_encoder_output[b])
                   for b, prompt in enumerate(prompts)]
        order = {tag: i for i, tag in enumerate(batch.add(windows))}
        results: list[Sequence | None] = [None] * len(prompts)
        while batch.live:
            for tag, sequence in batch.step():
                results[order[tag]] = sequence
        batch.close()
        return results  # type: ignore[return-value]

    def rows_for(self, rows: int) -> int:
        """The rows of the state a batch of `rows` rows gets: a power of two in fixed shapes."""
        return 1 << (rows - 1).bit_length() if self.fixed_shapes else rows

    def _state(self, rows: int, frames: int, draft_frames: int | None) -> _State:
        key = (rows, frames, draft_frames)
        if key in self._idle:
            return self._idle.pop(key)
        device, C, R = self.device, self.capacity, rows

        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        target = self.target.empty_cache(R, frames, C, self.dtype, device)
        draft = None
        if self.draft is not None:
            shared = self.shared_cross if draft_frames is None else None
            draft = self.draft.empty_cache(R, draft_frames or frames, C, self.dtype, device,
                                           cross_from=target if shared else None, cross_layers=shared)
        # An empty slot is a row of one token: its (unused) steps then index nothing out of range.
        return _State(key, tokens=zeros(R, C), length=zeros(R) + 1, sample_begin=zeros(R), limit=zeros(R),
                      draft_cached=zeros(R), live=zeros(R, dtype=torch.bool), eot=zeros(R, dtype=torch.bool),
                      temperature=zeros(R, dtype=torch.float32), sum_logprob=zeros(R, dtype=torch.float64),
                      no_speech=zeros(R, dtype=torch.float32), sot=zeros(R), hint=zeros(R, C), hint_length=zeros(R),
                      hint_shift=zeros(R), hint_on=zeros(R, dtype=torch.bool), prefill_row=zeros(1), step=zeros(1), k=zeros(1),
                      noise=zeros(R, 3 * self.max_draft_tokens + 1, dtype=torch.float32), out=zeros(5, R),
                      target=target, draft=draft)

    def _release(self, state: _State) -> None:
        if self.fixed_shapes:
            self._idle[state.key] = state
            while len(self._idle) > IDLE_STATES:
                self._idle.popitem(last=False)


class Batch:
    """Rows decoding together. add() puts windows in free slots; each step() runs one round
    for every live row and returns the rows that finished, freeing their slots."""

    def __init__(self, engine: SpeculativeDecoder, rules: DecodingRules, rows: int, no_speech_token: int | None,
                 draft_length: DraftLength, generator: torch.Generator | None):
        self.engine = engine
        self.rules = rules
        self.rows_wanted = rows
        self.no_speech_token = no_speech_token
        self.draft_length = draft_length
        self.generator = generator
        self.use_draft = engine.draft is not None and draft_length.maximum > 0
        if self.use_draft and draft_length.maximum > engine.max_draft_tokens:
            raise ValueError(f"this engine proposes at most {engine.max_draft_tokens} tokens a round, not {draft_length.maximum}")
        self.state: _State | None = None
        self.slots: list[_Row | None] = []
        self._tags = 0

    @property
    def live(self) -> int:
        return sum(row is not None for row in self.slots)

    def close(self) -> None:
        if self.state is not None:
            self.engine._release(self.state)
            self.state = None

    @torch.inference_mode()
    def add(self, windows: list[Window]) -> list[int]:
        """Starts decoding these windows; returns a tag for each (step() names rows by it)."""
        if not windows:
            return []
        e = self.engine
        frames = {w.encoded.shape[0] for w in windows}
        draft_frames = {None if w.draft_encoded is None else w.draft_encoded.shape[0] for w in windows}
        if len(frames) != 1 or len(draft_frames) != 1:
            raise ValueError("a batch's windows must have the same number of encoder frames")
        key = (frames.pop(), draft_frames.pop())
        for w in windows:
            if len(w.prompt) + w.max_new_tokens > e.max_positions - 1:
                raise ValueError(f"prompt plus {w.max_new_tokens} new tokens exceeds the decoder's {e.max_positions} positions")
            if any(not 0 <= t < e.target.vocab_size for t in w.hint):
                raise ValueError(f"hint tokens must be token ids below the vocabulary's {e.target.vocab_size}")
        if self.state is not None and self.state.key[1:] != key and not self.live:
            self.close()
        if self.state is None:
            self.state = e._state(e.rows_for(max(self.rows_wanted, len(windows))), *key)
            self.slots = [None] * self.state.key[0]
        elif self.state.key[1:] != key:
            raise ValueError(f"windows of {key[0]} frames cannot join a batch of windows of {self.state.key[1]}")
        free = [i for i, row in enumerate(self.slots) if row is None]
        if len(free) < len(windows):
            # Room for the rows wanted at once, so the next windows fill slots without copying the batch.
            self._resize(e.rows_for(max(self.rows_wanted, self.live + len(windows))))
            free = [i for i, row in enumerate(self.slots) if row is None]
        slots = free[: len(windows)]
        started = time.perf_counter()
        self._write_rows(slots, windows)
        tags = []
        for slot, w in zip(slots, windows):
            length = len(w.prompt)
            self.slots[slot] = _Row(self._tags, length, length + w.max_new_tokens, length, w.temperature, bool(w.hint))
            tags.append(self._tags)
            self._tags += 1
        seconds = (time.perf_counter() - started) / len(windows)
        for slot in slots:
            self.slots[slot].seconds += seconds
        return tags

    def _write_rows(self, slots: list[int], windows: list[Window]) -> None:
        """Writes the rows' prompts and settings, fills their cross-attention K/V and caches
        their prompts."""
        e, s, device = self.engine, self.state, self.engine.device
        n, C = len(windows), e.capacity
        tokens = torch.zeros(n, C, dtype=torch.long)
        hint = torch.full((n, C), self.rules.eot, dtype=torch.long)
        for i, w in enumerate(windows):
            tokens[i, : len(w.prompt)] = torch.tensor(w.prompt, dtype=torch.long)
            hint[i, : len(w.hint)] = torch.tensor(w.hint[:C], dtype=torch.long)
        lengths = torch.tensor([len(w.prompt) for w in windows])
        values = {
            "tokens": tokens, "length": lengths, "sample_begin": lengths, "draft_cached": lengths - 1,
            "limit": lengths + torch.tensor([w.max_new_tokens for w in windows]), "live": torch.ones(n, dtype=torch.bool),
            "eot": torch.zeros(n, dtype=torch.bool), "temperature": torch.tensor([w.temperature for w in windows]),
            "sum_logprob": torch.zeros(n, dtype=torch.float64), "sot": torch.tensor([w.sot_index for w in windows]),
            "hint": hint, "hint_length": torch.tensor([min(len(w.hint), C) for w in windows]),
            "hint_shift": torch.zeros(n, dtype=torch.long), "hint_on": torch.tensor([bool(w.hint) for w in windows]),
        }
        index = torch.tensor(slots, device=device)
        for name, value in values.items():
            getattr(s, name).index_copy_(0, index, value.to(device, getattr(s, name).dtype))
        encoded = torch.stack([w.encoded for w in windows]).to(e.dtype)
        # One row at a time in fixed shapes: a row's K/V then never depend on the rows beside it.
        groups = [[i] for i in range(n)] if e.fixed_shapes else [list(range(n))]
        for group in groups:
            rows = index[group]
            known = [i for i in group if windows[i].cross is not None]
            fresh = [i for i in group if windows[i].cross is None]
            if known:
                e.target.copy_cross(s.target, index[known], [windows[i].cross for i in known])
            if fresh:
                e.target.fill_cross(s.target, index[fresh], encoded[fresh])
            if s.draft is not None and s.draft.cross_from is None:
                own = encoded if windows[0].draft_encoded is None else torch.stack([w.draft_encoded for w in windows])
                e.draft.fill_cross(s.draft, rows, own[group].to(e.dtype))
        width = max(len(w.prompt) for w in windows)
        if not e.fixed_shapes:
            self._prefill(None if slots == list(range(s.key[0])) else index, width)
            return
        for slot, w in zip(slots, windows):
            width = min(max(8, 1 << (len(w.prompt) - 1).bit_length()), C)
            s.prefill_row.fill_(slot)
            e.graphs.run(s.graphs, ("prefill", width), lambda: self._prefill(s.prefill_row, width), s.changed())

    def _prefill(self, rows: Tensor | None, width: int) -> None:
        """Caches the first `width` tokens of these rows (all if None): the target's prompt
        and the no-speech probability at <|startoftranscript|>, the draft's too. Tokens past
        a row's prompt are cached too, harmlessly: each position is rewritten before it is read."""
        e, s = self.engine, self.state
        pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
        tokens = pick(s.tokens)[:, :width]
        start = torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)
        at = pick(s.sot).clamp(max=width - 1)[:, None]
        logits = e.target.forward(tokens, start, s.target, logits_at=at, window=width, rows=rows)
        if self.no_speech_token is None:
            probs = torch.full_like(start, float("nan"), dtype=torch.float32)
        else:
            probs = logits[:, 0].float().softmax(-1).select(-1, self.no_speech_token)
        if rows is None:
            s.no_speech.copy_(probs)
        else:
            s.no_speech.index_copy_(0, rows, probs)
        if s.draft is not None:
            e.draft.forward(tokens, start, s.draft, logits_at=start[:, None], window=width, rows=rows)

    def _resize(self, rows: int) -> None:
        """Moves the live rows into the first slots of a state of `rows` rows."""
        e, old = self.engine, self.state
        keep = [i for i, row in enumerate(self.slots) if row is not None]
        index = torch.tensor(keep, dtype=torch.long, device=e.device)
        if rows == len(keep) and not e.fixed_shapes:  # finished rows dropped: a copy of the rest, once
            target = old.target.select(index)
            draft = None if old.draft is None else old.draft.select(index, cross_from=target)
            picked = {name: getattr(old, name).index_select(0, index) for name in _State.PER_ROW}
            new = replace(old, key=(rows, *old.key[1:]), target=target, draft=draft, noise=old.noise[:rows],
                          out=old.out[:, :rows], draft_probs=None, graphs={}, **picked)
        else:
            new = e._state(rows, *old.key[1:])
            for name in _State.PER_ROW:
                getattr(new, name)[: len(keep)].copy_(getattr(old, name).index_select(0, index))
            new.live[len(keep):] = False
            new.target.copy_rows(old.target, index, len(keep))
            if new.draft is not None:
                new.draft.copy_rows(old.draft, index, len(keep))
            e._release(old)
        self.slots = [self.slots[i] for i in keep] + [None] * (rows - len(keep))
        self.state = new

    @torch.inference_mode()
    def step(self) -> list[tuple[int, Sequence]]:
        """One round for every live row; returns (tag, result) for each row that finished."""
        e = self.engine
        if not e.fixed_shapes and 2 * self.live <= len(self.slots) and self.live < len(self.slots):
            # On a CPU, finished rows stop costing work once they are half the batch: dropping
            # them copies every live row's caches (tens of MB each), which a refill would undo.
            self._resize(self.live)
        s, rows = self.state, [row for row in self.slots if row is not None]
        if not rows:
            return []
        sample = any(row.temperature > 0 for row in rows)
        if sample:
            s.noise.uniform_(generator=self.generator).neg_().add_(1)  # (0, 1]
            if s.draft_probs is None:
                s.draft_probs = torch.zeros(len(self.slots), e.max_draft_tokens, e.target.vocab_size, device=e.device)
        started = time.perf_counter()
        hinted, k, draft_probs, noise = self._hint_round(rows, sample) if any(r.hinted for r in rows) else (None, 0, None, None)
        representative = hinted is None
        if hinted is None:
            k = self.draft_length.next_round(len(self.slots)) if self.use_draft else 0
            if k > 0:
                k, representative = self._propose(k, max(row.gap for row in rows), sample, rows)
            if sample:
                draft_probs, noise = s.draft_probs, s.noise[:, e.max_draft_tokens:]
        width = e.verify_width if hinted is None and e.verify_width else k + 1
        if width > k + 1:
            s.k.fill_(k)
        key = ("verify", width, sample, self.rules)
        verify = lambda: self._verify(width, draft_probs, noise, rows)  # noqa: E731
        representative &= e.graphs.run(s.graphs, key, verify, s.changed(), capture=hinted is None)
        kept, accepted, finished, gap, ended = s.out.tolist()  # the round's one read on the host
        seconds = time.perf_counter() - started
        if self.use_draft and hinted is None and representative:
            live = [i for i, row in enumerate(self.slots) if row is not None]
            self.draft_length.update(k, sum(accepted[i] for i in live), sum(accepted[i] < k for i in live), seconds,
                                     len(self.slots))
        share = seconds / len(rows)
        done = []
        for i, row in enumerate(self.slots):
            if row is None:
                continue
            stats = row.stats
            if hinted is not None:
                stats.hint_proposed += hinted[i]
                stats.hint_accepted += min(accepted[i], hinted[i])
            else:
                stats.draft_proposed += k
                stats.draft_accepted += accepted[i]
                stats.draft_passes += k
            stats.target_passes += 1
            stats.tokens += kept[i]
            stats.tokens_per_pass.append(kept[i])
            row.length += kept[i]
            row.gap = gap[i]
            row.seconds += share
            if finished[i]:
                done.append(i)
        return self._finish(done, ended) if done else []

    def _finish(self, slots: list[int], ended: list[int]) -> list[tuple[int, Sequence]]:
        s = self.state
        index = torch.tensor(slots, device=self.engine.device)
        scores = torch.stack([s.sum_logprob.index_select(0, index), s.no_speech.index_select(0, index).double()]).tolist()
        results = []
        for j, slot in enumerate(slots):
            row = self.slots[slot]
            end = row.length - (1 if ended[slot] else 0)
            tokens = s.tokens[slot, row.sample_begin : end].tolist()
            results.append((row.tag, Sequence(tokens, scores[0][j], scores[1][j], row.stats, row.seconds)))
            self.slots[slot] = None
        return results

    def _window(self, rows: list[_Row], extra: int) -> int | None:
        """What a step attends to: in fitted shapes the longest row's positions plus `extra`."""
        return None if self.engine.fixed_shapes else max(row.length for row in rows) + extra

    def _hint_round(self, rows: list[_Row], sample: bool) -> tuple[list[int] | None, int, Tensor | None, Tensor | None]:
        """Rows following their hints propose the rest of them (eagerly: hints vary in
        length). Returns, where any row follows its hint, the tokens each row proposed, k,
        and for sampling the proposals' distributions (all mass on each) and uniforms."""
        s, e = self.state, self.engine
        on, shift = hints.follow(s.hint, s.hint_length, s.hint_shift, s.hint_on, s.tokens, s.length, s.sample_begin)
        s.hint_on.copy_(on & s.live)
        s.hint_shift.copy_(shift)
        offset = s.length - s.sample_begin + s.hint_shift  # index in the hint of the first proposal
        left = torch.where(s.hint_on, s.hint_length - offset, 0)
        left_list = left.tolist()
        if not any(left_list[i] > 0 for i, row in enumerate(self.slots) if row is not None):
            return None, 0, None, None
        remaining = min(row.limit - row.length for row in rows)
        k = max(min(max(left_list), remaining - 1), 0)
        proposed = left.clamp(max=k).tolist()
        if k == 0:
            return proposed, 0, None, None
        steps = torch.arange(k, device=e.device)
        s.tokens.scatter_(1, s.length[:, None] + steps, s.hint.gather(1, (offset[:, None] + steps).clamp(max=e.capacity - 1)))
        if not sample:
            return proposed, k, None, None
        # A fixed proposal is a draft distribution with all its mass on it.
        proposals = s.tokens.gather(1, s.length[:, None] + steps)
        probs = torch.zeros(len(self.slots), k, e.target.vocab_size, device=e.device).scatter_(2, proposals[:, :, None], 1.0)
        noise = torch.rand(len(self.slots), 2 * k + 1, device=e.device, generator=self.generator).neg_().add_(1)
        return proposed, k, probs, noise

    def _propose(self, k: int, width: int, sample: bool, rows: list[_Row]) -> tuple[int, bool]:
        """The draft's k proposals, written to tokens[length : length + k], one draft step
        each: in fixed shapes one graph serves every step (and so every k), reading the step
        from the state, and the first step's catch-up width is rounded up to a power of two,
        so that catching up after rounds without drafting is one of a few graphs too. In
        fitted shapes drafting stops once every row has proposed end-of-text. Returns how
        many it proposed, and whether the steps' time is representative (asr/cudagraphs.py)."""
        e, s = self.engine, self.state
        s.step.zero_()
        ended = torch.zeros_like(s.live)
        representative = True
        if e.fixed_shapes:
            width = min(1 << (width - 1).bit_length(), e.capacity)
        for i in range(k):
            feed = width if i == 0 else 1
            if e.fixed_shapes:
                step = lambda: self._draft_step(feed, sample, rows, i)  # noqa: E731
                representative &= e.graphs.run(s.graphs, ("draft", feed, sample, self.rules), step, s.changed())
                continue
            ended |= self._draft_step(feed, sample, rows, i) == self.rules.eot
            if bool(ended.all()):
                return i + 1, representative
        return k, representative

    def _draft_step(self, width: int, sample: bool, rows: list[_Row], i: int) -> Tensor:
        """One draft step: predicts index length + step of each row and advances the step.
        It feeds the `width` tokens before that index: the last proposal, or at the first
        step the kept tokens the draft has not cached, ending at the pending one. A row with
        fewer re-feeds cached ones, which rewrites their keys and values; one with fewer
        tokens than `width` also feeds tokens past the index, whose entries are rewritten
        before anything attends to them. i: the step (for the window attended in fitted
        shapes). Returns the proposals [R]."""
        e, s = self.engine, self.state
        position = s.length + s.step  # [R] the index predicted
        start = (position - width).clamp(min=0)
        feed = s.tokens.gather(1, start[:, None] + torch.arange(width, device=e.device))
        logits = e.draft.forward(feed, start, s.draft, logits_at=(position - 1 - start)[:, None],
                                 window=self._window(rows, i))[:, 0]
        self.rules.apply(logits, self.rules.prefix(s.tokens, s.sample_begin, position[:, None]))
        if sample:
            u = s.noise.gather(1, s.step.expand(len(position))[:, None])[:, 0]
            proposal, probs = sampling.choose(logits, s.temperature, u)
            s.draft_probs.index_copy_(1, s.step, probs[:, None])
        else:
            proposal = logits.argmax(-1)
        s.tokens.scatter_(1, position[:, None], proposal[:, None])
        s.step.add_(1)
        s.draft_cached.copy_(s.length + s.step - 1)
        return proposal

    def _verify(self, width: int, draft_probs: Tensor | None, noise: Tensor | None, rows: list[_Row]) -> None:
        """The target's pass over `width` positions, the pending token and the proposals
        after it (k = width - 1, or in fixed shapes the state's k, the rest of the width being
        stale tokens whose results go unused): each live row keeps its longest agreeing
        prefix plus the target's own next token, cut at end-of-text and at its limit."""
        e, s, rules = self.engine, self.state, self.rules
        k = width - 1
        steps = torch.arange(width, device=e.device)
        positions = s.length[:, None] + steps  # predicted indices
        logits = e.target.forward(s.tokens.gather(1, positions - 1), s.length - 1, s.target, window=self._window(rows, k))
        n, _, vocab = logits.shape
        rules.apply(logits.view(n * width, vocab), rules.prefix(s.tokens, s.sample_begin, positions))
        proposals = s.tokens.gather(1, positions[:, :k])
        proposed = (steps[:k] < s.k)[None] if width > 1 and e.verify_width == width else None
        if noise is not None:
            if draft_probs is None:  # no proposals: k = 0
                draft_probs = logits.new_zeros(n, 0, vocab, dtype=torch.float32)
            accepted, chosen = sampling.verify(logits, proposals, s.temperature, draft_probs[:, :k], noise[:, : 2 * k + 1],
                                               proposed)
        else:
            chosen = logits.argmax(-1)
            right = proposals == chosen[:, :k]
            accepted = (right if proposed is None else right & proposed).long().cumprod(1).sum(1)
        s.tokens.scatter_(1, (s.length + accepted)[:, None], chosen.gather(1, accepted[:, None]))

        # Keep accepted + 1 tokens, cut at end-of-text and at the length limit.
        window = s.tokens.gather(1, positions)
        is_eot = (window == rules.eot) & (steps < (accepted + 1)[:, None])
        ends_with_eot = is_eot.any(1)
        new = torch.where(ends_with_eot, is_eot.long().argmax(1) + 1, accepted + 1)
        new = torch.minimum(new, s.limit - s.length) * s.live
        kept = steps < new[:, None]
        scores = logits.float()
        logprobs = scores.gather(2, window[:, :, None])[:, :, 0] - scores.logsumexp(-1)
        s.sum_logprob.add_(torch.where(kept, logprobs, 0.0).sum(1).double())  # -inf * 0 would be NaN
        eot_kept = ends_with_eot & (is_eot & kept).any(1)
        s.length.add_(new)
        s.draft_cached.copy_(torch.minimum(s.draft_cached, s.length - 1))
        finished = s.live & (eot_kept | (s.length >= s.limit))
        s.eot.logical_or_(eot_kept)
        s.live.logical_and_(~finished)
        s.out.copy_(torch.stack([new, accepted, finished.long(), s.length - s.draft_cached, eot_kept.long()]))

