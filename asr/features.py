"""Log-mel features, computed once for a whole recording and cut into 30 s windows
(as openai/whisper does), so long audio costs one STFT, not one per window; recordings
too long to hold (hours) are read block by block instead (StreamedMel), with the same
windows."""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Iterator

import numpy as np
import torch
from torch import Tensor

from asr.audio import SAMPLE_RATE, check_heard

N_FFT = 400
HOP_LENGTH = 160
WINDOW_SECONDS = 30
WINDOW_SAMPLES = WINDOW_SECONDS * SAMPLE_RATE
WINDOW_FRAMES = WINDOW_SAMPLES // HOP_LENGTH  # 3000 mel frames per window
FRAME_SECONDS = HOP_LENGTH / SAMPLE_RATE  # 0.01 s


@lru_cache(maxsize=4)
def _mel_filters(n_mels: int) -> Tensor:
    from transformers.audio_utils import mel_filter_bank

    filters = mel_filter_bank(
        num_frequency_bins=1 + N_FFT // 2,
        num_mel_filters=n_mels,
        min_frequency=0.0,
        max_frequency=8000.0,
        sampling_rate=SAMPLE_RATE,
        norm="slaney",
        mel_scale="slaney",
    )
    return torch.from_numpy(filters.T.astype(np.float32))  # [n_mels, bins]


def log_mel(audio: np.ndarray, n_mels: int, device: str | torch.device = "cpu") -> Tensor:
    """[n_mels, frames] for audio followed by one window of silence, so that any window
    starting inside the audio can be cut to its full 3000 frames."""
    padded = np.concatenate([audio, np.zeros(WINDOW_SAMPLES, dtype=np.float32)])
    waveform = torch.from_numpy(padded).to(device)
    window = torch.hann_window(N_FFT, device=device)
    stft = torch.stft(waveform, N_FFT, HOP_LENGTH, window=window, return_complex=True)
    log_spec = _log10_mel(stft[..., :-1], n_mels)
    return _normalise(log_spec, log_spec.max())


def _log10_mel(stft: Tensor, n_mels: int) -> Tensor:
    power = (stft.abs() ** 2).contiguous()
    mel = _mel_filters(n_mels).to(stft.device) @ power
    return mel.clamp(min=1e-10).log10()


def _normalise(log_spec: Tensor, peak: Tensor | float) -> Tensor:
    """Whisper's scaling: an 80 dB range below the recording's loudest mel bin."""
    return (log_spec.clamp(min=peak - 8.0) + 4.0) / 4.0


def content_frames(audio: np.ndarray) -> int:
    return len(audio) // HOP_LENGTH


def window_at(mel: Tensor, seek: int, frames: int) -> Tensor:
    """The 3000 frames from `seek`, those past the audio's `frames` set to zero: Whisper's
    transcribe (and faster-whisper) cut a window's log-mel at the end of the audio and pad
    it with zeros, not with the log-mel of silence, and the model was trained on that."""
    return _zero_past(mel[:, seek : seek + WINDOW_FRAMES], frames - seek)


def first_window(audio: np.ndarray, mel_bins: int) -> Tensor:
    """A clip's first window as transcription cuts it (zeros past the audio, window_at): what
    a draft is trained and measured on, and benchmarks decode, is what transcription decodes."""
    return window_at(log_mel(audio, mel_bins), 0, content_frames(audio))


def _zero_past(window: Tensor, content: int) -> Tensor:
    if content >= window.shape[1]:
        return window
    window = window.clone()
    window[:, max(content, 0) :] = 0.0
    return window


