"""Transcripts out: txt, srt, vtt and json, named after the input's stem. Each file is
written to a temporary name and renamed into place, so an interrupted run never leaves
a half-written transcript over a finished one."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from asr.transcribe import Segment, Transcript
from asr.words import columns, cut_unspaced, joined, shared_times

FORMATS = ("txt", "srt", "vtt", "json", "tsv")
DEFAULT_FORMATS = FORMATS[:4]  # what a run writes unless told: tsv only where asked for
# The longest file name: 255 bytes on Linux's file systems and APFS, 255 UTF-16 units on NTFS.
NAME_MAX, NAME_UNIT = 255, ("UTF-16 units" if os.name == "nt" else "bytes")
# Read once, at import: reading it means setting it, which races with threads creating files.
UMASK = os.umask(0o022)
os.umask(UMASK)


def _clock(seconds: float, decimal: str) -> str:
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal}{millis:03d}"


def to_txt(transcript: Transcript) -> str:
    """A segment a line, as Whisper's writer (an hour's transcript is not one line)."""
    return "".join(f"{text}\n" for text in (s.text.strip() for s in transcript.segments) if text) or "\n"


@dataclass(frozen=True)
class SubtitleLayout:
    """How srt and vtt cues are laid out. max_line_width: text broken into lines of at most
    this many columns (a character; a Chinese, Japanese or Korean one takes two, as on a
    screen; a longer word has a line of its own), each segment a cue, timed
    by its words where they are timed. max_line_count: cues of at most this many lines; with
    word timestamps timed by their words, which flow across segments, a pause of more than
    PAUSE_SECONDS between two words starting a new cue; without, each segment's cues share
    its time by their characters. None: no limit."""

    max_line_width: int | None = None
    max_line_count: int | None = None

    def __post_init__(self) -> None:
        if self.max_line_count is not None and self.max_line_width is None:
            raise ValueError("a subtitle's line count needs a line width to break its lines at")
        if any(limit is not None and limit < 1 for limit in (self.max_line_width, self.max_line_count)):
            raise ValueError("subtitle line widths and counts are at least 1")


# A silence this long from one word's end to the next word's start ends a cue (Whisper's
# subtitle writer measures from one word's start to the next's, which a long word trips).
PAUSE_SECONDS = 3.0
# A cue of no time (a segment past the audio's end, clamped to it; a word timed at an
# instant) is shown up to this long before its time, or joins the cue before it within this.
MIN_CUE_SECONDS = 0.5
CJK = re.compile("[\u3000-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef]")  # no space between sentences
Piece = tuple[float, float, str]  # a word to lay out: start, end, text (leading space included)


def _cues(transcript: Transcript, layout: SubtitleLayout) -> list[Piece]:
    """The transcript as subtitle cues (start, end, lines) laid out as asked. A blank line ends
    a cue and "-->" starts one, so neither may be in a cue's text; a cue without text is
    none, a cue never starts before the previous one ends (players would stack them), and
    none lasts no time."""
    segments, width = transcript.segments, layout.max_line_width
    if width is None:
        laid_out = [(s.start, s.end, s.text) for s in segments]
    elif layout.max_line_count is not None and all(s.words is not None for s in segments):
        laid_out = _laid_out(_flowing(segments, width), width, layout.max_line_count)
    else:  # without words, each segment on its own (its text's times are a guess)
        laid_out = [cue for s in segments for cue in _laid_out(_pieces(s, width), width, layout.max_line_count)]
    cues: list[Piece] = []
    for given, end, text in laid_out:
        text = "\n".join(line.strip() for line in re.sub(r"-{2,}>", "->", text).splitlines() if line.strip())
        if not text:
            continue
        start = max(given, cues[-1][1]) if cues else given
        if round(end * 1000) > round(start * 1000):  # as written, to the millisecond
            cues.append((start, end, text))
        elif not cues:
            cues.append((start, start + MIN_CUE_SECONDS, text))
        elif given - cues[-1][1] >= MIN_CUE_SECONDS:  # of no time, well after the cue before: shown just before it
            cues.append((given - MIN_CUE_SECONDS, given, text))
        else:  # a cue of no time, which players never show: the cue before takes it, within the layout
            before_start, before_end, before = cues[-1]
            space = "" if CJK.match(before[-1]) and CJK.match(text[0]) else " "  # Thai spaces its sentences
            if width is None or ("\n" not in text and columns(before.split("\n")[-1] + space + text) <= width):
                cues[-1] = (before_start, before_end, f"{before}{space}{text}")
            elif layout.max_line_count is None or before.count("\n") + text.count("\n") + 2 <= layout.max_line_count:
                cues[-1] = (before_start, before_end, f"{before}\n{text}")
            else:  # no room there: up to MIN_CUE_SECONDS before its time, at most half the cue before's,
                begin = max(start - MIN_CUE_SECONDS, (before_start + before_end) / 2)
                if min(start - begin, begin - before_start) >= MIN_CUE_SECONDS / 2:
                    cues[-1] = (before_start, min(before_end, begin), before)
                    cues.append((begin, start, text))
                else:  # or, where that leaves either too short to read (words piled up at an instant), after it
                    cues.append((start, start + MIN_CUE_SECONDS, text))
    return cues


def _flowing(segments: list[Segment], width: int) -> list[Piece]:
    """The segments' words in one run, to flow from one segment into the next: a segment
    written without a leading space ("Yes", "반갑습니다.") is spaced from the one before, but
    between two Chinese or Japanese characters ("Hello friend.Yes indeed.")."""
    pieces: list[Piece] = []
    for segment in segments:
        words = _pieces(segment, width)
        if pieces and words and not words[0][2][:1].isspace() and not (
                CJK.match(pieces[-1][2][-1:]) and CJK.match(words[0][2][:1])):
            words[0] = (words[0][0], words[0][1], " " + words[0][2])
        pieces += words
    return pieces


def _pieces(segment: Segment, width: int) -> list[Piece]:
    """The segment's words, each cut where it is a run of a script written without spaces
    (Chinese, Japanese, Thai...) wider than a line (cut_unspaced). Timed words keep their
    times, a cut one's parts sharing it by their columns; without timed words, the words
    of its text share the segment's time so (about right: speech runs at a fairly even
    rate of characters)."""
    if not segment.words:
        parts = [piece for word in re.findall(r"\s*\S+", segment.text) for piece in cut_unspaced(word, width)]
        return _shared(segment.start, segment.end, parts)
    words: list[Piece] = []
    for word in segment.words:
        # A timed word of such a script is a token's piece ("Whis", "per"; "「"): one a
        # line may not break before (words.joined) goes with the word before it.
        if words and word.text[:1].strip() and words[-1][2] and joined(words[-1][2][-1], word.text[0]):
            words[-1] = (words[-1][0], word.end, words[-1][2] + word.text)
        else:
            words.append((word.start, word.end, word.text))
    return [piece for start, end, text in words for piece in _shared(start, end, cut_unspaced(text, width))]


def _shared(start: float, end: float, parts: list[str]) -> list[Piece]:
    """Parts of a text said from start to end, each timed by its share of the columns."""
    return [(begin, finish, part) for (begin, finish), part in zip(shared_times(start, end, parts, columns), parts)]


def _laid_out(words: list[Piece], width: int, count: int | None = None) -> list[Piece]:
    """Words as cues of lines filled up to `width` columns, at most `count` lines each
    (None: one cue), a pause ending a cue. A word keeps its leading space (none in Chinese
    or Japanese), which the line's start drops."""
    cues: list[list[list[Piece]]] = []
    lines: list[list[Piece]] = []
    used = 0
    for word in words:
        pause = bool(lines) and word[0] - lines[-1][-1][1] > PAUSE_SECONDS
        if lines and not pause and used + columns(word[2]) <= width:
            lines[-1].append(word)
            used += columns(word[2])
            continue
        if lines and (pause or len(lines) == count):
            cues.append(lines)
            lines = []
        lines.append([word])
        used = columns(word[2].strip())
    cues += [lines] if lines else []
    return [(cue[0][0][0], cue[-1][-1][1], "\n".join("".join(text for _, _, text in line) for line in cue)) for cue in cues]


