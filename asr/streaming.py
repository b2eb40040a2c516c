"""Live transcription of a growing audio stream, with speculative re-decoding.

Policy (LocalAgreement-2 of whisper_streaming, Macháček et al. 2023): each process() call
re-transcribes the buffer (the stream's audio since its last trim, at most 30 s) as one
window, conditioned on the committed text before the buffer (<|startofprev|>), and commits
the longest common word prefix of this hypothesis and the previous one. Committed words
never change again. Once the buffer is longer than buffer_trim_seconds, it is cut shortly
before the end of the last segment whose words are all committed (never the hypothesis's
last segment).

A buffer in which nothing has been heard yet (silence, room noise) keeps only its last
few seconds, so that speech starts near the buffer's start; one that no microphone could
have picked up (digital silence, a muted microphone) is not decoded at all.

Audio that does not fit in the 30 s buffer waits (a long chunk, a slow machine falling
behind, a buffer whose words never agreed). A full buffer with audio waiting is decoded as
Whisper decodes a long file: its closed segments are committed without waiting for a second
hypothesis and the buffer is cut after them (all of it when none closed), so each call
makes room and no audio is lost; finish() goes on until nothing waits.

Re-transcribing the buffer mostly repeats the previous hypothesis. So that repeat costs
almost nothing, the previous hypothesis's tokens (timestamps shifted where the buffer was
cut) are the first draft (asr/hints.py): the target verifies them in
one pass and keeps the agreeing prefix, the draft model takes over past it, and where the
new hypothesis meets the old one again (a word or a timestamp changed, the rest did not),
the rest of the old one is proposed again. Greedy output stays exactly the target's.

The encoder reads Whisper's whole 30 s window by default. It can read only the buffer plus
a little padding (encoder_padding_seconds), which makes early updates several times cheaper
but less accurate.

Each buffer is decoded greedily (no temperature fallback: sampled hypotheses would rarely
agree). A hypothesis that loops where Whisper thinks the buffer holds no speech is judged
silent (as offline, where the fallback's samples would then be skipped as silence). Another
hypothesis that loops or echoes the prompt is decoded again without the prompt;
the loops Whisper falls into on silence and at the end of the audio are cut from every
hypothesis, and so are copies of the prompt (from those decoded with it), lest two
hypotheses agree on them; but for the last decode and a backlog's, which no later one
corrects, where what passes Whisper's compression test is speech that repeats itself.

Words are timed as offline with the transcriber's word_timestamps (the target's
cross-attention, one more pass per update); otherwise roughly: Whisper gives segment
timestamps, and a segment's duration is shared among its words in proportion to their
characters (words after a pause are then timed from the pause's start).

The last decode (finish()) commits its whole hypothesis. Where Whisper ends that hypothesis
on a timestamp with speech after it (offline, the next window would start there), the buffer
is cut after its words and the rest decoded too.
"""

from __future__ import annotations

import bisect
import difflib
import itertools
import math
import re
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import numpy as np
import soxr

from asr.audio import SAMPLE_RATE, checked_rate, to_model_input
from asr.features import FRAME_SECONDS, WINDOW_SECONDS
from asr.slots import DecodeStats
from asr.transcribe import TIMESTAMP_SECONDS, Segment, Transcriber, WindowResult, text_runs
from asr.words import Word as TimedWord
from asr.words import NOT_WORD, copied_at, shared_times, split_words, word_key, word_keys

SAMPLES_PER_TIMESTAMP = round(TIMESTAMP_SECONDS * SAMPLE_RATE)
FRAMES_PER_SECOND = round(1 / FRAME_SECONDS)
CONTEXT_CHARACTERS = 200  # the prompt: the end of the committed text before the buffer (as whisper_streaming)
LOOP_WORDS = 5  # a run of this many words twice in a row (or a shorter one four times) is a loop
TOKENS_PER_SECOND = 15  # a buffer's hypothesis stops at 20 tokens + this many per second (more is a loop, not speech)
COMMITTED_COPY_WORDS = 8  # new words that repeat this many in a row of the text before them (prompt, committed) copy it
PROMPT_ECHO_WORDS = 4  # a hypothesis whose new words repeat this many words of the prompt is decoded again without it
UNHEARD_SECONDS = 2.0  # a hypothesis ending this long before the buffer's end, with speech after it, stopped short
# Half a second of speech from this long after a last hypothesis's closing timestamp: Whisper
# left it to a next window, and the rest of the buffer is decoded (_unheard_tail).
TAIL_SECONDS = 0.25
SPEECH_DB = 20  # speech: a quarter second within this many dB of the buffer's loudest
# A buffer whose loudest quarter second is quieter than this (in dB of a full-scale signal's
# power) holds nothing a microphone picked up: its own noise is louder (-60 to -50 dBFS).
INAUDIBLE_DBFS = -70
RESPELT_SIMILARITY = 0.75  # difflib's ratio of letters at which a hypothesis's words are the committed ones respelt
HEARD_BEFORE_SECONDS = 1.0  # a segment ending this long before the committed words' end is of their audio
HEARD_BEFORE_LETTERS = 0.75  # if this share of its letters are theirs
HEARD_AGAIN_WORDS = 3  # at most this many committed words heard again after a cut are recognised as such
UNHEARD_KEEP_SECONDS = 3.0  # a buffer in which nothing was heard keeps only its last seconds (_cut_unheard)
# A hypothesis's last word that ends a sentence this close to the buffer's end is not
# committed yet: the buffer may stop mid-sentence, which Whisper ends with a full stop
# ("Americans. ask not what your country can do for you. ask what"). It waits for words
# after it, or for this much more audio.
SETTLE_SECONDS = 1.0
# Audio a process() call waits for before it decodes again (whisper_streaming's min-chunk-size):
# two hypotheses of almost the same buffer agreed on a word cut off at its end ("rip-er").
MIN_STEP_SECONDS = 1.0
SENTENCE_END = re.compile(r"[.?!…。？！؟।][\"'”’)\]]*$")
TRIM_MARGIN_STEPS = 10  # the buffer is cut this many 20 ms timestamp steps before a segment's end: Whisper's
# end times run late, and a buffer starting on a clipped word sets Whisper hallucinating


@dataclass(frozen=True)
class Word:
    text: str  # as Whisper emits it, leading space included
    start: float  # seconds from the start of the stream
    end: float


@dataclass(frozen=True)
class StreamUpdate:
    committed: list[Word]  # words committed by this call (they never change again)
    tentative: list[Word]  # the current hypothesis past the committed words (may still change)
    committed_text: str  # all committed text so far
    tentative_text: str
    audio_seconds: float  # stream audio received so far
    buffer_seconds: float  # audio the call re-transcribed
    commit_latencies: list[float]  # per newly committed word: commit time minus the end of its audio (s)
    target_passes: int  # target forward passes in this call
    decoded_tokens: int  # tokens the call decoded (the whole buffer's hypothesis, end-of-text included)
    hypothesis_tokens_proposed: int  # previous-hypothesis tokens proposed as the first draft
    hypothesis_tokens_accepted: int  # of which the target kept (each saves a pass or a draft step)
    draft_tokens_accepted: int  # tokens the draft model proposed and the target kept
    compute_seconds: float
    now: float  # the clock when the call ended
    final: bool


