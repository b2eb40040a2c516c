"""From audio to timed segments: 30 s windows with Whisper's seek logic, language
detection, temperature fallback and no-speech skipping. Windows of different recordings
decode together as one batch; windows of one recording follow each other, since each
window's start depends on where the previous one's last segment ended."""

from __future__ import annotations

import atexit
import contextlib
import math
import numbers
import os
import queue
import threading
import time
import traceback
import weakref
import zlib
from concurrent.futures import FIRST_COMPLETED, Future, InvalidStateError, wait
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
from torch import Tensor

from asr import hints, sampling, vad
from asr.audio import (SAMPLE_RATE, AudioError, audio_seconds, checked_rate, gathered, load_audio, stream_audio,
                       time_within, to_model_input)
from asr.features import FRAME_SECONDS, HOP_LENGTH, WINDOW_FRAMES, WINDOW_SAMPLES, StreamedMel, content_frames, log_mel, window_at
from asr.cudagraphs import device_clock
from asr.decoder import KVCache, attention_without_cudnn, lengths_kernel
from asr.models import ModelPair
from asr.rules import DecodingRules
from asr.slots import DecodeStats, Sequence, Window
from asr.vocab import language_code
from asr.words import Word, align, anomalous, copied_at, keys_of_words, word_keys

TIMESTAMP_SECONDS = 0.02
FRAMES_PER_TIMESTAMP = round(TIMESTAMP_SECONDS / FRAME_SECONDS)
STREAM_ABOVE_SECONDS = 600.0  # Transcriber.read streams longer files block by block instead of loading them
# A sampled attempt with this many words in a row of its previous text copies it, and fails.
PROMPT_COPY_WORDS = 6
# The Scheduler admits a queued recording as if it had arrived this many seconds earlier per
# second of audio: a long one, which needs the most rounds, starts first (see Scheduler._admit).
HEAD_START_PER_AUDIO_SECOND = 0.1


def _floats(value: object) -> tuple[float, ...]:
    """One number, or the numbers of any iterable (a list, numpy array, tensor, generator: read
    once), as floats; text refused ("0.2" was taken as the temperatures 0, '.', 2)."""
    if isinstance(value, (str, bytes)):
        raise TypeError("text, not numbers")
    items = [value] if isinstance(value, numbers.Real) or getattr(value, "ndim", None) == 0 else list(value)
    if any(isinstance(item, (str, bytes)) for item in items):
        raise TypeError("text, not numbers")
    return tuple(float(item) for item in items)


def _clips(value: object) -> tuple[float, ...]:
    """clip_timestamps as seconds: numbers, or text of numbers between commas; checked."""
    wrong = f"clip_timestamps must be start, end, start, ... seconds, from 0 up and each after the one before, not {value!r}"
    try:
        clips = (tuple(float(t) for t in value.split(",")) if isinstance(value, str) and value.strip()
                 else () if isinstance(value, str) or value is None else _floats(value))
    except (TypeError, ValueError):
        raise ValueError(wrong) from None
    if not all(0 <= t < math.inf for t in clips) or any(b <= a for a, b in zip(clips, clips[1:])):
        raise ValueError(wrong)
    return clips


def _token_ids(value: object) -> tuple[int, ...]:
    """suppress_tokens as whole numbers from -1 up: any iterable of them, or text of them between commas."""
    wrong = f"suppress_tokens must be token ids (-1: the model's own list), not {value!r}"
    if value is None:
        return ()
    try:
        items = ([t for t in value.split(",") if t.strip()] if isinstance(value, str)
                 else [value] if isinstance(value, numbers.Integral) else list(value))
        ids = tuple(int(t) if isinstance(t, str) else t for t in items)
    except (TypeError, ValueError):
        raise ValueError(wrong) from None
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= -1 for t in ids):
        raise ValueError(wrong)
    return tuple(int(t) for t in ids)


def check_whole(name: str, value: object, least: int | None) -> None:
    """Refuses, naming it, a value that is no whole number (of Python or numpy; not a bool) of at least `least`."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or (least is not None and value < least):
        raise ValueError(f"{name} must be a whole number{f' of at least {least}' if least is not None else ''}, not {value!r}")


@dataclass(frozen=True)
class TranscribeOptions:
    language: str | None = None  # None: detect from the first window (or more, below)
    # Where the first window's likeliest language is no more than language_detection_threshold
    # likely, the next 30 s are heard too, up to this many windows (faster-whisper's options):
    # the first sure one's language, else the one likeliest in most of them. Not with a language.
    language_detection_segments: int = 1
    language_detection_threshold: float = 0.5
    # Each window's language detected (faster-whisper's multilingual): a recording whose speakers
    # change language; each segment says its window's. Not with a language given.
    multilingual: bool = False
    task: str = "transcribe"  # or "translate" (to English)
    temperatures: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    compression_ratio_threshold: float | None = 2.4
    log_prob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6
    condition_on_previous_text: bool = True
    # Text taken as said before the audio (names, spellings, style to expect): the first
    # window's previous text, as Whisper's initial_prompt. Later windows follow it as long as
    # they are conditioned on the previous text and not reset by a fallback above 0.5.
    initial_prompt: str = ""
    # Words and names to expect, put before every window's previous text (faster-whisper's
    # hotwords): unlike initial_prompt, never left behind by later windows.
    hotwords: str = ""
    # Text the transcript starts with (faster-whisper's prefix): forced at the window at 0 s
    # (none where clips start later, as faster-whisper's), then decoded on from. That window
    # reads no hotwords, as faster-whisper's.
    prefix: str = ""
    # Token ids never decoded (faster-whisper's suppress_tokens): -1 stands for the model's own
    # list (symbols speech is not written with); () suppresses none of it. The control tokens
    # (<|startoftranscript|>, <|translate|>, ...) are suppressed whatever is given.
    suppress_tokens: tuple[int, ...] = (-1,)
    without_timestamps: bool = False
    word_timestamps: bool = False  # each segment's words timed (asr/words.py): one more target pass per window
    # With word_timestamps, a segment whose words look hallucinated (asr.words.anomalous) between
    # silences longer than this many seconds is skipped, as Whisper's and faster-whisper's option.
    hallucination_silence_threshold: float | None = None
    # A greedy window heard as silence that copies its previous text is decoded again without it
    # (Transcriber._copied_greedily); False: kept as Whisper and faster-whisper keep it.
    retry_greedy_copies: bool = True
    # Silences cut out before decoding and times mapped back (asr/vad.py, faster-whisper's
    # vad_filter); the filter reads the whole recording first (a long file's block by block).
    vad_filter: bool = False
    # With vad_filter, faster-whisper's vad_parameters: a vad.VadParameters, a dict of its
    # fields or faster-whisper's VadOptions (None: its defaults).
    vad_parameters: vad.VadParameters | None = None
    # Only these parts of a recording transcribed: start, end, start, end, ... seconds (the
    # last end left out: to the recording's end), also as text ("60,120"), as Whisper's and
    # faster-whisper's option: each clip decoded window by window apart from the next, the
    # previous text carried over. Not with vad_filter (faster-whisper ignores it then).
    clip_timestamps: tuple[float, ...] = ()
    max_new_tokens: int = 224
    speculative: bool = True
    num_draft_tokens: int | None = None  # None: adaptive
    max_draft_tokens: int = 8
    seed: int = 0  # a sampled window's draws follow it, its seek and its attempt (asr/sampling.py)
    # Sampled attempts per temperature above 0, the likeliest kept (Whisper's and faster-whisper's
    # best_of, 5 by default there): rows decoded side by side, beyond the batch's rows.
    best_of: int = 1
    cuda_graphs: bool = True  # on CUDA, the engine's steps run as CUDA graphs (asr/cudagraphs.py)
    compile: bool = False  # the engine's steps compiled whole by torch.compile (SpeculativeDecoder.compiled)
    lengths_attention: bool | str = False  # on CUDA, attention by row lengths: "flash" (or True) or "triton" (SpeculativeDecoder's)
    fused_layers: bool = False  # on CUDA, linear maps fused with norms and residual adds in our kernels (SpeculativeDecoder's)

    def __post_init__(self) -> None:
        # As faster-whisper takes them: one temperature as a number, no prompt as None.
        # Any sequence: a tuple of floats, hashable and fixed as a frozen dataclass's, and
        # written to JSON (numpy's float32 is not).
        try:
            given = _floats(self.temperatures)
        except (TypeError, ValueError):
            raise ValueError(f"temperatures must be numbers from 0 up, not {self.temperatures!r}") from None
        if not all(0 <= t < math.inf for t in given):
            raise ValueError(f"temperatures must be numbers from 0 up, not {self.temperatures!r}")
        if not given:
            raise ValueError("temperatures: give at least one")
        object.__setattr__(self, "temperatures", given)
        object.__setattr__(self, "suppress_tokens", _token_ids(self.suppress_tokens))
        for name in ("initial_prompt", "hotwords", "prefix"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, "")
        object.__setattr__(self, "clip_timestamps", _clips(self.clip_timestamps))
        # Checked here, by name: they failed mid-decode with a bare TypeError, or decoded nonsense
        # (max_new_tokens -5 ran a row backwards until the decoder's positions ran out).
        for name, least in [("max_new_tokens", 1), ("best_of", 1), ("max_draft_tokens", 0), ("seed", None),
                            ("num_draft_tokens", 0), ("language_detection_segments", 1)]:
            if not (name == "num_draft_tokens" and self.num_draft_tokens is None):
                check_whole(name, getattr(self, name), least)
        for name in ("compression_ratio_threshold", "log_prob_threshold", "no_speech_threshold"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, numbers.Real) and not math.isnan(value)):
                raise ValueError(f"{name} must be a number, or None for no threshold, not {value!r}")
        sure = self.language_detection_threshold
        if isinstance(sure, bool) or not (isinstance(sure, numbers.Real) and 0 <= sure <= 1):
            raise ValueError(f"language_detection_threshold must be a probability from 0 to 1, not {sure!r}")
        threshold = self.hallucination_silence_threshold
        if threshold is not None and (isinstance(threshold, bool) or not (isinstance(threshold, numbers.Real)
                                                                          and 0 <= threshold < math.inf)):
            raise ValueError(f"hallucination_silence_threshold must be seconds from 0 up, or None, not {threshold!r}")
        if self.clip_timestamps and self.vad_filter:
            raise ValueError("clip_timestamps and vad_filter (--clip-timestamps, --vad): one or the other "
                             "(faster-whisper ignores vad_filter with clips)")
        if threshold is not None and not self.word_timestamps:
            raise ValueError("hallucination_silence_threshold judges segments by their timed words: it needs word_timestamps")
        if self.compression_ratio_threshold is not None and self.compression_ratio_threshold <= 0:
            raise ValueError(f"compression_ratio_threshold must be above 0 (every window fell back), "
                             f"not {self.compression_ratio_threshold!r}")
        for name in ("initial_prompt", "hotwords", "prefix"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ValueError(f"{name} must be text, not {value!r}")
            try:  # a Latin-1 byte, as Python passes it from a command line: the tokenizer refused it mid-run
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"{name} is not UTF-8 text: {value!r}") from None
        # Flags as flags: "false" is a true value, and was taken for one (speculative="false" drafted).
        for name in ("condition_on_previous_text", "without_timestamps", "word_timestamps", "retry_greedy_copies",
                     "vad_filter", "speculative", "cuda_graphs", "compile", "fused_layers", "multilingual"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name} must be True or False, not {getattr(self, name)!r}")
            object.__setattr__(self, name, bool(getattr(self, name)))
        if self.vad_parameters is not None:
            object.__setattr__(self, "vad_parameters", vad.VadParameters.of(self.vad_parameters))
            if self.vad_filter is not True:  # faster-whisper ignores them then: a filter asked for, not run
                raise ValueError("vad_parameters are the options of vad_filter (--vad): give vad_filter=True too")
        # One value per engine (ModelPair.engine's key): True is flash's kernel.
        object.__setattr__(self, "lengths_attention", lengths_kernel(self.lengths_attention) or False)
        if self.language is not None and not isinstance(self.language, str):
            raise ValueError(f"language must be a language's code or name, or None to detect it, not {self.language!r}")
        if self.language is not None and self.language.strip().lower() == "auto":  # as the commands take it
            object.__setattr__(self, "language", None)
        if self.language is not None:  # "English" or "EN" as Whisper's command line takes them
            object.__setattr__(self, "language", language_code(self.language))
        if self.multilingual and self.language is not None:  # faster-whisper's detection overrides the language given
            raise ValueError(f"multilingual detects each window's language: give no language (not {self.language!r})")
        if self.language_detection_segments > 1 and self.language is not None:  # it would have done nothing, unsaid
            raise ValueError(f"language_detection_segments hears windows to detect the language: give no language "
                             f"(not {self.language!r})")


@dataclass(frozen=True)
class Segment:
    id: int
    start: float
    end: float
    text: str
    tokens: list[int]  # its timestamp tokens included, as Whisper's and faster-whisper's (text: those below eot)
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    temperature: float
    words: list[Word] | None = None  # with word_timestamps
    language: str | None = None  # with multilingual: its window's, as detected
    # Where its window started, in frames (10 ms) of the audio decoded (the speech alone with
    # vad_filter), as Whisper's and faster-whisper's seek.
    seek: int = 0


@dataclass
class TranscriptionInfo:
    language: str
    language_probability: float
    duration: float
    speculative: bool
    stats: DecodeStats = field(default_factory=DecodeStats)
    features_seconds: float = 0.0  # log-mel features (on the models' device)
    encoder_seconds: float = 0.0
    decoder_seconds: float = 0.0
    windows: int = 0
    dtype: str = ""  # the models' dtypes, e.g. "float32, encoder bfloat16"
    duration_after_vad: float | None = None  # the speech decoded with vad_filter; else (None given) the duration
    warnings: tuple[str, ...] = ()  # what reading the audio lost (AudioInput.warnings)
    task: str = "transcribe"  # or "translate": then language is the speech's, the text English
    # Detected: every language's probability, likeliest first (faster-whisper's); None where the language was given.
    all_language_probs: list[tuple[str, float]] | None = None
    transcription_options: TranscribeOptions | None = None  # the Transcriber's
    vad_options: vad.VadParameters | None = None  # those vad_filter ran with; None where it did not run

    def __post_init__(self) -> None:
        if self.duration_after_vad is None:  # as faster-whisper's: all of it was decoded
            self.duration_after_vad = self.duration


@dataclass
class Transcript:
    source: str
    segments: list[Segment]
    info: TranscriptionInfo

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.segments).strip()


@dataclass
class WindowResult:
    """One window decoded by Transcriber.transcribe_window."""

    tokens: list[int]  # generated tokens, timestamps included, end-of-text excluded
    language: str
    temperature: float
    silent: bool  # judged to hold no speech (transcribe would skip the window)
    info: TranscriptionInfo  # this window's stats and timings
    no_speech_prob: float = 0.0  # Whisper's probability that the window holds no speech
    # With word_timestamps (and not silent): the words of its text, timed by the target's
    # cross-attention (asr/words.py), in seconds into the window.
    words: list[Word] | None = None
    looped: bool = False  # stopped where it plainly loops (asr/slots.py's LOOP_TOKENS), short of its end


@dataclass(frozen=True)
class TextRun:
    """Text tokens between two timestamps of a window's tokens (text_runs)."""

    start: float  # the timestamp before them, in seconds into the window (none: 0)
    end: float  # the one after them (none: the window's duration)
    tokens: list[int]
    end_token: int  # the window's tokens up to here make this run and those before it
    closing: int | None  # the closing timestamp, in 20 ms steps (None: the run is open)