def to_srt(transcript: Transcript, layout: SubtitleLayout = SubtitleLayout()) -> str:
    blocks = [
        f"{i}\n{_clock(start, ',')} --> {_clock(end, ',')}\n{text}\n"
        for i, (start, end, text) in enumerate(_cues(transcript, layout), start=1)
    ]
    return "\n".join(blocks)


def to_vtt(transcript: Transcript, layout: SubtitleLayout = SubtitleLayout()) -> str:
    # WebVTT reads "<" as a tag's start and "&" as an escape's in a cue's text ("I <3 AT&T").
    escape = {ord("&"): "&amp;", ord("<"): "&lt;"}
    blocks = [f"{_clock(start, '.')} --> {_clock(end, '.')}\n{text.translate(escape)}\n"
              for start, end, text in _cues(transcript, layout)]
    return "WEBVTT\n\n" + "\n".join(blocks)


def to_tsv(transcript: Transcript) -> str:
    """openai/whisper's tsv: a header, then a segment a line, its start and end in whole
    milliseconds, its text with tabs and line breaks as spaces (a spreadsheet's columns)."""
    rows = [f"{round(1000 * s.start)}\t{round(1000 * s.end)}\t{' '.join(s.text.split())}\n"
            for s in transcript.segments if s.text.strip()]
    return "start\tend\ttext\n" + "".join(rows)


