"""Audio in: any common format to 16 kHz mono float32, with errors that name the file."""

from __future__ import annotations

import math
import numbers
import os
import warnings
from pathlib import Path
from typing import Iterator

import numpy as np

SAMPLE_RATE = 16_000
# Video containers: their audio (not .ts, TypeScript's too: a folder of code would be all failures).
AUDIO_EXTENSIONS = {".wav", ".flac", ".mp3", ".ogg", ".oga", ".opus", ".m4a", ".m4b", ".aac", ".wma", ".amr", ".aiff", ".aif",
                    ".caf", ".webm", ".mp4", ".m4v", ".mkv", ".mka", ".mov", ".avi", ".3gp", ".wmv", ".mpg", ".mpeg",
                    ".flv", ".ogv"}
MAX_SECONDS = 6 * 3600  # longer input is refused rather than exhausting memory
SILENT_PEAK = 1e-6  # no sample louder than this: digital silence
FLOAT_PEAK = 64.0  # float samples louder than this are PCM integers cast to float, not audio clipped a little
# libsndfile ends an MP3 where its header's estimate of the length does, silently: a VBR file
# without a Xing header, files joined with `cat`, or a damaged stretch lost the rest. FFmpeg
# decodes every frame (as faster-whisper and the whisper command read MP3). In Ogg, libsndfile
# skips a damaged page without a word, and what follows comes early: FFmpeg's times tell.
FFMPEG_FORMATS = {"MP3", "OGG"}
# A file whose header states this much more audio than it holds was cut short (a copy or
# download interrupted): its transcript would be of a part, and a folder run would skip it as done.
TRUNCATED_SECONDS = 0.5
MP3_FRAME_SECONDS = 576 / 8000  # the longest an MP3 frame lasts (MPEG-2.5 layer III at 8 kHz)
# Audio missing inside a stream (a damaged FLAC stretch the decoder resyncs past, packets that
# fail to decode) shows as a jump in its frames' times: filled with silence from this long,
# so that the times after it stay the recording's (subtitles would run early by the loss).
GAP_SECONDS = 0.05
# Containers whose frame times count samples exactly (Ogg's granule positions): a jump there
# is audio lost, never a clock's jitter (a browser's webm), which other containers fill only
# after a lost packet.
EXACT_TIMES = {"flac", "ogg", "wav"}
# Bare streams whose times the demuxer counts from the frames it passes on: audio lost never
# shows as a jump, and a damaged stretch comes as one packet of a frame's duration, whatever
# its bytes held. Its bytes at the stream's bit rate say how long it was.
COUNTED_TIMES = {"mp3", "aac"}
# A jump in the times of other containers (a Matroska cluster lost) is told from this long,
# and not filled: there it may be the clock's own.
JUMP_TOLD_SECONDS = 0.5
UNSIZED_WAV = 0x7FFF0000


class AudioError(ValueError):
    """The file could not be used as audio; the message names it and the problem."""


class MissingAudio(AudioError, FileNotFoundError):
    """No file at the path given: an AudioError, and a FileNotFoundError for code that
    catches OSError around reading files (faster-whisper raises one)."""


class AudioWarning(UserWarning):
    """The file was read, less a damaged part of it; the message names it and what was lost."""


