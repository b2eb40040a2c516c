"""The speculative decoding engine, one loop for CPU and GPU: the draft proposes k tokens, the
target verifies k+1 positions in one pass, and each row keeps its longest agreeing prefix plus
one target token. Rejected positions are rolled back by moving a row's length, never by copying.
With k = 0 a round is plain target-only decoding.

A Batch holds rows (windows) in slots of a static KV cache (asr/slots.py); a row that finishes
frees its slot, and the caller refills it at once (Batch.add). Each round is two steps over the
whole batch, the draft's proposals and the target's verification, which read nothing back to the
host; the host reads one small summary per round (and, in rounds that need them, a hint's
proposals, the tokens of rows that may be looping, and in fitted shapes whether every row's draft
has ended). In fixed shapes (CUDA by default) the steps keep fixed
shapes (every position of the cache attended under a mask, finished rows frozen in place, batches
padded to a power of two) and run as CUDA graphs (asr/cudagraphs.py). In fitted shapes (a CPU's)
the same steps run eagerly in shapes fitted to the data: attention over the longest row, finished
rows dropped, drafting stopped once every row has proposed end-of-text.

Greedy output equals the target's alone; at temperature > 0 too, for the same row seeds: the
draft draws a position with the noise the target verifies it with (asr/sampling.py). Hints
(asr/hints.py) replace the draft's proposals."""

from __future__ import annotations

import time

import torch
from torch import Tensor

from asr import hints, sampling
from asr.cudagraphs import CompiledSteps, StepGraphs, compilations, device_clock
from asr.decoder import DecoderRunner, attention_without_cudnn, lengths_attention_unavailable, lengths_kernel
from asr.draft_length import DraftLength
from asr.rules import DecodingRules
from asr.slots import RoundSummary, Row, Sequence, Slots, States, Window, prefill_width


USUAL_GAP = 3  # kept tokens the draft has not cached at a round's start: 1 or 2, 3 after a plain round


def feed_width(gap: int, capacity: int) -> int:
    """In fixed shapes, the width of a first draft step catching up `gap` tokens: one of a few."""
    return min(1 << (gap - 1).bit_length(), capacity)


