"""A batch's rows in the slots of a static KV cache, for the speculative loop
(asr/speculative.py): the window a caller adds and the sequence it gets back, the tensors
a round's steps read and write (State), and what happens between rounds: windows put in
free slots with their prompts cached, finished rows read out and their slots freed, and
in fitted shapes (a CPU's) the finished rows dropped once they are half the batch.

On a GPU a batch's state is kept for reuse when the batch closes (States), since captured
graphs point at its tensors."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from asr import hints, sampling
from asr.cudagraphs import device_clock
from asr.decoder import KVCache, attention_without_cudnn
from asr.rules import DecodingRules

if TYPE_CHECKING:
    from asr.speculative import SpeculativeDecoder

IDLE_STATES = 8  # batch states (with their graphs) kept for reuse on a GPU
# A window that stops at a loop (Window.stop_loops) does so once its last LOOP_TOKENS tokens
# are a run of at most LOOP_PERIOD repeated: a clipped word at a stream buffer's end looped as
# "fa-----..." to the token limit, a target pass a token.
LOOP_TOKENS, LOOP_PERIOD = 48, 8


def prefill_width(length: int, capacity: int) -> int:
    """In fixed shapes, the width a prompt of `length` tokens is cached in: one of a few."""
    return min(max(8, 1 << (length - 1).bit_length()), capacity)


@dataclass
class DecodeStats:
    draft_proposed: int = 0
    # The target's agreement with the draft, to measure it. A row's proposals count up to its
    # draft's first end-of-text and its limit (a batch drafts on for its other rows); an
    # end-of-text accepted is also the token its pass keeps (so accepted + passes can exceed tokens).
    draft_accepted: int = 0
    target_passes: int = 0
    tokens: int = 0  # tokens kept (end-of-text included)
    hint_proposed: int = 0  # tokens proposed from a hint, not counted as draft tokens
    hint_accepted: int = 0
    tokens_per_pass: list[int] = field(default_factory=list)  # kept by each target pass: accepted proposals + 1
    accepted_per_pass: list[int] = field(default_factory=list)  # draft tokens accepted by each pass that verified some

    # None, not 0, where nothing was proposed (or decoded): "every proposal rejected" is another thing.
    @property
    def acceptance_rate(self) -> float | None:
        return self.draft_accepted / self.draft_proposed if self.draft_proposed else None

    @property
    def tokens_per_target_pass(self) -> float | None:
        return self.tokens / self.target_passes if self.target_passes else None

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
    looped: bool = False  # stopped at a loop (Window.stop_loops), short of its end

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
    # The draft's acceptance is kept per language (asr/draft_length.py): its code, or another
    # key for another task on it ("de>translate")
    language: str | None = None
    seed: int = 0  # at temperature > 0, what the row's draws follow (asr/sampling.py)
    # Stop at a loop (LOOP_TOKENS), the sequence marked looped: for a caller to whom a loop is
    # a failed decode whatever its length (Whisper's compression-ratio test needs it long).
    stop_loops: bool = False
    # The prompt's last tokens that are the sequence's first (a prefix the caller forces): the
    # rules take them as decoded, and the sequence returned starts with them.
    forced: int = 0


@dataclass
class State:
    """A batch's tensors for `rows` rows of `frames` encoder frames. On a GPU they are kept
    and reused, since captured graphs point at them."""

    key: tuple  # (rows, frames, draft frames)
    tokens: Tensor  # [R, C] prompt, kept tokens, then proposals
    length: Tensor  # [R] tokens kept, prompt included
    sample_begin: Tensor  # [R] where generated tokens start
    free_begin: Tensor  # [R] where those decoded freely start: past a forced prefix (Window.forced)
    limit: Tensor  # [R] the length at which a row stops
    draft_cached: Tensor  # [R] leading positions the draft has cached
    live: Tensor  # [R] bool: a row being decoded
    temperature: Tensor  # [R] float32
    seed: Tensor  # [R] each row's sampling seed, below 2**32
    logprob: Tensor  # [R, C] float32: each kept token's log-probability, at its position
    no_speech: Tensor  # [R] float32
    sot: Tensor  # [R] index of <|startoftranscript|>
    hint: Tensor  # [R, C], padded with end-of-text
    hint_length: Tensor  # [R]
    hint_shift: Tensor  # [R] (asr/hints.py)
    hint_on: Tensor  # [R] bool
    prefill_row: Tensor  # [1] the row a captured prefill reads
    step: Tensor  # [1] the draft step under way: a captured draft step reads (and advances) it
    k: Tensor  # [1] the proposals a captured verification checks
    out: Tensor  # [6, R] a round's summary, RoundSummary's fields in their order
    target: KVCache
    draft: KVCache | None
    graphs: dict = field(default_factory=dict)

    # The per-row tensors a row's move carries over.
    PER_ROW = ("tokens", "length", "sample_begin", "free_begin", "limit", "draft_cached", "live", "temperature", "seed",
               "logprob", "no_speech", "sot", "hint", "hint_length", "hint_shift", "hint_on")

    def changed(self) -> list[Tensor]:
        """What a step may change besides the caches: put back after a capture's warm-up."""
        return [getattr(self, name) for name in self.PER_ROW] + [self.step, self.out]