def load_audio(path: str | Path, seconds: float | None = None, allow_silence: bool = False,
               notices: list[str] | None = None) -> np.ndarray:
    """seconds: the duration the file's header states, where the caller has read it
    (audio_seconds). allow_silence: digital silence is audio too (an evaluation's clip
    without speech), not an error (nothing to transcribe). notices: where given, what the
    read lost (damaged packets skipped) is added to it, for the caller to report with the
    transcript, rather than warned (AudioWarning)."""
    path = Path(path)
    if not path.exists():
        raise MissingAudio(f"{path}: no such file")
    if path.is_dir():
        raise AudioError(f"{path}: is a directory, not an audio file")
    if not path.is_file():  # a pipe (stdin, <(...)) has no size: it was called an empty file
        raise AudioError(f"{path}: not a regular file (a named pipe, socket or device): audio is read from a "
                         "file, more than once; save it to one first")
    if path.stat().st_size == 0:
        raise AudioError(f"{path}: empty file")
    check_whole(path)
    if seconds is None:
        seconds = audio_seconds(path)
    if seconds is not None and seconds > MAX_SECONDS:  # before it fills memory
        raise AudioError(too_long(str(path), seconds))
    known = _libsndfile_format(path)
    try:
        if known in FFMPEG_FORMATS:
            samples, rate = _read_ffmpeg(path, notices)
        else:
            samples, rate = _read_soundfile(path)
            if not len(samples):  # a WAV whose recorder never wrote its data size (0): FFmpeg reads to the end
                samples, rate = _read_ffmpeg(path, notices)
    except AudioError:
        raise
    except Exception as error:  # libsndfile lacks m4a/aac/video containers: FFmpeg (PyAV) reads those
        try:
            samples, rate = _read_ffmpeg(path, notices)
        except AudioError:
            if known is None:
                raise
            # libsndfile knows the format but not this data: say so, not FFmpeg's guess
            raise AudioError(f"{path}: corrupt or truncated {known} audio ({error})") from error
    audio = to_model_input(samples, rate, str(path))
    if not allow_silence:
        check_heard(audio.size, float(np.abs(audio).max()), str(path))
    return audio


def check_heard(samples: int, peak: float, name: str) -> None:
    """AudioError for a recording of no samples, or of digital silence only (a muted or
    unplugged input): nothing for Whisper to transcribe. peak: the largest |sample|."""
    if not samples:
        raise AudioError(f"{name}: contains no audio samples")
    if peak < SILENT_PEAK:
        raise AudioError(f"{name}: contains only digital silence, nothing to transcribe")


def gathered(blocks: Iterator[np.ndarray], seconds: float, name: str) -> np.ndarray:
    """A stream's blocks (stream_audio's) as one array, filled in place (a list of blocks
    joined would hold the recording twice); seconds: its header's estimate. Checked as
    load_audio checks a file."""
    limit = MAX_SECONDS * SAMPLE_RATE  # as load_audio refuses a longer file: before it fills memory
    if seconds * SAMPLE_RATE > limit:
        raise AudioError(too_long(name, seconds))
    samples, size = np.empty(round(seconds * SAMPLE_RATE) + SAMPLE_RATE, dtype=np.float32), 0
    for block in blocks:
        if size + len(block) > len(samples):  # the header said less
            if size + len(block) > limit:
                raise AudioError(too_long(name, (size + len(block)) / SAMPLE_RATE))
            samples = np.resize(samples, min(2 * (size + len(block)), limit))
        samples[size : size + len(block)] = block
        size += len(block)
    check_heard(size, float(np.abs(samples[:size]).max()) if size else 0.0, name)
    return samples[:size]


def check_whole(path: Path) -> None:
    """AudioError where a WAV's data chunk states more audio than the file holds: libsndfile
    and FFmpeg both read such a file to its end, silently. (An MP3's Xing frame count is
    checked against what it decodes to: _ffmpeg_blocks.)"""
    stated = _wav_stated_and_held(path)
    if stated is not None and stated[0] - stated[1] > TRUNCATED_SECONDS:
        raise AudioError(_truncated(path, *stated))


def _truncated(path: Path, stated: float, held: float) -> str:
    return (f"{path}: truncated: its header states {stated:.1f} s of audio, the file holds {held:.1f} s (a copy or "
            "download cut short? If the recording itself ended early, `ffmpeg -i FILE whole.wav` rewrites its header)")


