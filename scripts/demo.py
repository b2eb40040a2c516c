"""`make demo`: transcribe samples/ offline with the embedded models, target-only and
speculative side by side, and print each transcript with its timing and speed-up."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from asr.audio import load_audio
from asr.metrics import read_manifest, word_error_rate
from asr.models import DEFAULT_PRESET, PRESETS, TARGET_AS_DRAFT, load_pair
from asr.transcribe import TranscribeOptions, Transcriber

SAMPLES = Path(__file__).resolve().parent.parent / "samples"


def main() -> int:
    argparse.ArgumentParser(description=__doc__).parse_args()  # no options: --help says what this does
    torch.set_num_threads(max(1, torch.get_num_threads()))
    target, draft = PRESETS[DEFAULT_PRESET]
    print(f"preset {DEFAULT_PRESET!r}: target {target}, draft {draft}")
    if draft == TARGET_AS_DRAFT:
        print("note: this preset drafts with the target's own decoder. Every proposal is accepted, which proves\n"
              "      the mechanics, but drafting costs as much as decoding, so it cannot be faster than target-only.\n")
    started = time.perf_counter()
    pair = load_pair(target, draft)
    print(f"models loaded in {time.perf_counter() - started:.1f} s\n")
    plain = Transcriber(pair, TranscribeOptions(speculative=False))
    speculative = Transcriber(pair, TranscribeOptions(speculative=True))
    clips = read_manifest(SAMPLES / "manifest.tsv")
    plain.transcribe(load_audio(clips[0].path))  # warm-up, so the first clip's timing is fair

    decoder = {"plain": 0.0, "speculative": 0.0}
    encoder = 0.0  # both systems' encoder seconds: the same work, timed twice
    hypotheses, identical = [], True
    for clip in clips:
        audio = load_audio(clip.path)
        base = plain.transcribe(audio, name=clip.path.name)
        fast = speculative.transcribe(audio, name=clip.path.name)
        identical &= [s.tokens for s in base.segments] == [s.tokens for s in fast.segments]
        hypotheses.append(base.text)
        for key, t in (("plain", base), ("speculative", fast)):
            decoder[key] += t.info.decoder_seconds
            encoder += t.info.encoder_seconds
        stats = fast.info.stats
        print(f"{clip.path.name} ({fast.info.duration:.1f} s, language {fast.info.language})")
        print(f"  {fast.text}")
        print(f"  target-only {base.info.encoder_seconds + base.info.decoder_seconds:.2f} s | speculative "
              f"{fast.info.encoder_seconds + fast.info.decoder_seconds:.2f} s | decoder speed-up "
              f"{base.info.decoder_seconds / fast.info.decoder_seconds:.2f}x | acceptance "
              f"{'-' if stats.acceptance_rate is None else f'{stats.acceptance_rate:.0%}'}, "
              f"{stats.tokens_per_target_pass or 0:.1f} tokens per target pass\n")
    english = [(c.reference, h) for c, h in zip(clips, hypotheses) if c.language == "en"]
    # End to end with the encoder's mean time for both: its two timings' noise, not drafting, made
    # one system's end to end faster than its decoder alone (1.12x against 1.02x).
    shared = encoder / 2
    print(f"total: decoder speed-up {decoder['plain'] / decoder['speculative']:.2f}x, end to end (the encoder's "
          f"{shared:.2f} s, the same in both, included) {(shared + decoder['plain']) / (shared + decoder['speculative']):.2f}x; "
          f"transcripts identical: {'yes' if identical else 'NO'}; English WER {word_error_rate(*zip(*english)):.1%}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