@dataclass(frozen=True)
class RoundSummary:
    """A round's State.out, read on the host: per slot of the batch."""

    kept: list[int]  # tokens kept
    accepted: list[int]  # proposals accepted
    finished: list[int]  # 1 where the row finished
    gap: list[int]  # kept tokens the draft has not cached yet
    ended: list[int]  # 1 where it ended on end-of-text
    # Proposals that count: up to the row's first end-of-text among them, and that its limit leaves room for.
    counted: list[int]

    @classmethod
    def of(cls, out: Tensor) -> "RoundSummary":
        return cls(*out.tolist())


@dataclass
class Row:
    """The host's view of a live row."""

    tag: int
    length: int
    limit: int
    sample_begin: int
    temperature: float
    hinted: bool
    language: str | None
    gap: int = 1  # kept tokens the draft has not cached yet
    stats: DecodeStats = field(default_factory=DecodeStats)
    seconds: float = 0.0
    stop_loops: bool = False  # Window.stop_loops


class States:
    """The engine's batch states by (rows, frames, draft frames); in fixed shapes a closed
    batch's state is kept (with its graphs) for the next batch of that key."""

    def __init__(self, engine: SpeculativeDecoder):
        self.engine = engine
        self.idle: OrderedDict[tuple, State] = OrderedDict()

    def get(self, rows: int, frames: int, draft_frames: int | None) -> State:
        key = (rows, frames, draft_frames)
        if key in self.idle:
            return self.idle.pop(key)
        e, C, R = self.engine, self.engine.capacity, rows

        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> Tensor:
            return torch.zeros(shape, dtype=dtype, device=e.device)

        target = e.target.empty_cache(R, frames, C, e.dtype, e.device)
        draft = None
        if e.draft is not None:
            shared = e.shared_cross if draft_frames is None else None
            draft = e.draft.empty_cache(R, draft_frames or frames, C, e.dtype, e.device,
                                        cross_from=target if shared else None, cross_layers=shared)
        # An empty slot is a row of one token: its (unused) steps then index nothing out of range.
        return State(key, tokens=zeros(R, C), length=zeros(R) + 1, sample_begin=zeros(R), free_begin=zeros(R), limit=zeros(R),
                     draft_cached=zeros(R), live=zeros(R, dtype=torch.bool),
                     temperature=zeros(R, dtype=torch.float32), seed=zeros(R), logprob=zeros(R, C, dtype=torch.float32),
                     no_speech=zeros(R, dtype=torch.float32), sot=zeros(R), hint=zeros(R, C), hint_length=zeros(R),
                     hint_shift=zeros(R), hint_on=zeros(R, dtype=torch.bool), prefill_row=zeros(1), step=zeros(1), k=zeros(1),
                     out=zeros(6, R),
                     target=target, draft=draft)

    def rows_for(self, rows: int) -> int:
        """The rows of the state a batch of `rows` rows gets: a power of two in fixed shapes."""
        return 1 << (rows - 1).bit_length() if self.engine.fixed_shapes else rows

    def release(self, state: State) -> None:
        """Keeps a state no batch uses any more (fixed shapes), its rows freed: a row left
        live (a batch that grew, or one closed mid-decode) would decode on in the next batch
        given this state, and a hint it followed could take that batch's round past the cache."""
        if self.engine.fixed_shapes:
            state.live.fill_(False)
            state.length.fill_(1)
            state.hint_on.fill_(False)
            self.idle[state.key] = state
            while len(self.idle) > IDLE_STATES:
                self.idle.popitem(last=False)