def _wav_stated_and_held(path: Path) -> tuple[float, float] | None:
    """The seconds of audio a WAV's data chunk states, and those the file's size holds; None
    for other files and sizes that state no length: 0, or from UNSIZED_WAV up (what a
    recorder writing to a pipe leaves: arecord's 0x80000000, SoX's 0x7ffff000)."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        head = file.read(12)
        if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
            return None
        byte_rate = 0
        while len(chunk := file.read(8)) == 8:  # chunks in turn (metadata before the data: any size)
            name, length = chunk[:4], int.from_bytes(chunk[4:], "little")
            if name == b"data":
                if not byte_rate or not 0 < length < UNSIZED_WAV:
                    return None
                return length / byte_rate, (size - file.tell()) / byte_rate
            if name == b"fmt ":
                if length < 12:
                    return None
                byte_rate = int.from_bytes(file.read(12)[8:12], "little")
                length -= 12
            file.seek(length + (length & 1), 1)
    return None


def _id3_length(head: bytes) -> int:
    """The bytes of the ID3v2 tag (cover art: tens of kB) that head, a file's or a packet's
    first 10 bytes or more, starts with; 0 if none."""
    if head[:3] != b"ID3" or len(head) < 10:
        return 0
    return 10 + sum((b & 0x7F) << 7 * (3 - i) for i, b in enumerate(head[6:10])) + (10 if head[5] & 0x10 else 0)


def _holds_no_audio(packet: bytes) -> bool:
    """Whether a packet FFmpeg could not decode is an MP3's own metadata, not audio: the header
    frame (Xing, Info, VBRI) of the second of two files joined with `cat`, after its ID3 tag,
    or a tag alone (at the end)."""
    rest = packet
    while skip := _id3_length(rest):  # a tag added before the encoder's own
        rest = rest[skip:]
    return not rest or any(tag in rest[:64] for tag in (b"Xing", b"Info", b"VBRI"))


def _mp3_stated_seconds(path: Path) -> float | None:
    """The seconds of audio an MP3's Xing/Info frame states (its frame count), or None."""
    with open(path, "rb") as file:
        file.seek(_id3_length(file.read(10)))
        frame = file.read(200)
    if len(frame) < 4 or frame[0] != 0xFF or frame[1] & 0xE6 != 0xE2:  # an MPEG layer III frame header
        return None
    version, rate_index = (frame[1] >> 3) & 3, (frame[2] >> 2) & 3
    if version == 1 or rate_index == 3:
        return None
    rate = (44100, 48000, 32000)[rate_index] >> {3: 0, 2: 1, 0: 2}[version]
    tag = next((i for i in (frame.find(b"Xing"), frame.find(b"Info")) if 4 <= i <= 40), None)
    if tag is None or not int.from_bytes(frame[tag + 4 : tag + 8], "big") & 1:  # no frame count stated
        return None
    return int.from_bytes(frame[tag + 8 : tag + 12], "big") * (1152 if version == 3 else 576) / rate


def float_mono(samples: np.ndarray, name: str = "audio") -> np.ndarray:
    """[frames] or [frames, channels], float or PCM integers (whose full scale becomes 1.0)
    -> float32 [frames], channels averaged."""
    samples = np.asarray(samples)
    if samples.dtype.kind in "iu" and samples.dtype.itemsize > 4:
        # numpy's default for a list of ints, no PCM format's: scaled by 2**63 it would be silence
        raise AudioError(f"{name}: {samples.dtype} samples; give PCM as int16 or int32, or floats in [-1, 1]")
    if samples.dtype.kind in "iu":
        half = 2.0 ** (8 * samples.dtype.itemsize - 1)
        samples = (samples.astype(np.float64) - (half if samples.dtype.kind == "u" else 0.0)) / half
    elif samples.dtype.kind != "f":
        raise AudioError(f"{name}: samples must be numbers (float or PCM integers), not {samples.dtype}")
    else:
        check_float_peak(samples, name)
    if samples.ndim == 2:
        if samples.shape[0] <= 8 < samples.shape[1]:  # librosa's [channels, frames]: averaging would keep 2 samples
            raise AudioError(f"{name}: samples shaped {samples.shape} look like [channels, frames]; "
                             "give [frames, channels] (transpose it)")
        samples = samples.mean(axis=1)
    elif samples.ndim != 1:
        raise AudioError(f"{name}: expected samples shaped [frames] or [frames, channels], got {samples.shape}")
    return samples.astype(np.float32, copy=False)


def check_float_peak(samples: np.ndarray, name: str) -> None:
    """Float samples far past full scale are PCM integers cast to float unscaled
    (x.astype(np.float32)), on which Whisper writes nonsense. NaN and infinities are for
    to_model_input to name."""
    peak = max(float(samples.max()), -float(samples.min())) if samples.size else 0.0  # no copy of an hour's audio
    if FLOAT_PEAK < peak < float("inf"):
        raise AudioError(f"{name}: float samples peak at {peak:.0f}, where [-1, 1] is full scale: PCM integers as "
                         "floats, unscaled? (divide int16 by 32768, or give the integers as they are)")


