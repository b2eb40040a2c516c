"""`asr transcribe PATH...`: files or folders in, one transcript per file out."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from asr.audio import AUDIO_EXTENSIONS, AudioError, load_audio
from asr.models import DEFAULT_PRESET, PRESETS, load_pair
from asr.transcribe import AudioInput, TranscribeOptions, Transcriber
from asr.writers import FORMATS, write_transcript

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asr", description="Speculative Whisper transcription")
    commands = parser.add_subparsers(dest="command", required=True)
    t = commands.add_parser("transcribe", help="transcribe audio files or folders of them")
    t.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="audio files, or folders of audio files")
    t.add_argument("--out-dir", type=Path, default=Path("."), help="where transcripts go (default: .)")
    t.add_argument("--formats", default="txt,srt,vtt,json", help=f"comma-separated, from {','.join(FORMATS)}")
    models = t.add_mutually_exclusive_group()
    models.add_argument("--preset", choices=sorted(PRESETS), help=f"target + draft pair (default: {DEFAULT_PRESET})")
    models.add_argument("--target", help="hub id, save_pretrained dir, CTranslate2 dir, or packaged:NAME")
    t.add_argument("--draft", help="the draft for --target (same kinds of source; 'target' drafts with itself)")
    t.add_argument("--draft-encoder", choices=["auto", "shared", "own"], default="auto",
                   help="shared: the draft reads the target's encoder output; own: a full Whisper draft runs its encoder")
    t.add_argument("--no-speculation", action="store_true", help="decode with the target alone")
    t.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (default: cuda when present)")
    t.add_argument("--dtype", choices=sorted(DTYPES), help="default: float16 on GPU, float32 on CPU")
    t.add_argument("--batch-size", type=int, default=1, help="windows (of different files) decoded together")
    t.add_argument("--num-draft-tokens", type=int, help="fixed k (default: adaptive)")
    t.add_argument("--language", help="e.g. en, de (default: detect)")
    t.add_argument("--task", choices=["transcribe", "translate"], default="transcribe")
    t.add_argument("--temperature", type=float, default=0.0, help="first temperature (default 0: greedy)")
    t.add_argument("--temperature-increment", type=float, default=0.2,
                   help="fallback step up to 1.0 when output looks wrong (0 disables fallback)")
    t.add_argument("--without-timestamps", action="store_true", help="no timestamp tokens (one segment per window)")
    t.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    return parser


def collect_inputs(paths: list[Path]) -> tuple[list[Path], list[str]]:
    files, errors = [], []
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix.lower() in AUDIO_EXTENSIONS and p.is_file())
            if not found:
                errors.append(f"{path}: folder holds no audio files ({', '.join(sorted(AUDIO_EXTENSIONS))})")
            files.extend(found)
        elif path.exists():
            files.append(path)
        else:
            errors.append(f"{path}: no such file or folder")
    return files, errors


def temperatures(start: float, increment: float) -> tuple[float, ...]:
    if increment <= 0:
        return (start,)
    steps = int(round((1.0 - start) / increment)) if start < 1.0 else 0
    return tuple(round(start + i * increment, 4) for i in range(steps + 1))


def transcribe_command(args: argparse.Namespace) -> int:
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        print(f"asr: unknown format(s) {unknown or args.formats!r}; choose from {', '.join(FORMATS)}", file=sys.stderr)
        return 2
    if args.draft and not args.target:
        print("asr: --draft goes with --target (a preset names its own draft)", file=sys.stderr)
        return 2
    files, errors = collect_inputs(args.paths)
    stems: dict[str, Path] = {}
    for path in files:
        if path.stem in stems and stems[path.stem] != path:
            errors.append(f"{path}: same name as {stems[path.stem]}; both would write {args.out_dir / path.stem}.*")
        stems.setdefault(path.stem, path)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = DTYPES[args.dtype] if args.dtype else (torch.float16 if device.startswith("cuda") else torch.float32)
    target, draft = (args.target, args.draft) if args.target else PRESETS[args.preset or DEFAULT_PRESET]
    if args.no_speculation:
        draft = None
    try:
        pair = load_pair(target, draft, draft_encoder=args.draft_encoder, device=device, dtype=dtype)
        options = TranscribeOptions(
            language=args.language,
            task=args.task,
            temperatures=temperatures(args.temperature, args.temperature_increment),
            speculative=not args.no_speculation,
            num_draft_tokens=args.num_draft_tokens,
            without_timestamps=args.without_timestamps,
            seed=args.seed,
        )
        transcriber = Transcriber(pair, options, batch_size=max(1, args.batch_size))
    except (ValueError, FileNotFoundError) as error:
        print(f"asr: {error}", file=sys.stderr)
        return 2

    def audio_inputs():
        for path in files:
            try:
                yield AudioInput(str(path), load_audio(path))
            except AudioError as error:
                errors.append(str(error))
                print(f"error: {error}", file=sys.stderr)

    started = time.perf_counter()
    done = 0
    for transcript in transcriber.transcribe_many(audio_inputs()):
        path = Path(transcript.source)
        write_transcript(transcript, args.out_dir, path.stem, formats)
        info = transcript.info
        busy = info.encoder_seconds + info.decoder_seconds
        rtf = info.duration / busy if busy else float("inf")
        drafted = f", acceptance {info.stats.acceptance_rate:.0%}" if info.speculative else ""
        print(f"{path} ({info.duration:.1f} s audio, {busy:.2f} s, {rtf:.1f}x real time{drafted}): {transcript.text}")
        done += 1
    print(f"{done} transcribed, {len(errors)} failed, {time.perf_counter() - started:.1f} s", file=sys.stderr)
    for error in errors:
        print(f"failed: {error}", file=sys.stderr)
    return 1 if errors else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "transcribe":
        return transcribe_command(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
