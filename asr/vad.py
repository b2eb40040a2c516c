"""Voice activity detection (faster-whisper's vad_filter): Silero VAD finds the speech, the
recording's silences are cut out before it is transcribed, and the transcript's times are
mapped back onto the recording. Whisper tends to invent text over long silences or music,
and every window of silence costs an encoder pass and a decode. The model and its rules for
speech chunks (silences under 2 s kept, 0.4 s of padding) are faster-whisper's own, an
optional dependency, so the filtered audio is the audio faster-whisper would decode."""

from __future__ import annotations

import bisect
import dataclasses
import importlib.util
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from asr.audio import SAMPLE_RATE, time_within

if TYPE_CHECKING:
    from asr.transcribe import Segment

NEEDS = "voice activity detection (--vad) needs faster-whisper's Silero VAD: pip install 'asr[vad]'"


@dataclass(frozen=True)
class VadParameters:
    """faster-whisper's VadOptions (its vad_parameters), checked when made: what Silero's
    probabilities make speech, and how chunks are joined, split and padded."""

    threshold: float = 0.5  # a frame's speech probability above it is speech
    neg_threshold: float | None = None  # below it always silence (None: threshold - 0.15, as Silero's)
    min_speech_duration_ms: int = 0  # shorter chunks of speech dropped
    max_speech_duration_s: float = float("inf")  # longer chunks split at a silence (or cut)
    min_silence_duration_ms: int = 2000  # shorter silences kept inside a chunk
    speech_pad_ms: int = 400  # silence kept each side of a chunk

    def __post_init__(self) -> None:
        def number(name: str, low: float, high: float, whole: bool = False) -> None:
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value)
                    or not low <= value <= high or whole and value != int(value)):
                kind = "a whole number" if whole else "a number"
                raise ValueError(f"vad_parameters: {name} must be {kind} from {low} to {high}, not {value!r}")
            # numpy's float32 0.3 as 0.3, not 0.30000001192092896 (a ledger then told other settings)
            plain = float(str(value)) if isinstance(value, np.floating) else float(value)
            object.__setattr__(self, name, int(plain) if whole else plain)

        number("threshold", 0.0, 1.0)
        if self.neg_threshold is not None:
            number("neg_threshold", 0.0, 1.0)
        number("max_speech_duration_s", 0.0, math.inf)
        for name in ("min_speech_duration_ms", "min_silence_duration_ms", "speech_pad_ms"):
            number(name, 0, 3_600_000, whole=True)
        if self.neg_threshold is not None and self.neg_threshold > self.threshold:  # speech would hardly ever end
            raise ValueError(f"vad_parameters: neg_threshold ({self.neg_threshold}) must not be above threshold "
                             f"({self.threshold})")
        # Silero's chunks hold a 32 ms frame and the padding each side: a shorter limit cut speech into frames.
        shortest = (512 / SAMPLE_RATE) + 2 * self.speech_pad_ms / 1000
        if self.max_speech_duration_s <= shortest:
            raise ValueError(f"vad_parameters: max_speech_duration_s must be above {shortest:g} (a 32 ms frame and "
                             f"speech_pad_ms each side), not {self.max_speech_duration_s:g}")

    def changed(self) -> dict:
        """The fields set to other than their defaults (as a ledger or report records them: JSON has no inf)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}

    @classmethod
    def of(cls, given: object) -> "VadParameters":
        """From a VadParameters, a mapping of its fields, or faster-whisper's VadOptions."""
        if isinstance(given, cls):
            return given
        if type(given).__name__ == "VadOptions" and dataclasses.is_dataclass(given):
            given = dataclasses.asdict(given)
        if not isinstance(given, Mapping):
            raise ValueError(f"vad_parameters must be a dict of VAD options or a VadParameters, not {given!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(map(repr, set(given) - names))
        if unknown:
            raise ValueError(f"vad_parameters: no option named {', '.join(unknown)}; "
                             f"they are {', '.join(sorted(names))}")
        return cls(**given)


def available() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("faster_whisper", "onnxruntime"))