def text_runs(tokens: list[int], timestamp_begin: int, duration: float) -> list[TextRun]:
    """A window's tokens cut at every timestamp, as a stream cuts its hypotheses (empty runs
    left out); text after the last timestamp runs to the window's duration."""
    runs, text, start = [], [], 0.0
    for i, token in enumerate(tokens + [None]):  # None: the end of the tokens
        if token is not None and token < timestamp_begin:
            text.append(token)
            continue
        closing = None if token is None else token - timestamp_begin
        end = duration if closing is None else min(closing * TIMESTAMP_SECONDS, duration)
        if text:
            runs.append(TextRun(start, max(end, start), text, i + (token is not None), closing))
        text, start = [], end
    return runs


class Cancelled(Exception):
    """A transcription stopped by Progress.cancel()."""


_DECODING: set[Callable[[], None]] = set()  # what stops each segments() decoding thread still running
_SCHEDULERS: "weakref.WeakSet[Scheduler]" = weakref.WeakSet()  # those not closed
os.register_at_fork(after_in_child=_SCHEDULERS.clear)  # a forked child has none of their workers


@atexit.register
def _stop_decoding() -> None:
    """At exit, segments() iterators left unread and schedulers left open: their threads stopped
    and waited for (a thread cut off inside torch as the interpreter ends aborted the process:
    "terminate called without an active exception", after a script's last transcript)."""
    for stop in list(_DECODING):
        stop()
    for scheduler in list(_SCHEDULERS):
        scheduler.close()


class _Following(Iterator[Segment]):
    """Transcriber.segments' iterator: the segments of each report a decoding thread puts in
    `events` (Progress after each window, then the Transcript, or an error), as they come.
    close() stops the decoding (a generator's close did nothing before its first segment)."""

    def __init__(self, first: Progress | Transcript, events: queue.SimpleQueue, stop: Callable[[], None]):
        self._event, self._events, self._stop = first, events, stop
        self._seen, self._closed = 0, False

    def __next__(self) -> Segment:
        while not self._closed:
            if self._seen < len(segments := self._event.segments):
                self._seen += 1
                return segments[self._seen - 1]
            if isinstance(self._event, Transcript):
                break
            event = self._events.get()
            if isinstance(event, BaseException):  # Cancelled too: another call stopped it
                self.close()
                raise event
            self._event = event
        self.close()
        raise StopIteration

    def close(self) -> None:
        self._closed = True
        self._stop()


def _scanned(blocks: Iterator[np.ndarray], progress: Progress | None) -> Iterator[np.ndarray]:
    """blocks, until progress is cancelled."""
    for block in blocks:
        if progress is not None and progress.cancelled:
            raise Cancelled("cancelled while its audio was read")
        yield block


class Progress:
    """One recording's transcription seen from another thread (AudioInput.progress; a new one
    for each transcription): while it decodes, how far it has got and its segments so far;
    cancel() stops it (whoever waits for the transcript has gone), and Transcriber.transcribe
    raises Cancelled. Written by the decoding thread alone, each field replaced whole, so a
    reader never sees one half-built."""

    def __init__(self, listener: Callable[[Progress], None] | None = None) -> None:
        self.listener = listener  # called in the decoding thread after each report (as each window ends)
        self.started = False  # decoding has begun: no longer queued or waiting for a turn
        self.duration = 0.0  # of the recording, in seconds
        self.fraction = 0.0  # of the recording decoded
        self.segments: list[Segment] = []  # decoded so far, in the recording's times
        self.info: TranscriptionInfo | None = None  # the transcription's (its language, once the first window is decoded)
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


@dataclass
class AudioInput:
    name: str
    samples: np.ndarray | StreamedMel  # 16 kHz mono, or a long recording read block by block
    progress: Progress | None = None  # for a thread that watches this recording's transcription
    # What reading the file lost (damaged packets skipped, each message naming the file): the
    # transcript carries them (TranscriptionInfo.warnings) to the command line, JSON and web page.
    warnings: tuple[str, ...] = ()
    # Where vad_filter's cut is made as the file is read (Transcriber.read: a long recording),
    # the samples are the speech alone, and this is where it lies in the recording.
    speech: vad.SpeechMap | None = None

    def __post_init__(self) -> None:
        # Arrays as transcribe() takes them: float64 (soundfile's default) failed in the
        # features' matrix product, and int16 PCM was read unscaled (JFK's "The", not his sentence).
        if not isinstance(self.samples, StreamedMel) and self.speech is None:
            self.samples = to_model_input(self.samples, SAMPLE_RATE, self.name)

    @property
    def cancelled(self) -> bool:
        return self.progress is not None and self.progress.cancelled


