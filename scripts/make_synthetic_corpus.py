"""Builds a synthetic English speech corpus for distilling a draft, where no speech corpus
can be reached: passages of public-domain and freely licensed English text spoken by
espeak-ng (formant synthesis) or flite (CMU's statistical and diphone voices, closer to
a human voice) with varied voices, rates and pitches, then speed-perturbed, sometimes
reverberated, and mixed with noise.

    apt-get install espeak-ng flite fortunes bible-kjv dict-devil
    python scripts/make_synthetic_corpus.py --out corpus/ --clips 3000 [--engines flite]

Text: sentences from Debian's `fortunes`, the King James Bible (`bible-kjv`, public
domain) and Ambrose Bierce's Devil's Dictionary (`dict-devil`, public domain); sources
that are not installed are skipped. A clip is a run of consecutive sentences from one
source read by one voice, with pauses between sentences, from --min-seconds up to
--max-seconds long: several sentences per 30 s window, as in real recordings, give the
target more tokens to label per (costly) encoder pass.

Writes corpus/NNNNN.flac (16 kHz mono) and corpus/manifest.tsv (file, duration_seconds,
reference, notes). Never point this at the evaluation recordings: they stay unseen."""

from __future__ import annotations

import argparse
import gzip
import random
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import soundfile
import soxr

FORTUNES = Path("/usr/share/games/fortunes")
DEVIL = Path("/usr/share/dictd/devil.dict.dz")
ESPEAK_VOICES = ["en-us", "en-gb", "en-gb-scotland", "en-gb-x-gbclan", "en-gb-x-rp", "en-gb-x-gbcwmd", "en-029", "en-us-nyc"]
ESPEAK_VARIANTS = ["", "+m1", "+m2", "+m3", "+m4", "+m5", "+m6", "+m7", "+f1", "+f2", "+f3", "+f4", "+f5", "+klatt", "+klatt2", "+klatt4"]
FLITE_VOICES = ["awb", "rms", "slt", "kal16", "kal"]  # kal is 8 kHz: telephone-band speech
ENGINES = ["espeak-ng", "flite"]
SAMPLE_RATE = 16_000
PLAIN = re.compile(r"[A-Za-z0-9 ,.;:!?'\"()-]+")


def split_sentences(paragraph: str) -> list[str]:
    """Sentences of 3-30 words in plain characters (espeak reads anything, but the labels
    should be ordinary prose)."""
    flat = " ".join(paragraph.replace("_", "").split())
    return [s for s in re.split(r"(?<=[.!?])\s+", flat) if 3 <= len(s.split()) <= 30 and PLAIN.fullmatch(s)]


def fortunes() -> list[str]:
    """Plain-prose sentences from every fortune file, in file order."""
    found: list[str] = []
    if not FORTUNES.is_dir():
        return found
    for path in sorted(FORTUNES.iterdir()):
        if path.suffix or not path.is_file():
            continue
        for fortune in path.read_text(encoding="utf-8", errors="ignore").split("\n%\n"):
            if not re.search(r"^\s|[<>{}\[\]|_=#*\\]|\t", fortune, flags=re.M):  # verse, code, tables, ascii art
                found += split_sentences(fortune)
    return list(dict.fromkeys(found))