def to_json(transcript: Transcript) -> str:
    info, stats = transcript.info, transcript.info.stats
    document = {
        "text": transcript.text,
        "language": info.language or None,  # none detected: nothing decoded (no speech kept by vad_filter)
        "task": info.task,  # translate: the language is the speech's, the text English
        "language_probability": round(info.language_probability, 4),
        "duration": round(info.duration, 3),
        **({} if info.vad_options is None else {"duration_after_vad": round(info.duration_after_vad, 3)}),
        **({"warnings": list(info.warnings)} if info.warnings else {}),  # damaged audio skipped in reading
        "segments": [_segment(s) for s in transcript.segments],
        "stats": {
            "speculative": info.speculative,
            "dtype": info.dtype,
            "draft_tokens_proposed": stats.draft_proposed,
            "draft_tokens_accepted": stats.draft_accepted,
            "acceptance_rate": None if stats.acceptance_rate is None else round(stats.acceptance_rate, 4),
            # A fallback's retry proposes its failed attempt first: not draft tokens, but kept
            # in fewer passes too (without them, tokens looked too many for the draft's share).
            "hint_tokens_proposed": stats.hint_proposed,
            "hint_tokens_accepted": stats.hint_accepted,
            "target_forward_passes": stats.target_passes,
            "tokens": stats.tokens,
            "windows": info.windows,
            "features_seconds": round(info.features_seconds, 4),
            "encoder_seconds": round(info.encoder_seconds, 4),
            "decoder_seconds": round(info.decoder_seconds, 4),
        },
    }
    return json.dumps(_finite(document), ensure_ascii=False, indent=2, allow_nan=False) + "\n"


def _finite(value: object) -> object:
    """NaN and infinities are not JSON (JSON.parse refuses the file): a figure that overflowed is null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def _segment(s: Segment) -> dict:
    # openai/whisper's keys, which tools written for its JSON read.
    # The text as Whisper wrote it, leading space included: joined, the segments make the text.
    document = {"id": s.id, "seek": s.seek, "start": s.start, "end": s.end, "text": s.text, "tokens": s.tokens,
                "temperature": s.temperature, "avg_logprob": round(s.avg_logprob, 4),
                "compression_ratio": round(s.compression_ratio, 4), "no_speech_prob": round(s.no_speech_prob, 4)}
    if s.language is not None:  # multilingual: the language detected in its window
        document["language"] = s.language
    if s.words is not None:
        document["words"] = [{"start": round(w.start, 3), "end": round(w.end, 3), "word": w.text,
                              "probability": round(w.probability, 4)} for w in s.words]
    return document


RENDERERS: dict[str, Callable[[Transcript, SubtitleLayout], str]] = {
    "txt": lambda transcript, _: to_txt(transcript), "srt": to_srt, "vtt": to_vtt,
    "json": lambda transcript, _: to_json(transcript), "tsv": lambda transcript, _: to_tsv(transcript)}


def render(transcript: Transcript, fmt: str, layout: SubtitleLayout = SubtitleLayout()) -> str:
    _check_formats([fmt])
    return RENDERERS[fmt](transcript, layout)


def _check_formats(formats: list[str]) -> None:
    if unknown := [fmt for fmt in formats if fmt not in RENDERERS]:  # a bare KeyError: 'TXT'
        raise ValueError(f"unknown output format {unknown[0]!r}: the formats are {', '.join(FORMATS)}")


def unwritable(folder: Path) -> str | None:
    """Why folder cannot be made and written into (None: it can): said before any model
    loads, not after hours of work."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a folder"
    # A file made and gone: os.access said yes to root, and of /proc. Once, by a name of its own
    # (tempfile's retries a refusal as a clash on Windows, 2 billion times).
    probe = existing / f".asr-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        probe.unlink()
        return None
    except OSError as error:
        return f"{existing} cannot be written to ({error.strerror or error})"


