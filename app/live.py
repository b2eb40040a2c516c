"""One visitor's microphone recording: browser chunks (any rate, integer PCM, maybe stereo)
to 16 kHz mono float32, decoded by its own StreamingTranscriber over the shared models.

Gradio hands a stream handler only the newest chunk: one that arrives while the handler is
still busy replaces the one before it. So the handler only queues audio, and a worker
thread per recording decodes whatever has arrived since its last pass."""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import replace

import numpy as np

from app.engine import Engine, Settings
from asr.audio import AudioError, checked_rate, float_mono
from asr.streaming import MIN_STEP_SECONDS, StreamingTranscriber, StreamSummary, StreamUpdate, summarize

# No chunk for this long: the visitor's browser stopped sending (its tab is closed at once: cancel).
IDLE_SECONDS = 30.0


def microphone_chunk(rate: int, samples: np.ndarray) -> np.ndarray:
    """A browser's chunk as float mono; AudioError for one that cannot be audio, refused
    alone (NaN, in the resampler's state, ended the recording; a rate of 0, the session)."""
    samples = float_mono(samples, "microphone chunk")
    if not np.isfinite(samples).all():
        raise AudioError("microphone chunk: contains NaN or infinite samples")
    checked_rate(rate, "microphone chunk")
    return samples


class LiveSession:
    _running = 0  # sessions whose worker runs, server-wide (LiveSession.running)
    _count = threading.Lock()

    def __init__(self, engine: Engine, settings: Settings):
        self._engine = engine
        self.created = time.time()  # the date, for the downloads' names
        # Word timestamps are the uploads' (the page shows no live word times: a pass an update for nothing).
        self._streamer = StreamingTranscriber(engine.transcriber(replace(settings, word_timestamps=False)),
                                              clock=self._stream_clock)
        self._started: float | None = None  # wall time of the stream's first sample
        self._stopped: float | None = None  # wall time of Stop
        self._pending: list[tuple[int, np.ndarray]] = []  # chunks (rate, samples) not yet given to the streamer
        self._pending_seconds = 0.0
        self._stopping = False
        self._cancelled = False
        self._fed = time.monotonic()  # wall time of the last chunk
        self.idle: float | None = None  # ended after this many seconds without a chunk (IDLE_SECONDS)
        self._wake = threading.Condition()
        self.updates: list[StreamUpdate] = []  # appended by the worker only
        self.shown = 0  # updates the page has displayed (-1: it has displayed the error)
        self.error: str | None = None  # why the worker stopped before the recording ended
        self._worker = threading.Thread(target=self._run, name="asr-live", daemon=True)
        with LiveSession._count:
            LiveSession._running += 1
        try:
            self._worker.start()
        except BaseException:  # no thread to count down when it ends
            with LiveSession._count:
                LiveSession._running -= 1
            raise

    @staticmethod
    def running() -> int:
        """Recordings being transcribed now, by every visitor (the page's live slots)."""
        return LiveSession._running

    @property
    def finished(self) -> bool:
        return not self._worker.is_alive()

    def feed(self, rate: int, samples: np.ndarray) -> None:
        """Queues a chunk and returns at once."""
        samples = microphone_chunk(rate, samples)
        with self._wake:
            if self._stopping or self.finished or not samples.size:
                return
            self._fed = time.monotonic()
            if self._started is None:
                # The first chunk arrives as it ends: the speaker started its length earlier.
                self._started = time.monotonic() - samples.size / rate
            self._pending.append((rate, samples))
            self._pending_seconds += samples.size / rate
            if self._pending_seconds >= MIN_STEP_SECONDS:  # what the streamer would decode (chunks come every 0.5 s)
                self._wake.notify()

    def stop(self) -> None:
        """Ends the recording; its worker makes the final update. Returns at once."""
        with self._wake:
            if not self._stopping:  # a recording that ended (idle, time limit) keeps its end
                self._stopping, self._stopped = True, time.monotonic()
            self._wake.notify()

    def finish(self) -> None:
        """Ends the recording and waits for its final update."""
        self.stop()
        self._worker.join()

    def cancel(self) -> None:
        """The visitor left: the audio not yet decoded is dropped and no final decode runs
        (a decode under way ends first); returns at once."""
        with self._wake:
            if not self._stopping:
                self._stopping, self._stopped = True, time.monotonic()
            self._cancelled = True
            self._pending, self._pending_seconds = [], 0.0
            self._wake.notify()

    def recorded_seconds(self) -> float:
        """Wall time since the first sample: more than the audio heard when chunks were lost
        (Gradio keeps only the newest chunk while a server too busy to take them catches up)."""
        if self._started is None:
            return 0.0
        end = self._stopped if self._stopped is not None else time.monotonic()
        return end - self._started

    def waiting_seconds(self) -> float:
        """Audio received that no decode has read yet, a backlog behind the stream's full
        buffer included: it grows where decoding is slower than speech (chunks Gradio
        dropped are not counted: recorded_seconds)."""
        with self._wake:
            pending = self._pending_seconds
        return pending + self._streamer.undecoded_seconds

    @property
    def last(self) -> StreamUpdate | None:
        return self.updates[-1] if self.updates else None

    def summary(self) -> StreamSummary:
        """Figures over the whole recording (each update covers one decode)."""
        return summarize(list(self.updates))

    def _run(self) -> None:
        try:
            self._decode()
        except Exception as error:  # the page shows it; the server's log gets the traceback
            traceback.print_exc()
            self.error = f"{type(error).__name__}: {error}"
        finally:
            with LiveSession._count:
                LiveSession._running -= 1

    def _decode(self) -> None:
        retried = False
        while True:
            with self._wake:
                # A backlog behind the stream's full buffer is decoded without waiting for more audio
                # (not right after a failed decode: that is tried again with the next audio).
                while (not self._stopping and self._pending_seconds < MIN_STEP_SECONDS
                       and (retried or self._streamer.undecoded_seconds < MIN_STEP_SECONDS)):
                    if (idle := time.monotonic() - self._fed) >= IDLE_SECONDS:
                        self._stopping, self._stopped, self.idle = True, self._fed, IDLE_SECONDS
                    else:
                        self._wake.wait(IDLE_SECONDS - idle)
                if self._cancelled:
                    return
                chunks, self._pending, self._pending_seconds, stopping = self._pending, [], 0.0, self._stopping
            for rate, chunk in chunks:  # resampled by the streamer (finish() flushes its resampler)
                self._streamer.insert_audio(chunk, rate)
            if stopping and self._started is None:
                return  # nothing was heard
            try:
                with self._engine.turn():
                    update = self._streamer.finish() if stopping else self._streamer.process()
            except Exception:
                # Once, tried again at the next pass (the buffer is kept): a failure can pass
                # (memory that other requests held).
                if retried:
                    raise
                retried = True
                traceback.print_exc()
                continue
            retried = False
            self.updates.append(update)
            if stopping:
                return

    def _stream_clock(self) -> float:
        # Wall time, so commit latency is what the speaker waits: queueing and model work included.
        return time.monotonic() - (self._started or 0.0)
