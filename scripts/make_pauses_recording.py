"""Writes the recording behind the README's --vad figures, with its manifest:

    python scripts/make_pauses_recording.py OUT_DIR
    asr transcribe OUT_DIR/pauses.flac --language en [--vad]
    asr evaluate OUT_DIR/manifest.tsv --out OUT_DIR/report --peers faster-whisper --peers transformers [--vad]

pauses.flac: two dev clips around 40 s of faint noise, 67.7 s in all, the recording the
tests use (tests/conftest.py::speech_between_silences); its reference is the two clips'."""

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
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    soundfile.write(out / "pauses.flac", speech_between_silences(), SAMPLE_RATE)
    references = {c.path.name: c.reference for c in read_manifest(DEV / "manifest.tsv")}
    reference = f"{references['jfk.flac']} {references['2412-153948-0000.flac']}"
    (out / "manifest.tsv").write_text(f"file\treference\npauses.flac\t{reference}\n")
    print(out / "pauses.flac", out / "manifest.tsv")
