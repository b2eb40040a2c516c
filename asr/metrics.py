"""Word error rate after Whisper's text normalisers, and labelled manifests."""

from __future__ import annotations

import codecs
import csv
import io
import itertools
import os
import re
import unicodedata
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import jiwer

from asr.vocab import language_code
from asr.words import UNSPACED

# Languages written without spaces between words: scored by the letter (Khmer too, whose
# word timings follow Whisper's list, without it).
SCORED_BY_LETTER = UNSPACED | {"km"}

# whisper-normalizer ships Whisper's normalisers with the English spelling map
# (British to American), which transformers' copy needs from a hub tokenizer.
NORMALIZER = ("whisper-normalizer (Whisper's English normaliser with its spelling map, typographic apostrophes "
              "(’ ‘) read as ' first; basic normaliser otherwise, "
              "keeping marks (vowel signs), its letters split for languages written without spaces: there WER is a "
              "character error rate)")



@lru_cache(maxsize=1)
def _english():
    from whisper_normalizer.english import EnglishTextNormalizer

    return EnglishTextNormalizer()


@lru_cache(maxsize=2)
def _basic(split_letters: bool = False):
    from whisper_normalizer.basic import BasicTextNormalizer

    # Whisper's own makes every mark a space: Hindi's or Thai's vowel signs and viramas, so that
    # a wrong vowel was no error and words fell apart into consonants.
    return BasicTextNormalizer(split_letters=split_letters, preserve_marks=True)


def normalize(text: str, language: str = "en") -> str:
    """Whisper's English normaliser for English, its basic (language-neutral) one otherwise,
    marks kept; for Chinese, Japanese, Thai... (no spaces between words) the basic one with its
    letters split by spaces, so that a "word" error rate counts letters, not whole sentences."""
    if language != "en":
        return " ".join(_without_stray_marks(_basic(language in SCORED_BY_LETTER)(text)).split())
    # Typographic apostrophes would split "beauty’s" where "beauty's" expands to "beauty is".
    return _english()(text.replace("\u2019", "'").replace("\u2018", "'")).strip()


def _without_stray_marks(text: str) -> str:
    """Marks kept, those that belong to no letter become spaces: an emoji's variation
    selector (its emoji a space, "❤️" left a word of its own), enclosing marks (a keycap's)."""
    out = []
    for char in text:
        category = unicodedata.category(char)
        stray = category[0] == "M" and (category == "Me" or "VARIATION SELECTOR" in unicodedata.name(char, "")
                                        or not out or unicodedata.category(out[-1])[0] not in "LNM")
        out.append(" " if stray else char)
    return "".join(out)


def word_error_rate(references: list[str], hypotheses: list[str], languages: list[str] | None = None) -> float | None:
    """Corpus-level WER of normalised texts (normalized_wer)."""
    languages = languages or ["en"] * len(references)
    pairs = [(normalize(r, lang), normalize(h, lang)) for r, h, lang in zip(references, hypotheses, languages, strict=True)]
    return normalized_wer([r for r, _ in pairs], [h for _, h in pairs])


def normalized_wer(references: list[str], hypotheses: list[str]) -> float | None:
    """All errors over all reference words (word_errors of each pair). None where no
    reference has a word."""
    counts = [word_errors(r, h) for r, h in zip(references, hypotheses, strict=True)]
    words = sum(c.reference_words for c in counts)
    return sum(c.errors for c in counts) / words if words else None


@dataclass(frozen=True)
class WordErrors:
    substitutions: int
    deletions: int
    insertions: int
    reference_words: int

    @property
    def errors(self) -> int:
        return self.substitutions + self.deletions + self.insertions


def word_errors(reference: str, hypothesis: str) -> WordErrors:
    """jiwer's alignment of two normalised texts; a reference without words (silence, music)
    has only insertions: every word of the hypothesis (jiwer cannot align an empty reference)."""
    if not reference.split():
        return WordErrors(0, 0, len(hypothesis.split()), 0)
    out = jiwer.process_words(reference, hypothesis)
    return WordErrors(out.substitutions, out.deletions, out.insertions, len(reference.split()))


LANGUAGE_COLUMNS = ("language", "lang", "locale")


@dataclass(frozen=True)
class LabelledClip:
    path: Path
    duration: float | None  # None: not in the manifest, measured from the audio
    reference: str
    language: str = "en"


