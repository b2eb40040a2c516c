"""Word error rate after Whisper's English normaliser, and labelled manifests."""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import jiwer


@lru_cache(maxsize=1)
def _normalizer():
    from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

    # The British-to-American spelling table ships with hub tokenizers, not offline: skipped.
    return EnglishTextNormalizer({})


def normalize(text: str) -> str:
    # Typographic apostrophes would split "beauty’s" where "beauty's" expands to "beauty is".
    return _normalizer()(text.replace("\u2019", "'").replace("\u2018", "'"))


def word_error_rate(references: list[str], hypotheses: list[str]) -> float:
    pairs = [(normalize(r), normalize(h)) for r, h in zip(references, hypotheses, strict=True)]
    pairs = [(r, h) for r, h in pairs if r]
    return jiwer.wer([r for r, _ in pairs], [h for _, h in pairs]) if pairs else 0.0


@dataclass(frozen=True)
class LabelledClip:
    path: Path
    duration: float
    reference: str
    language: str = "en"


def read_manifest(path: Path) -> list[LabelledClip]:
    """A tab-separated file with columns file, duration_seconds, reference and optionally
    notes ("lang=de" marks a non-English clip); files are relative to the manifest's folder."""
    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    clips = []
    for row in rows:
        language = re.search(r"lang=(\w+)", row.get("notes") or "")
        clips.append(LabelledClip(path.parent / row["file"], float(row["duration_seconds"]), row["reference"],
                                  language.group(1) if language else "en"))
    return clips
