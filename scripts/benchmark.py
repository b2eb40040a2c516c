"""Side-by-side speed of transformers' `generate` (target only), our target-only decoder
and our speculative decoder, on the dev clips, in one run (these machines are noisy:
only ratios measured together mean anything).

    python scripts/benchmark.py [--preset embedded] [--batch-sizes 1,8] [--threads N] [--draft-lengths 2,4,6]

Each clip is one 30 s window (the short dev clips), decoded greedily with timestamps,
language and task forced. Each batch is encoded once and every method decodes that same
encoder output, taking turns; the encoder time is reported once and counted in every
method's end-to-end figure. Speculative decoding is shown with the preset's draft and
with the target's own decoder as draft (which measures the machinery's overhead), and with
--draft-lengths the preset's draft at fixed k beside its adaptive k."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from asr.audio import load_audio
from asr.features import first_window
from asr.metrics import load_note, machine_load, read_manifest
from asr.models import PRESETS, WhisperModel, load_pair
from asr.draft_length import DraftLength
from asr.slots import DecodeStats
from asr.speculative import SpeculativeDecoder
from asr.transcribe import TranscribeOptions, Transcriber
from transformers_reference import transformers_generate  # beside this script

DEV = Path(__file__).resolve().parent.parent.parent / "shared" / "eval" / "dev"


GENERATE = "transformers generate"
TARGET_ONLY = "ours target-only"


def decode(method: str, target: WhisperModel, drafts: dict[str, WhisperModel], encoded: torch.Tensor, rules,
           prompt: list[int], max_new: int, draft_lengths: dict[str, DraftLength]) -> tuple[list[list[int]], list[DecodeStats]]:
    if method == GENERATE:
        return transformers_generate(target.model, encoded, prompt, rules.suppress.tolist(), target.begin_suppress,
                                     target.vocab.no_timestamps, target.vocab.eot, max_new), []
    draft = drafts.get(method)
    decoder = SpeculativeDecoder(target.runner, draft.runner if draft is not None else None)
    sequences = decoder.decode(encoded, [prompt] * len(encoded), rules, max_new_tokens=max_new,
                               draft_length=draft_lengths.get(method))
    return [s.tokens for s in sequences], [s.stats for s in sequences]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="embedded", choices=sorted(PRESETS))
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--max-new-tokens", type=int, default=224)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--draft-lengths", default="",
                        help="also the preset's draft at these fixed k (e.g. 2,4,6), beside the adaptive k")
    parser.add_argument("--dev", type=Path, default=DEV, help="folder of manifest.tsv (its clips up to 30 s)")
    args = parser.parse_args()
    # Said before the models load (a traceback after they had, or torch's own for 0 threads).
    if not all(b.strip().isdigit() and int(b) >= 1 for b in args.batch_sizes.split(",")):
        parser.error(f"--batch-sizes {args.batch_sizes!r}: whole numbers from 1, comma-separated")
    if not all(k.strip().isdigit() and 1 <= int(k) <= 8 for k in args.draft_lengths.split(",") if k):
        parser.error(f"--draft-lengths {args.draft_lengths!r}: whole numbers from 1 to 8, comma-separated")
    if args.threads < 1 or args.max_new_tokens < 1:
        parser.error("--threads and --max-new-tokens: at least 1")
    if not (args.dev / "manifest.tsv").is_file():
        parser.error(f"--dev {args.dev}: holds no manifest.tsv")
    torch.set_num_threads(args.threads)

    target_name, draft_name = PRESETS[args.preset]
    pair = load_pair(target_name, draft_name)
    target = pair.target
    drafts = {f"ours speculative ({draft_name})": pair.draft, "ours speculative (draft = target)": target}
    fixed = {f"ours speculative ({draft_name}, k = {k})": int(k) for k in args.draft_lengths.split(",") if k}
    drafts |= dict.fromkeys(fixed, pair.draft)
    methods = [GENERATE, TARGET_ONLY, *drafts]
    rules = Transcriber(pair, TranscribeOptions(language="en")).rules(timestamps=True)
    prompt = target.vocab.sot_sequence("en", "transcribe")
    clips = [c for c in read_manifest(args.dev / "manifest.tsv") if c.duration <= 30]
    windows = [first_window(load_audio(c.path), target.config.num_mel_bins) for c in clips]
    audio_seconds = sum(c.duration for c in clips)
    # float32 throughout: `asr transcribe`'s default (--dtype auto) runs the encoder in bfloat16
    # where the CPU computes in it, which changes the encoder's share (benchmark_encoder.py).
    print(f"preset {args.preset}: target {target_name}, draft {draft_name}; {len(clips)} dev clips, "
          f"{audio_seconds:.0f} s of audio, {args.threads} threads, float32 (encoder too), torch {torch.__version__}\n")
    load = 0.0  # sampled after each batch size: the minute before the run is not its
    print("| batch | method | decoder s | ms / token | decoder speed-up vs generate | vs ours target-only "
          "| end-to-end vs ours target-only | RTFx | acceptance | tokens / target pass | output == generate |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        encoder_seconds = 0.0
        decoder_seconds = dict.fromkeys(methods, 0.0)
        outputs = {m: [] for m in methods}
        stats = {m: DecodeStats() for m in methods}
        # k adapts across windows, as it does in a transcription.
        draft_lengths = {m: DraftLength(fixed=fixed.get(m)) for m in drafts}
        for start in range(-batch, len(windows), batch):  # the first round warms up and is not counted
            features = torch.stack(windows[max(start, 0) : max(start, 0) + batch])
            began = time.perf_counter()
            encoded = target.encode(features)
            if start >= 0:
                encoder_seconds += time.perf_counter() - began
            # Methods take turns, in a rotating order, so that the machine's drift is shared.
            shift = (start // batch) % len(methods)
            for method in methods[shift:] + methods[:shift]:
                began = time.perf_counter()
                tokens, row_stats = decode(method, target, drafts, encoded, rules, prompt, args.max_new_tokens, draft_lengths)
                if start < 0:
                    continue
                decoder_seconds[method] += time.perf_counter() - began
                outputs[method] += tokens
                for s in row_stats:
                    stats[method].add(s)
        tokens = sum(len(o) + 1 for o in outputs[GENERATE])
        for method in methods:
            s = stats[method]
            seconds = decoder_seconds[method]
            acceptance = f"{s.acceptance_rate:.0%}" if s.draft_proposed else "-"
            per_pass = f"{s.tokens_per_target_pass:.2f}" if s.target_passes else "-"
            end_to_end = (encoder_seconds + decoder_seconds[TARGET_ONLY]) / (encoder_seconds + seconds)
            print(f"| {batch} | {method} | {seconds:.2f} | {1000 * seconds / tokens:.1f} "
                  f"| {decoder_seconds[GENERATE] / seconds:.2f}x | {decoder_seconds[TARGET_ONLY] / seconds:.2f}x "
                  f"| {end_to_end:.2f}x | {audio_seconds / (encoder_seconds + seconds):.1f} | {acceptance} | {per_pass} "
                  f"| {'yes' if outputs[method] == outputs[GENERATE] else 'NO'} |")
        print(f"| {batch} | (encoder, shared by all) | {encoder_seconds:.2f} | | | | | | | | |")
        load = max(load, machine_load())
    print(f"\n{load_note(load, args.threads)}")


if __name__ == "__main__":
    main()