def to_model_input(samples: np.ndarray, rate: int, name: str = "audio") -> np.ndarray:
    """Any array float_mono takes, at any rate -> 16 kHz mono float32, checked."""
    samples = float_mono(samples, name)
    if samples.size == 0:
        raise AudioError(f"{name}: contains no audio samples")
    if rate <= 0:
        raise AudioError(f"{name}: invalid sample rate {rate}")
    if samples.size / rate > MAX_SECONDS:
        raise AudioError(too_long(name, samples.size / rate))
    if not np.isfinite(samples).all():
        raise AudioError(f"{name}: contains NaN or infinite samples")
    if rate != SAMPLE_RATE:
        import soxr

        given = samples.size
        samples = soxr.resample(samples, rate, SAMPLE_RATE, quality="HQ")
        if samples.size == 0:  # a few samples at a high rate
            raise AudioError(f"{name}: too short ({given} samples at {rate} Hz, none at {SAMPLE_RATE} Hz)")
    return np.ascontiguousarray(samples, dtype=np.float32)


# Rates a recording has: below 1 kHz nothing of speech is left; a rate of 100 was a wrong
# argument, decoded as 30 minutes of nothing without a word.
RATE_RANGE = (1_000, 1_000_000)


def checked_rate(rate: float, name: str) -> float:
    """An array's or a chunk's sample rate, or AudioError where it is not a number of hertz
    within RATE_RANGE (a rate of 0 divided by zero in the chunk's seconds)."""
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not 0 < rate < math.inf:
        raise AudioError(f"{name}: invalid sample rate {rate!r}")
    if not RATE_RANGE[0] <= rate <= RATE_RANGE[1]:
        raise AudioError(f"{name}: sample rate {rate!r} Hz is no recording's (expected {RATE_RANGE[0]:,} to "
                         f"{RATE_RANGE[1]:,} Hz; 16,000 for Whisper's own)")
    return rate


def too_long(name: str, seconds: float) -> str:
    return f"{name}: {seconds / 3600:.1f} h is longer than the {MAX_SECONDS // 3600} h limit"


def time_within(seconds: float, limit: float, places: int = 3) -> float:
    """A time rounded to `places` decimals, never past `limit` (the end of the recording or
    of a stretch of it): rounding 53.2665625 up to 53.267 put a segment after the end."""
    value = round(min(seconds, limit), places)
    return value if value <= limit else round(value - 10**-places, places)


def _stated_seconds(container) -> float | None:
    """The duration an open PyAV container's header states, if any."""
    stream = container.streams.audio[0]
    if stream.duration is not None and stream.time_base is not None:  # from the sound's start: a video's may be later
        return float(stream.duration * stream.time_base) + _sound_delay(container) / SAMPLE_RATE
    return container.duration / 1_000_000 if container.duration else None  # in AV_TIME_BASE units


def audio_seconds(path: str | Path) -> float | None:
    """The duration a file's header states, or else its packets' timestamps (a browser's
    MediaRecorder webm states none), without decoding it; None when it cannot tell (the
    file is then found out when read)."""
    if not _mpeg_audio(Path(path)):
        try:
            import soundfile

            info = soundfile.info(str(path))
            if info.frames:  # none: a WAV whose data size was never written, which FFmpeg measures
                return float(info.duration)
        except Exception:
            pass
    try:
        import av

        with av.open(_for_ffmpeg(path), metadata_errors="ignore") as container:
            stream = container.streams.audio[0]
            if (stated := _stated_seconds(container)) is not None:
                return stated
            # The packets demuxed, not decoded: a small part of what decoding them costs.
            end = max((p.pts + (p.duration or 0) for p in container.demux(stream) if p.pts is not None), default=0)
            return float(end * stream.time_base) if end > 0 and stream.time_base is not None else None
    except Exception:
        return None


