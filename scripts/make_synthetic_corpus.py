"""Builds a synthetic English speech corpus for distilling a draft, where no speech corpus
can be reached: sentences from Debian's `fortunes` package spoken by espeak-ng with
varied voices, rates and pitches, then speed-perturbed and mixed with noise.

    apt-get install espeak-ng fortunes
    python scripts/make_synthetic_corpus.py --out corpus/ --clips 3000

Writes corpus/NNNNN.flac (16 kHz mono) and corpus/manifest.tsv (file, duration_seconds,
reference, notes). Never point this at the evaluation recordings: they stay unseen."""

from __future__ import annotations

import argparse
import random
import re
import subprocess
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import soundfile
import soxr

FORTUNES = Path("/usr/share/games/fortunes")
VOICES = ["en-us", "en-gb", "en-gb-scotland", "en-gb-x-gbclan", "en-gb-x-rp", "en-gb-x-gbcwmd", "en-029", "en-us-nyc"]
VARIANTS = ["", "+m1", "+m2", "+m3", "+m4", "+m5", "+m6", "+m7", "+f1", "+f2", "+f3", "+f4", "+f5", "+klatt", "+klatt2", "+klatt4"]
SAMPLE_RATE = 16_000


def sentences(directory: Path) -> list[str]:
    """Plain-prose sentences of 4-30 words from every fortune file."""
    found: set[str] = set()
    for path in sorted(directory.iterdir()):
        if path.suffix or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="ignore")
        for fortune in text.split("\n%\n"):
            if re.search(r"^\s|[<>{}\[\]|_=#*\\]|\t", fortune, flags=re.M):
                continue  # verse, code, tables, attributions, ascii art
            flat = " ".join(fortune.split())
            for sentence in re.split(r"(?<=[.!?])\s+", flat):
                words = sentence.split()
                if 4 <= len(words) <= 30 and re.fullmatch(r"[A-Za-z0-9 ,.;:!?'\"()-]+", sentence):
                    found.add(sentence)
    return sorted(found)


def synthesize(job: tuple[int, str, int, Path]) -> tuple[str, float, str, str] | None:
    index, text, seed, out_dir = job
    rng = random.Random(seed)
    voice = rng.choice(VOICES) + rng.choice(VARIANTS)
    rate, pitch = rng.randint(120, 210), rng.randint(20, 80)
    with tempfile.NamedTemporaryFile(suffix=".wav") as raw:
        # Text on stdin: a sentence starting with "-" must not read as an option.
        done = subprocess.run(["espeak-ng", "-v", voice, "-s", str(rate), "-p", str(pitch), "-w", raw.name, "--stdin"],
                              input=text.encode(), capture_output=True)
        try:
            audio, rate_in = soundfile.read(raw.name, dtype="float32")
        except soundfile.LibsndfileError:
            return None
        if done.returncode != 0 or len(audio) == 0:
            return None
    speed = rng.uniform(0.9, 1.1)  # resampling as if played faster or slower: tempo and pitch move together
    audio = soxr.resample(audio, rate_in * speed, SAMPLE_RATE)
    audio = audio / (np.abs(audio).max() + 1e-9) * rng.uniform(0.2, 0.9)
    lead, tail = (np.zeros(int(SAMPLE_RATE * rng.uniform(0.05, 0.8)), dtype=np.float32) for _ in range(2))
    audio = np.concatenate([lead, audio, tail])
    noise_kind = rng.choice(["none", "white", "pink", "brown"])
    snr = rng.uniform(5, 35)
    if noise_kind != "none":
        noise = np.random.default_rng(seed).normal(size=len(audio)).astype(np.float32)
        if noise_kind != "white":
            spectrum = np.fft.rfft(noise)
            freqs = np.maximum(np.fft.rfftfreq(len(noise)), 1e-4)
            spectrum /= freqs ** (0.5 if noise_kind == "pink" else 1.0)
            noise = np.fft.irfft(spectrum, n=len(noise)).astype(np.float32)
        power = float(np.mean(audio**2)) / (10 ** (snr / 10))
        audio = audio + noise / (np.sqrt(np.mean(noise**2)) + 1e-9) * np.sqrt(power)
    audio = np.clip(audio, -1, 1).astype(np.float32)
    name = f"{index:05d}.flac"
    soundfile.write(out_dir / name, audio, SAMPLE_RATE)
    notes = f"voice={voice} rate={rate} pitch={pitch} speed={speed:.2f} noise={noise_kind}" + (
        f"@{snr:.0f}dB" if noise_kind != "none" else "")
    return name, len(audio) / SAMPLE_RATE, text, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--clips", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    pool = sentences(FORTUNES)
    if not pool:
        raise SystemExit(f"no sentences under {FORTUNES}: apt-get install fortunes")
    random.Random(args.seed).shuffle(pool)
    chosen = pool[: args.clips]
    print(f"{len(pool)} sentences available, synthesising {len(chosen)}")
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = [(i, text, args.seed * 1_000_003 + i, args.out) for i, text in enumerate(chosen)]
    rows = []
    with ProcessPoolExecutor(args.workers) as pool_:
        for row in pool_.map(synthesize, jobs, chunksize=16):
            if row is not None:
                rows.append(row)
    with open(args.out / "manifest.tsv", "w", encoding="utf-8") as manifest:
        manifest.write("file\tduration_seconds\treference\tnotes\n")
        for name, duration, text, notes in rows:
            manifest.write(f"{name}\t{duration:.3f}\t{text}\t{notes}\n")
    print(f"wrote {len(rows)} clips, {sum(r[1] for r in rows) / 3600:.2f} h, to {args.out}")


if __name__ == "__main__":
    main()
