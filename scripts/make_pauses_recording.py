"""Writes the recording behind the README's --vad figures, with its manifest:

    python scripts/make_pauses_recording.py OUT_DIR
    asr transcribe OUT_DIR/pauses.flac --language en [--vad]
    asr evaluate OUT_DIR/manifest.tsv --out OUT_DIR/report --peers faster-whisper --peers transformers [--vad]

pauses.flac: two dev clips around 40 s of faint noise, 67.7 s in all, the recording the
tests use (tests/conftest.py::speech_between_silences); its reference is the two clips'.

    python scripts/make_pauses_recording.py OUT_DIR --repeat 28 --rate 48000 --stereo
    /usr/bin/time -v asr transcribe OUT_DIR/pauses-x28.flac --language en --vad

also writes pauses-xN.flac: it N times over (28: 31.6 minutes), at that rate and in two
channels, as a long recording from a recorder; the README's memory figure for --vad."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import soundfile

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from conftest import DEV, speech_between_silences  # noqa: E402

from asr.audio import SAMPLE_RATE  # noqa: E402
from asr.metrics import read_manifest  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, metavar="OUT_DIR")
    parser.add_argument("--repeat", type=int, default=0, help="also write pauses-xN.flac, the recording N times over")
    parser.add_argument("--rate", type=int, default=SAMPLE_RATE, help="its sample rate (default 16000)")
    parser.add_argument("--stereo", action="store_true", help="in two channels")
    args = parser.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    soundfile.write(out / "pauses.flac", speech_between_silences(), SAMPLE_RATE)
    if args.repeat:
        import numpy as np
        import soxr

        long = soxr.resample(np.tile(speech_between_silences(), args.repeat), SAMPLE_RATE, args.rate)
        soundfile.write(out / f"pauses-x{args.repeat}.flac", np.stack([long, long], 1) if args.stereo else long, args.rate)
        print(out / f"pauses-x{args.repeat}.flac")
    references = {c.path.name: c.reference for c in read_manifest(DEV / "manifest.tsv")}
    reference = f"{references['jfk.flac']} {references['2412-153948-0000.flac']}"
    (out / "manifest.tsv").write_text(f"file\treference\npauses.flac\t{reference}\n")
    print(out / "pauses.flac", out / "manifest.tsv")