class StreamedMel:
    """The windows of log_mel for a recording read block by block, so that hours of
    audio are never held at once: memory stays at about one window of samples.

    log_mel's windows depend on the whole recording in two ways: its length, and its
    loudest mel bin (the floor of the 80 dB range). A first pass over the stream measures
    both; windows are then computed on demand as the seek moves forward (it never moves
    back), each from the samples its frames see, with the same STFT framing and centre
    padding as the whole-recording path, so `window(seek)` equals
    `window_at(log_mel(samples), seek, frames)` up to floating-point summation order. The price is
    reading (decoding and resampling) the file twice.
    """

    def __init__(self, open_blocks: Callable[[], Iterator[np.ndarray]], n_mels: int, name: str = "audio"):
        self._open = open_blocks
        self.n_mels = n_mels
        scan = _SampleStream(open_blocks())
        peak = -10.0  # log10 of the clamp: what frames of pure padding give
        first = 0
        while not scan.ended or _frame_start(first) < scan.length:  # frames that see any audio
            peak = max(peak, float(self._log10_frames(scan, first, first + WINDOW_FRAMES).max()))
            first += WINDOW_FRAMES
        check_heard(scan.length, scan.peak_amplitude, name)
        self.peak = peak
        self.samples = scan.length
        self._stream: _SampleStream | None = None

    @property
    def frames(self) -> int:
        return self.samples // HOP_LENGTH

    @property
    def duration(self) -> float:
        return self.samples / SAMPLE_RATE

    def window(self, seek: int, frames: int | None = None) -> Tensor:
        """frames: where its audio ends for this window (a clip's end), if before the recording's."""
        if self._stream is None or max(_frame_start(seek), 0) < self._stream._offset:  # a recording transcribed again
            self._stream = _SampleStream(self._open())
        try:
            window = _normalise(self._log10_frames(self._stream, seek, seek + WINDOW_FRAMES), self.peak)
        except Exception:
            self._stream = None  # read again from the start if asked again: a failed read's blocks are lost
            raise
        return _zero_past(window, (self.frames if frames is None else frames) - seek)

    def _log10_frames(self, stream: "_SampleStream", first: int, end: int) -> Tensor:
        """Frames [first, end): frame f is centred on sample f * HOP_LENGTH."""
        samples = stream.take(_frame_start(first), _frame_start(end - 1) + N_FFT)
        window = torch.hann_window(N_FFT)
        stft = torch.stft(torch.from_numpy(samples), N_FFT, HOP_LENGTH, window=window, center=False, return_complex=True)
        return _log10_mel(stft, self.n_mels)


def _frame_start(frame: int) -> int:
    return frame * HOP_LENGTH - N_FFT // 2


class _SampleStream:
    """A forward-only view of a block stream as one signal: samples past the end are
    zeros and samples before 0 mirror the start (torch.stft's centre padding of
    log_mel's audio + silence). Samples before the last request are dropped."""

    def __init__(self, blocks: Iterator[np.ndarray]):
        self._blocks = blocks
        self._buffer = np.zeros(0, dtype=np.float32)
        self._offset = 0  # signal index of _buffer[0]
        self.ended = False
        self.peak_amplitude = 0.0

    @property
    def length(self) -> int:
        """Samples read so far: the signal's length once ended."""
        return self._offset + len(self._buffer)

    def take(self, start: int, stop: int) -> np.ndarray:
        while not self.ended and self.length < stop + 1:  # + 1: the mirror of the start reads one further
            block = next(self._blocks, None)
            if block is None:
                self.ended = True
            elif len(block):
                self.peak_amplitude = max(self.peak_amplitude, float(np.abs(block).max()))
                self._buffer = np.concatenate([self._buffer, block])
        if max(start, 0) < self._offset:
            raise ValueError(f"samples from {start} were already dropped (the stream is at {self._offset})")
        signal = self._signal(max(start, 0), stop)
        if start < 0:
            signal = np.concatenate([self._signal(1, 1 - start)[::-1], signal])
        self._drop_before(max(start, 0))
        return np.ascontiguousarray(signal)

    def _signal(self, start: int, stop: int) -> np.ndarray:
        part = self._buffer[max(start - self._offset, 0) : max(stop - self._offset, 0)]
        return np.concatenate([part, np.zeros(stop - start - len(part), dtype=np.float32)])

    def _drop_before(self, index: int) -> None:
        if index > self._offset:
            self._buffer = self._buffer[index - self._offset :]
            self._offset = index
