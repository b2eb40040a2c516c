"""Audio in: any common format to 16 kHz mono float32, with errors that name the file."""

from __future__ import annotations

from pathlib import Path

import numpy as np

SAMPLE_RATE = 16_000
AUDIO_EXTENSIONS = {".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".aac", ".webm", ".mp4", ".aiff", ".aif"}
MAX_SECONDS = 6 * 3600  # longer input is refused rather than exhausting memory


class AudioError(ValueError):
    """The file could not be used as audio; the message names it and the problem."""


def load_audio(path: str | Path) -> np.ndarray:
    path = Path(path)
    if not path.exists():
        raise AudioError(f"{path}: no such file")
    if path.is_dir():
        raise AudioError(f"{path}: is a directory, not an audio file")
    if path.stat().st_size == 0:
        raise AudioError(f"{path}: empty file")
    try:
        samples, rate = _read_soundfile(path)
    except Exception:  # libsndfile lacks m4a/aac/video containers: FFmpeg (PyAV) reads those
        samples, rate = _read_ffmpeg(path)
    audio = to_model_input(samples, rate, str(path))
    if float(np.abs(audio).max()) < 1e-6:
        raise AudioError(f"{path}: contains only digital silence, nothing to transcribe")
    return audio


def to_model_input(samples: np.ndarray, rate: int, name: str = "audio") -> np.ndarray:
    """Any [frames] or [frames, channels] array at any rate -> 16 kHz mono float32."""
    samples = np.asarray(samples)
    if samples.ndim == 2:
        samples = samples.mean(axis=1)
    elif samples.ndim != 1:
        raise AudioError(f"{name}: expected samples shaped [frames] or [frames, channels], got {samples.shape}")
    if samples.size == 0:
        raise AudioError(f"{name}: contains no audio samples")
    if rate <= 0:
        raise AudioError(f"{name}: invalid sample rate {rate}")
    if samples.size / rate > MAX_SECONDS:
        raise AudioError(f"{name}: {samples.size / rate / 3600:.1f} h is longer than the {MAX_SECONDS // 3600} h limit")
    samples = samples.astype(np.float32)
    if not np.isfinite(samples).all():
        raise AudioError(f"{name}: contains NaN or infinite samples")
    if rate != SAMPLE_RATE:
        import soxr

        samples = soxr.resample(samples, rate, SAMPLE_RATE, quality="HQ")
    return np.ascontiguousarray(samples, dtype=np.float32)


def _read_soundfile(path: Path) -> tuple[np.ndarray, int]:
    import soundfile

    samples, rate = soundfile.read(str(path), dtype="float32", always_2d=False)
    return samples, rate


def _read_ffmpeg(path: Path) -> tuple[np.ndarray, int]:
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise AudioError(f"{path}: has no audio stream")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
            chunks = []
            for frame in container.decode(audio=0):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
    except AudioError:
        raise
    except Exception as error:
        raise AudioError(f"{path}: not a readable audio file ({type(error).__name__}: {error})") from error
    if not chunks:
        raise AudioError(f"{path}: contains no audio samples")
    return np.concatenate(chunks), SAMPLE_RATE