def manifest_rows(path: Path, required: tuple[str, ...], limit: int | None = None) -> list[tuple[int, dict]]:
    """The rows of a tab-separated UTF-8 file with a header naming at least the columns
    `required` (in any case; a byte-order mark before it is no part of it), each with its
    line number and a non-empty file. A row that does not fit is an error naming its line.
    limit: only the first rows are read (a bad row after them is not looked at)."""
    csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))  # an hour's reference passes csv's 128 KiB
    if path.is_dir():  # read_bytes: a bare "[Errno 21] Is a directory"
        raise ValueError(f"{path}: is a folder; a manifest is a tab-separated file naming each clip and its reference")
    data = path.read_bytes()
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):  # a spreadsheet's "Unicode Text"
        try:
            text = data.decode("utf-16")
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}: not UTF-16 text, as its start says ({error.reason} at byte {error.start})") from None
    else:
        bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0  # not part of "file"
        try:
            text = data[bom:].decode("utf-8")
        except UnicodeDecodeError as error:  # decoded whole: a reader's error.start counts from its last chunk
            at = bom + error.start
            line = len((data[:at] + b"x").splitlines())  # \n, \r\n or \r, as csv reads them
            raise ValueError(f"{path}:{line}: not UTF-8 text ({error.reason} at byte {at})") from None
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter="\t", quoting=csv.QUOTE_NONE)
    # A spreadsheet's "Language" column was ignored: its clips were decoded as English.
    columns = reader.fieldnames = [c.strip().lower() for c in reader.fieldnames or []]
    missing = set(required) - set(columns)
    if missing:
        found = f"missing {', '.join(sorted(missing))}" if any(columns) else "its first line, the header, is blank"
        if len(columns) == 1 and "," in columns[0]:
            found += " (its header is comma-separated: save it with tabs)"
        raise ValueError(f"{path}: a manifest needs the column{'s' * (len(required) > 1)} {' and '.join(required)} "
                         f"(tab-separated); {found}")
    # DictReader would keep the last silently. Unnamed columns (a spreadsheet's trailing tabs) are no field.
    if repeated := sorted({c for c in columns if c.strip() and columns.count(c) > 1}):
        raise ValueError(f"{path}: the header names {', '.join(repeated)} more than once")
    def written(row: dict) -> bool:  # DictReader skips an empty line; one of spaces and tabs is as blank
        fields = [v or "" for k, v in row.items() if k is not None] + row.get(None, [])
        return any(field.strip() for field in fields)

    rows = [(reader.line_num, row) for row in itertools.islice(filter(written, reader), limit)]
    for line, row in rows:
        extra = [field for field in row.pop(None, []) if field.strip()]  # a trailing tab is no field
        if extra or any(row[column] is None for column in required):
            found = len(columns) + len(extra) - sum(v is None for v in row.values())
            why = "a tab inside the reference splits it" if extra else "a column is missing"
            raise ValueError(f"{path}:{line}: {found} tab-separated fields where the header has {len(columns)} ({why})")
        if not row["file"].strip():
            raise ValueError(f"{path}:{line}: no file named")
    return rows


def row_language(path: Path, line: int, row: dict, default: str) -> str:
    """A manifest row's language: a language (or lang, or locale: de-DE) column, or "lang=de"
    in a notes column, or else default."""
    hint = re.search(r"(?<!\w)lang=([\w-]+)", row.get("notes") or "", re.IGNORECASE)  # not src_lang= or tgt_lang=
    # A "lang" column was ignored: German clips decoded and scored as English, WER 100 %.
    given = {language_code(value) for column in LANGUAGE_COLUMNS if (value := row.get(column) or "").strip()}
    if len(given) > 1:
        raise ValueError(f"{path}:{line}: its language columns disagree ({', '.join(sorted(given))})")
    return given.pop() if given else language_code(hint.group(1) if hint else default)


def read_manifest(path: Path, default_language: str = "en", limit: int | None = None) -> list[LabelledClip]:
    """A manifest (manifest_rows) with at least the columns file and reference (files
    relative to the manifest's folder; an empty reference is a clip without speech).
    Optional: duration_seconds, and the clip's language as a language (or lang, or locale:
    de-DE) column or "lang=de" in a notes column (default: default_language). A clip listed
    twice is an error: it would weigh double in the WER and the speed."""
    clips, lines = [], {}
    for line, row in manifest_rows(path, ("file", "reference"), limit):
        language = row_language(path, line, row, default_language)
        duration = (row.get("duration_seconds") or "").strip()
        try:
            seconds = float(duration) if duration else None
        except ValueError:
            seconds = None
        if duration and not (seconds is not None and 0 < seconds < float("inf")):
            raise ValueError(f"{path}:{line}: duration_seconds {duration!r} is not a number of seconds above 0")
        clip = LabelledClip(path.parent / row["file"].strip(), seconds, row["reference"], language)
        if (first := lines.setdefault(_real(clip.path), line)) != line:
            raise ValueError(f"{path}:{line}: {row['file'].strip()} is listed on line {first} too: a clip listed twice "
                             "would weigh double in the WER and the speed")
        clips.append(clip)
    return clips


def _real(path: Path) -> str:
    """The path with links followed (the same file by two names is one clip); as written where
    it cannot be looked up (a name the locale cannot encode: its file fails on its own)."""
    try:
        return os.path.realpath(path)
    except (OSError, ValueError):
        return os.path.normpath(path)


def machine_load() -> float:
    """The machine's 1-minute load average (0.0 where the system keeps none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def load_note(load: float, threads: int, cpu_time: bool = False) -> str:
    """A benchmark's line on the machine's load during its run (the highest of its samples):
    on a 2-core machine busy with other work, ratios flipped (ours target-only 0.87x
    generate, against 2.05x quiet), and nothing in the output said so. cpu_time: the run
    timed its work in CPU time, which others' load does not inflate."""
    note = f"load average up to {load:.1f} on {os.cpu_count()} CPUs, this run using {threads} threads"
    if load > threads + 1 and not cpu_time:  # more than one other runnable process
        note += ": other work competed for the CPUs, so these figures are unreliable (run again on a quiet machine)"
    return note