Audio = str | Path | np.ndarray | AudioInput  # what Transcriber.transcribe takes (Transcriber.input)


@dataclass
class _Job:
    """A recording being transcribed (or one window of it, for transcribe_window): its
    features, how far the seek has got, and the Transcriber whose options it follows."""

    transcriber: Transcriber
    audio: AudioInput
    mel: Tensor | StreamedMel
    frames: int
    info: TranscriptionInfo
    language: str | None
    seek: int = 0
    segments: list[Segment] = field(default_factory=list)
    context: list[int] = field(default_factory=list)  # tokens that condition the next window
    heard: list[int] = field(default_factory=list)  # of them, those decoded from the recording (not the prompt)
    hint: list[int] = field(default_factory=list)  # tokens the window is expected to give: its first draft
    last_speech: float = 0.0  # where the last segment with timed words ended (asr/words.py)
    encoded: Tensor | None = None  # the current window's encoder output (kept for a fallback)
    draft_encoded: Tensor | None = None  # a draft with its own encoder: its output
    attempt: int = 0  # index of the current window's temperature in the options' temperatures
    unprompted: bool = False  # the window is decoded without its previous text (Transcriber._copied_greedily)
    copied: Sequence | None = None  # the greedy attempt that copied its previous text, while it is so checked
    failed: list[Sequence] = field(default_factory=list)  # the window's attempts that fell back
    candidates: list[Sequence] = field(default_factory=list)  # the current attempt's samples decoded (best_of)
    rows: int = 0  # the current attempt's rows still decoding
    max_new_tokens: int | None = None  # a lower limit than the options'
    window_only: bool = False  # one window decoded, not the recording's seek loop
    detect_each: bool = False  # every window's language detected (TranscribeOptions.multilingual)
    # clip_timestamps' (start, end) frames within the audio (None: all of it), the seek in one of them
    clips: tuple[tuple[int, int], ...] | None = None
    result: WindowResult | None = None  # a window_only job's, once decoded
    speech: vad.SpeechMap | None = None  # with vad_filter: where the decoded audio lies in the recording
    alone: bool = False  # a Scheduler's: its window decoded in a batch of its own, its shared batch having failed

    def window(self) -> Tensor:
        if isinstance(self.mel, StreamedMel):
            return self.mel.window(self.seek, self.window_end)
        return window_at(self.mel, self.seek, self.window_end)

    def _clip(self) -> tuple[int, int] | None:
        """The clip the seek is in (None: no clips, or past the last)."""
        return next(((start, end) for start, end in self.clips or () if self.seek < end), None)

    @property
    def window_end(self) -> int:
        """The frame where the current window's audio ends: the audio's, or its clip's end."""
        clip = self._clip()
        return self.frames if clip is None else clip[1]

    def move_to(self, seek: int) -> None:
        """Seeks there; with clips, at or past the current clip's end to the next clip's start
        whatever the seek (a window's last timestamp can lie past its clip's end), after the
        last to the audio's end, as Whisper's and faster-whisper's clip loop."""
        if self.clips is not None:
            current = self._clip()
            if current is None:
                seek = self.frames
            elif seek < current[1]:
                seek = max(seek, current[0])
            else:
                seek = next((start for start, _ in self.clips if start >= current[1]), self.frames)
        self.seek = seek

    @property
    def done(self) -> bool:
        return self.result is not None if self.window_only else self.seek >= self.frames

    @property
    def duration(self) -> float:
        """Of the audio decoded (the speech alone, with vad_filter)."""
        return self.info.duration if self.speech is None else self.speech.seconds

    def transcript(self) -> Transcript:
        return Transcript(self.audio.name, self._restored(self.segments), self.info)

    def report(self) -> None:
        """Tells the recording's Progress, if it has one, where decoding has got."""
        progress = self.audio.progress
        if progress is None or self.window_only:
            return
        progress.started, progress.duration, progress.info = True, self.info.duration, self.info
        progress.fraction = 1.0 if self.done else min(self._recording_time(self.seek * FRAME_SECONDS) / self.info.duration, 1.0)
        progress.segments = progress.segments + self._restored(self.segments[len(progress.segments) :])
        if progress.listener is not None:
            progress.listener(progress)

    def _recording_time(self, seconds: float) -> float:
        """A time in the decoded audio as one in the recording (with vad_filter, the speech alone is decoded)."""
        return seconds if self.speech is None else self.speech.original(seconds, self.speech.chunk_of(seconds))

    def _restored(self, segments: list[Segment]) -> list[Segment]:
        """In the recording's times (with vad_filter the decoded audio is its speech alone)."""
        return segments if self.speech is None else [self.speech.restore(s) for s in segments]


