"""The GPU path, tested on CPU: decoding in fixed shapes (asr/graphs.py, what CUDA graphs
capture) gives the tokens of the loop of asr/speculative.py on the tiny models of
conftest.py; its steps read nothing back to the host (they run on the meta device, where
any such read fails), at large-v3 geometry too; the oracle draft (asr/oracle.py) gives the
acceptance asked for and exact output; scripts/benchmark_gpu.py runs end to end. Tests of
the CUDA graphs themselves skip without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import WhisperConfig, WhisperForCausalLM, WhisperForConditionalGeneration

from asr.decoder import DecoderRunner
from asr.graphs import StaticDecoder
from asr.oracle import acceptance_from_tokens_per_pass, expected_tokens_per_pass, oracle_proposals
from asr.rules import DecodingRules
from asr.speculative import DecodeStats, DraftLength, SpeculativeDecoder
from conftest import (
    BEGIN_SUPPRESS, EOT, MAX_TARGET_POSITIONS, NO_TIMESTAMPS, REPO, SOT, SUPPRESS, decoder_only_draft, perturbed, save_tiny,
    tiny_target,
)
from test_exactness import BATCH, MAX_NEW, prompt_for, rules_for, runner, target_and_windows

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def pair():
    """A tiny target whose rows end at different lengths, its encoder output, and drafts of
    both kinds (decoder-only on the target's encoder; a full Whisper with its own)."""
    target, features = target_and_windows(0)
    own = perturbed(target, noise=0.1, seed=0)
    with torch.inference_mode():
        encoded = target.model.encoder(features).last_hidden_state
        own_encoded = own.model.encoder(features).last_hidden_state
    return target, encoded, decoder_only_draft(target, noise=0.1, seed=0), own, own_encoded


def assert_same(static, eager):
    assert [s.tokens for s in static] == [s.tokens for s in eager]
    for a, b in zip(static, eager):
        assert a.sum_logprob == pytest.approx(b.sum_logprob, abs=1e-5)
        assert a.no_speech_prob == pytest.approx(b.no_speech_prob, abs=1e-9, nan_ok=True)
        assert a.stats.tokens == b.stats.tokens


@torch.inference_mode()
def test_static_forward_gives_the_dynamic_forwards_logits(pair):
    """Attending over the whole capacity under a mask equals attending over the prefix,
    rows at different positions, after a rollback."""
    target, encoded = pair[0], pair[1][:2]
    run = runner(target)
    prompt = torch.tensor([[SOT, 50259, 50359, 400, 500, 600]] * 2)
    caches = [run.new_cache(encoded, capacity=24) for _ in range(2)]
    outputs = []
    for cache, static in zip(caches, (False, True)):
        run.forward(prompt, torch.tensor([0, 0]), cache, static=static)
        outputs.append(run.forward(torch.tensor([[11, 12, 13], [21, 22, 23]]), torch.tensor([4, 6]), cache, static=static))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("timestamps", [False, True], ids=["no-timestamps", "timestamps"])
def test_fixed_shapes_give_the_loops_tokens(pair, timestamps: bool):
    """Target-only and speculative, k = 1..8, batches of 1..4 (padded to 1, 2, 4) whose rows
    end at different lengths, one decoder reused throughout (its buffers and stale cache
    entries from earlier decodes must not matter), both draft kinds."""
    target, encoded, draft, own, own_encoded = pair
    rules, prompt = rules_for(timestamps), prompt_for(timestamps)
    options = dict(max_new_tokens=MAX_NEW, no_speech_token=50362)
    eager = SpeculativeDecoder(runner(target)).decode(encoded, [prompt] * BATCH, rules, **options)
    assert len({len(s.tokens) for s in eager}) > 1, "rows should end at different lengths"

    assert_same(StaticDecoder(runner(target)).decode(encoded, [prompt] * BATCH, rules, **options), eager)
    static = StaticDecoder(runner(target), runner(draft))
    proposed = accepted = 0
    for k, batch in [(1, 4), (4, 4), (8, 4), (3, 1), (3, 3), (2, 2)]:
        rows = list(range(BATCH - batch, BATCH))
        result = static.decode(encoded[rows], [prompt] * batch, rules, draft_length=DraftLength(fixed=k), **options)
        assert_same(result, [eager[r] for r in rows])
        proposed += sum(s.stats.draft_proposed for s in result)
        accepted += sum(s.stats.draft_accepted for s in result)
    assert 0.1 < accepted / proposed < 0.95  # acceptance and rollback both exercised

    own_static = StaticDecoder(runner(target), runner(own))
    result = own_static.decode(encoded, [prompt] * BATCH, rules, draft_encoder_output=own_encoded,
                               draft_length=DraftLength(fixed=3), **options)
    assert_same(result, eager)


def test_fixed_shapes_with_previous_text_and_adaptive_k(pair):
    """Prompts of different lengths (a lone <|startoftranscript|>, as English-only models
    take, and previous text up to the decoder's last position), the no-speech probability
    read at <|startoftranscript|>, and k adapting every round."""
    target, encoded, draft = pair[:3]
    rules = rules_for(True)
    prompts = [[SOT]] + [[50361] + list(range(400, 400 + 6 * row)) + prompt_for(True) for row in range(1, BATCH)]
    sot_index = [p.index(SOT) for p in prompts]
    max_new = MAX_TARGET_POSITIONS - 1 - max(map(len, prompts))
    options = dict(sot_index=sot_index, no_speech_token=50362, max_new_tokens=max_new)
    eager = SpeculativeDecoder(runner(target)).decode(encoded, prompts, rules, **options)
    draft_length = DraftLength(maximum=6)
    result = StaticDecoder(runner(target), runner(draft), max_draft_tokens=6).decode(
        encoded, prompts, rules, draft_length=draft_length, **options)
    assert_same(result, eager)
    assert all(0 <= s.no_speech_prob <= 1 for s in result)


def test_buffers_follow_the_encoders_frame_count(pair):
    """Windows encoded over fewer frames (short audio) get buffers of their own size."""
    target, encoded, draft = pair[:3]
    static = StaticDecoder(runner(target), runner(draft))
    rules, prompt = rules_for(True), [prompt_for(True)] * 2
    for frames in (encoded.shape[1], 12, encoded.shape[1]):
        window = encoded[2:, :frames].contiguous()
        eager = SpeculativeDecoder(runner(target)).decode(window, prompt, rules, max_new_tokens=MAX_NEW)
        assert_same(static.decode(window, prompt, rules, max_new_tokens=MAX_NEW, draft_length=DraftLength(fixed=2)), eager)
        assert static._buffers[2].frames == (frames, None)


def test_static_decoder_refuses_what_it_does_not_do(pair):
    target, encoded, draft = pair[:3]
    static = StaticDecoder(runner(target), runner(draft), max_draft_tokens=4)
    prompt = [prompt_for(True)]
    with pytest.raises(ValueError, match="greedily"):
        static.decode(encoded[:1], prompt, rules_for(True), temperature=0.5)
    with pytest.raises(ValueError, match="greedily"):
        static.decode(encoded[:1], prompt, rules_for(True), hints=[[400]])
    with pytest.raises(ValueError, match="at most 4"):
        static.decode(encoded[:1], prompt, rules_for(True), draft_length=DraftLength(fixed=5))


def test_oracle_draft_gives_the_acceptance_asked_for_and_exact_output(pair):
    """End-of-text suppressed (fixed-length rows, as the benchmark decodes random models):
    the tokens of target-only decoding, and tokens per target pass (hence the per-token
    acceptance) and accepted / proposed as predicted for each alpha."""
    target, encoded, draft = pair[:3]
    encoded = encoded.repeat(2, 1, 1)  # 8 rows; each gets its own draws
    rules = DecodingRules(vocab_size=51865, eot=EOT, no_timestamps=NO_TIMESTAMPS, suppress=SUPPRESS + [EOT],
                          begin_suppress=BEGIN_SUPPRESS, timestamps=False)
    prompts = [prompt_for(False)] * len(encoded)
    max_new = MAX_TARGET_POSITIONS - 1 - len(prompts[0])
    reference = [s.tokens for s in SpeculativeDecoder(runner(target)).decode(encoded, prompts, rules, max_new_tokens=max_new)]
    assert all(len(tokens) == max_new for tokens in reference)
    static = StaticDecoder(runner(target), runner(draft))
    k = 4
    for alpha in (0.6, 0.9):
        proposals = oracle_proposals(reference, alpha, 51865, seed=1)
        right = sum(p == r for row, ref in zip(proposals, reference) for p, r in zip(row, ref))
        assert right / (len(reference) * max_new) == pytest.approx(alpha, abs=0.04)
        result = static.decode(encoded, prompts, rules, max_new_tokens=max_new, draft_length=DraftLength(fixed=k),
                               oracle=proposals)
        assert [s.tokens for s in result] == reference
        stats = DecodeStats()
        for s in result:
            stats.add(s.stats)
        # The last round of a row is cut at its limit, so a pass keeps a little less than predicted.
        assert stats.tokens_per_target_pass == pytest.approx(expected_tokens_per_pass(alpha, k), rel=0.08)
        assert acceptance_from_tokens_per_pass(stats.tokens_per_target_pass, k) == pytest.approx(alpha, abs=0.05)
        predicted = (alpha - alpha ** (k + 1)) / ((1 - alpha) * k)
        assert stats.acceptance_rate == pytest.approx(predicted, abs=0.05)


def test_acceptance_from_tokens_per_pass_inverts_the_prediction():
    for k in (1, 4, 8):
        for alpha in (0.0, 0.3, 0.8, 0.99):
            assert acceptance_from_tokens_per_pass(expected_tokens_per_pass(alpha, k), k) == pytest.approx(alpha, abs=1e-6)


def meta_pair(d_model: int, layers: int, draft_layers: int, heads: int, ffn: int, vocab: int, positions: int, frames: int):
    config = WhisperConfig(vocab_size=vocab, num_mel_bins=128, d_model=d_model, encoder_layers=1, decoder_layers=layers,
                           encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn,
                           decoder_ffn_dim=ffn, max_source_positions=frames, max_target_positions=positions)
    with torch.device("meta"):
        target = WhisperForConditionalGeneration(config)
        draft = WhisperForCausalLM(WhisperConfig.from_dict({**config.to_dict(), "decoder_layers": draft_layers}))
    return (DecoderRunner(target.model.decoder, target.proj_out.weight),
            DecoderRunner(draft.model.decoder, draft.proj_out.weight))


@pytest.mark.parametrize("geometry", ["tiny", "large-v3"])
@torch.inference_mode()
def test_steps_read_nothing_back_to_the_host(geometry: str):
    """A round's two steps run on meta tensors, which hold no values: any read on the host
    (.item(), bool(), int(), .tolist()) would fail. That is what lets CUDA capture them, and
    it needs no GPU. large-v3 geometry (32 + 2 layers of width 1280) builds here for free."""
    if geometry == "tiny":
        target, draft = meta_pair(64, 2, 1, 4, 128, 51865, 64, 30)
        batch, k = 4, 3
    else:
        target, draft = meta_pair(1280, 32, 2, 20, 5120, 51866, 448, 1500)
        batch, k = 16, 8
    static = StaticDecoder(target, draft)
    frames = 30 if geometry == "tiny" else 1500
    encoded = torch.empty(batch, frames, target.cross_attention_width, device="meta")
    rules = DecodingRules(vocab_size=target.vocab_size, eot=EOT, no_timestamps=NO_TIMESTAMPS, suppress=SUPPRESS,
                          begin_suppress=BEGIN_SUPPRESS, timestamps=True, device="meta")
    buffers = static._reset(encoded, None, [prompt_for(True)] * batch, batch, 20, None)
    static._propose(buffers, rules, k, oracle=False)
    static._propose(buffers, rules, k, oracle=True)
    static._verify(buffers, rules, k)
    static._verify(buffers, rules, 0)
    assert buffers.tokens.shape == (batch, static.capacity) and buffers.summary.shape == (3,)
    assert buffers.target.self_k[0].shape == (batch, target.num_heads, static.capacity, target.head_dim)


def test_benchmark_gpu_runs_end_to_end_on_cpu(tmp_path, dev_clips):
    """Tiny geometry; section 2 with tiny models saved as directories standing in for the
    packaged pair (the real one is what the GPU run measures), on one dev clip."""
    target = tiny_target(0, dtype=torch.float32, frames=3000)  # a 30 s window of mel frames
    save_tiny(target, tmp_path / "target")
    save_tiny(decoder_only_draft(target, noise=0.1, seed=0), tmp_path / "draft")
    out = tmp_path / "out"
    command = [sys.executable, str(REPO / "scripts" / "benchmark_gpu.py"), "--device", "cpu", "--geometry", "tiny",
               "--batch-sizes", "2", "--max-new-tokens", "8", "--acceptance", "0.9", "--repeats", "1",
               "--real-target", str(tmp_path / "target"), "--real-draft", str(tmp_path / "draft"),
               "--real-clips", "2", "--real-max-new-tokens", "8", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RANDOM weights" in done.stdout and "oracle" in done.stdout
    report = json.loads((out / "benchmark_gpu.json").read_text())
    sections = {row["section"] for row in report["rows"]}
    assert len(sections) == 2 and len(report["rows"]) == 4 + 5
    assert all(row["identical"] for row in report["rows"])
    assert all(row["floor_seconds"] > 0 for row in report["rows"])
    assert (out / "benchmark_gpu.png").stat().st_size > 10_000
    assert "| floor ms / token |" in (out / "benchmark_gpu.md").read_text()


@cuda
@pytest.mark.parametrize("timestamps", [False, True], ids=["no-timestamps", "timestamps"])
def test_cuda_graphs_give_the_loops_tokens(timestamps: bool):
    """On a GPU: the captured graphs (one per batch size and k, replayed) give the eager
    loop's tokens; capture itself fails on any host synchronisation inside a step."""
    target, features = target_and_windows(0)  # rows that end at different lengths
    draft = decoder_only_draft(target, noise=0.1, seed=0).float().cuda()
    target = target.float().cuda()
    with torch.inference_mode():
        encoded = target.model.encoder(features.float().cuda()).last_hidden_state
    prompt = prompt_for(timestamps)
    rules = DecodingRules(vocab_size=51865, eot=EOT, no_timestamps=NO_TIMESTAMPS, suppress=SUPPRESS,
                          begin_suppress=BEGIN_SUPPRESS, timestamps=timestamps, device="cuda")
    eager = SpeculativeDecoder(runner(target)).decode(encoded, [prompt] * BATCH, rules, max_new_tokens=MAX_NEW)
    static = StaticDecoder(runner(target), runner(draft))
    for k, batch in [(0, 4), (1, 4), (4, 4), (8, 4), (3, 1), (3, 3), (4, 4)]:
        rows = list(range(BATCH - batch, BATCH))
        result = static.decode(encoded[rows], [prompt] * batch, rules, max_new_tokens=MAX_NEW,
                               draft_length=DraftLength(fixed=k))
        assert [s.tokens for s in result] == [eager[r].tokens for r in rows], f"k={k} batch={batch}"
    assert all(buffers.graphs for buffers in static._buffers.values())


@cuda
def test_transcriber_on_cuda_decodes_in_fixed_shapes_with_the_same_transcripts(dev_clips):
    """The packaged pair in float32 on the GPU: the Transcriber's fixed-shape path (CUDA
    graphs) gives the transcripts of the loop it replaces."""
    from asr.models import load_pair
    from asr.transcribe import TranscribeOptions, Transcriber

    pair = load_pair("packaged:whisper-base", "bundled:whisper-base-2l", device="cuda")
    clips = dev_clips[:4]
    graphed = Transcriber(pair, TranscribeOptions(language="en", cuda_graphs=True), batch_size=4)
    loop = Transcriber(pair, TranscribeOptions(language="en"), batch_size=4)
    with_graphs = [[s.tokens for s in t.segments] for t in graphed.transcribe_many(graphed.read(c) for c in clips)]
    without = [[s.tokens for s in t.segments] for t in loop.transcribe_many(loop.read(c) for c in clips)]
    assert with_graphs == without
    assert graphed._static._buffers
