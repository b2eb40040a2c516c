"""Folder throughput, batched versus one by one, on the same files in one run.

    python scripts/benchmark_folder.py                       # dev clips, as they are and as long recordings
    python scripts/benchmark_folder.py --set long --batch-sizes 1,8,16
    python scripts/benchmark_folder.py --folder my_audio/    # your own files

Each batch size transcribes the same folder through the folder code path (asr.batch:
header scan, duration sort, reading, decoding, atomic writes) into a fresh output folder,
with one model pipeline loaded once. The batch sizes take turns in mirrored order (1, 8, 8,
1 for sizes 1,8), so that drift in a shared machine's load weighs on all of them alike; each
row sums its two runs. RTFx is seconds of audio per second of wall time; "vs batch N" is
the ratio of RTFx to the first size's (N); "same text" counts transcripts identical to its.

Sets built from ../shared/eval/dev (English):
- short: the clips as they are (1.5 to 53 s; most shorter than one 30 s window);
- long: recordings of about --long-seconds each, the clips joined with short pauses in a
  different order for each recording (long-form speech: every window full).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import soundfile
import torch

from asr.audio import SAMPLE_RATE, load_audio
from asr.batch import DEFAULT_BATCH_SIZE, FolderRun, FolderSummary, transcribe_folder
from asr.metrics import load_note, machine_load, read_manifest
from asr.models import DEFAULT_PRESET, PRESETS, choose_dtypes, load_pair
from asr.transcribe import TranscribeOptions, Transcriber

DEV = Path(__file__).resolve().parent.parent.parent / "shared" / "eval" / "dev"


def build_short(folder: Path) -> None:
    for clip in read_manifest(DEV / "manifest.tsv"):
        shutil.copy(clip.path, folder / clip.path.name)


def build_long(folder: Path, count: int, seconds: float) -> None:
    clips = [load_audio(c.path) for c in read_manifest(DEV / "manifest.tsv")]
    pause = np.zeros(int(0.4 * SAMPLE_RATE), dtype=np.float32)
    for n in range(count):
        parts, total, i = [], 0, n
        while total < seconds * SAMPLE_RATE:
            parts += [clips[i % len(clips)], pause]
            total += len(parts[-2]) + len(pause)
            i += 3  # a different order for each recording
        soundfile.write(folder / f"recording_{n:02d}.flac", np.concatenate(parts)[: int(seconds * SAMPLE_RATE)], SAMPLE_RATE)


def run(folder: Path, transcriber: Transcriber, out: Path) -> tuple[FolderSummary, dict[str, str]]:
    summary = transcribe_folder(FolderRun((folder,), out, ("txt",), progress=False, echo=False), lambda: transcriber)
    texts = {p.relative_to(out).as_posix(): p.read_text() for p in out.rglob("*.txt")}
    return summary, texts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", choices=["short", "long", "both"], default="both")
    parser.add_argument("--folder", type=Path, help="benchmark this folder instead of the dev sets")
    parser.add_argument("--batch-sizes", default=f"1,{DEFAULT_BATCH_SIZE}", help="comma-separated; the first is the baseline")
    parser.add_argument("--long-count", type=int, default=8, help="recordings in the long set")
    parser.add_argument("--long-seconds", type=float, default=45.0)
    parser.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET)
    parser.add_argument("--no-speculation", action="store_true")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="as asr transcribe's (auto: float32 decoders, a bfloat16 encoder where the CPU computes in it)")
    args = parser.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if not sizes or min(sizes) < 1:
        parser.error(f"--batch-sizes {args.batch_sizes!r}: whole numbers from 1, comma-separated")
    if args.folder and not (args.folder.is_dir() and any(p.is_file() for p in args.folder.rglob("*"))):
        parser.error(f"--folder {args.folder}: not a folder with files in it")

    target, draft = PRESETS[args.preset]
    dtype, encoder_dtype = choose_dtypes("cpu", None if args.dtype == "auto" else getattr(torch, args.dtype))
    pair = load_pair(target, None if args.no_speculation else draft, dtype=dtype, encoder_dtype=encoder_dtype)
    options = TranscribeOptions(speculative=not args.no_speculation)
    print(f"preset {args.preset} ({target} + {'no draft' if args.no_speculation else draft}), {pair.target.dtype_label}, "
          f"{torch.get_num_threads()} CPU threads, batch sizes {sizes}; RTFx: seconds of audio per second of wall time "
          "(reading, decoding and writing)", flush=True)
    load = 0.0  # sampled after each set: the minute before the run is not its
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        sets: list[tuple[str, Path]] = []
        if args.folder:
            sets.append((str(args.folder), args.folder))
        else:
            for name in ("short", "long") if args.set == "both" else (args.set,):
                folder = scratch / name
                folder.mkdir()
                build_short(folder) if name == "short" else build_long(folder, args.long_count, args.long_seconds)
                sets.append((name, folder))
        warm = next(p for p in sorted(sets[0][1].rglob("*")) if p.is_file())
        Transcriber(pair, options).transcribe(warm)  # first-call costs (allocation, oneDNN packing) out of the timings

        print(f"| set | files | audio s | batch | wall s (2 runs) | RTFx | vs batch {sizes[0]} | acceptance | same text |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, folder in sets:
            totals = {size: FolderSummary() for size in sizes}
            texts: dict[int, dict[str, str]] = {}
            for turn, size in enumerate(sizes + sizes[::-1]):
                summary, texts[size] = run(folder, Transcriber(pair, options, batch_size=size), scratch / f"out-{name}-{size}-{turn}")
                assert summary.failed == 0, f"{summary.failed} file(s) failed"
                total = totals[size]
                total.ok = summary.ok
                for field in ("audio_seconds", "wall_seconds", "draft_proposed", "draft_accepted"):
                    setattr(total, field, getattr(total, field) + getattr(summary, field))
            baseline = totals[sizes[0]]
            for size in sizes:
                total = totals[size]
                same = sum(text == texts[sizes[0]].get(k) for k, text in texts[size].items())
                print(f"| {name} | {total.ok} | {total.audio_seconds / 2:.1f} | {size} | {total.wall_seconds:.1f} | "
                      f"{total.rtfx:.2f} | {total.rtfx / baseline.rtfx:.2f}x | "
                      f"{'-' if total.acceptance is None else f'{total.acceptance:.0%}'} | {same}/{len(texts[size])} |", flush=True)
            load = max(load, machine_load())
    print(f"\n{load_note(load, torch.get_num_threads())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
