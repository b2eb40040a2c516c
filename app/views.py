"""HTML for the page's results: timed transcripts, live text, and rows of figures. Plain
functions of their data, so the page's wording is testable without a browser."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Iterable

from asr.streaming import StreamSummary
from asr.transcribe import Progress, SchedulerLoad, Segment, Transcript
from asr.words import Word

PLACEHOLDER = '<div class="asr-empty">{}</div>'
MIN_TIMED_SECONDS = 0.5  # audio shorter than this gets no real-time factor: a request's fixed cost is all it would show


@dataclass(frozen=True)
class Figure:
    label: str
    value: str
    note: str = ""


def clock(seconds: float) -> str:
    """m:ss.s, or h:mm:ss.s past an hour (rounded to the tenth first: 59.96 s is 1:00.0, not 0:60.0)."""
    minutes, tenths = divmod(round(max(seconds, 0.0) * 10), 600)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{tenths / 10:04.1f}" if hours else f"{minutes}:{tenths / 10:04.1f}"


def speed(rtf: float) -> str:
    """Real-time factor (compute seconds per audio second) in words."""
    if not rtf:
        return ""
    return f"{1 / rtf:.1f}× faster than real time" if rtf <= 1 else f"{rtf:.1f}× slower than real time"


def figures_html(figures: list[Figure]) -> str:
    cards = "".join(
        f'<div class="asr-figure"><div class="asr-figure-label">{html.escape(f.label)}</div>'
        f'<div class="asr-figure-value">{html.escape(f.value)}</div>'
        f'<div class="asr-figure-note">{html.escape(f.note)}</div></div>'
        for f in figures
    )
    return f'<div class="asr-figures">{cards}</div>'


def error_html(message: str) -> str:
    return f'<div class="asr-error" role="alert"><strong>Cannot transcribe.</strong> {html.escape(message)}</div>'


def notice_html(title: str, message: str) -> str:
    """Something the visitor should know, above the text it concerns: not an error."""
    return f'<div class="asr-warning" role="status"><strong>{html.escape(title)}</strong> {html.escape(message)}</div>'


def warnings_html(messages: Iterable[str]) -> str:
    """What reading an upload lost (TranscriptionInfo.warnings), above its transcript."""
    return "".join(notice_html("Part of the audio could not be read.", m) for m in messages)


def transcript_html(transcript: Transcript) -> str:
    if not transcript.segments:
        return PLACEHOLDER.format("No speech found in this recording.")
    return segments_html(transcript.segments)


def segments_html(segments: list[Segment]) -> str:
    rows = "".join(
        f'<div class="asr-segment"><span class="asr-time">{clock(s.start)} – {clock(s.end)}</span>'
        f'<span class="asr-text">{_words_html(s.words) if s.words else html.escape(s.text.strip())}</span></div>'
        for s in segments
    )
    return f'<div class="asr-transcript">{rows}</div>'


def _words_html(words: list[Word]) -> str:
    """Each word a span whose tooltip gives its time and probability."""
    return "".join(
        f'<span class="asr-word" title="{w.start:.2f}–{w.end:.2f} s · probability {w.probability:.0%}">'
        f"{html.escape(w.text.lstrip() if i == 0 else w.text)}</span>"
        for i, w in enumerate(words)
    )


def upload_figures(transcript: Transcript, seconds: float, language_name: str, language_detected: bool) -> list[Figure]:
    info, stats = transcript.info, transcript.info.stats
    # Below half a second, the fixed cost of a request made a 10 ms file "128x slower than real time".
    rtf = seconds / info.duration if info.duration >= MIN_TIMED_SECONDS else None
    figures = [
        Figure("Audio", f"{info.duration:.1f} s", clock(info.duration) if info.vad_options is None
               else f"{info.duration_after_vad:.1f} s of it speech (VAD)"),
        Figure("Processing", f"{seconds:.2f} s", f"encoder {info.encoder_seconds:.2f} s · decoder {info.decoder_seconds:.2f} s"),
        Figure("Real-time factor", "–", "too short to tell") if rtf is None else Figure("Real-time factor", f"{rtf:.2f}", speed(rtf)),
    ]
    if info.speculative:
        # A target-only decoder runs one target pass per token; each accepted draft token saves one.
        saved = stats.tokens - stats.target_passes
        figures += [
            Figure("Draft tokens accepted", f"{stats.draft_accepted} / {stats.draft_proposed}",
                   "none proposed" if stats.acceptance_rate is None else f"{stats.acceptance_rate:.0%} of proposals"),
            # Hint tokens (a retry proposing its failed attempt first) save passes with no draft token.
            Figure("Target passes saved", f"{saved}",
                   f"{stats.target_passes} passes for {stats.tokens} tokens"
                   + (f" ({saved / stats.tokens:.0%} fewer)" if stats.tokens else "")
                   + (f" · {stats.hint_accepted} tokens taken from a retry's earlier attempt" if stats.hint_accepted else "")),
        ]
    else:
        figures.append(Figure("Target passes", f"{stats.target_passes}", "no draft model: one pass per token"))
    if not info.language:  # Skip silences found no speech: no window was decoded to tell it
        figures.append(Figure("Language", "none", "no speech to detect it from"))
    elif language_detected and not transcript.segments:  # noise heard as a language, beside "No speech found"
        figures.append(Figure("Language", "none", f"no speech heard (the likeliest, {language_name}, at "
                                                  f"{info.language_probability:.0%})"))
    else:
        note = f"detected ({info.language_probability:.0%})" if language_detected else "as chosen"
        figures.append(Figure("Language", language_name, note))
    return figures


def progress_figures(progress: Progress, seconds: float) -> list[Figure]:
    """An upload still decoding, `seconds` after it was handed over."""
    if not progress.started:
        return [Figure("Starting", f"{seconds:.0f} s", "reading the audio, or waiting for the models")]
    done = progress.fraction * progress.duration
    return [
        Figure("Audio", f"{progress.duration:.1f} s", clock(progress.duration)),
        Figure("Transcribed", f"{progress.fraction:.0%}", f"{clock(done)} of {clock(progress.duration)}"),
        Figure("Processing", f"{seconds:.0f} s", "so far"),
    ]


def live_html(committed: str, tentative: str, listening: bool, ended: bool = False) -> str:
    """Committed text never changes again; the tentative tail may still be revised, so it is
    shown apart (grey) until the transcriber commits it. ended: a recording's final text
    (none: it said nothing was heard, not the idle invitation to speak)."""
    if not committed.strip() and not tentative.strip():
        if ended:
            return PLACEHOLDER.format("No speech heard in this recording.")
        return PLACEHOLDER.format("Listening…" if listening else "Press Record and speak: the transcript appears here.")
    return (
        '<div class="asr-live">'
        f'<span class="asr-committed">{html.escape(committed.strip())}</span> '
        f'<span class="asr-tentative">{html.escape(tentative.strip())}</span></div>'
    )


def stopped_html(message: str, committed: str, tentative: str) -> str:
    """A live session that failed: why, above the text it had (which stays on the page: the
    error once took its place, and minutes of dictation went with it)."""
    kept = live_html(committed, tentative, listening=False) if committed.strip() or tentative.strip() else ""
    return error_html(message) + kept


BEHIND_SECONDS = 5.0  # this much audio waiting for a decode: the page says the transcript falls behind


def live_status(final: bool, recorded_seconds: float, waiting_seconds: float, limit_seconds: int) -> str:
    """The live recording's state in words: recording (and how far behind its transcript
    is, where the server decodes slower than speech), finished, or stopped at the limit."""
    if final:
        return ("finished" if recorded_seconds <= limit_seconds else
                f"stopped at the {limit_seconds // 60}-minute limit: press Stop, then Record to go on")
    if waiting_seconds > BEHIND_SECONDS:
        return (f"recording · the transcript is {waiting_seconds:.0f} s behind: this server decodes more slowly "
                "than you speak")
    return "recording"


def live_figures(summary: StreamSummary, recorded_seconds: float, status: str) -> list[Figure]:
    """status: the recording's, in words (recording, finished, why it stopped)."""
    if summary.median_commit_latency is None:
        latency = Figure("Commit latency", "–", "nothing committed yet")
    else:
        latency = Figure("Commit latency", f"{summary.median_commit_latency:.1f} s",
                         f"median · p90 {summary.p90_commit_latency:.1f} s · max {summary.max_commit_latency:.1f} s "
                         f"over {summary.words} words")
    # As an upload's: a recording of a fraction of a second showed its fixed costs as "real-time factor 2.17".
    rtf = (f"real-time factor {summary.compute_seconds / summary.audio_seconds:.2f}"
           if summary.audio_seconds >= MIN_TIMED_SECONDS else "too short for a real-time factor")
    passes = summary.target_passes
    return [
        Figure("Audio heard", f"{summary.audio_seconds:.1f} s",
               f"of {max(recorded_seconds, summary.audio_seconds):.1f} s recorded · {status}"),
        latency,
        Figure("Compute", f"{summary.compute_seconds:.1f} s", f"{rtf} · {summary.updates} decodes"),
        Figure("Target passes", f"{passes}",
               f"{summary.decoded_tokens} tokens, {summary.decoded_tokens / passes:.1f} per pass" if passes else ""),
        # Each re-decode proposes the previous hypothesis first; what the target keeps costs no new pass.
        Figure("Reused hypothesis", f"{summary.hypothesis_tokens_accepted} / {summary.hypothesis_tokens_proposed}",
               f"tokens kept · {summary.draft_tokens_accepted} more from the draft"),
    ]


def server_figures(load: SchedulerLoad, recordings: int, most_recordings: int) -> list[Figure]:
    """recordings: microphones being transcribed, of most_recordings at once."""
    return [
        Figure("Live recordings", f"{recordings} / {most_recordings}", "microphones being transcribed"),
        Figure("In progress", f"{load.recordings + load.windows}",
               f"{load.recordings} files · {load.windows} live updates · {load.queued} waiting"),
        Figure("Batch", f"{load.rows} rows", "decoding together now"),
        Figure("Audio served", f"{load.audio_seconds_served / 3600:.2f} h", f"{load.recordings_served} files"),
        Figure("Live updates", f"{load.windows_served}", "microphone windows decoded"),
        Figure("Failures", f"{load.failures}", "decoding errors (bad files are refused before)"),
        Figure("Cancelled", f"{load.cancelled}", "uploads stopped, or whose visitor left"),
    ]