def king_james_bible() -> list[str]:
    try:
        text = subprocess.run(["bible", "-f", "Ge1:1-Re22:21"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    verses = [line.split(" ", 1)[1] for line in text.splitlines() if " " in line]
    return [s for verse in verses for s in split_sentences(verse)]


def devils_dictionary() -> list[str]:
    if not DEVIL.exists():
        return []
    text = gzip.open(DEVIL, "rt", encoding="utf-8", errors="ignore").read()
    return [s for paragraph in re.split(r"\n\s*\n", text) for s in split_sentences(paragraph)]


SOURCES = {"fortunes": fortunes, "kjv": king_james_bible, "devil": devils_dictionary}


def speak(engine: str, text: str, voice: str, rate: float, pitch: float) -> tuple[np.ndarray, int] | None:
    """`rate` and `pitch` are relative, 0 to 1 (slow to fast, low to high)."""
    with tempfile.NamedTemporaryFile(suffix=".wav") as raw, tempfile.NamedTemporaryFile("w", suffix=".txt") as words:
        # Text from a file: a sentence starting with "-" must not read as an option.
        words.write(text)
        words.flush()
        if engine == "espeak-ng":
            command = ["espeak-ng", "-v", voice, "-s", str(round(120 + 90 * rate)), "-p", str(round(20 + 60 * pitch)),
                       "-w", raw.name, "-f", words.name]
        else:
            command = ["flite", "-voice", voice, "--setf", f"duration_stretch={1.25 - 0.45 * rate:.2f}",
                       "--setf", f"int_f0_target_mean={round(85 + 110 * pitch)}", "-f", words.name, "-o", raw.name]
        done = subprocess.run(command, capture_output=True)
        try:
            audio, rate_in = soundfile.read(raw.name, dtype="float32")
        except soundfile.LibsndfileError:
            return None
    return (audio, rate_in) if done.returncode == 0 and len(audio) else None


def reverberate(audio: np.ndarray, rng: random.Random, seed: int) -> np.ndarray:
    """A room: the direct sound plus exponentially decaying noise (RT60 0.15-0.7 s)."""
    rt60 = rng.uniform(0.15, 0.7)
    length = int(SAMPLE_RATE * rt60)
    decay = np.exp(-6.9 * np.arange(length) / length)  # -60 dB at rt60
    response = np.random.default_rng(seed + 1).normal(size=length) * decay * rng.uniform(0.05, 0.3)
    response[0] = 1.0
    size = len(audio) + length - 1
    wet = np.fft.irfft(np.fft.rfft(audio, size) * np.fft.rfft(response, size), size)
    return wet[: len(audio)].astype(np.float32)


def synthesize(job: tuple[int, list[str], float, int, list[str], Path]) -> tuple[str, float, str, str] | None:
    index, passage, seconds, seed, engines, out_dir = job
    rng = random.Random(seed)
    engine = rng.choice(engines)
    voice = rng.choice(ESPEAK_VOICES) + rng.choice(ESPEAK_VARIANTS) if engine == "espeak-ng" else rng.choice(FLITE_VOICES)
    rate, pitch = rng.random(), rng.random()
    speed = rng.uniform(0.9, 1.1)  # resampling as if played faster or slower: tempo and pitch move together
    pieces, spoken, length = [], [], rng.uniform(0.05, 0.8)
    for sentence in passage:
        said = speak(engine, sentence, voice, rate, pitch)
        if said is None:
            break
        audio = soxr.resample(said[0], said[1] * speed, SAMPLE_RATE)
        pause = np.zeros(int(SAMPLE_RATE * rng.uniform(0.1, 0.9)), dtype=np.float32)
        if spoken and length + (len(audio) + len(pause)) / SAMPLE_RATE > seconds:
            break
        pieces += [audio, pause]
        spoken.append(sentence)
        length += (len(audio) + len(pause)) / SAMPLE_RATE
    if not spoken or length > 29.5:
        return None
    audio = np.concatenate([np.zeros(int(SAMPLE_RATE * rng.uniform(0.05, 0.8)), dtype=np.float32)] + pieces)
    room = rng.random() < 0.3
    if room:
        audio = reverberate(audio, rng, seed)
    audio = audio / (np.abs(audio).max() + 1e-9) * rng.uniform(0.2, 0.9)
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
    notes = f"{engine} voice={voice} rate={rate:.2f} pitch={pitch:.2f} speed={speed:.2f} room={room} noise={noise_kind}" + (
        f"@{snr:.0f}dB" if noise_kind != "none" else "")
    return name, len(audio) / SAMPLE_RATE, " ".join(spoken), notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--clips", type=int, default=3000)
    parser.add_argument("--min-seconds", type=float, default=4.0)
    parser.add_argument("--max-seconds", type=float, default=28.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    args = parser.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    if not engines:  # rng.choice([]) then failed in every worker
        parser.error(f"--engines {args.engines!r}: name at least one, of {', '.join(ENGINES)}")
    if unknown := set(engines) - set(ENGINES):
        parser.error(f"unknown engine(s): {', '.join(sorted(unknown))}")
    if missing := [e for e in engines if shutil.which(e) is None]:
        raise SystemExit(f"not installed: {', '.join(missing)} (apt-get install {' '.join(missing)})")
    texts = {name: load() for name, load in SOURCES.items()}
    texts = {name: sentences for name, sentences in texts.items() if sentences}
    if not texts:
        raise SystemExit("no text found: apt-get install fortunes bible-kjv dict-devil")
    print(", ".join(f"{name}: {len(sentences)} sentences" for name, sentences in texts.items()))
    rng = random.Random(args.seed)
    jobs = []
    for i in range(args.clips):
        sentences = texts[rng.choice(sorted(texts))]  # each source equally often, whatever its size
        start = rng.randrange(len(sentences))
        jobs.append((i, sentences[start : start + 12], rng.uniform(args.min_seconds, args.max_seconds),
                     args.seed * 1_000_003 + i, engines, args.out))
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with ProcessPoolExecutor(args.workers) as workers:
        for row in workers.map(synthesize, jobs, chunksize=8):
            if row is not None:
                rows.append(row)
    with open(args.out / "manifest.tsv", "w", encoding="utf-8") as manifest:
        manifest.write("file\tduration_seconds\treference\tnotes\n")
        for name, duration, text, notes in rows:
            manifest.write(f"{name}\t{duration:.3f}\t{text}\t{notes}\n")
    print(f"wrote {len(rows)} clips, {sum(r[1] for r in rows) / 3600:.2f} h, to {args.out}")


if __name__ == "__main__":
    main()