@dataclass(frozen=True)
class SpeechMap:
    """Where the speech that the filter kept lies in the recording."""

    chunks: tuple[tuple[int, int], ...]  # (start, end) of each speech chunk, in samples of the recording
    pad: int = 0  # samples of silence the filter keeps before (and after) each chunk's speech, at most
    length: int = 0  # of the recording, in samples
    parameters: VadParameters = VadParameters()  # the filter's that found the chunks
    ends: tuple[int, ...] = field(init=False)  # each chunk's end in the filtered audio, in samples
    cut: tuple[int, ...] = field(init=False)  # samples cut out before each chunk

    def __post_init__(self) -> None:
        ends = np.cumsum([end - start for start, end in self.chunks], dtype=np.int64).tolist()
        object.__setattr__(self, "ends", tuple(ends))
        object.__setattr__(self, "cut", tuple(end - kept for (_, end), kept in zip(self.chunks, ends)))

    @property
    def seconds(self) -> float:
        """The filtered audio's duration."""
        return (self.ends[-1] if self.ends else 0) / SAMPLE_RATE

    def chunk_of(self, seconds: float, is_end: bool = False) -> int:
        """The chunk that a time in the filtered audio falls in; a time exactly at a chunk's
        end belongs to it if it ends something (a segment), else to the next chunk."""
        sample = round(seconds * SAMPLE_RATE)
        index = bisect.bisect_left(self.ends, sample) if is_end else bisect.bisect_right(self.ends, sample)
        return min(index, len(self.chunks) - 1)

    def original(self, seconds: float, chunk: int, within: int | None = None) -> float:
        """A time in the filtered audio, in chunk `chunk`, as a time in the recording, at most
        the end of chunk `within` (by default its own)."""
        end = self.chunks[chunk if within is None else within][1]
        return time_within(seconds + self.cut[chunk] / SAMPLE_RATE, end / SAMPLE_RATE)

    def restore(self, segment: Segment) -> Segment:
        """The segment with its (and its words') times in the recording. A word's ends are
        both mapped by the chunk of its middle, as faster-whisper maps them, and a segment with
        words spans them (its own ends, mapped alone, could take in a cut's silence where
        its first or last word straddles the cut). A segment without words whose end falls in
        the next chunk's padding, or less than a word's time past it, ends in its own chunk:
        Whisper's end, at or just past the next speech's onset, stretched a subtitle over the
        40 s cut between. A start in a chunk's trailing padding is the next chunk's start."""
        if not segment.words:
            first, last = self.chunk_of(segment.start), self.chunk_of(segment.end, is_end=True)
            reach = self.pad + SAMPLE_RATE // 4
            if last > first and round(segment.end * SAMPLE_RATE) - self.ends[last - 1] <= reach:
                last -= 1
            start = segment.start  # a start in the trailing padding alone: speech before it is its chunk's
            if last > first and self.ends[first] - round(start * SAMPLE_RATE) <= self.pad:
                start, first = self.ends[first] / SAMPLE_RATE, first + 1
            return replace(segment, start=self.original(start, first), end=self.original(segment.end, last))
        words, last = [], len(self.chunks) - 1
        for word in segment.words:
            # A word may end past its chunk (the filter's guess) as the alignment heard it,
            # mapped into the cut silence as faster-whisper maps it: it was cut at the chunk's end.
            chunk = self.chunk_of((word.start + word.end) / 2)
            words.append(replace(word, start=self.original(word.start, chunk, last),
                                 end=self.original(word.end, chunk, last)))
        return replace(segment, start=words[0].start, end=words[-1].end, words=words)


# Silero's judgement depends on the level, Whisper's features do not (they are scaled to their
# peak): speech peaking at -53 dBFS lost 7 of its 11 s, at -60 all. A quieter recording is
# raised to this peak for the filter alone (noise, hum and clicks raised so stay no speech);
# a louder one is judged as faster-whisper judges it.
QUIET_PEAK = 0.1
MAX_GAIN = 1000.0  # 60 dB: dither alone is not raised to speech's level (a peak near 0 overflowed to inf)


def speech_only(samples: np.ndarray, parameters: VadParameters | None = None) -> tuple[np.ndarray, SpeechMap]:
    """The recording's speech chunks, concatenated, and where they were (parameters None: the defaults)."""
    from faster_whisper.vad import VadOptions, get_speech_timestamps  # optional: see available()

    parameters = parameters or VadParameters()
    options = VadOptions(**dataclasses.asdict(parameters))
    peak = max(float(samples.max()), -float(samples.min())) if len(samples) else 0.0  # no copy of an hour's samples
    heard = samples * np.float32(min(QUIET_PEAK / peak, MAX_GAIN)) if 0 < peak < QUIET_PEAK else samples
    chunks = tuple((c["start"], c["end"]) for c in get_speech_timestamps(heard, options, SAMPLE_RATE))
    kept = np.concatenate([samples[start:end] for start, end in chunks]) if chunks else samples[:0]
    return kept, SpeechMap(chunks, pad=options.speech_pad_ms * SAMPLE_RATE // 1000, length=len(samples),
                           parameters=parameters)