class Slots:
    """A batch's rows in slots: add() puts windows in free slots (a row's prompt cached);
    a round (asr/speculative.py's Batch.step) then reads out the rows that finished."""

    def __init__(self, engine: SpeculativeDecoder, rules: DecodingRules, rows: int, no_speech_token: int | None):
        self.engine = engine
        self.rules = rules
        self.rows_wanted = rows
        self.no_speech_token = no_speech_token
        self.state: State | None = None
        self.slots: list[Row | None] = []
        self._tags = 0

    @property
    def live(self) -> int:
        return sum(row is not None for row in self.slots)

    @torch.inference_mode()
    def close(self) -> None:
        if self.state is not None:
            self.engine.states.release(self.state)
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
            hints.check(w.hint, e.target.vocab_size)
        if self.state is not None and self.state.key[1:] != key and not self.live:
            self.close()
        if self.state is None:
            self.state = e.states.get(self._rows_for(len(windows)), *key)
            self.slots = [None] * self.state.key[0]
        elif self.state.key[1:] != key:
            raise ValueError(f"windows of {key[0]} frames cannot join a batch of windows of {self.state.key[1]}")
        free = [i for i, row in enumerate(self.slots) if row is None]
        if len(free) < len(windows):
            self._resize(self._rows_for(self.live + len(windows), growing=True))
            free = [i for i, row in enumerate(self.slots) if row is None]
        slots = free[: len(windows)]
        started = device_clock(e.device)
        self._write_rows(slots, windows)
        tags = []
        for slot, w in zip(slots, windows):
            length = len(w.prompt)
            self.slots[slot] = Row(self._tags, length, length + w.max_new_tokens, length - w.forced, w.temperature, bool(w.hint),
                                   w.language, stop_loops=w.stop_loops)
            tags.append(self._tags)
            self._tags += 1
        seconds = (device_clock(e.device) - started) / len(windows)
        for slot in slots:
            self.slots[slot].seconds += seconds
        return tags

    @torch.inference_mode()
    def drop(self, tags: set[int]) -> None:
        """Stops decoding the rows of these tags (their windows abandoned) and frees their
        slots, as a finished row's; the other rows decode on as before."""
        slots = [i for i, row in enumerate(self.slots) if row is not None and row.tag in tags]
        if slots:
            self._free(slots)

    def _free(self, slots: list[int]) -> None:
        s, index = self.state, torch.tensor(slots, device=self.engine.device)
        s.live.index_fill_(0, index, False)
        s.hint_on.index_fill_(0, index, False)
        # A free slot is a row of one token: a round's positions past a live row's (a long
        # hint's) then stay inside the cache for every slot.
        s.length.index_fill_(0, index, 1)
        for slot in slots:
            self.slots[slot] = None

    def _rows_for(self, live: int, growing: bool = False) -> int:
        """The rows of a state for `live` rows. In fixed shapes room for the rows wanted at
        once, so that the next windows fill slots (in graphs already captured) without
        copying the batch. In fitted shapes the rows at hand: each round computes every row
        of the state, and each row's caches (about 50 MB for whisper-base in float32) are
        allocated and zeroed: a batch of 8 given one window (one recording, or a language
        of its own in `asr evaluate`) paid for 8. Growing, the state at least doubles (up to
        the rows wanted), so that windows joining one at a time copy the batch a few times."""
        e = self.engine
        if e.fixed_shapes:
            return e.states.rows_for(max(self.rows_wanted, live))
        return max(live, min(self.rows_wanted, 2 * len(self.slots))) if growing else live

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
            "tokens": tokens, "length": lengths, "sample_begin": lengths - torch.tensor([w.forced for w in windows]),
            "free_begin": lengths, "draft_cached": lengths - 1,
            "logprob": torch.zeros(n, C),  # a forced token's counts as 0, as CTranslate2's
            "limit": lengths + torch.tensor([w.max_new_tokens for w in windows]), "live": torch.ones(n, dtype=torch.bool),
            "temperature": torch.tensor([w.temperature for w in windows]),
            "seed": torch.tensor([w.seed & sampling.MASK for w in windows]),
            "sot": torch.tensor([w.sot_index for w in windows]),
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
            self._run_prefill(slot, prefill_width(len(w.prompt), C))

    def _run_prefill(self, slot: int, width: int) -> None:
        """In fixed shapes, the prefill of one row (a step read from the state, as a graph). Never
        compiled (--compile): it runs once a window, where compiling its 7 widths would cost
        more than it saves."""
        e, s = self.engine, self.state
        s.prefill_row.fill_(slot)
        e.graphs.run(s.graphs, ("prefill", width, self.no_speech_token), lambda: self._prefill(s.prefill_row, width),
                     s.changed())

    def _prefill(self, rows: Tensor | None, width: int) -> None:
        """Caches the first `width` tokens of these rows (all if None): the target's prompt
        and the no-speech probability at <|startoftranscript|>, the draft's too. Tokens past
        a row's prompt are cached too, harmlessly: each position is rewritten before it is read."""
        e, s = self.engine, self.state
        pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
        tokens = pick(s.tokens)[:, :width]
        start = torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)
        at = pick(s.sot).clamp(max=width - 1)[:, None]
        with attention_without_cudnn(e.device):  # once a window, of up to 7 widths: cuDNN's plans would not pay
            logits = e.target.forward(tokens, start, s.target, logits_at=at, window=width, rows=rows, fused=e.fused_layers)
            if s.draft is not None:
                e.draft.forward(tokens, start, s.draft, logits_at=start[:, None], window=width, rows=rows,
                                fused=e.fused_layers)
        if self.no_speech_token is None:
            probs = torch.full_like(start, float("nan"), dtype=torch.float32)
        else:
            probs = logits[:, 0].float().softmax(-1).select(-1, self.no_speech_token)
        if rows is None:
            s.no_speech.copy_(probs)
        else:
            s.no_speech.index_copy_(0, rows, probs)

    def _resize(self, rows: int) -> None:
        """Moves the live rows into the first slots of a state of `rows` rows."""
        e, old = self.engine, self.state
        keep = [i for i, row in enumerate(self.slots) if row is not None]
        index = torch.tensor(keep, dtype=torch.long, device=e.device)
        if rows == len(keep) and not e.fixed_shapes:  # finished rows dropped: a copy of the rest, once
            target = old.target.select(index)
            draft = None if old.draft is None else old.draft.select(index, cross_from=target)
            picked = {name: getattr(old, name).index_select(0, index) for name in State.PER_ROW}
            new = replace(old, key=(rows, *old.key[1:]), target=target, draft=draft, out=old.out[:, :rows], graphs={},
                          **picked)
        else:
            new = e.states.get(rows, *old.key[1:])
            for name in State.PER_ROW:
                getattr(new, name)[: len(keep)].copy_(getattr(old, name).index_select(0, index))
            new.live[len(keep):] = False
            new.target.copy_rows(old.target, index, len(keep))
            if new.draft is not None:
                new.draft.copy_rows(old.draft, index, len(keep))
            e.states.release(old)
        self.slots = [self.slots[i] for i in keep] + [None] * (rows - len(keep))
        self.state = new

    def _drop_finished(self) -> None:
        """In fitted shapes, finished rows stop costing work once they are half the batch: dropping
        them copies every live row's caches (tens of MB each), which a refill would undo."""
        if not self.engine.fixed_shapes and 2 * self.live <= len(self.slots) and self.live < len(self.slots):
            self._resize(self.live)

    def _record(self, out: RoundSummary, drafted: list[int], hinted: list[int] | None, seconds: float) -> list[int]:
        """Books a round's summary on its rows: tokens kept, proposals accepted (per slot, those
        the draft proposed, or its hint), where the draft's cache ends, the round's time shared;
        returns the slots whose rows finished."""
        kept, accepted, finished, gap, counted = out.kept, out.accepted, out.finished, out.gap, out.counted
        share = seconds / self.live
        done = []
        for i, row in enumerate(self.slots):
            if row is None:
                continue
            stats = row.stats
            if hinted is not None and hinted[i]:
                stats.hint_proposed += hinted[i]
                stats.hint_accepted += min(accepted[i], hinted[i])
            elif proposed := min(drafted[i], counted[i]):  # a batch drafts on past a row's end: not its proposals
                stats.draft_proposed += proposed
                stats.draft_accepted += min(accepted[i], proposed)
                stats.accepted_per_pass.append(min(accepted[i], proposed))
            stats.target_passes += 1
            stats.tokens += kept[i]
            stats.tokens_per_pass.append(kept[i])
            row.length += kept[i]
            row.gap = gap[i]
            row.seconds += share
            if finished[i]:
                done.append(i)
        return done

    def _looping(self, done: list[int], kept: list[int]) -> dict[int, int]:
        """The rows that stop at a loop (Window.stop_loops), by slot, each with the length it
        stops at: the first of this round's lengths (kept: tokens each slot kept) whose last
        LOOP_TOKENS tokens are a run of at most LOOP_PERIOD repeated. Each length is tested, as
        decoding a token a round would (where a row had finished, its last is not), so a row
        stops where the target alone would, whatever the round kept."""
        slots = [i for i, row in enumerate(self.slots) if row is not None and row.stop_loops and kept[i]
                 and row.length - row.sample_begin >= LOOP_TOKENS]
        if not slots:
            return {}
        device = self.engine.device
        span = LOOP_TOKENS - 1 + max(kept[i] for i in slots)  # the tokens every tested length looks at
        ends = torch.tensor([self.slots[i].length for i in slots], device=device)[:, None]
        tails = self.state.tokens[torch.tensor(slots, device=device)[:, None],
                                  (ends - span + torch.arange(span, device=device)).clamp(min=0)].tolist()
        stops = {}
        for slot, tail in zip(slots, tails):
            row = self.slots[slot]
            first = max(row.length - kept[slot] + 1, row.sample_begin + LOOP_TOKENS)
            for length in range(first, row.length + (0 if slot in done else 1)):
                run = tail[length - row.length + span - LOOP_TOKENS : length - row.length + span]
                if any(run[period:] == run[:-period] for period in range(1, LOOP_PERIOD + 1)):
                    stops[slot] = length
                    break
        return stops

    def _finish(self, slots: list[int], ended: list[int], looped: dict[int, int]) -> list[tuple[int, Sequence]]:
        """Reads out these finished rows' results (ended: per slot, whether it ended on
        end-of-text, which the tokens leave out; looped: the slots stopped at a loop, each
        with the length it stops at) and frees their slots."""
        s, device = self.state, self.engine.device
        index = torch.tensor(slots, device=device)
        ends = [looped.get(slot, self.slots[slot].length) for slot in slots]  # end-of-text included
        # Summed from each token's, not per round: the sum is the same however many tokens a round kept.
        positions = torch.arange(s.tokens.shape[1], device=device)
        scored = ((positions >= s.sample_begin.index_select(0, index)[:, None])
                  & (positions < torch.tensor(ends, device=device)[:, None]))
        sums = torch.where(scored, s.logprob.index_select(0, index).double(), 0.0).sum(1)
        scores = torch.stack([sums, s.no_speech.index_select(0, index).double()]).tolist()
        results = []
        for j, (slot, end) in enumerate(zip(slots, ends)):
            row = self.slots[slot]
            if slot in looped:  # its round's tokens past the stop are not kept
                row.stats.tokens -= row.length - end
                row.stats.tokens_per_pass[-1] -= row.length - end
            tokens = s.tokens[slot, row.sample_begin : end - (1 if ended[slot] and slot not in looped else 0)].tolist()
            results.append((row.tag, Sequence(tokens, scores[0][j], scores[1][j], row.stats, row.seconds, slot in looped)))
        self._free(slots)
        return results