class Transcriber:
    """The typed Python API: `Transcriber(load_pair(...)).transcribe("talk.flac")`."""

    def __init__(self, models: ModelPair, options: TranscribeOptions = TranscribeOptions(), batch_size: int = 1,
                 scheduler: Scheduler | None = None):
        """scheduler: decode in its shared batches (many threads' work together) rather than
        in this thread."""
        check_whole("batch_size", batch_size, 1)  # 0 waited for ever for a batch's first recording
        # A model's name (faster-whisper's WhisperModel("base")) or options as a dict failed deep inside.
        if not isinstance(models, ModelPair):
            raise TypeError(f"Transcriber takes the models asr.models.load_pair(...) loads, not {models!r}")
        if not isinstance(options, TranscribeOptions):
            raise TypeError(f"Transcriber takes its options as a TranscribeOptions(...), not {options!r}")
        self.models = models
        self.options = options
        self.batch_size = batch_size
        self.scheduler = scheduler
        target = models.target
        self.vocab = target.vocab
        # One engine per model pair and configuration: its batch states, CUDA graphs and draft
        # length's measurements outlive this Transcriber. A fixed k of up to max_draft_tokens
        # shares the adaptive length's engine: in fixed shapes its width is what a verification
        # computes, and one width for all keeps each the same as target-only to the bit (and a
        # hint's proposals a round are not held to k).
        maximum = max(options.max_draft_tokens, options.num_draft_tokens or 0)
        self.engine = models.engine(self.speculative, maximum, options.cuda_graphs, options.compile,
                                    options.lengths_attention, options.fused_layers)
        self._draft_length = self.engine.draft_length(options.num_draft_tokens)
        if options.task not in ("transcribe", "translate"):
            raise ValueError(f"task must be transcribe or translate, not {options.task!r}")
        self._check_language(options.language)
        if options.vad_filter and not vad.available():
            raise ValueError(vad.NEEDS)
        if not self.vocab.multilingual and options.task == "translate":
            raise ValueError(f"{target.name} is English-only: it cannot translate (task translate needs a multilingual model)")
        if not self.vocab.multilingual and (options.multilingual or options.language_detection_segments > 1):
            raise ValueError(f"{target.name} is English-only: it has no languages to tell apart "
                             f"({'multilingual' if options.multilingual else 'language_detection_segments'})")
        hotwords = options.hotwords.strip()  # at most the previous text's room, as faster-whisper cuts them
        self._hotwords = self.vocab.encode(" " + hotwords)[: self._previous_room] if hotwords else []
        prefix = options.prefix.strip()  # as faster-whisper cuts it
        self._prefix = self.vocab.encode(" " + prefix)[: self._previous_room] if prefix else []
        vocab_size = target.config.vocab_size
        if outside := [t for t in options.suppress_tokens if t >= vocab_size]:
            raise ValueError(f"suppress_tokens: {outside[0]} is no token of {target.name} (its ids end at {vocab_size - 1})")

    @property
    def _previous_room(self) -> int:
        """Tokens of previous text a window reads at most: the last half of the decoder's positions, as Whisper's."""
        return self.engine.max_positions // 2 - 1

    @property
    def speculative(self) -> bool:
        """Whether a draft proposes: not without one, nor at a k (fixed, or the most) of 0."""
        o = self.options
        k = o.max_draft_tokens if o.num_draft_tokens is None else o.num_draft_tokens
        return o.speculative and self.models.draft is not None and k > 0

    @property
    def batch_key(self) -> tuple:
        """Transcribers with equal keys can decode in one batch: same engine, rules and draft length."""
        o = self.options
        return id(self.engine), id(self.rules(not o.without_timestamps)), o.num_draft_tokens, o.max_draft_tokens

    def rules(self, timestamps: bool) -> DecodingRules:
        """Whisper's decoding rules for this target (shared by every Transcriber over it with these suppress_tokens)."""
        return self.models.target.rules(timestamps, self.options.suppress_tokens)

    def warm_up(self, rows: int | None = None) -> None:
        """Readies the engine for batches of `rows` windows (default: the scheduler's rows, else
        batch_size): on a GPU, every step they can meet is captured now rather than at its
        first use mid-decode (SpeculativeDecoder.warm_up); nothing on a CPU. For long-lived
        processes (the web page, a stream, `asr evaluate` before its timed runs), and only
        while nothing decodes on the engine (a scheduler's worker idle)."""
        self._interrupt()  # a segments() iterator left unread decodes on this engine
        models = self.models
        own = self.speculative and models.draft_has_own_encoder
        rows = rows or (self.scheduler.rows if self.scheduler is not None else self.batch_size)
        self.engine.warm_up(self.rules(not self.options.without_timestamps), rows=rows,
                            frames=models.target.encoder.config.max_source_positions,
                            draft_frames=models.draft.encoder.config.max_source_positions if own else None,
                            no_speech_token=self.vocab.no_speech)

    def transcribe(self, audio: Audio, name: str | None = None, sample_rate: int = SAMPLE_RATE) -> Transcript:
        """A file, or an array of samples ([frames] or [frames, channels], float or PCM
        integers) at sample_rate, resampled to 16 kHz (soundfile.read's 44.1 kHz, read as 16 kHz,
        gave no text). Raises Cancelled if the AudioInput's progress is cancelled before it is done."""
        item = self._at_model_rate(audio, name, sample_rate)
        if self.scheduler is not None:
            return self.submit(item).result()
        for transcript in self.transcribe_many([item]):
            return transcript
        raise Cancelled(item.name)

    def _interrupt(self) -> None:
        """Without a scheduler the models decode one recording at a time, whichever Transcriber
        asks: a segments() iterator over them left unread (a loop left with break keeps it)
        is stopped before the next call decodes (it then yields what was decoded, and raises
        Cancelled)."""
        following = self.models._following
        if following is not None and following[0] is not threading.current_thread():
            following[1]()

    def segments(self, audio: Audio, name: str | None = None,
                 sample_rate: int = SAMPLE_RATE) -> tuple[Iterator[Segment], TranscriptionInfo]:
        """faster-whisper's transcribe: an iterator of the segments, each window's as it ends,
        and the transcription's info, returned once the first window's language is known
        (its figures complete once the segments are). transcribe's audio; the decoding runs
        in a thread of its own, and closing the iterator (close(), or dropping it) stops it.
        An error in decoding is raised by the iterator. Without a scheduler the models decode
        one recording at a time: the next call of any Transcriber over them stops an iterator
        left unread (a loop left with break keeps it), which then yields what was decoded
        and raises Cancelled."""
        item = self._at_model_rate(audio, name, sample_rate)
        if item.progress is not None:
            raise ValueError(f"{item.name}: segments() follows the transcription itself: give no Progress")
        events: queue.SimpleQueue = queue.SimpleQueue()  # a Progress after each window, then the Transcript or an error
        item = replace(item, progress=Progress(events.put))

        def decode() -> None:
            try:
                events.put(self.transcribe(item))
            except BaseException as error:  # Cancelled too, where the iterator was closed
                events.put(error)
            finally:  # nothing left to stop: the recording (its samples) is let go
                _DECODING.discard(stop)
                if (following := self.models._following) is not None and following[0] is thread:
                    self.models._following = None

        def stop() -> None:  # at the next round
            item.progress.cancel()  # a no-op once done
            if thread is not threading.current_thread():
                thread.join()

        self._interrupt()
        thread = threading.Thread(target=decode, name=f"asr segments {item.name}", daemon=True)
        if self.scheduler is None:
            self.models._following = (thread, stop)
        _DECODING.add(stop)
        thread.start()
        try:
            first = events.get()
        except BaseException:  # Ctrl-C: a decoding thread cut off inside torch at exit aborted the process
            stop()
            raise
        if isinstance(first, BaseException):
            stop()
            raise first

        segments = _Following(first, events, stop)
        # Dropped unread: the decoding stops too. Only cancelled here, not waited for: the
        # collector may run this in any thread, a Scheduler's worker too, which the decoding
        # waits for. The program ending with it unread: _stop_decoding waits.
        weakref.finalize(segments, item.progress.cancel)
        return segments, first.info

    def _at_model_rate(self, audio: Audio, name: str | None, sample_rate: int) -> AudioInput:
        """transcribe's audio as an AudioInput: an array at another rate resampled to 16 kHz."""
        if sample_rate != SAMPLE_RATE:
            if not isinstance(audio, np.ndarray):
                raise ValueError(f"sample_rate is an array's: a file tells its own, an AudioInput holds 16 kHz samples "
                                 f"(given {sample_rate})")
            audio = to_model_input(audio, checked_rate(sample_rate, name or "audio"), name or "audio")
        return self.input(audio, name)

    def submit(self, audio: Audio) -> Future:
        """With a scheduler: transcribe's work handed over without waiting for it (the
        features are computed here, in the caller's thread); a Future of the Transcript."""
        if self.scheduler is None:
            raise ValueError("submit() needs a Transcriber with a scheduler")
        audio = self.input(audio)
        if audio.progress is None:  # what stops the decoding when the Future is cancelled
            audio = replace(audio, progress=Progress())
        transcript: Future = Future()
        transcript.add_done_callback(lambda future: future.cancelled() and audio.progress.cancel())

        def done(job: Future) -> None:
            try:
                _settle(transcript, job.result().transcript())
            except BaseException as error:
                _settle(transcript, error=error)

        self.scheduler.submit(self._start(audio)).add_done_callback(done)
        return transcript

    def input(self, audio: Audio, name: str | None = None) -> AudioInput:
        """What transcribe takes, as an AudioInput named `name` (default: an array "audio",
        a file its path); a file is read (read)."""
        if isinstance(audio, AudioInput):
            return audio if name is None else replace(audio, name=name)
        if isinstance(audio, np.ndarray):
            return AudioInput(name or "audio", audio)
        if isinstance(audio, (str, Path)):
            return self.read(audio, name)
        raise TypeError(f"audio must be a file's path, an array of samples or an AudioInput, not {type(audio).__name__}")

    def read(self, path: str | Path, name: str | None = None, stream_above_seconds: float = STREAM_ABOVE_SECONDS,
             progress: Progress | None = None) -> AudioInput:
        """A file as transcribe_many's input: loaded whole, or, when its header says it is
        longer than stream_above_seconds, scanned once and then read block by block as the
        windows advance. With vad_filter, such a file is read at 16 kHz (not at its own rate
        and channels, whole: 2 GB for an hour of 48 kHz stereo) and cut to its speech here,
        whose features are then computed window by window too. Raises AudioError for
        unusable input either way; what reading it lost are the input's warnings. progress:
        the input's; once cancelled, the scan stops (Cancelled) within a block of 30 s (a
        web page's Stop, or its visitor gone: hours of audio took minutes to scan)."""
        seconds, notices = audio_seconds(path), []
        if seconds is None or seconds <= stream_above_seconds:
            return AudioInput(name or str(path), load_audio(path, seconds, notices=notices), progress,
                              warnings=tuple(notices))
        n_mels = self.models.target.config.num_mel_bins
        if self.options.vad_filter:
            kept, speech = vad.speech_only(gathered(_scanned(stream_audio(path, notices=notices), progress),
                                                     seconds, str(path)), self.options.vad_parameters)
            if len(kept) <= stream_above_seconds * SAMPLE_RATE:
                return AudioInput(name or str(path), kept, progress, warnings=tuple(notices), speech=speech)
            # Its features are computed window by window, as a long recording's are: an hour's took 1 GB at once.
            blocks = np.array_split(kept, -(-len(kept) // WINDOW_SAMPLES))  # views of it
            mel = StreamedMel(lambda: _scanned(iter(blocks), progress), n_mels, str(path))  # Stop stops its scan
            return AudioInput(name or str(path), mel, progress, warnings=tuple(notices), speech=speech)
        # The first pass over the file (StreamedMel's scan) tells what it lost, and stops when
        # cancelled; the next ones read the same, and a cancelled decode stops on its own.
        passes = iter([(notices, progress)])

        def open_blocks() -> Iterator[np.ndarray]:
            told, watched = next(passes, ([], None))
            return _scanned(stream_audio(path, notices=told), watched)

        return AudioInput(name or str(path), StreamedMel(open_blocks, n_mels, str(path)), progress,
                          warnings=tuple(notices))

    def transcribe_many(self, inputs: Iterable[Audio]) -> Iterator[Transcript]:
        """Yields each recording's transcript as soon as its last window is decoded, so not
        necessarily in the inputs' order: each names its source (an array its place,
        "audio[3]", unless given as a named AudioInput). Inputs: as transcribe takes them,
        files read as they are reached. Up to batch_size recordings decode together, one
        window each; a row whose window is done takes the recording's next window, or the
        next recording, at once. A recording whose progress is cancelled stops decoding and
        yields nothing. An input that cannot be read (AudioError, TypeError) is raised once
        the recordings decoding when it was reached are yielded; to go on past such files,
        read them first (Transcriber.read), as folder runs do."""
        if self.scheduler is not None:  # its worker runs the engine: not this thread too
            yield from self._handed_over(inputs)
            return
        self._interrupt()
        pending = self._read(inputs)
        decoding = _Decoding(self, self.batch_size)
        exhausted, failure = False, None
        try:
            while True:
                new = []
                while not exhausted and decoding.recordings + len(new) < self.batch_size:
                    item = next(pending, None)
                    if not isinstance(item, AudioInput):
                        exhausted, failure = True, item
                        break
                    if not item.cancelled:
                        new.append(self._start(item))
                for job in decoding.submit(new):
                    if job.done:  # else dropped, cancelled
                        yield job.transcript()
                if not decoding.busy:
                    if failure is not None:
                        raise failure
                    if exhausted:
                        return
                    continue  # every recording pulled was done at once (no speech, cancelled): pull more
                for job in decoding.step():
                    yield job.transcript()
        finally:
            decoding.close()

    def _read(self, inputs: Iterable[Audio]) -> Iterator[AudioInput | Exception]:
        """The inputs as AudioInputs, pulled lazily (a folder's audio is not all held at once),
        up to the first that cannot be read: its error, naming it, ends them."""
        for index, item in enumerate(inputs):
            try:
                yield self.input(item, f"audio[{index}]" if isinstance(item, np.ndarray) else None)
            except TypeError as error:  # not audio at all: which of the inputs it was
                yield TypeError(f"audio[{index}]: {error}")
                return
            except (AudioError, OSError) as error:  # these name the file, or the array by its place
                yield error
                return

    def _handed_over(self, inputs: Iterable[Audio]) -> Iterator[Transcript]:
        """transcribe_many through the scheduler: batch_size recordings handed over at a time,
        each yielded when done; an abandoned generator cancels what it handed over."""
        pending, running = self._read(inputs), set[Future]()
        exhausted, failure = False, None
        try:
            while True:
                while not exhausted and len(running) < self.batch_size:
                    item = next(pending, None)
                    if not isinstance(item, AudioInput):
                        exhausted, failure = True, item
                    elif not item.cancelled:
                        running.add(self.submit(item))
                if not running:
                    if failure is not None:
                        raise failure
                    return
                done, running = wait(running, return_when=FIRST_COMPLETED)
                failed = [future for future in done if future.exception() is not None]
                for future in done:  # the transcripts done beside a failure first
                    if future not in failed:
                        yield future.result()
                for future in failed:
                    if not isinstance(future.exception(), Cancelled):
                        raise future.exception()
        finally:
            for future in running:
                future.cancel()

    def transcribe_window(
        self,
        samples: np.ndarray,
        context: list[int],
        language: str | None = None,
        hint: list[int] | None = None,
        encoder_frames: int | None = None,
        max_new_tokens: int | None = None,
    ) -> WindowResult:
        """Decodes at most 30 s of audio as one window, as transcribe decodes each of its
        windows (language detection when none is given, temperature fallback), conditioned on
        the text tokens `context` and with `hint` as the first draft (asr/hints.py):
        how a stream re-transcribes its buffer. encoder_frames: encode only the window's first
        frames (an even number; WhisperModel.encode) rather than all 3000. max_new_tokens: a
        lower limit than the options'."""
        # Checked here, in the caller's thread: raised in a shared scheduler's, an error would
        # fail every window decoding beside this one.
        if len(samples) > WINDOW_SAMPLES:
            raise ValueError(f"a window holds at most {WINDOW_SAMPLES} samples, not {len(samples)}")
        language = None if language is None else language_code(language)
        self._check_language(language)
        self._interrupt()
        if encoder_frames is not None and not (0 < encoder_frames <= WINDOW_FRAMES and encoder_frames % 2 == 0):
            raise ValueError(f"encoder_frames must be an even number of frames up to {WINDOW_FRAMES}, not {encoder_frames}")
        if max_new_tokens is not None:  # -5 ran a row backwards; 0 meant the options' limit
            check_whole("max_new_tokens", max_new_tokens, 1)
        hints.check(hint or [], self.models.target.config.vocab_size)
        context = list(context)  # a generator, read by the check, was no context after it
        try:  # ids outside the vocabulary failed the whole batch with a bare IndexError
            hints.check(context, self.models.target.config.vocab_size)
        except ValueError:
            raise ValueError(f"context must be token ids, whole numbers from 0 to "
                             f"{self.models.target.config.vocab_size - 1}: {context!r:.80}") from None
        job = self._start(AudioInput("window", samples), window_only=True)
        if language is not None:
            job.language = job.info.language = language
            job.info.language_probability = 1.0
        job.context, job.hint = context, list(hint or [])  # context: a list of its own already
        job.max_new_tokens = max_new_tokens
        if self.scheduler is not None:
            return self.scheduler.run(job, encoder_frames).result
        decoding = _Decoding(self, 1, encoder_frames)
        try:
            decoding.submit([job])
            while not job.done:
                decoding.step()
        finally:
            decoding.close()
        return job.result

    def _check_language(self, language: str | None) -> None:
        if language is None:
            return
        if not self.vocab.multilingual and language != "en":  # a window was decoded in English, reported as asked
            raise ValueError(f"{self.models.target.name} is English-only: it cannot transcribe {language!r}")
        if self.vocab.multilingual and language not in self.vocab.languages:
            raise ValueError(f"unknown language {language!r}; known: {', '.join(self.vocab.languages)}")

    def _start(self, audio: AudioInput, window_only: bool = False) -> _Job:
        """window_only: one window as it is (a stream's buffer), never filtered by vad_filter nor clipped."""
        target = self.models.target
        speech = None
        if isinstance(audio.samples, StreamedMel):
            if self.options.vad_filter and audio.speech is None:
                raise ValueError(f"{audio.name}: vad_filter needs the whole recording, not one read block by block")
            mel, frames, duration = audio.samples, audio.samples.frames, audio.samples.duration
            features_seconds = 0.0  # its features are computed window by window (_Decoding.submit)
        else:
            samples, duration = audio.samples, len(audio.samples) / SAMPLE_RATE
            if self.options.vad_filter and not window_only and audio.speech is None:
                samples, speech = vad.speech_only(samples, self.options.vad_parameters)
            started = device_clock(target.device)
            mel = log_mel(samples, target.config.num_mel_bins, device=target.device)
            features_seconds = device_clock(target.device) - started
            frames = content_frames(samples)
        if audio.speech is not None:  # cut as it was read: the samples are its speech
            speech, duration = audio.speech, audio.speech.length / SAMPLE_RATE
        info = TranscriptionInfo(
            language=self.options.language or ("en" if not self.vocab.multilingual else ""),
            # Until detected; left "" and 0 where nothing is decoded (no audio, no speech kept by vad_filter)
            language_probability=0.0 if self.vocab.multilingual and not self.options.language else 1.0,
            duration=duration,
            speculative=self.speculative,
            dtype=target.dtype_label,
            duration_after_vad=None if speech is None else speech.seconds,
            vad_options=None if speech is None else speech.parameters,
            transcription_options=self.options,
            features_seconds=features_seconds,
            warnings=audio.warnings,
            task=self.options.task,
        )
        prompt = self.options.initial_prompt.strip()
        context = self.vocab.encode(" " + prompt) if prompt else []
        job = _Job(self, audio, mel, frames, info, language=info.language or None, context=context, speech=speech,
                   window_only=window_only, detect_each=self.options.multilingual and not window_only)
        if self.options.clip_timestamps and not window_only:  # frames as faster-whisper rounds them
            bounds = [min(round(t * (SAMPLE_RATE // HOP_LENGTH)), frames) for t in self.options.clip_timestamps]
            bounds += [frames] * (len(bounds) % 2)  # the last clip's end left out: the audio's
            job.clips = tuple((start, end) for start, end in zip(bounds[::2], bounds[1::2]) if start < end)
            job.move_to(0)
        return job

    @torch.inference_mode()
    def detect_language(self, encoded: Tensor) -> tuple[list[list[tuple[str, float]]], KVCache]:
        """Whisper's language guess: per row, the target's distribution over language tokens
        after <|startoftranscript|>, (code, probability) likeliest first; with the cache it used,
        whose cross-attention K/V the windows' decoding can take over rather than compute again."""
        runner = self.models.target.runner
        cache = runner.new_cache(encoded, capacity=1)
        sot = torch.full((encoded.shape[0], 1), self.vocab.sot, device=encoded.device)
        with attention_without_cudnn(encoded.device):  # once a recording: a cuDNN plan would not pay
            logits = runner.forward(sot, torch.zeros(encoded.shape[0], dtype=torch.long, device=encoded.device), cache)[:, 0]
        codes = list(self.vocab.languages)
        ids = torch.tensor([self.vocab.languages[c] for c in codes], device=encoded.device)
        probs, order = logits[:, ids].float().softmax(-1).sort(dim=-1, descending=True, stable=True)
        return [[(codes[c], p) for c, p in zip(row_order, row_probs)]
                for row_order, row_probs in zip(order.tolist(), probs.tolist())], cache

    def _language_over_windows(self, job: _Job, ranked: list[tuple[str, float]]
                               ) -> tuple[str, float, list[tuple[str, float]]]:
        """faster-whisper's language_detection_segments, given the first window's guess `ranked`:
        while a window's likeliest language is no more than language_detection_threshold
        likely, the next 30 s of the recording are heard, up to that many windows. Returns the
        language chosen, its probability and the last window heard's ranking: the first sure
        window's language, else the one likeliest in most windows (the first such), at its
        highest probability there."""
        options, target = self.options, self.models.target
        votes: dict[str, list[float]] = {}
        for index in range(options.language_detection_segments):
            seek = job.seek + index * WINDOW_FRAMES
            if seek >= job.frames:
                break
            if index:  # the recording's next 30 s, past a clip's end too (as faster-whisper hears them)
                mel = job.mel.window(seek) if isinstance(job.mel, StreamedMel) else window_at(job.mel, seek, job.frames)
                ranked = self.detect_language(target.encode(mel[None].to(target.device)))[0][0]
            language, probability = ranked[0]
            if probability > options.language_detection_threshold:
                return language, probability, ranked
            votes.setdefault(language, []).append(probability)
        language = max(votes, key=lambda code: len(votes[code]))
        return language, max(votes[language]), ranked

    def _needs_fallback(self, sequence: Sequence, temperature: float, previous: list[int]) -> bool:
        options = self.options
        low_logprob = options.log_prob_threshold is not None and sequence.avg_logprob < options.log_prob_threshold
        no_speech = options.no_speech_threshold is not None and sequence.no_speech_prob > options.no_speech_threshold
        if no_speech and low_logprob:
            return False  # silence: nothing to retry (a confident text is retried if repetitive)
        if self._repeats(sequence):
            return True
        return low_logprob or (temperature > 0 and self._copies(sequence, previous))

    def _repeats(self, sequence: Sequence) -> bool:
        return self.loops(self.vocab.decode(sequence.tokens), sequence.looped)

    def loops(self, text: str, looped: bool) -> bool:
        """Whisper's compression-ratio test: text that repeats itself too much to be speech; or
        a window's stopped at a loop (Sequence.looped), which it would fail had the loop run on."""
        threshold = self.options.compression_ratio_threshold
        return threshold is not None and (looped or compression_ratio(text.strip()) > threshold)

    def _copies(self, sequence: Sequence, previous: list[int]) -> bool:
        """Whether a window's text repeats PROMPT_COPY_WORDS words in a row of its previous
        text: conditioned on it, a sampled attempt at a short or silent window often copies it
        with a confident log-probability (the dev sonnet's 0.3 s tail, in 5 of 8 seeds:
        "... and tender churl makes waste in niggerding." again). Whisper's own rules keep such
        an attempt; sampled attempts are chance already, and the next temperature is tried."""
        said, before = word_keys(self.vocab.decode(sequence.tokens)), word_keys(self.vocab.decode(previous))
        return copied_at(said, before, keys_of_words(said, PROMPT_COPY_WORDS)) is not None

    def _copied_greedily(self, job: _Job, sequence: Sequence, temperature: float) -> bool:
        """Whether a recording's first, greedy attempt at a window, heard as silence (no-speech
        probability above its threshold) but kept for its confident text, copied
        PROMPT_COPY_WORDS words in a row of the text decoded before it (not of the prompt: the
        audio may say what the user wrote; in Chinese or Japanese two characters count as a
        word). Whisper's rules keep such a copy where its log-probability is confident,
        though that is the previous text's: the JFK clip's next clip's line again in the 35 s
        of silence after it (no-speech 0.97, log-probability -0.29; faster-whisper too), or,
        with a bfloat16 encoder, a line of the sonnet in place of its last. It is then decoded again, greedily, without its previous text: the
        sonnet's last line, or in the silence Whisper's "you" (no-speech 0.95), which is then
        skipped as silence whatever its log-probability (_silent), and the previous text with
        it. Where that attempt copies the text too, the speech repeats itself, and the first
        attempt stands, as Whisper's rules judge it; where it falls back, the window's sampled
        attempts are decoded without the previous text too. retry_greedy_copies False: never."""
        options = self.options
        return (options.retry_greedy_copies and temperature == 0 and job.attempt == 0 and not job.window_only
                and not job.unprompted and options.no_speech_threshold is not None
                and sequence.no_speech_prob > options.no_speech_threshold and not self._silent(sequence)
                and self._copies(sequence, job.heard))

    def _likeliest(self, attempts: list[Sequence], previous: list[int]) -> Sequence:
        """The attempt with the highest average log-probability among those that neither
        repeat themselves nor (sampled) copy their previous text, if any (faster-whisper's
        choice, but for copies; Whisper keeps the last). attempts: at each temperature in turn."""
        plain = [s for s, t in zip(attempts, self.options.temperatures) if not self._repeats(s)
                 and not (t > 0 and self._copies(s, previous))]
        return max(plain or attempts, key=lambda s: s.avg_logprob)

    def _prompt(self, job: _Job) -> tuple[list[int], int, int]:
        """[<|startofprev|> [hotwords] previous text] <|startoftranscript|> <|lang|> <|task|>
        [<|notimestamps|>] [[<|0.00|>] prefix]; returns it with the index of
        <|startoftranscript|> and the number of its last tokens forced as the transcript's
        first (the prefix, the window at the audio's start alone: its hotwords left out, as
        faster-whisper does). Every attempt at a window has the same previous text, as in Whisper (but those
        after a greedy copy's retry, which have none: _copied_greedily): a fallback above 0.5
        resets it for the next window."""
        vocab = self.vocab
        context = job.context if not job.unprompted else []
        forced = self._prefix if job.seek == 0 else []  # as faster-whisper's: none where clips start later
        hotwords = self._hotwords if not forced else []
        previous: list[int] = []
        if context or hotwords:  # the hotwords first, as faster-whisper's; the text keeps the room they leave
            # (and a prefix's: a long prompt and a long prefix passed the decoder's 448 positions)
            room = self._previous_room - len(hotwords) - len(forced)
            previous = [vocab.sot_prev] + hotwords + (context[-room:] if room > 0 else [])
        prompt = previous + vocab.sot_sequence(job.language, self.options.task)
        if self.options.without_timestamps:
            prompt.append(vocab.no_timestamps)
        elif forced:  # the prefix is the text of a segment starting at the window's start
            forced = [vocab.timestamp_begin] + forced
        return prompt + forced, len(previous), len(forced)

    def _silent(self, sequence: Sequence, unprompted: bool = False) -> bool:
        """Whisper's no-speech skip: a window heard as silence, unless its text is confident;
        unprompted (the greedy retry of a copy of its previous text, _copied_greedily): heard
        as silence, whatever its text (Whisper's "you" of silence, at -0.83)."""
        options = self.options
        return (
            options.no_speech_threshold is not None
            and sequence.no_speech_prob > options.no_speech_threshold
            and (unprompted or not (options.log_prob_threshold is not None
                                and sequence.avg_logprob > options.log_prob_threshold))
        )

    def _align(self, job: _Job, texts: list[list[int]], times: list[tuple[float, float]], frames: int, offset: float,
               last_speech: float) -> tuple[list[list[Word]], list[tuple[float, float]], float]:
        """asr.words.align over the job's current window."""
        sot_sequence = self.vocab.sot_sequence(job.language, self.options.task)
        # Words are split as the output's language writes them: English when translating.
        written = "en" if self.options.task == "translate" else job.language
        return align(self.models.target, job.encoded, sot_sequence, texts, times, frames, offset, written, job.duration,
                     last_speech)

    def _window_words(self, job: _Job, tokens: list[int]) -> list[Word]:
        """The words of a window's text (a stream's buffer), timed. (Grouped by segment, as
        offline, a word with punctuation joined across two segments' edge shifts the later
        segments' words by one.)"""
        runs = text_runs(tokens, self.vocab.timestamp_begin, job.duration)
        words = self._align(job, [r.tokens for r in runs], [(r.start, r.end) for r in runs], job.frames, 0.0, 0.0)[0]
        return [word for segment in words for word in segment]

    def _past_hallucinations(self, job: _Job, pieces: list[tuple[float, float, list[int]]], words: list[list[Word]],
                             seek: int) -> tuple[int, int | None]:
        """Whisper's hallucination_silence_threshold over a window's timed segments: the seek,
        and how many of them to keep (None: none, the window decoded again from its first
        one's start, an anomaly after a silence). An anomalous segment with silence (or another
        anomaly, or the window's edge) on both sides ends the window there, and decoding goes
        on from it (or from the end of the recording, where little is left), so that silence
        is no longer heard as the words before it. As faster-whisper's (openai/whisper's also
        moves the seek of a window that ends within the threshold of its last word)."""
        threshold = self.options.hallucination_silence_threshold
        offset = job.seek * FRAME_SECONDS
        window_end = (job.seek + WINDOW_FRAMES) * FRAME_SECONDS  # a whole window's, as Whisper's
        content_end = (job.seek + min(WINDOW_FRAMES, job.window_end - job.seek)) * FRAME_SECONDS
        timed = [i for i, w in enumerate(words) if w]
        if timed and anomalous(words[timed[0]]) and pieces[timed[0]][0] - offset > threshold:
            return job.seek + max(1, round((pieces[timed[0]][0] - offset) / FRAME_SECONDS)), None
        heard_until = job.last_speech  # the end of the speech before this segment
        for n, i in enumerate(timed):
            start, end, _ = pieces[i]
            if anomalous(words[i]):
                following = words[timed[n + 1]] if n + 1 < len(timed) else None
                next_start = following[0].start if following else content_end
                before = start - heard_until > threshold or start < threshold or start - offset < 2.0
                after = (next_start - end > threshold or (following is not None and anomalous(following))
                         or window_end - end < 2.0)
                if before and after:
                    at_end = job.frames * FRAME_SECONDS - end < threshold
                    return job.frames if at_end else round(max(offset + 1, start) / FRAME_SECONDS), i
            heard_until = end
        return seek, len(pieces)

    def _advance(self, job: _Job, sequence: Sequence, temperature: float) -> None:
        """Whisper's seek logic: cut the window's tokens into segments at timestamp pairs,
        and move the seek to the end of the last complete segment. The job changes only
        once nothing can fail (the word alignment, a GPU pass): a batch that raises has its
        jobs decode their current window again (Scheduler._guarded)."""
        segment_frames = min(WINDOW_FRAMES, job.window_end - job.seek)
        window_seek, offset = job.seek, job.seek * FRAME_SECONDS
        seek = job.seek + segment_frames
        if self._silent(sequence, unprompted=job.unprompted and temperature == 0):
            job.move_to(seek)
            if job.unprompted:  # the text it copied would condition the next window as it did this one
                job.context, job.heard = [], []
            return
        tokens = sequence.tokens
        ts_begin = self.vocab.timestamp_begin
        is_ts = [t >= ts_begin for t in tokens]
        pieces: list[tuple[float, float, list[int]]] = []
        consecutive = [i + 1 for i in range(len(tokens) - 1) if is_ts[i] and is_ts[i + 1]]
        single_ending = is_ts[-2:] == [False, True]
        if consecutive:
            slices = consecutive + ([len(tokens)] if single_ending else [])
            last_slice = 0
            for current in slices:
                piece = tokens[last_slice:current]
                start = (piece[0] - ts_begin) * TIMESTAMP_SECONDS
                end = (piece[-1] - ts_begin) * TIMESTAMP_SECONDS
                pieces.append((offset + start, offset + end, piece))
                last_slice = current
            if not single_ending:
                seek = job.seek + (tokens[last_slice - 1] - ts_begin) * FRAMES_PER_TIMESTAMP
        else:
            duration = segment_frames * FRAME_SECONDS
            timestamps = [t for t in tokens if t >= ts_begin]
            if timestamps and timestamps[-1] != ts_begin:
                duration = (timestamps[-1] - ts_begin) * TIMESTAMP_SECONDS
            pieces.append((offset, offset + duration, tokens))

        ratio = compression_ratio(self.vocab.decode(tokens).strip())
        texts = [[t for t in piece if t < self.vocab.eot] for _, _, piece in pieces]  # the words' tokens
        decoded = [self.vocab.decode(piece) for _, _, piece in pieces]
        words: list[list[Word] | None] = [None] * len(pieces)
        if self.options.word_timestamps:
            # As Whisper (and faster-whisper): segments take their words' times, and unless the
            # window ended on a lone timestamp the next one starts where its last word ended.
            words, times, last_speech = self._align(job, texts, [(start, end) for start, end, _ in pieces],
                                                    segment_frames, offset, job.last_speech)
            pieces = [(start, end, piece) for (start, end), (_, _, piece) in zip(times, pieces)]
            if not single_ending and last_speech > offset:
                seek = round(last_speech / FRAME_SECONDS)
            if self.options.hallucination_silence_threshold is not None:
                seek, count = self._past_hallucinations(job, pieces, words, seek)
                if count is None:  # the window's speech starts late, with a hallucination: from there again
                    job.move_to(seek)
                    return
                if count < len(pieces):  # where the speech heard last ends now (align's, untrimmed, where none is cut)
                    pieces, texts, decoded, words = pieces[:count], texts[:count], decoded[:count], words[:count]
                    last_speech = next((w[-1].end for w in reversed(words) if w),
                                       pieces[-1][1] if pieces else job.last_speech)
            job.last_speech = last_speech
        job.move_to(seek)
        # Within the recording: a last window's timestamps can pass its end.
        pieces = [(time_within(start, job.duration), time_within(max(end, start), job.duration), piece)
                  for start, end, piece in pieces]
        # Whisper drops instantaneous and empty segments (after timing the words of all); here
        # also one wholly past the recording's end, which its end made instantaneous.
        keep = [start != end and text.strip() != "" for (start, end, _), text in zip(pieces, decoded)]
        kept: list[int] = []
        for (start, end, piece), text, timed, k in zip(pieces, decoded, words, keep):
            if not k:
                continue
            kept += piece
            job.segments.append(
                Segment(
                    id=len(job.segments),
                    start=start,
                    end=end,
                    text=text,
                    tokens=piece,
                    avg_logprob=sequence.avg_logprob,
                    compression_ratio=ratio,
                    no_speech_prob=sequence.no_speech_prob,
                    temperature=temperature,
                    words=timed,
                    seek=window_seek,
                    language=job.language if job.detect_each else None,
                )
            )
        # Whisper conditions the next window on the kept segments' tokens, timestamps included.
        reset = temperature > 0.5 or not self.options.condition_on_previous_text
        # Only the last half of the decoder's positions conditions a window (_prompt): no more is kept.
        job.context = [] if reset else (job.context + kept)[-self._previous_room :]
        job.heard = [] if reset else (job.heard + kept)[-self._previous_room :]


class _Decoding:
    """The windows being decoded: the current window of each job is a row of one engine
    batch. A decoded row is judged as Whisper judges it (temperature fallback): decoded
    again at the next temperature, or done; a recording then moves its seek and waits for
    the next submit() to encode its next window. Jobs may follow different Transcribers'
    options (language, task, thresholds) as long as they share the owner's engine, rules
    and draft length (Transcriber.batch_key)."""

    def __init__(self, owner: Transcriber, rows: int, encoder_frames: int | None = None):
        self.owner = owner
        self.batch = owner.engine.batch(
            owner.rules(timestamps=not owner.options.without_timestamps), rows=rows,
            no_speech_token=owner.vocab.no_speech, draft_length=owner._draft_length)
        self.encoder_frames = encoder_frames
        self.jobs: dict[int, _Job] = {}  # by the batch's row tag
        self.waiting: list[_Job] = []  # recordings whose next window is still to be encoded

    @property
    def busy(self) -> bool:
        return bool(self.jobs or self.waiting)

    def members(self) -> list[_Job]:
        """The jobs decoding (one row each, or best_of rows) and waiting, each once."""
        return list({id(job): job for job in [*self.jobs.values(), *self.waiting]}.values())

    @property
    def recordings(self) -> int:
        """Recordings in progress (single windows not counted)."""
        return sum(not job.window_only for job in self.members())

    def close(self) -> None:
        self.batch.close()

    def _drop_cancelled(self) -> list[_Job]:
        """Stops decoding the jobs whose progress was cancelled (their rows freed at once,
        the other rows decoding on); returns them."""
        rows = {tag: job for tag, job in self.jobs.items() if job.audio.cancelled}
        if rows:
            self.batch.drop(set(rows))
        for tag in rows:
            del self.jobs[tag]
        dropped, waiting, self.waiting = list({id(job): job for job in rows.values()}.values()), self.waiting, []
        for job in waiting:  # one read of each job's flag: cancel() may land meanwhile
            (dropped if job.audio.cancelled else self.waiting).append(job)
        return dropped

    def submit(self, jobs: list[_Job]) -> list[_Job]:
        """Drops the jobs cancelled since the last call; encodes the current window of each
        job (and of the recordings waiting for their next one) and starts decoding it, at the
        first temperature. Returns the jobs it is done with: those dropped (not done), and the
        recordings with nothing to decode (no audio frames, or no speech kept by vad_filter)."""
        dropped = self._drop_cancelled()
        jobs, self.waiting = self.waiting + jobs, []
        empty = [job for job in jobs if job.done]
        for job in empty:
            job.report()
        jobs = [job for job in jobs if not job.done]
        if not jobs:
            return dropped + empty
        o = self.owner
        target, draft = o.models.target, o.models.draft
        began = device_clock(target.device)
        features = torch.stack([job.window()[:, : self.encoder_frames].to(target.device) for job in jobs])
        started = device_clock(target.device)
        features_seconds = (started - began) / len(jobs)
        encoded = target.encode(features)
        draft_encoded = draft.encode(features) if o.speculative and o.models.draft_has_own_encoder else None
        encoder_seconds = (device_clock(target.device) - started) / len(jobs)
        started = time.perf_counter()
        undetected = [i for i, job in enumerate(jobs) if job.language is None or job.detect_each]
        cross: dict[int, tuple[list[Tensor], list[Tensor]]] = {}
        if undetected:
            guesses, cache = o.detect_language(encoded[undetected])
            for row, (i, ranked) in enumerate(zip(undetected, guesses)):
                job = jobs[i]
                job.language = ranked[0][0]
                if not job.info.language:  # the first window's, as faster-whisper's info with multilingual
                    language, probability = ranked[0]
                    if not job.window_only and job.transcriber.options.language_detection_segments > 1:
                        language, probability, ranked = job.transcriber._language_over_windows(job, ranked)
                        if not job.detect_each:  # else the window's own, as faster-whisper's
                            job.language = language
                    job.info.language, job.info.language_probability, job.info.all_language_probs = (
                        language, probability, ranked)
                # In fixed shapes a row's K/V are computed alone (Slots._write_rows), not batched as here.
                if not o.engine.fixed_shapes:
                    cross[i] = ([k[row] for k in cache.cross_k], [v[row] for v in cache.cross_v])
        detection_seconds = (time.perf_counter() - started) / len(jobs)
        for i, job in enumerate(jobs):
            job.report()
            job.info.features_seconds += features_seconds
            job.info.encoder_seconds += encoder_seconds
            job.info.decoder_seconds += detection_seconds
            job.encoded = encoded[i]
            job.draft_encoded = None if draft_encoded is None else draft_encoded[i]
            job.attempt, job.failed, job.unprompted, job.copied = 0, [], False, None
        self._add(jobs, [cross.get(i) for i in range(len(jobs))])
        return dropped + empty

    def _add(self, jobs: list[_Job], cross: list[tuple[list[Tensor], list[Tensor]] | None] | None = None) -> None:
        """cross: each job's target cross-attention K/V where language detection computed them."""
        windows, owners = [], []
        for job, known in zip(jobs, cross or [None] * len(jobs)):
            t = job.transcriber
            temperature = t.options.temperatures[job.attempt]
            prompt, sot_index, forced = t._prompt(job)
            limit = min(job.max_new_tokens or t.options.max_new_tokens, t.options.max_new_tokens)  # None: the options'
            max_new = min(limit, self.owner.engine.max_positions - 1 - len(prompt))
            # A retry at a higher temperature mostly repeats the failed attempt (a repetition
            # loop), so that attempt is its hint: a hint's proposals keep only what the target
            # would sample, and a loop is then verified in a few passes instead of one per token.
            hint = job.failed[-1].tokens if job.failed else job.hint
            # A sampled window's draws follow its own seed, whatever is batched beside it; each
            # of best_of samples its own (the first as without best_of).
            job.candidates, job.rows = [], t.options.best_of if temperature > 0 else 1
            # The draft's acceptance is kept per language and task: an English draft is right
            # twice as often on German translated as on German transcribed.
            accepts_as = job.language if t.options.task == "transcribe" else f"{job.language}>{t.options.task}"
            for sample in range(job.rows):
                seed = sampling.seed_of(t.options.seed, job.seek, job.attempt, *([sample] if sample else []))
                windows.append(Window(job.encoded, prompt, sot_index, max_new, temperature, hint, job.draft_encoded,
                                      known, accepts_as, seed, stop_loops=job.window_only, forced=forced))
                owners.append(job)
        for job, tag in zip(owners, self.batch.add(windows)):
            self.jobs[tag] = job

    def step(self) -> list[_Job]:
        """One round; returns the jobs that are done (a recording's last window decoded, or
        a single window)."""
        done, again = [], []
        for tag, sequence in self.batch.step():
            job = self.jobs.pop(tag)
            t, temperatures = job.transcriber, job.transcriber.options.temperatures
            job.info.decoder_seconds += sequence.seconds
            job.info.stats.add(sequence.stats)  # every attempt's
            job.candidates.append(sequence)
            job.rows -= 1
            if job.rows:
                continue  # its other samples are decoding still
            # Of best_of samples, the likeliest: Whisper's ranking (length_penalty None), the
            # log-probability (end-of-text's included) over the tokens (end-of-text not counted).
            sequence = max(job.candidates, key=lambda candidate: candidate.sum_logprob / max(len(candidate.tokens), 1))
            if t._copied_greedily(job, sequence, temperatures[job.attempt]):
                job.unprompted, job.copied = True, sequence
                again.append(job)
                continue
            if job.copied is not None:  # the check's answer: heard without the previous text too, the speech repeats
                if t._copies(sequence, job.heard):
                    sequence, job.unprompted = job.copied, False
                job.copied = None
            previous = [] if job.unprompted else job.context
            if t._needs_fallback(sequence, temperatures[job.attempt], previous):
                job.failed.append(sequence)
                if job.attempt + 1 < len(temperatures):
                    job.attempt += 1
                    again.append(job)
                    continue
                sequence = t._likeliest(job.failed, previous)  # every temperature failed
            job.info.windows += 1
            temperature = temperatures[job.attempt]
            if job.window_only:
                silent = t._silent(sequence)
                words = t._window_words(job, sequence.tokens) if t.options.word_timestamps and not silent else None
                job.result = WindowResult(sequence.tokens, job.info.language, temperature, silent, job.info,
                                          sequence.no_speech_prob, words, sequence.looped)
            else:
                t._advance(job, sequence, temperature)
                job.report()
            (done if job.done else self.waiting).append(job)
        if again:
            self._add(again)
        return done


@dataclass
class Served:
    """A Scheduler's counters of what it has done."""

    recordings_served: int = 0
    windows_served: int = 0
    audio_seconds_served: float = 0.0  # of recordings served
    failures: int = 0
    cancelled: int = 0  # recordings whose Progress was cancelled (stopped mid-decode, or never started)


@dataclass
class SchedulerLoad(Served):
    """What a Scheduler is doing now, and has done (Served's counters): a copy, as of its worker's last round."""

    queued: int = 0  # jobs waiting for a row
    recordings: int = 0  # recordings in progress
    windows: int = 0  # single windows (live updates) in progress
    rows: int = 0  # rows in the engine batches now


class Scheduler:
    """One worker thread decodes the work that any thread hands it, together: uploads and
    live microphone windows from many visitors share engine batches, as transcribe_many's
    recordings do (a row whose window is done takes the next one at once), rather than
    taking turns on the models. One batch per Transcriber.batch_key. At most `rows` recordings
    decode in a batch (each a row, or best_of rows while it samples), queued ones long-first
    (_admit); single windows (a live
    stream's updates, which a speaker waits for) join at once, ahead of queued recordings."""

    def __init__(self, rows: int = 8):
        check_whole("rows", rows, 1)  # 0 queued every recording for ever, spinning a core
        self.rows = rows
        self._wake = threading.Condition()
        self._queue: list[tuple[_Job, int | None, float]] = []  # (job, encoder frames, arrival)
        self._futures: dict[int, Future] = {}  # by id(job), for every job queued or decoding
        self._decodings: dict[tuple, _Decoding] = {}
        self._served = Served()
        self._closed = False
        self._measure()
        self._worker = threading.Thread(target=self._run, name="asr-scheduler", daemon=True)
        self._worker.start()
        _SCHEDULERS.add(self)

    def run(self, job: _Job, encoder_frames: int | None = None) -> _Job:
        """Decodes the job (transcribe_window hands its window here; Transcriber.submit uses submit) and
        returns it done; raises what decoding raised."""
        return self.submit(job, encoder_frames).result()

    def submit(self, job: _Job, encoder_frames: int | None = None) -> Future:
        """run() without waiting: a Future of the job, done."""
        future: Future = Future()
        with self._wake:
            if self._closed:
                raise RuntimeError("the scheduler is closed")
            self._futures[id(job)] = future
            self._queue.append((job, encoder_frames, time.monotonic()))
            self._wake.notify()
        return future

    def load(self) -> SchedulerLoad:
        """As of the worker's last round (a copy of the caller's own)."""
        return replace(self._load)

    def _measure(self) -> None:
        jobs = [job for d in self._decodings.values() for job in d.members()]
        with self._wake:
            self._load = SchedulerLoad(
                **asdict(self._served), queued=len(self._queue), recordings=sum(not j.window_only for j in jobs),
                windows=sum(j.window_only for j in jobs), rows=sum(len(d.jobs) for d in self._decodings.values()))

    def close(self) -> None:
        """Stops the worker; work not done fails with RuntimeError. Done at exit for a scheduler
        left open."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._worker.join()
        _SCHEDULERS.discard(self)

    def _run(self) -> None:
        while True:
            try:
                if not self._round():
                    break
            except Exception as error:
                # Raised outside any one batch's work (_guarded): making a batch or closing one
                # (a CUDA fault, memory). Every caller gets the error rather than waiting for
                # ever on a dead worker, and the worker starts afresh for the next requests.
                traceback.print_exc()
                self._fail_all(error)
            self._measure()
        self._fail_all(RuntimeError("the scheduler was closed before this was decoded"), failures=False)

    def _round(self) -> bool:
        """Admits what waits and moves every batch on by one step; False once closed."""
        with self._wake:
            while not self._closed and not self._queue and not any(d.busy for d in self._decodings.values()):
                self._wake.wait()
            if self._closed:
                return False
            admitted = self._admit()
        for key, decoding in list(self._decodings.items()):
            self._guarded(key, decoding.submit, admitted.get(key, []))
            if key in self._decodings and decoding.busy:
                self._guarded(key, decoding.step)
            if key[-1] is not None and key in self._decodings and not decoding.jobs:  # a job's own, its window done
                self._rejoin(key)
            elif key[-2] is not None and key in self._decodings and not decoding.busy:
                # A fitted encoder width (a stream's growing buffer): rarely met again, and each
                # batch kept held its caches (12 of them, 347 MB, for 30 s of whisper-base stream).
                # The engine keeps a few states for reuse (slots.IDLE_STATES).
                self._decodings.pop(key).close()
        return True

    def _fail_all(self, error: Exception, failures: bool = True) -> None:
        """Fails every job queued or decoding with `error` and drops the batches. failures:
        counted as such (not when the scheduler is closed)."""
        with self._wake:
            futures, decodings = list(self._futures.values()), list(self._decodings.values())
            self._futures, self._decodings, self._queue = {}, {}, []
            self._served.failures += len(futures) if failures else 0
        for future in futures:
            _settle(future, error=error)
        for decoding in decodings:
            try:
                decoding.close()
            except Exception:  # the fault that brought us here may fail this too
                traceback.print_exc()

    def _admit(self) -> dict[tuple, list[_Job]]:
        """Moves queued jobs that have room into their batches: single windows first (a
        speaker is waiting on each), then recordings, each as if it had arrived
        HEAD_START_PER_AUDIO_SECOND earlier per second of audio. A recording's time in a
        batch grows with its length while a short one's wait for a row is short, so starting
        long ones first evens out finishing times (the latency tail is long recordings); the
        head start is bounded, so no recording waits behind later ones for ever."""
        def order(entry: tuple[_Job, int | None, float]) -> tuple[bool, float]:
            job, _, arrived = entry
            return not job.window_only, arrived - HEAD_START_PER_AUDIO_SECOND * job.duration

        admitted: dict[tuple, list[_Job]] = {}
        kept = []
        for job, frames, arrived in sorted(self._queue, key=order):
            if job.audio.cancelled:
                self._cancel(job)
                continue
            if job.alone and any(k[-1] is not None for k in self._decodings):  # one at a time
                kept.append((job, frames, arrived))
                continue
            key = (*job.transcriber.batch_key, frames, id(job) if job.alone else None)
            if key not in self._decodings:
                self._decodings[key] = _Decoding(job.transcriber, 1 if job.alone else self.rows, frames)
            jobs = admitted.setdefault(key, [])
            recordings = self._decodings[key].recordings + sum(not j.window_only for j in jobs)
            if job.window_only or job.alone or recordings < self.rows:
                jobs.append(job)
            else:
                kept.append((job, frames, arrived))
        self._queue = kept
        return admitted

    def _rejoin(self, key: tuple) -> None:
        """A job's own batch, its window decoded: the job, unless done, goes back to the shared
        batch, first in line, for its next window."""
        decoding = self._decodings.pop(key)
        with self._wake:
            for job in decoding.waiting:
                job.alone = False
                self._queue.insert(0, (job, decoding.encoder_frames, 0.0))
        decoding.close()

    def _cancel(self, job: _Job) -> None:
        """Fails a cancelled job's caller (under the lock)."""
        self._served.cancelled += 1
        _settle(self._futures.pop(id(job)), error=Cancelled(job.audio.name))

    def _guarded(self, key: tuple, work: Callable[..., list[_Job] | None], *args: list[_Job]) -> None:
        """Runs a batch's submit or step and hands out what it finished (and fails the jobs
        it dropped, cancelled). If it raises, the batch starts afresh, and whose fault it was
        is found by decoding each job's current window again in a batch of its own, one job
        at a time (the windows before are kept; _rejoin): a job fails with the error its own
        batch raises, so one visitor's bad upload fails no one else's."""
        decoding = self._decodings[key]
        members = [*decoding.members(), *(args[0] if args else [])]
        try:
            done = work(*args) or []
        except Exception as error:
            with self._wake:
                del self._decodings[key]
                for job in members:
                    if job.audio.cancelled:
                        self._cancel(job)
                    elif len(members) == 1 or key[-1] is not None:
                        self._served.failures += 1
                        _settle(self._futures.pop(id(job)), error=error)
                    else:
                        job.alone = True
                        self._queue.append((job, decoding.encoder_frames, 0.0))  # first in line
            decoding.close()
            return
        with self._wake:
            for job in done:
                if not job.done:  # dropped
                    self._cancel(job)
                    continue
                if job.window_only:
                    self._served.windows_served += 1
                else:
                    self._served.recordings_served += 1
                    self._served.audio_seconds_served += job.info.duration
                _settle(self._futures.pop(id(job)), job)


def _settle(future: Future, result: object = None, error: BaseException | None = None) -> None:
    """Hands a caller its result or error, unless it cancelled the Future: then nobody waits."""
    with contextlib.suppress(InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


def compression_ratio(text: str) -> float:
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0
