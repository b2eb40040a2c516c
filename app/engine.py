"""The models, loaded once and shared by every visitor, and the settings a visitor picks."""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
from transformers.models.whisper.tokenization_whisper import LANGUAGES

from asr.audio import SAMPLE_RATE
from asr.models import ModelPair
from asr.transcribe import Cancelled, Progress, Scheduler, TranscribeOptions, Transcriber

AUTO = "auto"
MAX_PROMPT_CHARACTERS = 1000  # Whisper reads at most 223 tokens of previous text: the last ones


@dataclass(frozen=True)
class Settings:
    language: str = AUTO  # a code such as "en", or AUTO to detect
    task: str = "transcribe"  # or "translate"
    draft_length: str = AUTO  # tokens the draft proposes per round, or AUTO to adapt
    prompt: str = ""  # text said before the audio (names, spellings): TranscribeOptions.initial_prompt
    word_timestamps: bool = False  # uploads: each word timed (TranscribeOptions.word_timestamps)
    vad_filter: bool = False  # uploads: silences cut out before decoding (TranscribeOptions.vad_filter)

    def options(self, engine_options: dict) -> TranscribeOptions:
        """engine_options: how the engine runs (TranscribeOptions' cuda_graphs, compile, lengths_attention,
        fused_layers). ValueError, worded for the page, for a prompt that is not text."""
        try:  # the browser sends text; an API client may send a lone surrogate
            self.prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("the prompt holds a character that is not text (a lone surrogate)") from None
        return TranscribeOptions(
            language=None if self.language == AUTO else self.language,
            task=self.task,
            num_draft_tokens=None if self.draft_length == AUTO else int(self.draft_length),
            # The page's limit, also for API clients (the browser keeps to it; Gradio does not check):
            # a prompt of megabytes was tokenized on every request, for its last 223 tokens.
            initial_prompt=self.prompt[-MAX_PROMPT_CHARACTERS:],
            word_timestamps=self.word_timestamps,
            vad_filter=self.vad_filter,
            **engine_options,
        )


@dataclass
class Engine:
    models: ModelPair
    description: str  # what the page says it runs, e.g. the target and draft names
    # How the engine runs, as TranscribeOptions' fields: cuda_graphs (on a GPU, the decoder's
    # steps run as CUDA graphs, the default), compile, lengths_attention, fused_layers
    engine_options: dict = field(default_factory=dict)
    # Every visitor's uploads and live windows decode together in the scheduler's batches;
    # None: requests take turns on the models, one at a time (the lock).
    scheduler: Scheduler | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def transcriber(self, settings: Settings) -> Transcriber:
        """A Transcriber per request (cheap: it holds only options) over the shared models and
        their engines, whose adaptive draft length it shares; ValueError for settings the
        target refuses."""
        return Transcriber(self.models, settings.options(self.engine_options), scheduler=self.scheduler)

    def turn(self, progress: Progress | None = None) -> contextlib.AbstractContextManager:
        """What a request holds while it decodes: nothing when the scheduler batches requests
        (it takes them all at once), else the lock (one request at a time: on a CPU,
        concurrent runs would only fight over the same cores). progress: the request's; once
        cancelled, it stops waiting for the lock (Cancelled): a Stop waited for another
        visitor's whole transcription."""
        return contextlib.nullcontext() if self.scheduler is not None else _taken(self.lock, progress)

    def warm_up(self) -> None:
        """On a GPU every step of the default settings' batches captured (Transcriber.warm_up:
        before anything decodes, so that the scheduler's batch takes the warmed state), then
        one second of silence through both models, so the first visitor does not wait for the
        backends' one-time set-up. Fixed draft lengths share the engine (Transcriber)."""
        transcriber = self.transcriber(Settings())
        transcriber.warm_up()
        transcriber.transcribe(np.zeros(SAMPLE_RATE, np.float32))

    @property
    def multilingual(self) -> bool:
        return self.models.target.vocab.multilingual

    def language_choices(self) -> list[tuple[str, str]]:
        if not self.multilingual:
            return [("English (en)", "en")]
        codes = self.models.target.vocab.languages
        return [("Detect automatically", AUTO)] + [(f"{LANGUAGES.get(c, c).title()} ({c})", c) for c in codes]

    def language_name(self, code: str) -> str:
        return LANGUAGES.get(code, code).title()


@contextlib.contextmanager
def _taken(lock: threading.Lock, progress: Progress | None) -> Iterator[None]:
    while not lock.acquire(timeout=0.25):
        if progress is not None and progress.cancelled:
            raise Cancelled("cancelled while it waited for its turn")
    try:
        yield
    finally:
        lock.release()


def release_freed_memory(every: float = 60.0) -> None:
    """Every `every` seconds, for the life of the process, hands the heap memory that glibc
    keeps after frees back to the system (malloc_trim). Requests allocate tensors of many
    sizes (prompts, hints, batches of a few rows), and glibc's arenas keep what they free:
    the server's resident memory crept up by 10-14 % over 20 minutes of load without this.
    Nothing happens where the C library is not glibc."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return

    def loop() -> None:
        while True:
            time.sleep(every)
            trim(0)

    threading.Thread(target=loop, name="asr-malloc-trim", daemon=True).start()
