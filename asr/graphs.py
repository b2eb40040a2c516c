"""Greedy speculative decoding in fixed shapes, for CUDA graphs: the GPU path.

The loop of asr/speculative.py fits its shapes to the data: it attends to the longest
row's prefix, drops finished rows, and stops drafting once every row has proposed
end-of-text. Each of those reads a value back to the host, and a GPU idles at every such
read, once per draft token. Here each round is two steps of fixed shapes, the draft's k
proposals and the target's verification of k + 1 positions, over buffers allocated once
per batch size and reused by every decode of that size. Neither step reads anything back,
so on CUDA each is captured once per (batch, k) as a CUDA graph and then replayed: a
round launches two graphs, and the host reads one small summary per round (how many rows
are still going, and the acceptance that sets the next k).

What differs from asr/speculative.py, none of it changing the tokens kept:
- attention covers the cache's whole capacity under a mask (DecoderRunner.forward's static);
- finished rows stay in the batch, frozen (they keep nothing); a batch is padded with
  finished rows to a power of two, so a few sizes serve every batch;
- the draft proposes k tokens every round, and catches up over the last two kept tokens
  (re-feeding a token it has cached rewrites the same keys and values);
- the target's prefill covers the whole prompt, reading the no-speech probability there.

Greedy decoding without hints only; the Transcriber uses this path on CUDA for those and
the loop of asr/speculative.py otherwise (and on CPU, where its data-fitted shapes win)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from asr.decoder import DecoderRunner, KVCache
from asr.rules import DecodingRules, Prefix
from asr.speculative import DecodeStats, DraftLength, Sequence

# The per-row counters of _Buffers.counts.
PROPOSED, ACCEPTED, PASSES, KEPT = range(4)


@dataclass
class _Buffers:
    """Everything a round reads or writes, for one batch size: allocated once and reused
    by every decode of that size, so that captured graphs keep pointing at live memory."""

    tokens: Tensor  # [B, C] prompt, kept tokens, then proposals
    length: Tensor  # [B] tokens kept, prompt included
    sample_begin: Tensor  # [B] where generated tokens start
    limit: Tensor  # [B] the length at which a row stops
    done: Tensor  # [B] bool: finished, frozen
    eot: Tensor  # [B] bool: finished on end-of-text (its last kept token)
    sum_logprob: Tensor  # [B] float64
    counts: Tensor  # [B, 4] long: PROPOSED, ACCEPTED, PASSES, KEPT
    summary: Tensor  # [3] long, for the host: rows going, accepted, rows with a rejection (this round)
    oracle: Tensor  # [B, C] an oracle draft's proposals (asr/oracle.py), when one is given
    target: KVCache
    draft: KVCache | None
    frames: tuple[int, int | None]  # encoder frames the cross-attention caches hold (the draft's, if its own)
    graphs: dict[tuple, "torch.cuda.CUDAGraph"] = field(default_factory=dict)

    def small(self) -> list[Tensor]:
        """What a step's warm-up run changes that must be put back (the caches' changed
        entries are rewritten by the step itself before anything reads them)."""
        return [self.tokens, self.length, self.done, self.eot, self.sum_logprob, self.counts, self.summary]


class StaticDecoder:
    """SpeculativeDecoder.decode for greedy decoding without hints, in fixed shapes; on
    CUDA (unless cuda_graphs is False) its steps run as captured CUDA graphs. Keeps its
    buffers and graphs between decodes: make one per model pair and reuse it.
    max_draft_tokens: the largest k it will be asked for."""

    def __init__(
        self, target: DecoderRunner, draft: DecoderRunner | None = None, max_draft_tokens: int = 8, cuda_graphs: bool = True
    ):
        if draft is not None and draft.vocab_size != target.vocab_size:
            raise ValueError(f"the draft's vocabulary ({draft.vocab_size}) differs from the target's ({target.vocab_size})")
        self.target = target
        self.draft = draft
        # Layers whose cross-attention K/V the draft can take from the target's cache.
        self._shared_cross = draft.cross_layers_shared_with(target) if draft is not None else None
        self.max_draft_tokens = max_draft_tokens
        self.cuda_graphs = cuda_graphs
        self.max_positions = min(r.max_positions for r in (target, draft) if r is not None)
        # Past the decoder's last position, room for proposals beyond a row's limit (never kept).
        self.capacity = self.max_positions + max_draft_tokens + 1
        self._buffers: dict[int, _Buffers] = {}  # by batch size
        # Graphs hold the rules' tensors: one kept instance per set of rules.
        self._rules: dict[tuple, DecodingRules] = {}
        self._pool = None
        self._stream = None

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
        oracle: list[list[int]] | None = None,
    ) -> list[Sequence]:
        """As SpeculativeDecoder.decode (same arguments and results; generator is unused in
        greedy decoding there too). oracle[b]: proposals that replace the draft's for each of
        row b's generated indices, the draft still running its passes (asr/oracle.py)."""
        if temperature > 0 or any(hints or []):
            raise ValueError("StaticDecoder decodes greedily without hints: use SpeculativeDecoder for sampling or hints")
        use_draft = self.draft is not None and (draft_length is None or draft_length.maximum > 0)
        if oracle is not None and not use_draft:
            raise ValueError("an oracle replaces a draft's proposals: it needs a draft")
        draft_length = draft_length if draft_length is not None else DraftLength()
        if use_draft and draft_length.maximum > self.max_draft_tokens:
            raise ValueError(f"this StaticDecoder proposes at most {self.max_draft_tokens} tokens a round, not {draft_length.maximum}")
        batch = len(prompts)
        lengths = [len(p) for p in prompts]
        if max(lengths) + max_new_tokens > self.max_positions - 1:
            raise ValueError(f"prompt plus {max_new_tokens} new tokens exceeds the decoder's {self.max_positions} positions")
        rows = 1 << (batch - 1).bit_length()  # padded with finished rows to a power of two
        pad = rows - batch
        prompts = prompts + [prompts[0]] * pad
        sot = torch.tensor((sot_index or [0] * batch) + [(sot_index or [0])[0]] * pad, device=target_encoder_output.device)
        target_encoder_output = _pad_rows(target_encoder_output, pad)
        if draft_encoder_output is not None:
            draft_encoder_output = _pad_rows(draft_encoder_output, pad)
        b = self._reset(target_encoder_output, draft_encoder_output, prompts, batch, max_new_tokens, oracle)
        rules_key = _rules_key(rules)
        rules = self._rules.setdefault(rules_key, rules)

        no_speech = self._prefill(b, sot, no_speech_token, use_draft, max(lengths))
        capture = self.cuda_graphs and target_encoder_output.device.type == "cuda"
        clock = _Clock(target_encoder_output.device)
        while True:
            k = draft_length.k if use_draft else 0
            clock.start()
            captured = False
            if k > 0:
                step = lambda: self._propose(b, rules, k, oracle is not None)  # noqa: E731
                captured |= self._run(b, ("propose", k, oracle is not None, rules_key), step, capture)
            clock.lap()
            captured |= self._run(b, ("verify", k, rules_key), lambda: self._verify(b, rules, k), capture)
            clock.lap()
            going, accepted, rejected = b.summary.tolist()  # the round's one read on the host
            if k > 0 and not captured:  # a capture's time says nothing of a round's
                drafting, verifying = clock.seconds()
                draft_length.update(k, accepted, rejected, drafting / k, verifying)
            if going == 0:
                break
        return self._results(b, batch, no_speech)

    def _reset(
        self, encoded: Tensor, draft_encoded: Tensor | None, prompts: list[list[int]], batch: int, max_new_tokens: int,
        oracle: list[list[int]] | None,
    ) -> _Buffers:
        """The buffers of this batch size, set for a new decode."""
        rows, device = len(prompts), encoded.device
        frames = (encoded.shape[1], None if draft_encoded is None else draft_encoded.shape[1])
        b = self._buffers.get(rows)
        if b is None or b.frames != frames:  # one set per batch size: memory stays bounded
            b = self._buffers[rows] = self._allocate(encoded, draft_encoded)
        else:
            _fill_cross(self.target, b.target, encoded)
            if b.draft is not None and b.draft.cross_k[0] is not b.target.cross_k[0]:
                _fill_cross(self.draft, b.draft, draft_encoded if draft_encoded is not None else encoded)
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        tokens = torch.zeros(b.tokens.shape, dtype=torch.long)  # filled on the host, copied once
        proposals = torch.zeros(b.oracle.shape, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        for row, row_proposals in enumerate(oracle or []):
            row_proposals = row_proposals[: self.capacity - len(prompts[row])]
            proposals[row, len(prompts[row]) : len(prompts[row]) + len(row_proposals)] = torch.tensor(row_proposals, dtype=torch.long)
        b.tokens.copy_(tokens)
        b.oracle.copy_(proposals)
        b.length.copy_(lengths)
        b.sample_begin.copy_(lengths)
        going = torch.arange(rows, device=device) < batch
        b.limit.copy_(torch.where(going, lengths + max_new_tokens, lengths))
        b.done.copy_(~going)
        b.eot.zero_()
        b.sum_logprob.zero_()
        b.counts.zero_()
        return b

    def _allocate(self, encoded: Tensor, draft_encoded: Tensor | None) -> _Buffers:
        rows, device = encoded.shape[0], encoded.device

        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        target = self.target.new_cache(encoded, self.capacity)
        draft = None
        if self.draft is not None:
            shared = self._shared_cross if draft_encoded is None else None
            draft = self.draft.new_cache(draft_encoded if draft_encoded is not None else encoded, self.capacity,
                                         cross_from=target if shared else None, cross_layers=shared)
        return _Buffers(
            tokens=zeros(rows, self.capacity), length=zeros(rows), sample_begin=zeros(rows), limit=zeros(rows),
            done=zeros(rows, dtype=torch.bool), eot=zeros(rows, dtype=torch.bool),
            sum_logprob=zeros(rows, dtype=torch.float64), counts=zeros(rows, 4), summary=zeros(3),
            oracle=zeros(rows, self.capacity), target=target, draft=draft,
            frames=(encoded.shape[1], None if draft_encoded is None else draft_encoded.shape[1]),
        )

    def _prefill(self, b: _Buffers, sot: Tensor, no_speech_token: int | None, use_draft: bool, longest: int) -> Tensor:
        """Caches the prompts (the target's including each pending token, which its first
        verification rewrites, so that <|startoftranscript|> is always in reach); returns
        the no-speech probability of each row (NaN without no_speech_token)."""
        rows = b.length.shape[0]
        start = torch.zeros(rows, dtype=torch.long, device=b.tokens.device)
        logits = self.target.forward(b.tokens[:, :longest], start, b.target, logits_at=sot[:, None])
        if no_speech_token is None:
            no_speech = torch.full((rows,), float("nan"), device=b.tokens.device)
        else:
            no_speech = logits[:, 0].float().softmax(-1)[:, no_speech_token]
        if use_draft and longest > 1:
            self.draft.forward(b.tokens[:, : longest - 1], start, b.draft, logits_at=start[:, None])
        return no_speech

    def _propose(self, b: _Buffers, rules: DecodingRules, k: int, oracle: bool) -> None:
        """The draft's k proposals, written to tokens[length : length + k]. After a round the
        draft has cached all kept tokens but the last one (a rejection) or two (all accepted):
        it always feeds the last two, the first possibly again."""
        start = (b.length - 2).clamp(min=0)
        feed = b.tokens.gather(1, start[:, None] + torch.arange(2, device=start.device))
        last = (b.length - 1 - start)[:, None]
        for i in range(k):
            logits = self.draft.forward(feed, start, b.draft, logits_at=last, static=True)[:, 0]
            position = (b.length + i)[:, None]
            rules.apply(logits, Prefix.at(b.tokens, b.sample_begin, position, rules.timestamp_begin))
            proposal = b.oracle.gather(1, position) if oracle else logits.argmax(-1, keepdim=True)
            b.tokens.scatter_(1, position, proposal)
            start, feed, last = position[:, 0], proposal, torch.zeros_like(last)

    def _verify(self, b: _Buffers, rules: DecodingRules, k: int) -> None:
        """The target's pass over k + 1 positions: each going row keeps its longest agreeing
        prefix plus the target's own next token, cut at end-of-text and at its limit, as in
        SpeculativeDecoder.decode; finished rows keep nothing."""
        going = ~b.done
        steps = torch.arange(k + 1, device=b.length.device)
        positions = b.length[:, None] + steps  # predicted indices
        logits = self.target.forward(b.tokens.gather(1, positions - 1), b.length - 1, b.target, static=True)
        rows, width, vocab = logits.shape
        flat = logits.view(rows * width, vocab)
        rules.apply(flat, Prefix.at(b.tokens, b.sample_begin, positions, rules.timestamp_begin))
        chosen = flat.argmax(-1).view(rows, width)
        proposals = b.tokens.gather(1, positions[:, :k])
        accepted = (proposals == chosen[:, :k]).long().cumprod(1).sum(1)
        b.tokens.scatter_(1, (b.length + accepted)[:, None], chosen.gather(1, accepted[:, None]))

        window = b.tokens.gather(1, positions)
        is_eot = (window == rules.eot) & (steps < (accepted + 1)[:, None])
        ends_with_eot = is_eot.any(1)
        new = torch.where(ends_with_eot, is_eot.long().argmax(1) + 1, accepted + 1)
        new = torch.minimum(new, b.limit - b.length) * going
        kept = steps < new[:, None]
        logprobs = torch.log_softmax(logits.float(), -1).gather(2, window[:, :, None])[:, :, 0]
        b.sum_logprob += torch.where(kept, logprobs, 0.0).sum(1).double()  # -inf * 0 would be NaN
        eot_kept = ends_with_eot & (is_eot & kept).any(1)
        b.length += new
        b.eot |= eot_kept
        b.done |= eot_kept | (b.length >= b.limit)

        counted = going.long()
        b.counts += torch.stack([counted * k, accepted * counted, counted, new], 1)
        b.summary.copy_(torch.stack([(~b.done).sum(), (accepted * counted).sum(), ((accepted < k) & going).sum()]))

    def _run(self, b: _Buffers, key: tuple, step: Callable[[], None], capture: bool) -> bool:
        """Runs a step: eagerly, or as its CUDA graph, captured on first use (then returns True)."""
        if not capture:
            step()
            return False
        graph = b.graphs.get(key)
        captured = graph is None
        if captured:
            graph = b.graphs[key] = self._capture(b, step)
        graph.replay()
        return captured

    def _capture(self, b: _Buffers, step: Callable[[], None]) -> "torch.cuda.CUDAGraph":
        """Warms the step up on a side stream (library handles and workspaces are created
        outside the capture), puts back what the warm-up changed, and captures the step.
        Every graph shares one memory pool: their intermediates never outlive a replay, and
        replays run one after another on one stream."""
        if self._pool is None:
            self._pool, self._stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        saved = [t.clone() for t in b.small()]
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            step()
        torch.cuda.current_stream().wait_stream(self._stream)
        for tensor, value in zip(b.small(), saved):
            tensor.copy_(value)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
            step()
        return graph

    def _results(self, b: _Buffers, batch: int, no_speech: Tensor) -> list[Sequence]:
        tokens = b.tokens[:batch].tolist()
        begin, length, eot = b.sample_begin.tolist(), b.length.tolist(), b.eot.tolist()
        sum_logprob, probs, counts = b.sum_logprob.tolist(), no_speech.tolist(), b.counts.tolist()
        results = []
        for row in range(batch):
            c = counts[row]
            stats = DecodeStats(draft_proposed=c[PROPOSED], draft_accepted=c[ACCEPTED], target_passes=c[PASSES],
                                draft_passes=c[PROPOSED], tokens=c[KEPT])
            end = length[row] - (1 if eot[row] else 0)
            results.append(Sequence(tokens[row][begin[row] : end], sum_logprob[row], probs[row], stats))
        return results


class _Clock:
    """Seconds spent drafting and verifying in a round, read after the round's host read:
    CUDA events on a GPU (they add no synchronisation), wall time on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._marks: list = []

    def start(self) -> None:
        self._marks = []
        self.lap()

    def lap(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def seconds(self) -> tuple[float, float]:
        start, drafted, verified = self._marks
        if self.cuda:
            return start.elapsed_time(drafted) / 1000, drafted.elapsed_time(verified) / 1000
        return drafted - start, verified - drafted


def _pad_rows(encoded: Tensor, pad: int) -> Tensor:
    return torch.cat([encoded, encoded[:1].expand(pad, *encoded.shape[1:])]) if pad else encoded


def _fill_cross(runner: DecoderRunner, cache: KVCache, encoded: Tensor) -> None:
    """Writes a new window's cross-attention keys and values into the cache's own tensors."""
    fresh = runner.new_cache(encoded, capacity=1)
    for kept, new in zip(cache.cross_k + cache.cross_v, fresh.cross_k + fresh.cross_v):
        kept.copy_(new)


def _rules_key(rules: DecodingRules) -> tuple:
    return (rules.vocab_size, rules.eot, rules.no_timestamps, rules.timestamps, rules.max_initial_timestamp_index,
            tuple(rules.suppress.tolist()), tuple(rules.begin_suppress.tolist()), str(rules.suppress.device))