def write_atomic(path: Path, data: str | bytes) -> None:
    """Writes to a temporary file beside `path`, flushed to disk, then renamed over it: a
    crash leaves the old file or the new one, never part of one. The file gets the mode a
    plain open() would give it (the temporary file's own is private)."""
    write_files_atomic({path: data})


def write_files_atomic(files: dict[Path, str | bytes]) -> None:
    """write_atomic for files that go together (a report's): every one is written to its
    temporary file before any is renamed, so a full disk leaves the old set whole; a rename
    that fails midway (a file held open on Windows, another user's in a sticky folder) puts
    back those already replaced, from links (or copies) made before the first."""
    temporaries: dict[Path, str] = {}
    olds: dict[Path, str] = {}  # the old files' copies
    replaced: list[Path] = []
    try:
        for path, data in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporaries[path] = tempfile.mkstemp(dir=path.parent, prefix=temporary_prefix(path.name),
                                                         suffix=".part")
            with os.fdopen(handle, "wb") as out:
                # backslashreplace: a file name that is not UTF-8 (in a JSON transcript's source) as \udcXX
                out.write(data.encode("utf-8", "backslashreplace") if isinstance(data, str) else data)
                out.flush()
                if hasattr(os, "fchmod"):  # not on Windows before Python 3.13, whose files are not private anyway
                    # FAT and exFAT drives refuse it (EPERM) unless mounted "quiet": their files'
                    # modes are the mount's, and every transcript written to a USB stick failed.
                    with contextlib.suppress(PermissionError):
                        os.fchmod(out.fileno(), 0o666 & ~UMASK)
                os.fsync(out.fileno())
        if len(files) > 1:
            for path in files:
                if path.is_file():
                    handle, olds[path] = tempfile.mkstemp(dir=path.parent, prefix=temporary_prefix(path.name),
                                                          suffix=".part")
                    os.close(handle)
                    try:  # a second name for the old file: no space taken, its mode kept
                        os.unlink(olds[path])
                        os.link(path, olds[path])
                    except OSError:  # FAT, exFAT: no links
                        shutil.copy2(path, olds[path])
        for path in files:
            os.replace(temporaries[path], path)
            del temporaries[path]
            replaced.append(path)
    except BaseException:
        for temporary in temporaries.values():
            Path(temporary).unlink(missing_ok=True)
        for path in replaced:
            with contextlib.suppress(OSError):  # what can be put back is; the error raised is the first
                if path in olds:
                    os.replace(olds[path], path)
                    del olds[path]
                else:
                    path.unlink()
        raise
    finally:
        for old in olds.values():
            Path(old).unlink(missing_ok=True)


def name_length(name: str) -> int:
    """A file name's length as NAME_MAX counts it here."""
    return len(name.encode("utf-16-le", "surrogatepass")) // 2 if os.name == "nt" else len(os.fsencode(name))


TEMPORARY_END = len("abcd1234.part")  # what mkstemp adds to temporary_prefix: 8 random characters, the suffix


def temporary_prefix(name: str) -> str:
    """How write_atomic's temporary files for `name` start: ".NAME.", cut where the
    temporary's name would not fit where NAME fits."""
    return os.fsencode(f".{name}.")[:NAME_MAX - TEMPORARY_END].decode("utf-8", "ignore")


def write_transcript(transcript: Transcript, out_dir: Path, stem: str, formats: list[str],
                     layout: SubtitleLayout = SubtitleLayout()) -> list[Path]:
    _check_formats(formats)  # before any is written
    written = []
    for fmt in formats:
        path = out_dir / f"{stem}.{fmt}"
        write_atomic(path, render(transcript, fmt, layout))
        written.append(path)
    return written
