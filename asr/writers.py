"""Transcripts out: txt, srt, vtt and json, named after the input's stem. Each file is
written to a temporary name and renamed into place, so an interrupted run never leaves
a half-written transcript over a finished one."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from asr.transcribe import Segment, Transcript

FORMATS = ("txt", "srt", "vtt", "json")
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
    return transcript.text + "\n"


def _cues(transcript: Transcript) -> list[tuple[float, float, str]]:
    """Segments as subtitle cues: a blank line ends a cue and "-->" starts one, so neither
    may be in a cue's text; a segment without text is no cue."""
    cues = []
    for s in transcript.segments:
        text = "\n".join(line.strip() for line in s.text.replace("-->", "->").splitlines() if line.strip())
        if text:
            cues.append((s.start, s.end, text))
    return cues


def to_srt(transcript: Transcript) -> str:
    blocks = [
        f"{i}\n{_clock(start, ',')} --> {_clock(end, ',')}\n{text}\n"
        for i, (start, end, text) in enumerate(_cues(transcript), start=1)
    ]
    return "\n".join(blocks)


def to_vtt(transcript: Transcript) -> str:
    blocks = [f"{_clock(start, '.')} --> {_clock(end, '.')}\n{text}\n" for start, end, text in _cues(transcript)]
    return "WEBVTT\n\n" + "\n".join(blocks)


def to_json(transcript: Transcript) -> str:
    info, stats = transcript.info, transcript.info.stats
    document = {
        "text": transcript.text,
        "language": info.language,
        "language_probability": round(info.language_probability, 4),
        "duration": round(info.duration, 3),
        **({} if info.duration_after_vad is None else {"duration_after_vad": round(info.duration_after_vad, 3)}),
        "segments": [_segment(s) for s in transcript.segments],
        "stats": {
            "speculative": info.speculative,
            "dtype": info.dtype,
            "draft_tokens_proposed": stats.draft_proposed,
            "draft_tokens_accepted": stats.draft_accepted,
            "acceptance_rate": round(stats.acceptance_rate, 4),
            "target_forward_passes": stats.target_passes,
            "tokens": stats.tokens,
            "windows": info.windows,
            "encoder_seconds": round(info.encoder_seconds, 4),
            "decoder_seconds": round(info.decoder_seconds, 4),
        },
    }
    return json.dumps(document, ensure_ascii=False, indent=2) + "\n"


def _segment(s: Segment) -> dict:
    document = {"start": s.start, "end": s.end, "text": s.text.strip(), "avg_logprob": round(s.avg_logprob, 4),
                "no_speech_prob": round(s.no_speech_prob, 4), "temperature": s.temperature}
    if s.words is not None:
        document["words"] = [{"start": round(w.start, 3), "end": round(w.end, 3), "word": w.text,
                              "probability": round(w.probability, 4)} for w in s.words]
    return document


RENDERERS = {"txt": to_txt, "srt": to_srt, "vtt": to_vtt, "json": to_json}


def write_atomic(path: Path, data: str | bytes) -> None:
    """Writes to a temporary file beside `path`, flushed to disk, then renamed over it: a
    crash leaves the old file or the new one, never part of one. The file gets the mode a
    plain open() would give it (the temporary file's own is private)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(handle, "wb") as out:
            # backslashreplace: a file name that is not UTF-8 (in a JSON transcript's source) as \udcXX
            out.write(data.encode("utf-8", "backslashreplace") if isinstance(data, str) else data)
            out.flush()
            os.fchmod(out.fileno(), 0o666 & ~UMASK)
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_transcript(transcript: Transcript, out_dir: Path, stem: str, formats: list[str]) -> list[Path]:
    written = []
    for fmt in formats:
        path = out_dir / f"{stem}.{fmt}"
        write_atomic(path, RENDERERS[fmt](transcript))
        written.append(path)
    return written
