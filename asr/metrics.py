"""Word error rate after Whisper's text normalisers, and labelled manifests."""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import jiwer

# whisper-normalizer ships Whisper's normalisers with the English spelling map
# (British to American), which transformers' copy needs from a hub tokenizer.
NORMALIZER = "whisper-normalizer (Whisper's English normaliser with its spelling map; basic normaliser otherwise)"


@lru_cache(maxsize=1)
def _english():
    from whisper_normalizer.english import EnglishTextNormalizer

    return EnglishTextNormalizer()


@lru_cache(maxsize=1)
def _basic():
    from whisper_normalizer.basic import BasicTextNormalizer

    return BasicTextNormalizer()


def normalize(text: str, language: str = "en") -> str:
    """Whisper's English normaliser for English, its basic (language-neutral) one otherwise."""
    if language != "en":
        return _basic()(text).strip()
    # Typographic apostrophes would split "beauty’s" where "beauty's" expands to "beauty is".
    return _english()(text.replace("\u2019", "'").replace("\u2018", "'")).strip()


def word_error_rate(references: list[str], hypotheses: list[str], languages: list[str] | None = None) -> float:
    """Corpus-level WER (errors over all reference words) of normalised texts; references
    that normalise to nothing are left out, as jiwer cannot score them."""
    languages = languages or ["en"] * len(references)
    pairs = [(normalize(r, lang), normalize(h, lang)) for r, h, lang in zip(references, hypotheses, languages, strict=True)]
    return normalized_wer([r for r, _ in pairs], [h for _, h in pairs])


def normalized_wer(references: list[str], hypotheses: list[str]) -> float:
    pairs = [(r, h) for r, h in zip(references, hypotheses, strict=True) if r.strip()]
    return jiwer.wer([r for r, _ in pairs], [h for _, h in pairs]) if pairs else 0.0


@dataclass(frozen=True)
class LabelledClip:
    path: Path
    duration: float | None  # None: not in the manifest, measured from the audio
    reference: str
    language: str = "en"


def read_manifest(path: Path, default_language: str = "en") -> list[LabelledClip]:
    """A tab-separated file with a header and at least the columns file and reference
    (files relative to the manifest's folder). Optional: duration_seconds, and the clip's
    language as a language column or "lang=de" in a notes column (default: English)."""
    with open(path, newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        missing = {"file", "reference"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: a manifest needs the columns file and reference (tab-separated); missing {', '.join(sorted(missing))}")
        rows = list(reader)
    clips = []
    for row in rows:
        hint = re.search(r"lang=(\w+)", row.get("notes") or "")
        language = (row.get("language") or "").strip() or (hint.group(1) if hint else default_language)
        duration = (row.get("duration_seconds") or "").strip()
        clips.append(LabelledClip(path.parent / row["file"], float(duration) if duration else None, row["reference"] or "", language))
    return clips