def stream_audio(path: str | Path, block_seconds: float = 30.0, notices: list[str] | None = None) -> Iterator[np.ndarray]:
    """16 kHz mono float32 blocks of about block_seconds, read and resampled as they are
    needed, so a recording of hours is never held whole. The samples equal load_audio's
    (the same readers, channel mean and resampler, streamed), and so do the notices. Empty
    and silent input is for the consumer to judge, since only the whole stream tells."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        load_audio(path)  # raises the error a whole read would
    check_whole(path)
    seconds = 0.0
    for block in _blocks(path, block_seconds, notices):
        if not np.isfinite(block).all():
            raise AudioError(f"{path}: contains NaN or infinite samples (after {seconds:.1f} s)")
        check_float_peak(block, str(path))
        seconds += len(block) / SAMPLE_RATE
        yield block


def _blocks(path: Path, block_seconds: float, notices: list[str] | None) -> Iterator[np.ndarray]:
    import soundfile

    try:
        source = None if _mpeg_audio(path) else soundfile.SoundFile(str(path))
        if source is not None:
            source.seek(0)  # libsndfile's first read of an Ogg Opus file slips its pre-skip (312 samples) without it
    except Exception:  # not for libsndfile: FFmpeg reads it
        source = None
    if source is None or source.format in FFMPEG_FORMATS or not source.frames:  # (a WAV's data size never written)
        if source is not None:
            source.close()
        yield from _ffmpeg_blocks(path, block_seconds, notices)
        return
    import soxr

    given = 0  # samples yielded
    with source:
        rate = source.samplerate
        resampler = soxr.ResampleStream(rate, SAMPLE_RATE, 1, dtype="float32", quality="HQ") if rate != SAMPLE_RATE else None
        block_frames = max(1, int(block_seconds * rate))
        while True:
            try:
                block = source.read(block_frames, dtype="float32", always_2d=True)
            except Exception as error:
                damage = f"{path}: corrupt or truncated audio after {source.tell() / rate:.1f} s ({error})"
                break
            last = len(block) < block_frames
            samples = block.mean(axis=1) if block.shape[1] > 1 else block[:, 0]
            if resampler is not None:
                samples = resampler.resample_chunk(samples, last=last)
            if len(samples):
                given += len(samples)
                yield np.ascontiguousarray(samples, dtype=np.float32)
            if last:
                return
    # As load_audio: FFmpeg decodes past damage that stops libsndfile (a bad FLAC frame in a
    # long recording). Its samples up to those given are skipped.
    try:
        for block in _ffmpeg_blocks(path, block_seconds, notices):
            skipped, given = min(given, len(block)), given - min(given, len(block))
            if len(block) > skipped:
                yield block[skipped:]
    except AudioError as error:
        raise AudioError(damage) from error


def _for_ffmpeg(path: Path) -> str:
    """The path as FFmpeg takes it: a relative name with a colon (call-2024-01-01T10:30.mp3)
    was read as a protocol's URL and not found."""
    return os.path.abspath(path)


def _sound_delay(container) -> int:
    """Samples (at 16 kHz) from a video's start to its sound's start: 0 for a file without
    pictures, whose times are its sound's."""
    import av

    stream = container.streams.audio[0]
    if not container.streams.video or None in (stream.start_time, stream.time_base, container.start_time):
        return 0
    delay = float(stream.start_time * stream.time_base) - container.start_time / av.time_base
    return max(0, round(delay * SAMPLE_RATE))


def _mpeg_audio(path: Path) -> bool:
    """Whether a file is MPEG audio (MP3, MP2: an ID3 tag or a frame first, or so named), which
    FFmpeg reads (FFMPEG_FORMATS) and libsndfile's libmpg123 is never asked about: it wrote
    notes on damaged or joined files ("Illegal Audio-MPEG-Header", "Xing stream size off")
    straight to stderr, naming no file, through a folder run's progress bar, and on any file
    named .mp3 that is not audio at all."""
    if path.suffix.lower() in (".mp3", ".mp2"):
        return True
    try:
        with open(path, "rb") as file:
            head = file.read(3)
    except OSError:
        return False
    return head == b"ID3" or (len(head) == 3 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0 and head[1] & 0x06 != 0)


def _libsndfile_format(path: Path) -> str | None:
    if _mpeg_audio(path):
        return "MP3"
    try:
        import soundfile

        return soundfile.info(str(path)).format
    except Exception:
        return None