class SpeculativeDecoder:
    """The engine for one target (and optionally one draft); keeps the states of its batches
    (and their CUDA graphs) for reuse. fixed_shapes: decode in fixed shapes (default: on
    CUDA); cuda_graphs: run those as CUDA graphs on CUDA; compile: a torch.compile mode
    ("default", "max-autotune-no-cudagraphs", ...) in which each step is compiled whole;
    lengths_attention: the draft's steps and the verification attend by row lengths
    (asr/decoder.py's ByLengths, CUDA in float16 or bfloat16), and not by cuDNN's kernel:
    True or "flash" by flash-attention's kernel, "triton" by ours (asr/triton_ops.py);
    fused_layers: each linear map of the steps with the layer norm before it and the GELU or
    residual add after it in one kernel of ours (CUDA, asr/triton_ops.fused_linear)."""

    def __init__(self, target: DecoderRunner, draft: DecoderRunner | None = None, *, max_draft_tokens: int = 8,
                 fixed_shapes: bool | None = None, cuda_graphs: bool = True, compile: str | None = None,
                 lengths_attention: bool | str = False, fused_layers: bool = False):
        if draft is not None and draft.vocab_size != target.vocab_size:
            raise ValueError(f"the draft's vocabulary ({draft.vocab_size}) differs from the target's ({target.vocab_size})")
        kernel = lengths_kernel(lengths_attention)
        if kernel:
            for runner in filter(None, (target, draft)):
                weight = runner.decoder.embed_tokens.weight
                if reason := lengths_attention_unavailable(weight.device, weight.dtype, runner.head_dim, kernel):
                    raise ValueError(f"attention by row lengths cannot run here: {reason}")
        if fused_layers:
            for runner in filter(None, (target, draft)):
                if reason := runner.fused_unavailable():
                    raise ValueError(f"fused layers cannot run here: {reason}")
        self.lengths_attention = kernel  # None: masked
        self.fused_layers = bool(fused_layers)
        self.target, self.draft = target, draft
        # Layers whose cross-attention K/V the draft can take from the target's cache.
        self.shared_cross = draft.cross_layers_shared_with(target) if draft is not None else None
        self.max_draft_tokens = max_draft_tokens
        weight = target.decoder.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.fixed_shapes = self.device.type == "cuda" if fixed_shapes is None else fixed_shapes
        self.graphs = StepGraphs(cuda_graphs and self.fixed_shapes and self.device.type == "cuda", self.device)
        self.max_positions = min(r.max_positions for r in (target, draft) if r is not None)
        # Past the decoder's last position, room for proposals beyond a row's limit (never
        # kept); a multiple of 16, which attention kernels need of a mask's last dimension.
        self.capacity = -(-(self.max_positions + max_draft_tokens + 1) // 16) * 16
        # In fixed shapes every verification computes max_draft_tokens + 1 positions, whatever
        # k is: one graph serves every k, and a position's logits never depend on how many
        # the pass computes (so on a GPU, too, speculative output is the target-only output).
        self.verify_width = max_draft_tokens + 1 if self.fixed_shapes else None
        self.states = States(self)
        self._draft_lengths: dict[int | None, DraftLength] = {}
        self.compiled = CompiledSteps(compile)  # each step as the engine runs it: compiled whole, or as it is

    def draft_length(self, fixed: int | None = None) -> DraftLength:
        """The adaptive draft length over this engine (or a fixed one), one for all who ask: what
        one request measured serves the next (the web page makes a Transcriber per request)."""
        return self._draft_lengths.setdefault(fixed, DraftLength(fixed, maximum=self.max_draft_tokens))

    def batch(self, rules: DecodingRules, *, rows: int = 1, no_speech_token: int | None = None,
              draft_length: DraftLength | None = None) -> "Batch":
        """An empty batch for `rows` rows at once (it grows if given more; fitted shapes hold
        only the rows given: Slots._rows_for); draft_length: by default the engine's adaptive one."""
        return Batch(self, rules, rows, no_speech_token, draft_length or self.draft_length())

    @torch.inference_mode()
    def decode(self, target_encoder_output: Tensor, prompts: list[list[int]], rules: DecodingRules, *,
               sot_index: list[int] | None = None, no_speech_token: int | None = None,
               draft_encoder_output: Tensor | None = None, max_new_tokens: int = 224, temperature: float = 0.0,
               draft_length: DraftLength | None = None, hints: list[list[int]] | None = None,
               seeds: list[int] | None = None) -> list[Sequence]:
        """Decodes these rows together until all finish: target_encoder_output [B, frames, width]; the rest as
        Window's (seeds: by default each row's index, so a call made again draws the same samples)."""
        batch = self.batch(rules, rows=len(prompts), no_speech_token=no_speech_token, draft_length=draft_length)
        windows = [Window(target_encoder_output[b], prompt, (sot_index or [0] * len(prompts))[b], max_new_tokens,
                          temperature, (hints or [[]] * len(prompts))[b],
                          None if draft_encoder_output is None else draft_encoder_output[b],
                          seed=b if seeds is None else seeds[b])
                   for b, prompt in enumerate(prompts)]
        order = {tag: i for i, tag in enumerate(batch.add(windows))}
        results: list[Sequence | None] = [None] * len(prompts)
        while batch.live:
            for tag, sequence in batch.step():
                results[order[tag]] = sequence
        batch.close()
        return results  # type: ignore[return-value]

    @torch.inference_mode()
    def warm_up(self, rules: DecodingRules, *, rows: int, frames: int, draft_frames: int | None = None,
                no_speech_token: int | None = None) -> None:
        """With CUDA graphs, runs twice every step a batch of `rows` rows can meet (prompts
        and the draft's catch-ups of every width, the verification; greedy and sampling) over
        windows of `frames` encoder frames (draft_frames: a draft's own encoder's), so that
        each is captured before decoding meets it, where a first use mid-decode costs tens of
        milliseconds (docs/gpu-check-2026-11-25.md). For long-lived processes; only while
        nothing else decodes on this engine (its graphs share one memory pool)."""
        if self.graphs.enabled:
            batch = self.batch(rules, rows=rows, no_speech_token=no_speech_token)
            try:
                batch.warm_up(frames, draft_frames)
            finally:
                batch.close()


class Batch(Slots):
    """Rows decoding together (asr/slots.py): add() puts windows in free slots; each step()
    runs one round for every live row and returns the rows that finished, freeing their slots."""

    def __init__(self, engine: SpeculativeDecoder, rules: DecodingRules, rows: int, no_speech_token: int | None,
                 draft_length: DraftLength):
        super().__init__(engine, rules, rows, no_speech_token)
        self.draft_length = draft_length
        self.use_draft = engine.draft is not None and draft_length.maximum > 0
        if self.use_draft and draft_length.maximum > engine.max_draft_tokens:
            raise ValueError(f"this engine proposes at most {engine.max_draft_tokens} tokens a round, not {draft_length.maximum}")

    @torch.inference_mode()
    def step(self) -> list[tuple[int, Sequence]]:
        """One round for every live row; returns (tag, result) for each row that finished."""
        self._drop_finished()
        e, s, rows = self.engine, self.state, [row for row in self.slots if row is not None]
        if not rows:
            return []
        sample = any(row.temperature > 0 for row in rows)
        started = device_clock(e.device)  # not work queued before: the round's own only (on a GPU)
        left = hints.follow_round(self) if any(row.hinted for row in rows) else None
        if left is None:
            # Sampled rounds are not measured (below): an exploration there would be lost.
            k = self._draft_k([row.language for row in rows], explore=not sample)
            k, representative = self._propose(k, max(row.gap for row in rows), sample, rows) if k else (0, True)
            hinted = None
        else:
            # Rows not following a hint (an upload's beside a stream's) draft meanwhile, as measured.
            drafting = [row.language for row, n in zip(self.slots, left) if row is not None and not n]
            k = self._draft_k(drafting, explore=False)
            k = self._propose(k, max(row.gap for row in rows), sample, rows)[0] if k else 0
            hinted = hints.propose(self, rows, left, k)
            k, representative = hinted.k, False
        width = e.verify_width or k + 1  # fixed shapes: verify_width positions, k read from the state
        if e.verify_width:
            s.k.fill_(k)
        representative &= self._run_verify(width, sample, rows)
        out = RoundSummary.of(s.out)
        seconds = time.perf_counter() - started
        # A greedy round the adaptive length chose: sampled rows accept at rates of their own.
        measured = self.use_draft and not sample and hinted is None
        if measured and representative:
            self.draft_length.update(k, seconds, len(self.slots), [
                (row.language, min(accepted, counted), counted)
                for row, accepted, counted in zip(self.slots, out.accepted, out.counted) if row is not None])
        elif measured:
            self.draft_length.unmeasured(len(self.slots))
        drafted = [k] * len(self.slots) if hinted is None else hinted.drafted
        done = self._record(out, drafted, None if hinted is None else hinted.proposed, seconds)
        looped = self._looping(done, out.kept)
        done += [slot for slot in looped if slot not in done]
        return self._finish(done, out.ended, looped) if done else []

    def _draft_k(self, languages: list[str | None], explore: bool) -> int:
        """The draft's proposals a row this round, for rows drafting in these languages: none
        without a draft; else the adaptive length's (explore: its next round, which may go
        the other way; else what it measured so far)."""
        if not self.use_draft or not languages:
            return 0
        if explore:
            return self.draft_length.next_round(len(self.slots), languages)
        return self.draft_length.current(len(self.slots), languages)

    def warm_up(self, frames: int, draft_frames: int | None) -> None:
        """SpeculativeDecoder.warm_up, over a row of zeros (the caller closes the batch)."""
        e, C = self.engine, self.engine.capacity
        zeros = lambda runner, n: torch.zeros(n, runner.cross_attention_width, dtype=e.dtype, device=e.device)  # noqa: E731
        own = None if draft_frames is None else zeros(e.draft, draft_frames)
        self.add([Window(zeros(e.target, frames), [self.rules.eot], max_new_tokens=1, draft_encoded=own)])
        s = self.state
        for _ in range(2):  # a first use, then a capture
            for width in sorted({prefill_width(n, C) for n in range(1, e.max_positions)}):
                self._run_prefill(0, width)
            for sample in (False, True):
                if self.use_draft:
                    for width in sorted({feed_width(gap, C) for gap in range(1, e.max_positions)}):
                        s.step.zero_()
                        self._run_draft_step(width, sample, [], 0)
                self._run_verify(e.verify_width, sample, [])

    def _window(self, rows: list[Row], extra: int) -> int | None:
        """What a step attends to: in fitted shapes the longest row's positions plus `extra`."""
        return None if self.engine.fixed_shapes else max(row.length for row in rows) + extra

    def _propose(self, k: int, width: int, sample: bool, rows: list[Row]) -> tuple[int, bool]:
        """The draft's k proposals, written to tokens[length : length + k], one draft step
        each: in fixed shapes one graph serves every step (and so every k), reading the step
        from the state, and the first step's catch-up width is rounded up to a power of two,
        so that catching up after rounds without drafting is one of a few graphs too. In
        fitted shapes drafting stops once every row has proposed end-of-text. Returns how
        many it proposed, and whether the steps' time is representative (asr/cudagraphs.py)."""
        e, s = self.engine, self.state
        s.step.zero_()
        usual = width <= USUAL_GAP  # a longer catch-up (after plain rounds or hints) is not what drafting costs
        if not e.fixed_shapes:
            ended, step, compiled, i = ~s.live, e.compiled(Batch._draft_step), compilations(), -1  # free slots: ended
            for i in range(k):
                ended |= step(self, width if i == 0 else 1, sample, self._window(rows, i)) == self.rules.eot
                if bool(ended.all()):
                    break
            return i + 1, usual and compilations() == compiled  # steps that compiled say nothing of their cost
        width, representative = feed_width(width, e.capacity), usual
        for i in range(k):
            representative &= self._run_draft_step(width if i == 0 else 1, sample, rows, i)
        return k, representative

    def _run_draft_step(self, width: int, sample: bool, rows: list[Row], i: int) -> bool:
        """_draft_step as a step (asr/cudagraphs.py), i the step; returns whether its time is
        representative."""
        e, s = self.engine, self.state
        step, window = e.compiled(Batch._draft_step), self._window(rows, i)
        return e.graphs.run(s.graphs, ("draft", width, sample, self.rules), lambda: step(self, width, sample, window),
                            s.changed())

    def _draft_step(self, width: int, sample: bool, window: int | None) -> Tensor:
        """One draft step: predicts index length + step of each row and advances the step.
        It feeds the `width` tokens before that index: the last proposal, or at the first
        step the kept tokens the draft has not cached, ending at the pending one. A row with
        fewer re-feeds cached ones, which rewrites their keys and values; one with fewer
        tokens than `width` also feeds tokens past the index, whose entries are rewritten
        before anything attends to them. window: as the pass's. Returns the proposals [R]."""
        e, s = self.engine, self.state
        position = s.length + s.step  # [R] the index predicted
        start = (position - width).clamp(min=0)
        feed = s.tokens.gather(1, start[:, None] + torch.arange(width, device=e.device))
        with attention_without_cudnn(e.device):
            logits = e.draft.forward(feed, start, s.draft, logits_at=(position - 1 - start)[:, None], window=window,
                                     by_lengths=e.lengths_attention, fused=e.fused_layers)[:, 0]
        self.rules.apply(logits, self.rules.prefix(s.tokens, s.sample_begin, position[:, None], s.free_begin))
        # Sampling, with the noise the target verifies this position with: where the two agree, the same token.
        proposal = sampling.choose(logits, s.temperature, s.seed, position) if sample else logits.argmax(-1)
        s.tokens.scatter_(1, position[:, None], proposal[:, None])
        s.step.add_(1)
        s.draft_cached.copy_(position)  # it has cached every token before the one it just proposed
        return proposal

    def _run_verify(self, width: int, sample: bool, rows: list[Row]) -> bool:
        """_verify as a step; returns whether its time is representative."""
        e, s = self.engine, self.state
        step, window = e.compiled(Batch._verify), self._window(rows, width - 1)
        return e.graphs.run(s.graphs, ("verify", width, sample, self.rules), lambda: step(self, width, sample, window),
                            s.changed())

    def _verify(self, width: int, sample: bool, window: int | None) -> None:
        """The target's pass over `width` positions, the pending token and the proposals
        after it (k = width - 1, or in fixed shapes the state's k, the rest of the width being
        stale tokens whose results go unused): each live row keeps its longest agreeing
        prefix plus the target's own next token, cut at end-of-text and at its limit.
        window: as the pass's. sample: rows at temperature > 0 draw with their noise (asr/sampling.py)."""
        e, s, rules = self.engine, self.state, self.rules
        k = width - 1
        steps = torch.arange(width, device=e.device)
        positions = s.length[:, None] + steps  # predicted indices
        # Inside the step: a compiled one then keeps it. By lengths, the cross-attention runs flash's kernel (11 us
        # against cuDNN's 20 at 9 queries over 1,500 frames on an H100, docs/gpu-check-2026-11-28.md).
        with attention_without_cudnn(e.device, width != e.verify_width or e.lengths_attention is not None):
            logits = e.target.forward(s.tokens.gather(1, positions - 1), s.length - 1, s.target, window=window,
                                      by_lengths=e.lengths_attention, fused=e.fused_layers)
        n, _, vocab = logits.shape
        rules.apply(logits.view(n * width, vocab), rules.prefix(s.tokens, s.sample_begin, positions, s.free_begin))
        proposals = s.tokens.gather(1, positions[:, :k])
        proposed = (steps[:k] < s.k)[None] if width > 1 and e.verify_width == width else None
        # The proposals a row's acceptance counts: up to its first end-of-text (a batch drafts on
        # past it: all k in fixed shapes, in fitted ones until every row's draft has ended),
        # within the state's k, and those its limit can keep.
        counted = torch.zeros_like(s.length)
        if k:
            counted = torch.where(proposals == rules.eot, steps[:k], k - 1).amin(1) + 1
            if proposed is not None:
                counted = torch.minimum(counted, s.k)
            counted = torch.minimum(counted, (s.limit - s.length - 1).clamp(min=0)) * s.live
        if sample:
            chosen = sampling.choose(logits.view(n * width, vocab), s.temperature.repeat_interleave(width),
                                     s.seed.repeat_interleave(width), positions.reshape(-1)).view(n, width)
        else:
            chosen = logits.argmax(-1)
        accepted = sampling.accepted(chosen, proposals, proposed)
        s.tokens.scatter_(1, (s.length + accepted)[:, None], chosen.gather(1, accepted[:, None]))

        # Keep accepted + 1 tokens, cut after the first end-of-text and at the length limit.
        verified = s.tokens.gather(1, positions)
        first_eot = torch.where(verified == rules.eot, steps, width).amin(1)  # width where there is none
        new = torch.minimum(torch.minimum(first_eot, accepted) + 1, s.limit - s.length) * s.live
        kept = steps < new[:, None]
        # log_softmax: one kernel, on CUDA from fp16 straight to float32 (a float copy and logsumexp were 11)
        logprobs = torch.log_softmax(logits, -1, dtype=torch.float32).gather(2, verified[:, :, None])[:, :, 0]
        s.logprob.scatter_(1, positions, torch.where(kept, logprobs, 0.0))  # past the kept: rewritten when kept
        eot_kept = first_eot < new
        s.length.add_(new)
        s.draft_cached.clamp_(max=s.length - 1)
        finished = s.live & (eot_kept | (s.length >= s.limit))
        s.live.logical_and_(~finished)
        # RoundSummary's fields, in order (not stack(out=): Dynamo breaks there)
        s.out.copy_(torch.stack([new, accepted, finished.long(), s.length - s.draft_cached, eot_kept.long(), counted]))
