"""Side-by-side speed of transformers' `generate` (target only), our target-only decoder
and our speculative decoder, on the dev clips, in one run (these machines are noisy:
only ratios measured together mean anything).

    python scripts/benchmark.py [--preset embedded] [--batch-sizes 1,8] [--repeats 1]

Each clip is one 30 s window (the short dev clips), decoded greedily with timestamps,
language and task forced. Encoder and decoder time are split: every method shares the
same encoder cost, the decoder is where they differ."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    WhisperTimeStampLogitsProcessor,
)
from transformers.generation.utils import GenerationMixin

from asr.audio import load_audio
from asr.features import WINDOW_FRAMES, log_mel
from asr.metrics import read_manifest
from asr.models import PRESETS, WhisperModel, load_pair
from asr.speculative import DecodeStats, DraftLength, SpeculativeDecoder
from asr.transcribe import TranscribeOptions, Transcriber

DEV = Path(__file__).resolve().parent.parent.parent / "shared" / "eval" / "dev"


@dataclass
class Timing:
    encoder: float = 0.0
    decoder: float = 0.0
    tokens: int = 0
    stats: DecodeStats = field(default_factory=DecodeStats)
    outputs: list[list[int]] = field(default_factory=list)


def transformers_generate(model: WhisperModel, features: torch.Tensor, prompt: list[int], suppress: list[int],
                          max_new: int) -> list[list[int]]:
    """transformers' greedy generate with Whisper's own logits processors (the same rules
    as ours; Whisper's generate wrapper would re-cut timestamped output into segments)."""
    vocab = model.vocab
    config = GenerationConfig(no_timestamps_token_id=vocab.no_timestamps, max_initial_timestamp_index=50,
                              eos_token_id=vocab.eot, pad_token_id=vocab.eot, bos_token_id=vocab.eot,
                              decoder_start_token_id=vocab.sot, max_new_tokens=max_new, do_sample=False)
    processors = LogitsProcessorList([
        SuppressTokensAtBeginLogitsProcessor(model.begin_suppress, begin_index=len(prompt)),
        SuppressTokensLogitsProcessor(suppress),
        WhisperTimeStampLogitsProcessor(config, begin_index=len(prompt)),
    ])
    with torch.inference_mode():
        out = GenerationMixin.generate(model.model, input_features=features, decoder_input_ids=torch.tensor([prompt] * len(features)),
                                       logits_processor=processors, generation_config=config)
    rows = [row[len(prompt):].tolist() for row in out]
    return [row[: row.index(vocab.eot)] if vocab.eot in row else row for row in rows]


def run(method: str, pair, windows: list[torch.Tensor], batch: int, rules, prompt: list[int], max_new: int) -> Timing:
    timing = Timing()
    target = pair.target
    for start in range(0, len(windows), batch):
        features = torch.stack(windows[start : start + batch])
        began = time.perf_counter()
        encoded = target.encode(features)
        encoded_at = time.perf_counter()
        timing.encoder += encoded_at - began
        if method == "transformers generate":
            outputs = transformers_generate(target, features, prompt, rules.suppress.tolist(), max_new)
            # generate runs the encoder itself: subtract the encoder time just measured.
            timing.decoder += time.perf_counter() - encoded_at - (encoded_at - began)
        else:
            draft = pair.draft.runner if method == "ours speculative" else None
            decoder = SpeculativeDecoder(target.runner, draft)
            sequences = decoder.decode(encoded, [prompt] * len(features), rules, max_new_tokens=max_new,
                                       draft_length=DraftLength())
            timing.decoder += time.perf_counter() - encoded_at
            outputs = [s.tokens for s in sequences]
            for s in sequences:
                timing.stats.add(s.stats)
        timing.outputs += outputs
        timing.tokens += sum(len(o) + 1 for o in outputs)
    return timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="embedded", choices=sorted(PRESETS))
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--max-new-tokens", type=int, default=224)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, draft = PRESETS[args.preset]
    pair = load_pair(target, draft)
    transcriber = Transcriber(pair, TranscribeOptions(language="en"))
    rules = transcriber.rules(timestamps=True)
    prompt = pair.target.vocab.sot_sequence("en", "transcribe")
    clips = [c for c in read_manifest(DEV / "manifest.tsv") if c.duration <= 30]
    windows = [log_mel(load_audio(c.path), pair.target.config.num_mel_bins)[:, :WINDOW_FRAMES] for c in clips]
    audio_seconds = sum(c.duration for c in clips)
    print(f"preset {args.preset}: target {target}, draft {draft}; {len(clips)} dev clips, {audio_seconds:.0f} s of audio, "
          f"{args.threads} threads, {torch.__version__}\n")
    run("ours target-only", pair, windows[:2], 2, rules, prompt, args.max_new_tokens)  # warm-up

    methods = ["transformers generate", "ours target-only", "ours speculative"]
    print("| batch | method | encoder s | decoder s | ms / token | decoder speed-up vs generate | vs ours target-only "
          "| end-to-end RTF | acceptance | tokens / target pass | output == generate |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        results = {m: run(m, pair, windows, batch, rules, prompt, args.max_new_tokens) for m in methods}
        reference = results["transformers generate"]
        for method, t in results.items():
            acceptance = f"{t.stats.acceptance_rate:.0%}" if t.stats.draft_proposed else "-"
            per_pass = f"{t.stats.tokens_per_target_pass:.2f}" if t.stats.target_passes else "-"
            print(f"| {batch} | {method} | {t.encoder:.2f} | {t.decoder:.2f} | {1000 * t.decoder / t.tokens:.1f} "
                  f"| {reference.decoder / t.decoder:.2f}x | {results['ours target-only'].decoder / t.decoder:.2f}x "
                  f"| {audio_seconds / (t.encoder + t.decoder):.1f} | {acceptance} | {per_pass} "
                  f"| {'yes' if t.outputs == reference.outputs else 'NO'} |")


if __name__ == "__main__":
    main()