@dataclass(frozen=True)
class _Segment:
    words: list[Word]
    end_token: int  # the window's tokens up to here make this segment and those before it
    end_timestamp: int | None  # its closing timestamp (relative to the buffer, in 20 ms steps); None if open


class StreamingTranscriber:
    """Feed audio with insert_audio(), call process() whenever it suits (each call decodes
    the buffer once, or twice when the first hypothesis is a hallucination, once
    min_step_seconds of audio came since its last decode), and finish() at the end of the
    stream.

    prompt: text before the stream (what was said before, names and spelling to expect),
    the first prompt (whisper_streaming's init_prompt); later the committed text follows it.
    None: the transcriber's initial_prompt. With the transcriber's condition_on_previous_text
    False, as offline after the first window, the buffer is decoded without a prompt once
    it has been cut. Of its other options a stream decodes greedily (no temperature fallback)
    and has silences of its own (vad_filter is the uploads'); it needs timestamps, which
    its buffer is cut at.

    encoder_padding_seconds: the encoder reads the buffer plus this much padding (in whole
    seconds), not Whisper's 30 s window (None), which makes an update several times cheaper
    while the buffer is short. Whisper was trained on 30 s windows: with no padding after
    the audio it repeats itself, with 2 s the dev clips' WER went from 0.5 % to 1.1 %.

    clock: seconds since the stream's first sample, read when a call ends, to measure commit
    latency. The default is an audio-time clock for a stream fed from a file: a call starts
    when the previous one ended or when the audio it is given arrived (it arrives in real
    time), whichever is later, and lasts its measured compute time.

    timer: what measures a call's compute time: the wall clock, or on a machine shared with
    other work, time.thread_time with torch on one thread (this thread's CPU time only, which
    others' load does not inflate; two threads on a machine of its own would be faster)."""

    def __init__(
        self,
        transcriber: Transcriber,
        *,
        hypothesis_draft: bool = True,
        buffer_trim_seconds: float = 15.0,
        min_step_seconds: float = MIN_STEP_SECONDS,
        encoder_padding_seconds: float | None = None,
        prompt: str | None = None,
        clock: Callable[[], float] | None = None,
        timer: Callable[[], float] = time.perf_counter,
    ):
        if not 0 < buffer_trim_seconds < WINDOW_SECONDS:  # NaN too
            raise ValueError(f"buffer_trim_seconds must be above 0 and below the {WINDOW_SECONDS} s window, "
                             f"not {buffer_trim_seconds}")
        if not 0 <= min_step_seconds < WINDOW_SECONDS:
            raise ValueError(f"min_step_seconds must be at least 0 and below the {WINDOW_SECONDS} s window, "
                             f"not {min_step_seconds}")
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError(f"prompt must be text, not {type(prompt).__name__}")
        if encoder_padding_seconds is not None and not 0 <= encoder_padding_seconds < math.inf:  # NaN too
            raise ValueError(f"encoder_padding_seconds must be a number of seconds, at least 0, not {encoder_padding_seconds}")
        if transcriber.options.without_timestamps:
            raise ValueError("a stream cuts its buffer at segment timestamps: it cannot decode without_timestamps")
        if transcriber.options.multilingual:  # it would have done nothing, unsaid
            raise ValueError("a stream keeps the language detected first (or given): it does not take multilingual")
        if transcriber.options.language_detection_segments > 1:  # its buffer is one window: it would do nothing, unsaid
            raise ValueError("a stream detects the language from its first buffer: it does not take "
                             "language_detection_segments")
        if transcriber.options.prefix.strip():  # every update would have started with it
            raise ValueError("a stream decodes its buffer again and again: it does not take a prefix")
        self._conditioned = transcriber.options.condition_on_previous_text
        self.transcriber = Transcriber(transcriber.models, replace(transcriber.options, temperatures=(0.0,)),
                                       scheduler=transcriber.scheduler)
        self.hypothesis_draft = hypothesis_draft
        self.buffer_trim_seconds = buffer_trim_seconds
        self.min_step_seconds = min_step_seconds
        self.encoder_padding_seconds = encoder_padding_seconds
        self.clock = clock
        self.timer = timer
        self._vocab = transcriber.vocab
        self._language = transcriber.options.language
        self._buffer = np.zeros(0, dtype=np.float32)
        self._buffer_start = 0  # stream sample index of the buffer's first sample
        # Received audio past the buffer's full window, in the chunks it came in: joined as it
        # came, an hour inserted before a finish() took minutes of copying.
        self._waiting: deque[np.ndarray] = deque()
        self._received = 0
        # Seconds of audio inserted, at the chunks' own rates (a resampler holds some back), and when last decoded.
        self._inserted, self._stepped = 0.0, 0.0
        self._rate: float = SAMPLE_RATE  # of the chunks inserted last
        self._resampler: soxr.ResampleStream | None = None  # theirs to 16 kHz, where it is another
        self._decoded_until = 0  # stream sample index of the buffer's end when it was last decoded
        self._decoded_before = 0  # and when it was decoded before that
        self._repeated = 0  # leading committed words of the buffer heard again after a cut (_heard_again)
        self._finished = False
        self._committed: list[Word] = []
        self._in_buffer: list[Word] = []  # committed words heard in the buffer, as the last hypothesis wrote them
        self._tentative: list[Word] = []
        self._hint: list[int] = []  # the last hypothesis's tokens, relative to the buffer
        self._held_back = False  # whether its new words were cut where they loop or copy (_agree)
        self._tail = False  # the last hypothesis left a tail of speech to a next window (_agree): a last decode cuts it
        self._settling: tuple[tuple[int, str], float] | None = None  # a last word waiting (_agree): (place, key), since
        self._unprompted = False  # the prompt made Whisper loop or echo it on this buffer's start: decode without it
        self._last_end = 0.0  # the audio-time clock when the last call ended
        self._decoded: list[DecodeStats] = []  # the statistics of every decode of the current call, retries too
        prompt = (transcriber.options.initial_prompt if prompt is None else prompt).strip()
        # Whole, as offline (up to Whisper's 223 tokens): CONTEXT_CHARACTERS bounds the text
        # committed after it, from the first cut.
        self._context_text = " " + prompt if prompt else ""  # the end of the committed text before the buffer
        self._context: list[int] = self._vocab.encode(self._context_text)  # its tokens: the prompt

    @property
    def audio_seconds(self) -> float:
        return self._received / SAMPLE_RATE

    @property
    def undecoded_seconds(self) -> float:
        """Audio received that no decode has heard yet: what came since the last decode, and a
        backlog waiting behind a full buffer (decoded a window a call)."""
        return (self._received - self._decoded_until) / SAMPLE_RATE

    @property
    def committed_text(self) -> str:
        return "".join(w.text for w in self._committed).strip()

    def warm_up(self) -> None:
        """Decodes a second of noise, so that the stream's first update does not pay the
        one-time costs of the first decode (kernel selection, allocations); on a GPU, with
        whole windows encoded and no scheduler, every step of the stream's one-row batches is
        captured first (Transcriber.warm_up)."""
        # With encoder padding every update has a frame count of its own: nothing fixed to warm.
        # A scheduler's engine is warmed by its owner (app/engine.py), while its worker is idle.
        if self.encoder_padding_seconds is None and self.transcriber.scheduler is None:
            self.transcriber.warm_up(rows=1)  # a stream's windows decode one at a time
        noise = np.random.default_rng(0).normal(0, 0.01, SAMPLE_RATE).astype(np.float32)
        self.transcriber.transcribe_window(noise, [], self._language, None, self._encoder_frames(len(noise)))

    def insert_audio(self, samples: np.ndarray, sample_rate: float = SAMPLE_RATE) -> None:
        """samples: [frames] or [frames, channels], float or PCM integers, at sample_rate (an
        empty chunk is nothing); AudioError for what is not audio (NaN, strings, other shapes,
        a rate that is not a positive number). Other rates than 16 kHz are resampled as the
        chunks come, one resampler a rate, so that chunk edges get no filter artefacts (a
        microphone switched mid-stream: the last rate's held-back samples go first)."""
        self._check_open()
        checked_rate(sample_rate, "stream chunk")
        if np.size(samples) == 0:
            return
        samples = to_model_input(samples, SAMPLE_RATE, "stream chunk")  # checked; resampled below
        self._inserted += len(samples) / sample_rate
        held = np.zeros(0, np.float32)
        if sample_rate != self._rate:
            if self._resampler is not None:
                held = self._resampler.resample_chunk(held, last=True)
            self._rate, self._resampler = sample_rate, None
            if sample_rate != SAMPLE_RATE:
                self._resampler = soxr.ResampleStream(sample_rate, SAMPLE_RATE, 1, dtype="float32", quality="HQ")
        self._take(held)
        self._take(samples if self._resampler is None else self._resampler.resample_chunk(samples))

    def _take(self, samples: np.ndarray) -> None:
        if len(samples):
            self._waiting.append(samples)
            self._received += len(samples)

    def process(self) -> StreamUpdate:
        """Decodes the buffer once if min_step_seconds of audio came since the last decode, or
        audio waits behind a full buffer (a window of its backlog a call)."""
        self._check_open()
        return self._update(final=False)

    def finish(self) -> StreamUpdate:
        """Decodes what is left and commits the whole hypothesis (final=True). The stream
        ends here: more audio needs a new StreamingTranscriber (a second finish() is empty)."""
        if self._resampler is not None:  # its held-back last samples
            self._take(self._resampler.resample_chunk(np.zeros(0, np.float32), last=True))
            # Flushed: where the decode below raises and the caller goes on, its next chunk starts a resampler anew.
            self._rate, self._resampler = SAMPLE_RATE, None
        update = self._update(final=True)
        self._finished = True
        return update

    def _check_open(self) -> None:
        if self._finished:
            raise RuntimeError("this stream has finished: start a new StreamingTranscriber for more audio")

    def _update(self, final: bool) -> StreamUpdate:
        started = self.timer()
        start_clock = max(self._last_end, self.audio_seconds)
        committed: list[Word] = []
        self._decoded, decoded_seconds = [], 0.0
        tail = False  # a last decode cut the buffer before speech it left to a next window (_agree)
        # Less than a step inserted since the last decode (10 chunks of 0.1 s add up to
        # 0.9999999999999999), and no more than that unheard: a backlog is decoded a window a call.
        soon = (not final and self._inserted - self._stepped < self.min_step_seconds - 1e-6
                and self._received - self._decoded_until < self.min_step_seconds * SAMPLE_RATE)
        while not soon:  # once; when final, until no audio waits
            self._fill()
            until = self._buffer_start + len(self._buffer)
            if (until == self._decoded_until and not self._waiting and not tail
                    and not (final and (self._held_back or self._tail))):
                break  # nothing new to hear (nor words a last decode would keep, nor a tail it would cut)
            # else new audio, or a full buffer decoded already that audio waits behind: it
            # is decoded again as a backlog's (_agree), which cuts it and makes room
            if self._inaudible():
                self._decoded_before, self._decoded_until = self._decoded_until, until
                self._cut_unheard()  # as after a decode judged silent, without its cost
            else:
                window, prompted = self._hypothesis()
                # decoded (a decode that raised is done again at the next call)
                self._decoded_before, self._decoded_until = self._decoded_until, until
                decoded_seconds += len(self._buffer) / SAMPLE_RATE
                shown = self._tentative
                committed += self._agree(window, prompted, final, cut_tail=final and not tail)
                if final and window.silent and not self._tentative:
                    # The last words shown (grey) are not lost to a final decode judged silent
                    # (a short last phrase, then a long silence before the stop).
                    self._tentative = shown
            if final and self._tail and not tail:
                # _agree cut it; the tail is decoded once (past its own last timestamp, noise
                # at the end of JFK was heard as "What country?")
                tail = True
            elif not (final and self._waiting):
                break
        if not soon:
            self._stepped = self._inserted
        if final:
            committed += self._commit(self._tentative)
            # All heard is committed: a second finish() finds nothing to decode (it decoded a
            # held-back loop again, and committed its words twice).
            self._in_buffer, self._tentative = self._in_buffer + self._tentative, []
            self._held_back = self._tail = False
        compute = self.timer() - started
        now = self.clock() if self.clock is not None else start_clock + compute
        self._last_end = now
        return StreamUpdate(
            committed=committed,
            tentative=list(self._tentative),
            committed_text=self.committed_text,
            tentative_text="".join(w.text for w in self._tentative).strip(),
            audio_seconds=self.audio_seconds,
            buffer_seconds=decoded_seconds,
            commit_latencies=[now - w.end for w in committed],
            target_passes=sum(s.target_passes for s in self._decoded),
            decoded_tokens=sum(s.tokens for s in self._decoded),
            hypothesis_tokens_proposed=sum(s.hint_proposed for s in self._decoded),
            hypothesis_tokens_accepted=sum(s.hint_accepted for s in self._decoded),
            draft_tokens_accepted=sum(s.draft_accepted for s in self._decoded),
            compute_seconds=compute,
            now=now,
            final=final,
        )

    def _hypothesis(self) -> tuple[WindowResult, bool]:
        """The buffer decoded (with the prompt unless it failed on this buffer), judged; and
        whether the prompt conditioned it."""
        prompted = bool(self._context) and not self._unprompted
        window = self._transcribe(self._context if prompted else [])
        # A window judged silent is not decoded again: without the prompt, Whisper fills
        # noise with a loop of its own ("I'm going to go to the next room." 14 times).
        # A retry's first draft is the hypothesis it retries, which it mostly repeats: a
        # buffer ending in a clipped word loops with the prompt and without alike ("making a
        # fa-----..." to the token limit), and that loop is then verified in a few passes.
        if prompted and not window.silent and self._hallucinated(window):
            # Until the buffer is cut: the same prompt before the same start failed again
            # in every update, each a decode to the token limit (5 s on a CPU, per 0.5 s chunk).
            window, prompted, self._unprompted = self._transcribe([], window.tokens), False, True
        elif prompted and self._stops_short(window):
            retry = self._transcribe([], window.tokens)
            if (self._heard_until(retry) or 0.0) > self._heard_until(window):
                window, prompted = retry, False
        return self._judged(window), prompted

    def _inaudible(self) -> bool:
        """Whether nothing has been heard in the buffer and nothing in it is loud enough for a
        microphone to have picked it up (digital silence, a muted microphone): Whisper hears
        quiet audio at any level (its features are log-scaled to the window's loudest), so
        such a buffer would cost a window's decode, to be judged silent at best."""
        if self._in_buffer or self._tentative:
            return False
        power = _quarter_powers(self._buffer)
        return len(power) > 0 and power.max() < 10 ** (INAUDIBLE_DBFS / 10)

    def _fill(self) -> None:
        """Moves waiting audio into the buffer, up to one window."""
        room, taken = max(WINDOW_SECONDS * SAMPLE_RATE - len(self._buffer), 0), [self._buffer]
        while room and self._waiting:
            chunk = self._waiting.popleft()
            if len(chunk) > room:
                self._waiting.appendleft(chunk[room:])
                chunk = chunk[:room]
            taken.append(chunk)
            room -= len(chunk)
        self._buffer = np.concatenate(taken)

    def _transcribe(self, context: list[int], hint: list[int] | None = None) -> WindowResult:
        """The buffer decoded after context, its first draft `hint` (default: the last update's hypothesis)."""
        seconds = len(self._buffer) / SAMPLE_RATE
        window = self.transcriber.transcribe_window(
            self._buffer, context, self._language, (self._hint if hint is None else hint) if self.hypothesis_draft else None,
            self._encoder_frames(len(self._buffer)), 20 + math.ceil(TOKENS_PER_SECOND * seconds),
        )
        self._decoded.append(window.info.stats)
        return window

    def _judged(self, window: WindowResult) -> WindowResult:
        """Offline, a window that loops is sampled again at higher temperatures and, where
        Whisper thinks it holds no speech, then skipped as silence. A stream decodes greedily
        only, so the hypothesis it keeps (after the retry without the prompt) is judged silent
        where it loops so: room noise was committed as "I'm going to go to the next room."."""
        threshold = self.transcriber.options.no_speech_threshold
        if window.silent or threshold is None or window.no_speech_prob <= threshold:
            return window
        text = self._vocab.decode(window.tokens)
        return replace(window, silent=True) if self.transcriber.loops(text, window.looped) else window

    def _hallucinated(self, window: WindowResult) -> bool:
        """Whether a hypothesis decoded with the prompt loops (Whisper's compression-ratio
        test) or its new words repeat PROMPT_ECHO_WORDS words of the prompt: Whisper's
        failures when the buffer starts or ends on a clipped word. Such a buffer is decoded again without the prompt
        (as Whisper drops it when it falls back to sampling)."""
        text = self._vocab.decode(window.tokens)
        if self.transcriber.loops(text, window.looped):
            return True
        prompt, keys = word_keys(self._context_text), word_keys(text)[len(self._in_buffer) :]  # past the committed words
        return copied_at(keys, prompt, PROMPT_ECHO_WORDS) is not None

    def _stops_short(self, window: WindowResult) -> bool:
        """Whether a hypothesis ends UNHEARD_SECONDS or more before the buffer does while the
        audio after its end holds speech. Given a prompt, Whisper sometimes ends its
        transcript a sentence early; offline the next window starts there, but a stream's
        buffer keeps its start, so the same prompt and audio would lose that sentence in
        every update, and at the end for good. Such a buffer is decoded again without the
        prompt, and the hypothesis that hears further is kept. One that heard no word at all
        is not short of one: without the prompt, Whisper made "Great." of a crowd's noise."""
        heard = self._heard_until(window)
        said = any(token < self._vocab.timestamp_begin for token in window.tokens)
        return (not window.silent and said and heard is not None and len(self._buffer) / SAMPLE_RATE - heard >= UNHEARD_SECONDS
                and self._speech_after(heard))

    def _unheard_tail(self, segments: list[_Segment]) -> bool:
        """Whether a hypothesis's last segment closes a second or more into the buffer, with
        half a second of speech from TAIL_SECONDS after it: Whisper leaves that speech to the
        next window (offline, the next window starts at that timestamp). A stream's last
        decode ended so, and JFK's last words were lost ("... ask what you can"). A shorter
        sound is the last word fading: the sonnet's "thee", decoded again as "nd the.". After
        a full stop, within half as many dB of the loudest: the crowd's half second after JFK's
        "country.", 15 dB below his voice and decoded alone, was committed as "I'm afraid."."""
        heard = segments[-1].end_timestamp * TIMESTAMP_SECONDS if segments and segments[-1].end_timestamp else 0.0
        ended = bool(segments) and SENTENCE_END.search(segments[-1].words[-1].text) is not None
        return heard >= 1.0 and self._speech_after(heard + TAIL_SECONDS, 2, SPEECH_DB / 2 if ended else SPEECH_DB)

    def _speech(self, db: float = SPEECH_DB) -> np.ndarray:
        """Whether each whole quarter second of the buffer is speech: within db of its loudest."""
        power = _quarter_powers(self._buffer)
        return power > (power.max() if len(power) else 0.0) * 10 ** (-db / 10)

    def _speech_after(self, seconds: float, quarters: int = 1, db: float = SPEECH_DB) -> bool:
        """Whether the buffer holds speech after `seconds` into it: `quarters` quarter seconds
        in a row of it (within db of the loudest)."""
        loud = self._speech(db)[math.ceil(seconds * 4) :]
        return any(loud[i : i + quarters].all() for i in range(len(loud) - quarters + 1))

    def _heard_until(self, window: WindowResult) -> float | None:
        """The hypothesis's last timestamp, in seconds into the buffer (None without timestamps)."""
        times = [t - self._vocab.timestamp_begin for t in window.tokens if t >= self._vocab.timestamp_begin]
        return max(times) * TIMESTAMP_SECONDS if times else None

    def _encoder_frames(self, samples: int) -> int | None:
        if self.encoder_padding_seconds is None:
            return None
        seconds = math.ceil(samples / SAMPLE_RATE + self.encoder_padding_seconds)
        return min(seconds, WINDOW_SECONDS) * FRAMES_PER_SECOND

    @property
    def _written_language(self) -> str | None:
        """The language of the committed text: English when translating (Turkish's sentences
        are left as written, _sentence_start; their English translation's are not)."""
        return "en" if self.transcriber.options.task == "translate" else self._language

    def _agree(self, window: WindowResult, prompted: bool, final: bool, cut_tail: bool = False) -> list[Word]:
        """LocalAgreement-2: commits the longest common prefix of this hypothesis and the last;
        then trims the buffer if it is long. A full buffer with audio waiting is committed
        and cut as offline (_closed_words, _cut_closed). Returns the words committed.

        The new words stop where they loop or copy the text before them (the prompt's, if
        the window was decoded with it), lest two hypotheses agree on a hallucination; in a
        last decode, or one of a backlog, no later one could set that right, so words that
        pass Whisper's own test are kept: speech that repeats itself ("No, no, no, no.")."""
        shown = self._tentative
        segments = [] if window.silent else self._split_at_committed(self._segments(window))
        words = [w for s in segments for w in s.words]
        backlog = bool(self._waiting)
        unheard = not words and not self._in_buffer and not self._tentative  # nothing heard in the buffer yet
        cut_clean = not self._in_buffer  # no committed word left in the buffer: those done are heard again
        done = self._already_committed(segments)
        if (done < len(self._in_buffer) and not (final or backlog)
                and self.transcriber.loops("".join(w.text for w in words), window.looped)):
            # A loop ("Thou hast chosen to die," 13 times) that does not hear the committed
            # words says nothing of them: taken as a hypothesis, it wiped them from the buffer's
            # record, and the next one committed them again. Nothing changes; its words wait
            # (held back: a last decode hears the buffer again).
            self._held_back = True
            return []
        new = words[done:]
        before = (word_keys(self._context_text) if prompted else []) + [word_key(w.text) for w in words[:done]]
        kept = _before_repeats([word_key(w.text) for w in new], before)
        if (kept < len(new) and (final or backlog)
                and not self.transcriber.loops("".join(w.text for w in new), window.looped)):
            kept = len(new)
        self._held_back = kept < len(new)
        fresh = new[:kept]
        agreed = 0
        if backlog:
            agreed = min(max(self._closed_words(segments) - done, 0), len(fresh))
        while (agreed < min(len(fresh), len(self._tentative))
               and word_key(fresh[agreed].text) == word_key(self._tentative[agreed].text)):
            agreed += 1
        if agreed and agreed == len(fresh) == len(new) and not (final or backlog) and SENTENCE_END.search(fresh[-1].text):
            # Timed from its end, or from when it first waited: a last segment Whisper leaves
            # open ends its last word at the buffer's end, however long the pause after it.
            word = (len(self._committed) + agreed, word_key(fresh[-1].text))
            end = (self._buffer_start + len(self._buffer)) / SAMPLE_RATE
            if self._settling is None or self._settling[0] != word:
                self._settling = (word, end)
            if end - min(fresh[-1].end, self._settling[1]) < SETTLE_SECONDS:
                agreed -= 1  # its full stop waits for the words after it, or for a pause heard
        if agreed and self._language is None:
            self._language = window.language  # the committed text is in it: keep it from now on
        committed = self._commit(fresh[:agreed])
        if committed and done and done == len(self._in_buffer) and len(self._committed) > len(committed) \
                and SENTENCE_END.search(self._committed[-len(committed) - 1].text) \
                and not SENTENCE_END.search(words[done - 1].text):
            # This hypothesis runs on a sentence whose full stop was committed ("for you. Ask
            # what" heard again as "for you, ask what", at a live page's 1 s updates): the
            # word after that full stop starts a sentence, never "for you. ask what".
            committed[0] = self._committed[-len(committed)] = _sentence_start(committed[0], self._written_language)
        if words[done:] or len(words) >= len(self._in_buffer):
            self._repeated = done if cut_clean else self._repeated
            self._in_buffer = words[: done + agreed]
        # else the hypothesis stops short of the committed words (it missed the end of the
        # buffer): they stay as they were, or the next hypothesis would commit them again
        self._tentative = fresh[agreed:]
        if self._held_back and not backlog and agreed + len(self._tentative) < len(shown):
            # A hypothesis cut where it loops is no word against those shown: they stay tentative
            # (and a last decode commits them). A bfloat16 encoder's "die die die..." on a buffer
            # locked to German put "die" in place of the shown "what you can do for your country."
            self._tentative = shown[agreed:]
        self._hint = window.tokens
        self._tail = (not backlog and not self._held_back and len(self._in_buffer) + len(self._tentative) == len(words)
                      and self._unheard_tail(segments))
        if cut_tail and self._tail:
            # As offline, where the next window would start at the hypothesis's last timestamp:
            # its words are committed and the buffer cut after them, for the tail to be decoded.
            committed += self._commit(self._tentative)
            self._in_buffer, self._tentative = self._in_buffer + self._tentative, []
            self._cut_at(*self._committed_segment(segments))
        elif unheard:
            self._cut_unheard()
        elif backlog:
            self._cut_closed(segments)
        elif pause := self._pause_after(segments):
            self._cut(pause, len(self._in_buffer))
            self._hint = []
        elif (self._all_committed(len(words)) and self._stops_short(window) and self._unheard_tail(segments)
              and (cut := self._committed_segment(segments)) is not None):
            # Its words all committed, it ends with speech to come, with the prompt and without:
            # Whisper given a committed sentence and a pause before new speech heard only the
            # sentence, update after update (JFK after a pause came only at the stream's end).
            # As offline, where the next window starts at the last timestamp. (A crowd after a
            # full stop is no speech to come: decoded alone, it was "Thank you.")
            self._cut_at(*cut)
        elif len(self._buffer) > self.buffer_trim_seconds * SAMPLE_RATE:
            self._trim_at_segment(segments)
        return committed

    def _all_committed(self, words: int) -> bool:
        """Whether a hypothesis of this many words has all of them committed (none waits)."""
        return bool(words) and not self._tentative and not self._held_back and len(self._in_buffer) == words

    def _pause_after(self, segments: list[_Segment]) -> int:
        """Where to cut a buffer (samples) whose words are all committed, its last segment
        closed with no speech after it: as an unheard buffer is cut (_cut_unheard), to the
        last UNHEARD_KEEP_SECONDS of the pause decoded twice; 0 if not so. Kept, the pause set
        Whisper timing the next speech from the end of the words before it: up to the whole
        pause early (20 s), the words after it piled at one instant."""
        if not self._all_committed(sum(len(segment.words) for segment in segments)):
            return 0
        end = segments[-1].end_timestamp
        if end is None or end * SAMPLES_PER_TIMESTAMP > len(self._buffer):
            return 0
        heard = end * TIMESTAMP_SECONDS + TAIL_SECONDS
        cut = self._unheard_drop()
        return cut if cut >= heard * SAMPLE_RATE and not self._speech_after(heard) else 0

    @staticmethod
    def _closed_words(segments: list[_Segment]) -> int:
        """The words of a hypothesis that Whisper decoding a long file would keep from this
        window: all of them, but for a last segment left open after closed ones (its audio
        runs past the window: the next window decodes it whole)."""
        words = sum(len(s.words) for s in segments)
        if len(segments) > 1 and segments[-1].end_timestamp is None:
            words -= len(segments[-1].words)
        return words

    def _cut_closed(self, segments: list[_Segment]) -> None:
        """Makes room in a full buffer: cuts it at the end of the last segment whose words are
        committed, or all of it (words without a closing time, or none)."""
        cut = self._committed_segment(segments)
        if cut is None:
            self._cut(len(self._buffer), len(self._in_buffer))
            self._hint = []
        else:
            self._cut_at(*cut)

    def _cut_unheard(self) -> None:
        """A buffer in which nothing has been heard (silence, room noise) keeps the last
        UNHEARD_KEEP_SECONDS of what the decode before this one heard, and all after. Cut only
        at a committed segment, such a buffer grew to a full window, whose backlog cut dropped
        it whole with the first words of speech at its end; and seconds of silence before
        speech set Whisper timing it from the buffer's start and stopping a sentence short,
        at every update."""
        drop = self._unheard_drop()
        if drop > 0:  # no committed word in it: the prompt stays as it is (_cut would bound it)
            self._buffer = self._buffer[drop:]
            self._buffer_start += drop
            self._hint = []
            self._unprompted = False

    def _unheard_drop(self) -> int:
        """The samples a buffer's start may lose where nothing in it was heard: all but the
        last UNHEARD_KEEP_SECONDS of the audio decoded twice (lest a call that took long,
        behind uploads, drop audio heard once)."""
        heard_twice = min(len(self._buffer), self._decoded_before - self._buffer_start)
        return heard_twice - round(UNHEARD_KEEP_SECONDS * SAMPLE_RATE)

    def _commit(self, words: list[Word]) -> list[Word]:
        """Appends words to the committed text, their times moved where needed so that they
        follow the committed ones (each hypothesis times its words anew). The stream's first
        word starts a sentence unless the prompt leaves one open: Whisper wrote "for a full
        hour" on a first buffer of two seconds, committed before a later one wrote "For"."""
        end = self._committed[-1].end if self._committed else 0.0
        prompt = self._context_text.strip()
        if words and not self._committed and (not prompt or SENTENCE_END.search(prompt)):
            words = [_sentence_start(words[0], self._written_language), *words[1:]]
        for word in words:
            start = max(word.start, end)
            end = max(word.end, start)
            self._committed.append(Word(word.text, start, end))
        return self._committed[len(self._committed) - len(words) :]

    def _segments(self, window: WindowResult) -> list[_Segment]:
        """Cuts a hypothesis at its timestamps into segments of timed words (text_runs): timed
        by the target's cross-attention where the window was decoded with word timestamps,
        else by sharing each segment's time among its words."""
        offset = self._buffer_start / SAMPLE_RATE
        runs = text_runs(window.tokens, self._vocab.timestamp_begin, len(self._buffer) / SAMPLE_RATE)
        texts = [self._vocab.decode(run.tokens) for run in runs]
        aligned = _aligned_words(texts, window.words, offset) if window.words else None
        # Whisper times speech after seconds of silence from the buffer's start (a pause's
        # last seconds, kept: _cut_unheard): the first segment starts no earlier than the
        # first speech. (The later ones start at Whisper's timestamps after the first.)
        onset = float(np.argmax(speech)) / 4 if (speech := self._speech()).any() else 0.0
        segments = []
        for i, (run, text) in enumerate(zip(runs, texts)):
            start = max(run.start, onset) if i == 0 and run.end > onset else run.start
            words = aligned[i] if aligned else _timed_words(text, offset + start, offset + run.end)
            segments.append(_Segment(words, run.end_token, run.closing))
        return [s for s in segments if s.words]

    def _already_committed(self, segments: list[_Segment]) -> int:
        """How many leading words of a hypothesis of the buffer were committed before: the
        committed words in the buffer when it starts with them (as it nearly always does);
        else, where the model changed its mind about committed audio, as many as align with
        them (after the last run of words the two have in common, one for one), or none if
        too few align (the model no longer hears them, at the buffer's start): at least half
        of them, or a run of two or more that ends them; or else the words that spell about
        what the committed ones do (_respelt), or else those of the segments that Whisper
        ends well before the committed words' end (_heard_before). One word in common ("for"
        of "can do for you" and "For a full hour") took the new words after it as committed."""
        words = [w for s in segments for w in s.words]
        known = [word_key(w.text) for w in self._in_buffer]
        keys = [word_key(w.text) for w in words]
        if not known:
            return self._heard_again(words)
        committed = "".join(known)
        if "".join(keys).startswith(committed):  # the same words, however split ("bud-barriest", "bud, barriest")
            done = total = 0
            while done < len(keys) and total + len(keys[done]) <= len(committed):
                total += len(keys[done])
                done += 1
            return done
        # A lone word in common further on in the hypothesis than among the committed words is
        # another saying of it ("to the" committed, "to a gaudy spring ... Pity the world"
        # took the 17 words up to "the" as committed); fewer, where the model no longer hears
        # the first committed words, is not, nor is a run of two or more (words said otherwise
        # before it: "$2,500 a year" heard as "two thousand five hundred dollars a year").
        near = max(2, len(known) // 4)
        blocks = [b for b in difflib.SequenceMatcher(None, known, keys, autojunk=False).get_matching_blocks()
                  if b.size >= 2 or b.size and b.b - b.a <= near]
        last = blocks[-1] if blocks else None
        if last is None or 2 * sum(b.size for b in blocks) < len(known) and not (
                last.a + last.size == len(known) and last.size >= 2):  # a run of two or more that ends them
            return _respelt(committed, keys) or self._heard_before(segments, committed, keys)
        return min(last.b + last.size + len(known) - (last.a + last.size), len(keys))

    def _heard_before(self, segments: list[_Segment], committed: str, keys: list[str]) -> int:
        """The words of a hypothesis's first segments that Whisper ends HEARD_BEFORE_SECONDS
        or more before the committed words in the buffer end, if most of their letters are
        the committed words' too, in order: audio they were committed for, heard otherwise
        ("to him and painful to myself. And so my fellow Americans, ask not" committed, then
        heard as "to hitman and painful to myself." alone; its words were committed again,
        after "not"). Whole segments: Whisper's timestamps are its own, a word's share of its
        segment is a guess. (The letters: a committed segment left open ends at the buffer's
        end, however long before it its words were said.)"""
        end, done = self._in_buffer[-1].end - HEARD_BEFORE_SECONDS, 0
        for segment in segments:
            if segment.end_timestamp is None or segment.words[-1].end > end:
                break
            done += len(segment.words)
        heard = "".join(keys[:done])
        shared = difflib.SequenceMatcher(None, committed, heard, autojunk=False).get_matching_blocks()
        return done if heard and sum(b.size for b in shared) >= HEARD_BEFORE_LETTERS * len(heard) else 0

    def _split_at_committed(self, segments: list[_Segment]) -> list[_Segment]:
        """A hypothesis that starts with the committed words of the buffer but writes the last
        of them joined to the next ("bud-barriest" after "bud berry" committed "bud") has
        that word split where the committed text ends, so that what follows it is a word of its
        own, to be committed in its turn (it was taken as committed, and lost)."""
        committed = "".join(word_key(w.text) for w in self._in_buffer)
        words = [w for s in segments for w in s.words]
        if not committed or not "".join(word_key(w.text) for w in words).startswith(committed):
            return segments
        total = 0
        for i, segment in enumerate(segments):
            for j, word in enumerate(segment.words):
                total += len(word_key(word.text))
                if total > len(committed):  # the committed text ends inside this word
                    parts = _split_word(word, len(word_key(word.text)) - (total - len(committed)))
                    return [*segments[:i], replace(segment, words=[*segment.words[:j], *parts, *segment.words[j + 1 :]]),
                            *segments[i + 1 :]]
                if total == len(committed):
                    return segments
        return segments

    def _heard_again(self, words: list[Word]) -> int:
        """After a cut that left no committed word in the buffer: how many leading words of a
        hypothesis are the last committed ones heard again (up to HEARD_AGAIN_WORDS, starting
        within a second of the last one's end), since the cut falls TRIM_MARGIN_STEPS before
        the committed words' end (as whisper_streaming's n-gram check)."""
        if not self._committed or not words or words[0].start > self._committed[-1].end + 1.0:
            return 0
        tail = [word_key(w.text) for w in self._committed[-HEARD_AGAIN_WORDS:]]
        keys = [word_key(w.text) for w in words[:HEARD_AGAIN_WORDS]]
        return next((n for n in range(min(len(tail), len(keys)), 0, -1) if keys[:n] == tail[-n:]), 0)

    def _trim_at_segment(self, segments: list[_Segment]) -> None:
        """Cuts the buffer at the end of the last closed segment whose words are all
        committed, never the hypothesis's last (as whisper_streaming: Whisper given a second
        or two of audio, and that mid-sentence, is unreliable): its text joins the prompt, and
        the hint keeps the tokens after it."""
        cut = self._committed_segment(segments[:-1])
        if cut is not None:
            self._cut_at(*cut)

    def _committed_segment(self, segments: list[_Segment]) -> tuple[_Segment, int] | None:
        """The last of these segments that closes inside the buffer (past the cut's margin)
        with all its words and those before committed, and how many words those are."""
        counted, found = 0, None
        for segment in segments:
            counted += len(segment.words)
            if counted > len(self._in_buffer):
                break
            end = segment.end_timestamp
            if end is not None and TRIM_MARGIN_STEPS < end and end * SAMPLES_PER_TIMESTAMP <= len(self._buffer):
                found = segment, counted
        return found

    def _cut_at(self, segment: _Segment, words: int) -> None:
        """Cuts the buffer shortly before the end of a segment, the buffer's first `words`
        committed words into the prompt; the hint keeps the tokens after the segment."""
        at = segment.end_timestamp - TRIM_MARGIN_STEPS
        hint = []
        for token in self._hint[segment.end_token :]:
            if token >= self._vocab.timestamp_begin:
                token -= at
                if token < self._vocab.timestamp_begin:
                    break  # a time before the cut: the rest no longer fits the new buffer
            hint.append(token)
        self._cut(at * SAMPLES_PER_TIMESTAMP, words)
        self._hint = hint

    def _cut(self, samples: int, words: int, text: str = "") -> None:
        """Drops the buffer's first samples and its first committed words (into the prompt,
        after `text`)."""
        # Words heard again after the last cut are in the prompt already.
        text = self._context_text + text + "".join(w.text for w in self._in_buffer[self._repeated : words])
        self._repeated = max(self._repeated - words, 0)
        if len(text) > CONTEXT_CHARACTERS:  # whole words only
            text = text[-CONTEXT_CHARACTERS:]
            text = text[text.find(" "):] if " " in text else text
        if not self._conditioned:  # the prompt was the first window's
            text = ""
        self._context_text, self._context = text, self._vocab.encode(text)
        self._in_buffer = self._in_buffer[words:]
        self._buffer = self._buffer[samples:]
        self._buffer_start += samples
        self._unprompted = False


def _sentence_start(word: Word, language: str | None) -> Word:
    """The word with its first letter as a sentence starts it: its title case, where that is
    one letter (not "ß" as "SS", nor Georgian's capitals), and not in Turkish or
    Azerbaijani, whose "i" takes a dot ("İ")."""
    text = word.text
    at = len(text) - len(text.lstrip())
    if at == len(text) or language in ("tr", "az") or len(title := text[at].title()) != 1:
        return word
    return replace(word, text=text[:at] + title + text[at + 1 :])


def _quarter_powers(samples: np.ndarray) -> np.ndarray:
    """The mean power of each whole quarter second of samples (a few samples' mean is noise)."""
    quarter = SAMPLE_RATE // 4
    quarters = len(samples) // quarter
    return (samples[: quarters * quarter].reshape(quarters, quarter).astype(np.float64) ** 2).mean(1)


def _before_repeats(keys: list[str], before: list[str]) -> int:
    """How many of a hypothesis's new words (keys) come before it loops (a run of LOOP_WORDS
    words or more twice in a row, or a shorter one four times) or copies COMMITTED_COPY_WORDS
    words in a row of the text before them (`before`)."""
    copied = copied_at(keys, before, COMMITTED_COPY_WORDS)
    for i in range(len(keys) if copied is None else copied):
        for n in range(1, (len(keys) - i) // 2 + 1):
            run = keys[i : i + n]
            if run == keys[i + n : i + 2 * n] and (n >= LOOP_WORDS or run * 2 == keys[i + 2 * n : i + 4 * n]):
                return i + n
    return len(keys) if copied is None else copied


def _respelt(committed: str, keys: list[str]) -> int:
    """How many leading words spell about what the committed words do, letter by letter
    (the same audio heard with other spellings: "and crease that thereby beauties rose",
    then "increase, that there by beauty's rows"; too few words agreed, and all were
    committed again): the prefix most like them, if at least RESPELT_SIMILARITY alike; else 0."""
    blocks = difflib.SequenceMatcher(None, committed, "".join(keys), autojunk=False).get_matching_blocks()
    best, most, end = 0, RESPELT_SIMILARITY, 0
    for words, key in enumerate(keys, 1):
        end += len(key)
        alike = 2 * sum(max(0, min(b.size, end - b.b)) for b in blocks) / (len(committed) + end)
        if alike >= most:
            best, most = words, alike
    return best


def _split_word(word: Word, chars: int) -> list[Word]:
    """The word cut after its first `chars` characters of key (word_key), times shared by characters."""
    counted, at = 0, 0
    for at, char in enumerate(word.text):
        counted += bool(NOT_WORD.fullmatch(char) is None)
        if counted == chars:
            break
    head, tail = word.text[: at + 1], word.text[at + 1 :]
    if not tail.strip() or not head.strip():
        return [word]
    middle = word.start + (word.end - word.start) * len(head.strip()) / len(word.text.strip())
    return [Word(head, word.start, middle), Word(tail, middle, word.end)]


def _aligned_words(texts: list[str], timed: list[TimedWord], offset: float) -> list[list[Word]] | None:
    """The words of each text (split_words), timed by the timed words (asr/words.py: the texts'
    words, split and grouped otherwise) their first and last characters fall in; None where
    the timed words do not spell the texts."""
    if "".join(w.text for w in timed) != "".join(texts):
        return None
    ends = list(itertools.accumulate(len(w.text) for w in timed))
    result, base = [], 0
    for text in texts:
        words, at = [], 0
        for piece in split_words(text):
            at = text.index(piece, at)
            first = bisect.bisect_right(ends, base + at + len(piece) - len(piece.lstrip()))
            last = bisect.bisect_right(ends, base + at + len(piece) - 1)
            words.append(Word(piece, offset + timed[first].start, offset + max(timed[last].end, timed[first].start)))
            at += len(piece)
        result.append(words)
        base += len(text)
    return result


def _timed_words(text: str, start: float, end: float) -> list[Word]:
    """Words with leading spaces, sharing [start, end] by their characters."""
    pieces = split_words(text)
    return [Word(piece, begin, finish) for piece, (begin, finish) in zip(pieces, shared_times(start, end, pieces))]


@dataclass(frozen=True)
class StreamSummary:
    committed_text: str
    audio_seconds: float
    updates: int  # process() calls that decoded
    compute_seconds: float
    target_passes: int
    decoded_tokens: int
    hypothesis_tokens_proposed: int
    hypothesis_tokens_accepted: int
    draft_tokens_accepted: int
    words: int
    median_commit_latency: float | None
    p90_commit_latency: float | None
    max_commit_latency: float | None


def summarize(updates: list[StreamUpdate]) -> StreamSummary:
    latencies = [x for u in updates for x in u.commit_latencies]

    def quantile(q: float) -> float | None:
        return float(np.quantile(latencies, q)) if latencies else None

    return StreamSummary(
        committed_text=updates[-1].committed_text if updates else "",
        audio_seconds=updates[-1].audio_seconds if updates else 0.0,
        updates=sum(1 for u in updates if u.buffer_seconds > 0),
        compute_seconds=sum(u.compute_seconds for u in updates),
        target_passes=sum(u.target_passes for u in updates),
        decoded_tokens=sum(u.decoded_tokens for u in updates),
        hypothesis_tokens_proposed=sum(u.hypothesis_tokens_proposed for u in updates),
        hypothesis_tokens_accepted=sum(u.hypothesis_tokens_accepted for u in updates),
        draft_tokens_accepted=sum(u.draft_tokens_accepted for u in updates),
        words=len(latencies),
        median_commit_latency=quantile(0.5),
        p90_commit_latency=quantile(0.9),
        max_commit_latency=max(latencies, default=None),
    )


# A stream's committed words as subtitle segments (stream_segments): one ends at a sentence's
# end, a pause this long, or this long after its start.
SEGMENT_PAUSE_SECONDS = 1.0
SEGMENT_MAX_SECONDS = 10.0


def stream_segments(words: list[Word]) -> list[Segment]:
    """Committed words (every update's `committed`, in order) as segments for the writers'
    txt, srt and vtt. A stream keeps no segments of Whisper's (each update re-cuts its
    buffer's), so they are cut at sentence ends and pauses; they carry no tokens or
    decoding figures (0.0), which only the JSON writer reads."""
    groups: list[list[Word]] = []
    for word in words:
        if not word.text.strip():
            continue
        last = groups[-1] if groups else None
        if (last is None or SENTENCE_END.search(last[-1].text) or word.start - last[-1].end >= SEGMENT_PAUSE_SECONDS
                or word.end - last[0].start > SEGMENT_MAX_SECONDS):
            groups.append([word])
        else:
            last.append(word)
    return [Segment(i, group[0].start, group[-1].end, "".join(w.text for w in group), [], 0.0, 0.0, 0.0, 0.0)
            for i, group in enumerate(groups)]


def feed_recording(
    stream: StreamingTranscriber, samples: np.ndarray, chunk_seconds: float, clock: Callable[[], float] | None = None
) -> Iterator[StreamUpdate]:
    """Feeds a recording to a stream as a live microphone would, and yields its updates
    (the last from finish()). Chunk i arrives at (i + 1) * chunk_seconds; each process()
    call takes every chunk that has arrived when it starts, at least one: a call that would
    start ahead of the audio waits for the next chunk. clock: the stream's clock, to run in
    real time (sleeping until chunks arrive); None: the stream's audio-time clock, where a
    call starts when the previous one ended, which gives the same arrivals without waiting."""
    step = max(1, round(chunk_seconds * SAMPLE_RATE))
    ends = list(range(step, len(samples), step)) + [len(samples)]
    fed, last_end = 0, 0.0
    while fed < len(ends):
        now = clock() if clock is not None else last_end
        arrival = ends[fed] / SAMPLE_RATE
        if now < arrival:
            if clock is not None:
                time.sleep(arrival - now)
            now = arrival
        arrived = max(fed + 1, bisect.bisect_right(ends, now, key=lambda end: end / SAMPLE_RATE))  # ends ascend
        stream.insert_audio(samples[ends[fed - 1] if fed else 0 : ends[arrived - 1]])
        fed = arrived
        update = stream.process()
        last_end = update.now
        yield update
    yield stream.finish()


def replay(stream: StreamingTranscriber, samples: np.ndarray, updates: list[StreamUpdate]) -> list[StreamUpdate]:
    """The calls of a recorded stream again on another stream, each process() given the
    audio it had: how to compare two configurations on the very same updates (with greedy
    decoding, with and without the hypothesis draft give the same hypotheses)."""
    replayed, fed = [], 0
    for update in updates[:-1]:  # the last one came from finish()
        received = round(update.audio_seconds * SAMPLE_RATE)
        stream.insert_audio(samples[fed:received])
        fed = received
        replayed.append(stream.process())
    stream.insert_audio(samples[fed:])
    return replayed + [stream.finish()]