def _read_soundfile(path: Path) -> tuple[np.ndarray, int]:
    import soundfile

    samples, rate = soundfile.read(str(path), dtype="float32", always_2d=False)
    return samples, rate


def _read_ffmpeg(path: Path, notices: list[str] | None) -> tuple[np.ndarray, int]:
    chunks, size = [], 0
    for chunk in _ffmpeg_blocks(path, 0, notices):  # counted as read: not every container states its length
        chunks.append(chunk)
        if (size := size + len(chunk)) > MAX_SECONDS * SAMPLE_RATE:
            raise AudioError(too_long(str(path), size / SAMPLE_RATE))
    if not chunks:
        raise AudioError(f"{path}: contains no audio samples")
    return np.concatenate(chunks), SAMPLE_RATE


def _ffmpeg_blocks(path: Path, block_seconds: float, notices: list[str] | None) -> Iterator[np.ndarray]:
    """Decoded frames resampled to 16 kHz mono, gathered into blocks of block_seconds
    (0: as decoded); damaged packets skipped are told in notices (load_audio's)."""
    import av

    pending: list[np.ndarray] = []
    size = 0
    lost: list[tuple[float, str]] = []  # each packet that could not be decoded: where it starts (s), the error
    ends_lost = [False]  # whether no packet decoded after the last lost one
    gaps: list[tuple[float, float]] = []  # audio missing between frames, filled with silence: where (s), how long (s)
    jumps: list[tuple[float, float]] = []  # times jumping with nothing lost, not filled: where (s), how far (s)
    decoded = 0
    try:
        with av.open(_for_ffmpeg(path), metadata_errors="ignore") as container:
            if not container.streams.audio:
                raise AudioError(f"{path}: has no audio stream")
            # A video's sound can start after its pictures: the silence before it is kept, so that
            # times (subtitles) are the video's, as a player plays them.
            if lead := _sound_delay(container):
                pending.append(np.zeros(lead, dtype=np.float32))
                size += lead

            exact, stated = container.format.name in EXACT_TIMES, _stated_seconds(container)
            counted = container.format.name in COUNTED_TIMES
            bit_rate = container.streams.audio[0].bit_rate or container.bit_rate

            def missing(due: float | None, start: float | None, lost_seconds: float) -> float:
                """Seconds of silence for the audio missing before a frame. In a container of
                exact times, where its time jumps past the last frame's end, all of it, up to
                the length its header states (a damaged FLAC stretch); in a bare stream, what
                the lost packets held; in others, of a jump, only what lost packets held (a
                broadcast's timestamps can jump with nothing lost), a longer jump told."""
                if start is None or due is None:
                    return 0.0
                if counted:
                    return lost_seconds
                if start - due < GAP_SECONDS:
                    return 0.0
                if exact:
                    return max(0.0, min(start, stated or start) - due)
                if start - due - lost_seconds >= JUMP_TOLD_SECONDS:
                    jumps.append((due, start - due - lost_seconds))
                return min(start - due, lost_seconds)

            def mono(outs) -> Iterator[np.ndarray]:  # channels averaged, as soundfile's are (see below)
                return (out.to_ndarray().mean(axis=0, dtype=np.float32) for out in outs)

            def resampled() -> Iterator[np.ndarray]:
                resampler, setup = None, None
                due = None  # where the next frame starts if nothing is missing (s)
                lost_seconds = 0.0  # held by the packets lost since the last frame decoded
                for packet in container.demux(container.streams.audio[0]):
                    try:
                        frames = packet.decode()
                    except av.error.InvalidDataError as error:
                        seconds = float(packet.duration * packet.time_base) if packet.duration and packet.time_base else 0.0
                        if _holds_no_audio(bytes(packet)):  # a joined file's header: nothing is lost
                            due = None if due is None else due + seconds  # its duration is a frame's, in the times
                            continue
                        # A damaged stretch: only it is lost, as with the ffmpeg command (a whole
                        # file failed on one bad packet).
                        at = float(packet.pts * packet.time_base) if packet.pts is not None and packet.time_base else 0.0
                        lost.append((at, str(error)))
                        ends_lost[0] = True
                        lost_seconds += max(seconds, packet.size * 8 / bit_rate if counted and bit_rate else 0.0)
                        continue
                    ends_lost[0] = ends_lost[0] and not frames
                    for frame in frames:
                        start = float(frame.pts * frame.time_base) if frame.pts is not None and frame.time_base else None
                        if silence := round(missing(due, start, lost_seconds) * SAMPLE_RATE):
                            if resampler is not None:  # what it holds is from before the gap
                                yield from mono(resampler.resample(None))
                                resampler, setup = None, None
                            gaps.append((due, silence / SAMPLE_RATE))
                            for piece in range(0, silence, 30 * SAMPLE_RATE):
                                yield np.zeros(min(30 * SAMPLE_RATE, silence - piece), dtype=np.float32)
                        lost_seconds = 0.0
                        due = (start if start is not None else due or 0.0) + frame.samples / frame.sample_rate
                        # MP3s joined with `cat`, a broadcast's AAC: the rate or channels can change
                        # midway, and a resampler takes only the frames it was set up with.
                        if setup != (frame.format.name, frame.layout.name, frame.sample_rate):
                            if resampler is not None:
                                yield from mono(resampler.resample(None))
                            # Channels kept and averaged below, as soundfile's are: FFmpeg's own stereo-to-mono
                            # mix sums them at 0.707 each, 3 dB louder than the same recording as a WAV.
                            resampler = av.AudioResampler(format="fltp", rate=SAMPLE_RATE)
                            setup = (frame.format.name, frame.layout.name, frame.sample_rate)
                        yield from mono(resampler.resample(frame))
                if resampler is not None:
                    yield from mono(resampler.resample(None))

            for out in resampled():
                pending.append(out)
                size += len(pending[-1])
                decoded += len(pending[-1])
                if size >= block_seconds * SAMPLE_RATE:
                    yield np.concatenate(pending)
                    pending, size = [], 0
            # Damage up to the end is junk after the audio, or a file cut short: the length the
            # header states tells them apart where it is exact (FLAC's, WAV's).
            if (ends_lost[0] and lead + decoded < 0.9 * SAMPLE_RATE * (_stated_seconds(container) or 0.0)) or (lost and not decoded):
                raise AudioError(f"{path}: not a readable audio file (corrupt or truncated: {lost[-1][1]})")
            # An MP3 cut short decodes cleanly to its end: its Xing frame count tells (files
            # joined with `cat` decode to more than their first header states, never less).
            # Damaged packets skipped are allowed for, each at most an MP3 frame: a file both
            # damaged and cut short was taken for whole, its missing end unsaid.
            stated = _mp3_stated_seconds(path)
            if stated is not None and decoded / SAMPLE_RATE + len(lost) * MP3_FRAME_SECONDS < stated - TRUNCATED_SECONDS:
                raise AudioError(_truncated(path, stated, decoded / SAMPLE_RATE))
    except AudioError:
        raise
    except Exception as error:
        # FFmpeg's own message names the file as it was opened (absolute): the path leads already.
        detail = getattr(error, "strerror", None) if isinstance(error, av.error.FFmpegError) else None
        raise AudioError(f"{path}: not a readable audio file ({type(error).__name__}: {detail or error})") from error
    if lost or gaps or jumps:
        told = [f"{len(lost)} damaged audio packet(s), the first at {lost[0][0]:.2f} s, could not be decoded and were "
                f"skipped ({lost[0][1]})"] if lost else []
        if gaps:
            where = (f"at {gaps[0][0]:.2f} s" if len(gaps) == 1 else
                     f"in {len(gaps)} stretches (the first at {gaps[0][0]:.2f} s)")
            told.append(f"{sum(length for _, length in gaps):.2f} s of audio missing {where} (damaged), replaced by "
                        "silence so that later times stay the recording's")
        if jumps:
            where = f"at {jumps[0][0]:.2f} s" if len(jumps) == 1 else f"{len(jumps)} times (the first at {jumps[0][0]:.2f} s)"
            told.append(f"its times jump {sum(length for _, length in jumps):.2f} s {where} (a part lost, or the file's "
                        "clock jumping): later times may run early by as much")
        notice = f"{path}: {'; '.join(told)}"
        if notices is None:
            warnings.warn(notice, AudioWarning, stacklevel=2)
        else:
            notices.append(notice)
    if pending:
        yield np.concatenate(pending)
