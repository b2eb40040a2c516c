"""Log-mel features, computed once for a whole recording and cut into 30 s windows
(as openai/whisper does), so long audio costs one STFT, not one per window."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from torch import Tensor

from asr.audio import SAMPLE_RATE

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
    power = (stft[..., :-1].abs() ** 2).contiguous()
    mel = _mel_filters(n_mels).to(device) @ power
    log_spec = mel.clamp(min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def content_frames(audio: np.ndarray) -> int:
    return len(audio) // HOP_LENGTH


def window_at(mel: Tensor, seek: int) -> Tensor:
    return mel[:, seek : seek + WINDOW_FRAMES]
