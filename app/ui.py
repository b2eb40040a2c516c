"""The Gradio page: settings on the left, an Upload tab and a Microphone tab on the right."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import html
import os
import re
import shutil
import signal
import tempfile
import threading
import time
import traceback
import uuid
import weakref
from collections import OrderedDict
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import gradio as gr
import numpy as np

from app.engine import AUTO, MAX_PROMPT_CHARACTERS, Engine, Settings, release_freed_memory
from app.live import LiveSession, microphone_chunk
from app.views import (PLACEHOLDER, Figure, error_html, figures_html, live_figures, live_html, live_status, notice_html,
                       progress_figures, segments_html, server_figures, stopped_html, transcript_html, upload_figures,
                       warnings_html)
from asr import vad
from asr.audio import AUDIO_EXTENSIONS, AudioError
from asr.streaming import stream_segments
from asr.transcribe import AudioInput, Cancelled, Progress, TranscribeOptions, Transcriber, Transcript, TranscriptionInfo
from asr.writers import DEFAULT_FORMATS, SubtitleLayout, write_transcript

T = TypeVar("T")

MAX_DRAFT_LENGTH = TranscribeOptions().max_draft_tokens  # a fixed k above it would build an engine of its own
# Each live recording holds a queue slot for as long as it lasts, so this is how many
# people can speak at once; their windows decode in the scheduler's batches.
LIVE_SESSIONS = 8
DEPARTED_KEPT = 1024  # visitors gone, remembered for a first chunk's handler still running
# Transcriptions accepted at once: their audio is read in parallel, then they decode together
# (up to the scheduler's rows; the rest wait there for a row), or take turns without batching.
UPLOADS = 16
QUEUE_SIZE = 64  # events waiting beyond these get "queue full" rather than piling up
# A recording left running ends after this long: its session finishes (on_chunk; Gradio's own
# time limit ends the stream event, but the browser, still recording, starts another).
LIVE_TIME_LIMIT_S = 15 * 60
MAX_UPLOAD = "1gb"
# An upload's progress is looked at this often, and shown when it has moved (a window ended),
# or after QUIET_UPDATE_S without an update: Gradio learns only at an update whether the
# visitor is still there (it closes the handler of one who left, which stops the decoding).
PROGRESS_EVERY_S = 1.0
QUIET_UPDATE_S = 5.0
DROP_A_FILE = "Drop a file above: its timed transcript appears here."  # the upload tab, empty
# Subtitle downloads: Whisper's segments as they are, or lines of a broadcast-style width.
SUBTITLE_LAYOUTS = {"segments": SubtitleLayout(), "42x2": SubtitleLayout(max_line_width=42, max_line_count=2)}

CSS = """
.asr-header h1 { font-size: 1.6rem; margin: 0 0 .2rem 0; }
.asr-header p { margin: 0; color: var(--body-text-color-subdued); }
.asr-figures { display: grid; grid-template-columns: repeat(auto-fit, minmax(125px, 1fr)); gap: .6rem; }
.asr-figure { border: 1px solid var(--border-color-primary); border-radius: 8px; padding: .6rem .8rem;
  background: var(--background-fill-secondary); }
.asr-figure-label { font-size: .78rem; text-transform: uppercase; letter-spacing: .04em;
  color: var(--body-text-color-subdued); }
.asr-figure-value { font-size: 1.45rem; font-weight: 600; font-variant-numeric: tabular-nums; }
.asr-figure-note { font-size: .8rem; color: var(--body-text-color-subdued); min-height: 1em; }
.asr-transcript { max-height: 420px; overflow-y: auto; border: 1px solid var(--border-color-primary);
  border-radius: 8px; }
.asr-segment { display: flex; gap: 1rem; padding: .45rem .8rem; border-bottom: 1px solid var(--border-color-primary); }
.asr-segment:last-child { border-bottom: none; }
.asr-time { flex: none; width: 9.5rem; font-family: var(--font-mono); font-size: .85rem;
  color: var(--body-text-color-subdued); padding-top: .1rem; }
/* The downloads are the server's: Gradio's × on each removed its link, for good. */
#upload-downloads button[aria-label="Remove this file"], #live-downloads button[aria-label="Remove this file"] {
  display: none; }
/* A phone's width: the times above their text (beside it, the text had three words a line). */
@media (max-width: 600px) { .asr-segment { flex-direction: column; gap: .1rem; } .asr-time { width: auto; } }
/* ... and the tabs above the settings, which stacked first put Record three screens down. */
@media (max-width: 600px) { #work { order: -1; } }
.asr-live { font-size: 1.25rem; line-height: 1.6; min-height: 6rem; padding: .8rem 1rem;
  border: 1px solid var(--border-color-primary); border-radius: 8px; }
.asr-tentative { color: var(--body-text-color-subdued); opacity: .6; font-style: italic; }
.asr-error { color: var(--error-text-color); background: var(--error-background-fill);
  border: 1px solid var(--error-border-color); border-radius: 8px; padding: .8rem 1rem; }
.asr-warning { border: 1px solid var(--border-color-accent); border-radius: 8px; padding: .6rem 1rem;
  margin-bottom: .6rem; }
.asr-empty { color: var(--body-text-color-subdued); padding: 1rem; border: 1px dashed var(--border-color-primary);
  border-radius: 8px; text-align: center; }
"""

FONTS = ["ui-sans-serif", "system-ui", "Segoe UI", "Helvetica", "Arial", "sans-serif"]  # local: no font downloads
MONO_FONTS = ["ui-monospace", "SFMono-Regular", "Menlo", "Consolas", "monospace"]


def build(engine: Engine, downloads_dir: Path, keep_seconds: float = 3600.0) -> gr.Blocks:
    """The page over the shared models; transcripts to download are written under
    downloads_dir (swept by serve) and uploads (Gradio's cache) are removed keep_seconds later."""
    with gr.Blocks(title="asr: speculative Whisper", analytics_enabled=False,
                   delete_cache=(sweep_interval(keep_seconds), int(keep_seconds))) as demo:
        gr.HTML(
            '<div class="asr-header"><h1>Speculative Whisper transcription</h1>'
            f"<p>{html.escape(engine.description)}. The draft proposes tokens, the target verifies them in one pass: "
            "the same text as the target alone, in fewer passes.</p></div>"
        )
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=240, elem_id="settings"):
                gr.Markdown("### Settings")
                language = gr.Dropdown(engine.language_choices(), value=engine.language_choices()[0][1], label="Language")
                task = gr.Radio(
                    [("Transcribe", "transcribe"), ("Translate to English", "translate")], value="transcribe",
                    label="Task", interactive=engine.multilingual,
                )
                draft_length = gr.Dropdown(
                    [("Adaptive", AUTO)] + [(str(k), str(k)) for k in range(1, MAX_DRAFT_LENGTH + 1)], value=AUTO,
                    label="Draft length (tokens per round)",
                    info="Adaptive tunes it to the measured acceptance and cost.",
                )
                prompt = gr.Textbox(label="Prompt (optional)", lines=2, max_length=MAX_PROMPT_CHARACTERS, elem_id="prompt",
                                    info="Text said before the audio: names and spellings to expect.")
                words = gr.Checkbox(label="Word timestamps", elem_id="word-timestamps",
                                    info="Uploads: each word's time and probability (hover a word; in the JSON).")
                filtering = vad.available()
                silences = gr.Checkbox(label="Skip silences (VAD)", elem_id="vad", interactive=filtering,
                                       info="Uploads: Silero VAD cuts pauses out before decoding; times stay the file's."
                                            + ("" if filtering else " Needs faster-whisper: pip install 'asr[vad]'."))
                subtitles = gr.Radio(
                    [("One cue per segment", "segments"), ("Lines of up to 42 characters", "42x2")], value="segments",
                    label="Subtitles (srt, vtt downloads)", elem_id="subtitles",
                    info="Lines of up to 42 characters: cues of two lines, timed by their words with word timestamps.")
                gr.Markdown("Settings apply to the next file or recording.")
                server_panel(engine)
            with gr.Column(scale=3, elem_id="work"):
                with gr.Tabs():
                    with gr.Tab("Upload", id="upload"):
                        left_upload = upload_tab(engine, downloads_dir, language, task, draft_length, prompt, words,
                                                 silences, subtitles)
                    with gr.Tab("Microphone", id="microphone"):
                        left_microphone = microphone_tab(engine, downloads_dir, subtitles, language, task,
                                                         draft_length, prompt)

        def on_leave(request: gr.Request) -> None:
            left_upload(request)
            left_microphone(request)

        demo.unload(on_leave)
    return demo


def server_panel(engine: Engine) -> None:
    """The server's live numbers, for whoever runs it: refreshed every few seconds."""
    if engine.scheduler is None:
        gr.Markdown("Requests take turns on the models, one at a time.")
        return
    with gr.Accordion("Server", open=False):
        figures = gr.HTML(elem_id="server-figures")
    load = lambda: figures_html(server_figures(engine.scheduler.load(), LiveSession.running(), LIVE_SESSIONS))  # noqa: E731
    gr.Timer(5.0).tick(load, None, figures, show_progress="hidden", queue=False)


def sweep_interval(keep_seconds: float) -> int:
    """Seconds between two sweeps of files kept keep_seconds."""
    return int(max(60.0, min(keep_seconds / 4, 600.0)))


def sweeping(directory: Path, max_age: float, every: float, cache: Path | None = None) -> threading.Event:
    """Sweeps directory, and what Gradio leaves in its cache (sweep_cache), every `every`
    seconds, from a thread of its own, until the event returned is set. (A sweep after each
    upload left the last visitors' transcripts on an idle server until it stopped.)"""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(every):
            with contextlib.suppress(FileNotFoundError):  # the server stopped, its folder going
                sweep(directory, max_age)
            if cache is not None:
                sweep_cache(cache, max_age)

    threading.Thread(target=run, name="asr-sweep", daemon=True).start()
    return stop


def sweep(directory: Path, max_age: float) -> None:
    """Removes the download folders (one per transcript) older than max_age seconds, but for
    those whose request still holds its upload (_hold)."""
    cutoff = time.time() - max_age
    for folder in directory.iterdir():
        try:
            if folder.stat().st_mtime < cutoff and not any(folder.glob(".upload*")):
                shutil.rmtree(folder, ignore_errors=True)
        except FileNotFoundError:  # another request swept it first
            continue


def sweep_cache(cache: Path, max_age: float) -> None:
    """What Gradio's own sweep (delete_cache) leaves in its cache, older than max_age: the
    folders it emptied (one per upload and per download), and the empty temporary file its
    File component makes on every request and never tracks. A server up for weeks gathered
    them without end."""
    cutoff = time.time() - max_age
    try:
        entries = list(os.scandir(cache))
    except OSError:  # the cache not made yet, or gone
        return
    # Only names Gradio gives (the cache may be a shared folder, GRADIO_TEMP_DIR=/tmp): a
    # sha256's 64 hex digits for a folder, NamedTemporaryFile's tmp + 8 for the file. In the
    # system's temporary folder, where other programs make such files too, those are left.
    shared = os.path.realpath(cache) == os.path.realpath(tempfile.gettempdir())
    for entry in entries:
        with contextlib.suppress(OSError):  # gone meanwhile, or a folder not empty (rmdir removes only an empty one)
            stat = entry.stat(follow_symlinks=False)
            if stat.st_mtime >= cutoff:
                continue
            if entry.is_dir(follow_symlinks=False) and re.fullmatch(r"[0-9a-f]{64}", entry.name):
                os.rmdir(entry.path)
            elif (entry.is_file(follow_symlinks=False) and not shared and re.fullmatch(r"tmp[a-z0-9_]{8}", entry.name)
                  and not stat.st_size):
                os.unlink(entry.path)


def upload_tab(engine: Engine, downloads_dir: Path, *settings: gr.components.Component) -> Callable[[gr.Request], None]:
    """The tab; returns what to call when a visitor leaves (Blocks.unload)."""
    audio = gr.File(label="Audio or video file", file_types=sorted(AUDIO_EXTENSIONS), type="filepath",
                    elem_id="upload-file")
    with gr.Row():
        run = gr.Button("Transcribe", variant="primary", elem_id="upload-run", scale=4)
        stop = gr.Button("Stop", variant="stop", visible=False, elem_id="upload-stop", scale=1)
    figures = gr.HTML(elem_id="upload-figures")
    transcript = gr.HTML(PLACEHOLDER.format(DROP_A_FILE), elem_id="upload-transcript")
    downloads = gr.File(label="Download (txt, srt, vtt, json)", file_count="multiple", interactive=False,
                        visible=False, elem_id="upload-downloads")

    def upload(path: str | None, language: str, task: str, draft_length: str, prompt: str, words: bool, silences: bool,
               subtitles: str, request: gr.Request) -> Iterator[tuple[str, str, dict, dict]]:
        yield from transcribe_upload(engine, downloads_dir, path, language, task, draft_length, prompt,
                                     words, silences, subtitles, request.session_hash)

    def replace(path: str | None, language: str, task: str, draft_length: str, prompt: str, words: bool,
                silences: bool, subtitles: str, request: gr.Request) -> None:
        replace_upload(request.session_hash, (path, language, task, draft_length, prompt, words, silences, subtitles))

    # One listener for both, UPLOADS bounding them together. A new file or new settings first
    # stop the tab's running upload (replace_upload, at once, outside the queue); the new request
    # runs once it has stopped (always_last), so the page ends with the newest request's result.
    # replace first: the page calls a trigger's listeners in turn, and one after the upload
    # came only once the upload had ended (and again, as each is, when a waiting trigger is sent).
    gr.on([audio.upload, run.click], replace, [audio, *settings], None, queue=False,
          api_visibility="undocumented")
    gr.on([audio.upload, run.click], upload, [audio, *settings], [figures, transcript, downloads, stop],
          concurrency_limit=UPLOADS, trigger_mode="always_last",
          api_name="transcribe")  # gradio_client's /transcribe (scripts/benchmark_app.py)
    stop.click(stop_tab_upload, None, None, queue=False)
    audio.clear(clear_upload, None, [figures, transcript, downloads], queue=False)

    def forget_tab(request: gr.Request) -> None:
        with _TABS_LOCK:
            _TABS.pop(request.session_hash, None)

    return forget_tab


@dataclasses.dataclass
class _Tab:
    """A browser tab's upload (by Gradio's session): what decodes, and what the page asked
    while it did, which waits behind it (always_last; the page reads its file and settings
    when it sends it, once the upload has ended). A new file or new settings stop the upload,
    as its Stop button does. What waits is dropped by Stop (or the file's ×), or when it is
    what just decoded (Transcribe pressed as the file was dropped): it decoded the whole file
    again, after Stop or after the first run."""

    running: tuple | None = None  # the file and settings decoding
    progress: Progress | None = None  # ... and its progress, which stops it
    waiting: tuple | None = None  # the file and settings the page asked for while it decoded
    stopped_waiting: bool = False  # Stop came after that: the next request decodes nothing
    done: tuple | None = None  # ... or decodes nothing if it is this, which the page shows whole


_TABS: dict[str, _Tab] = {}
_TABS_LOCK = threading.Lock()


def stop_upload(request: gr.Request) -> bool:
    """Stops this tab's upload, and drops what waits behind it: its handler then shows it
    Stopped, with what was decoded. (The handler says so itself: a listener's `cancels` would
    leave its progress updates in flight free to arrive after the page said Stopped.)
    Returns whether an upload was decoding."""
    with _TABS_LOCK:
        if (tab := _TABS.get(request.session_hash)) is None or tab.progress is None:
            return False
        tab.progress.cancel()
        tab.stopped_waiting = tab.waiting is not None
        return True


def stop_tab_upload(request: gr.Request) -> None:
    """Stop's listener: one with no outputs returns nothing (Gradio warns of each value)."""
    stop_upload(request)


def clear_upload(request: gr.Request) -> tuple[str | dict, str | dict, dict]:
    """The file removed (its ×): a decoding upload stops, as with Stop (its transcript would
    come for a file no longer shown); a finished one's transcript and downloads go with the
    file (they stayed, under no file)."""
    if stop_upload(request):
        return gr.skip(), gr.skip(), gr.skip()
    return "", PLACEHOLDER.format(DROP_A_FILE), gr.update(value=None, visible=False)


def _dropped(session: str, request: tuple) -> bool:
    """Whether this request, starting, is one the tab dropped (_Tab); either way, what was
    dropped is dropped once."""
    with _TABS_LOCK:
        if (tab := _TABS.get(session)) is None:
            return False
        dropped = tab.stopped_waiting or tab.done == request
        tab.stopped_waiting, tab.done = False, None
        _forget_idle(session, tab)
        return dropped


def _forget_idle(session: str, tab: _Tab) -> None:
    """Under _TABS_LOCK: a tab with nothing decoding or dropped is not kept (plain HTTP
    clients' requests each come in a session of their own, and never leave)."""
    if tab.progress is None and not tab.stopped_waiting and tab.done is None:
        _TABS.pop(session, None)


def replace_upload(session: str, request: tuple) -> None:
    """A new request (the path and settings of the page's file) while this tab's upload
    decodes: it waits, and stops the upload if it is of another file or other settings. API
    clients' requests do not come through here."""
    with _TABS_LOCK:
        if request[0] and (tab := _TABS.get(session)) is not None and tab.progress is not None:
            tab.waiting, tab.stopped_waiting = request, False  # asked after a Stop: it decodes
            if tab.running != request:
                tab.progress.cancel()


def transcribe_upload(engine: Engine, downloads_dir: Path, path: str | None, language: str,
                      task: str, draft_length: str, prompt: str, words: bool, silences: bool, subtitles: str,
                      session: str | None = None) -> Iterator[tuple[str, str, dict, dict]]:
    """An upload's progress while it decodes (its segments so far, as windows end, with
    the Stop button), then its figures, transcript and downloads; or, for any failure, an error
    naming the visitor's file (not the server's copy) in place of the transcript. Stop (the
    session's, stop_upload, or a new file or new settings, replace_upload) ends it with the
    segments decoded so far. When the visitor leaves, Gradio closes its wrapper of this
    generator at the next yield, and CPython then finalizes this one at once (GeneratorExit at
    the yield): the decoding stops (Progress.cancel), freeing its row (tests/test_app.py
    checks each in a browser)."""
    request = (path, language, task, draft_length, prompt, words, silences, subtitles)
    if session is not None and _dropped(session, request):  # the page stays as it is
        yield gr.skip(), gr.skip(), gr.skip(), gr.skip()
        return
    if not path:
        yield _failed("Choose an audio file first.")
        return
    name = Path(path).name  # the visitor's file name; the path is the server's upload cache
    if not os.path.exists(path):  # Transcribe pressed again, with other settings, an hour after the upload
        yield _failed(f"{name}: the server no longer holds this upload (uploads are removed a while after they "
                      "came, as their transcripts are): upload the file again")
        return
    progress = Progress()
    handed_over = time.perf_counter()
    folder = downloads_dir / uuid.uuid4().hex  # the transcript's downloads
    if session is not None:
        with _TABS_LOCK:
            tab = _TABS.setdefault(session, _Tab())
            tab.running, tab.progress = request, progress
    # Named as the visitor's file, but never hidden (".take2.wav", "..flac") in their downloads folder.
    stem = Path(name).stem.lstrip(".") or "transcript"
    source = path  # what is read: the upload, or a link to it that Gradio's sweep leaves alone (_hold)
    finished = False
    try:
        try:
            transcriber = engine.transcriber(Settings(language, task, draft_length, prompt, words, silences))
        except ValueError as error:
            yield _failed(f"{name}: these settings cannot be used: {error}")
            return
        source = _hold(path, folder)
        # At once: the last file's transcript and downloads stayed a second, to be taken for this one's.
        yield _progress(progress, time.perf_counter() - handed_over)
        # In a thread of its own, while the page is told how long it has waited: hours of audio
        # take minutes to scan, and until the first update Stop was hidden and a visitor who
        # left was not noticed (the scan stops once the progress is cancelled).
        reading = in_thread(functools.partial(transcriber.read, source, name, progress=progress))
        yield from _waiting(reading, progress, handed_over)
        audio = reading.result()
        # Its warnings name the visitor's file, as its errors do (in the downloaded JSON too).
        audio = dataclasses.replace(audio, warnings=tuple(w.replace(source, name) for w in audio.warnings))
        # Into the shared batches, this thread waiting; or, one request at a time, in a thread of its own.
        decoding = transcriber.submit(audio) if engine.scheduler is not None else in_thread(
            functools.partial(_decode, engine, transcriber, audio))
        yield from _waiting(decoding, progress, handed_over)
        result, seconds = decoding.result(), time.perf_counter() - handed_over
        # No speech: the JSON (its language, duration, figures), not an empty text and subtitles.
        files = write_transcript(result, folder, stem, list(DEFAULT_FORMATS) if result.segments else ["json"],
                                 SUBTITLE_LAYOUTS[subtitles])
        finished = True
    except Cancelled:  # Stop, or a new file or new settings
        stopped = figures_html([Figure("Stopped", f"{progress.fraction:.0%}", "of the file transcribed")])
        if not progress.segments:
            yield (stopped, PLACEHOLDER.format("Nothing transcribed."), gr.update(value=None, visible=False),
                   gr.update(visible=False))
            return
        # What was decoded, as text and subtitles named .partial (a JSON's figures would be of a part).
        partial = Transcript(name, list(progress.segments), TranscriptionInfo("", 0.0, progress.duration, False))
        try:
            files = write_transcript(partial, folder, f"{stem}.partial", ["txt", "srt", "vtt"],
                                     SUBTITLE_LAYOUTS[subtitles])
        except OSError:  # a full disk: the segments stay on the page
            traceback.print_exc()
            files = []
        yield (stopped, segments_html(progress.segments),
               gr.update(value=[str(f) for f in files] or None, visible=bool(files)), gr.update(visible=False))
        return
    except AudioError as error:
        yield _failed(str(error).replace(source, name))
        return
    except Exception as error:  # out of memory, a full disk...: said on the page, the traceback in the server's log
        traceback.print_exc()
        yield _failed(f"{name}: {type(error).__name__}: {error}".replace(source, name).replace(path, name))
        return
    finally:
        progress.cancel()  # nothing once decoded; if the visitor left, the decoding stops
        if source != path:
            Path(source).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # a folder left with no transcript in it
            folder.rmdir()
        with _TABS_LOCK:  # an API client's requests may overlap in one session
            if session is not None and (tab := _TABS.get(session)) is not None and tab.progress is progress:
                if finished and tab.waiting == request:  # asked again as it decoded: the page shows it now
                    tab.done = request
                tab.running = tab.progress = tab.waiting = None
                _forget_idle(session, tab)
    stats = upload_figures(result, seconds, engine.language_name(result.info.language), language == AUTO)
    yield (figures_html(stats), warnings_html(result.info.warnings) + transcript_html(result),
           gr.update(value=[str(f) for f in files], visible=True), gr.update(visible=False))


def _hold(upload: str, folder: Path) -> str:
    """A link to the upload in folder (made here), read in its place until the request ends:
    Gradio removes its uploads keep_seconds after they came, in use or not, and a recording
    over 10 minutes is opened again after its scan, which can wait past that for a row (it
    failed with "no such file"). Where no link can be made (another file system), the upload."""
    folder.mkdir(parents=True)
    held = folder / f".upload{Path(upload).suffix}"
    try:
        os.link(upload, held)
    except OSError:
        return upload
    return str(held)


def _waiting(work: Future, progress: Progress, handed_over: float) -> Iterator[tuple[str, str, dict, dict]]:
    """The upload's progress while work runs: when it changed, and at least every QUIET_UPDATE_S
    (for Gradio to notice a visitor gone); nothing once cancelled, whose end work says."""
    shown, last = None, time.perf_counter()
    while not wait([work], timeout=PROGRESS_EVERY_S).done:
        now, state = time.perf_counter(), (progress.started, progress.fraction, len(progress.segments))
        if not progress.cancelled and (state != shown or now - last >= QUIET_UPDATE_S):
            shown, last = state, now
            yield _progress(progress, now - handed_over)


def _progress(progress: Progress, seconds: float) -> tuple[str, str, dict, dict]:
    so_far = segments_html(progress.segments) if progress.segments else PLACEHOLDER.format("Transcribing…")
    return (figures_html(progress_figures(progress, seconds)), so_far, gr.update(value=None, visible=False),
            gr.update(visible=True))


def _decode(engine: Engine, transcriber: Transcriber, audio: AudioInput) -> Transcript:
    """One request at a time: the transcript, once the models were this request's."""
    with engine.turn(audio.progress):
        return transcriber.transcribe(audio)


def in_thread(work: Callable[[], T]) -> Future[T]:
    """work's result, computed in a thread of its own (a daemon: the server's exit does not wait for it)."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as error:  # whatever it is, the waiting handler must hear of it
            future.set_exception(error)

    threading.Thread(target=run, name="asr-upload", daemon=True).start()
    return future


def _failed(message: str) -> tuple[str, str, dict, dict]:
    # Shown in place of the transcript, where the visitor is looking, until the next run.
    return "", error_html(message), gr.update(value=None, visible=False), gr.update(visible=False)


def microphone_tab(engine: Engine, downloads_dir: Path, subtitles: gr.components.Component,
                   *settings: gr.components.Component) -> Callable[[gr.Request], None]:
    """The tab; returns what to call when a visitor leaves (Blocks.unload). A stopped
    recording's committed text is offered as txt, srt and vtt (under downloads_dir)."""
    gr.Markdown("Press **Record** and speak. Black text is final; grey text is the current guess and may "
                "still change as more speech arrives. Commit latency: from the end of a spoken word to its "
                "final text.")
    microphone = gr.Audio(sources=["microphone"], streaming=True, type="numpy", label="Microphone",
                          elem_id="microphone")
    text = gr.HTML(live_html("", "", listening=False), elem_id="live-transcript")
    figures = gr.HTML(elem_id="live-figures")
    downloads = gr.File(label="Download (txt, srt, vtt)", file_count="multiple", interactive=False,
                        visible=False, elem_id="live-downloads")
    hidden = gr.update(value=None, visible=False)
    session = gr.State(None)  # this visitor's LiveSession: every browser tab has its own
    # The same, by Gradio's session: a visitor who closes the page sends no Stop, and Gradio
    # hands an unload handler no State.
    recordings: dict[str, LiveSession] = {}
    # The last visitors gone, with when: a first chunk's handler may be making their session still.
    departed: OrderedDict[str, float] = OrderedDict()
    # Record presses, by Gradio's session, and the press each recording came of: a Stop still
    # decoding its last audio when Record is pressed again, or queued till after it, shows
    # nothing (its text and downloads would land on the new recording).
    records: dict[str, int] = {}
    record_of: weakref.WeakKeyDictionary[LiveSession, int | None] = weakref.WeakKeyDictionary()

    def show(live: LiveSession) -> tuple[str | dict, str | dict, LiveSession]:
        if live.shown == -1:  # an error or an idle end, shown once: the page keeps it
            return gr.skip(), gr.skip(), live
        if live.error is not None:  # above the text, where the speaker is looking
            live.shown, last = -1, live.last
            return (stopped_html(f"The live transcription stopped: {live.error}", last.committed_text if last else "",
                                 last.tentative_text if last else ""), gr.skip(), live)
        shown = len(live.updates)  # read once: the worker may append meanwhile
        if not shown:
            return live_html("", "", listening=not live.finished), gr.skip(), live
        # Ended for want of audio, its final decode done: a chunk now is the microphone back, unheard.
        idle = live.idle if live.finished else None
        if live.shown == shown and idle is None:  # chunks come twice a second; decodes less often
            return gr.skip(), gr.skip(), live
        live.shown, update = shown if idle is None else -1, live.updates[shown - 1]
        recorded = live.recorded_seconds()
        status = live_status(update.final, recorded, live.waiting_seconds(), LIVE_TIME_LIMIT_S)
        text = live_html(update.committed_text, update.tentative_text, listening=not update.final, ended=update.final)
        if idle is not None:
            text = notice_html("The recording ended.", f"No audio came from the microphone for {idle:.0f} s; what "
                                                       "came after is not transcribed. Stop, then Record, to go on.") + text
        return text, figures_html(live_figures(live.summary(), recorded, status)), live

    def on_start(request: gr.Request) -> tuple[str, str, dict, None]:
        # The last recording's must not be found by this one's Stop; if still running (its Stop
        # queued, to find no session), nobody is left to see it.
        if (last := recordings.pop(request.session_hash, None)) is not None:
            last.cancel()
        records[request.session_hash] = records.get(request.session_hash, 0) + 1
        if LiveSession.running() >= LIVE_SESSIONS:  # this recording's chunks wait in the queue, unheard, for a slot
            return error_html(f"All {LIVE_SESSIONS} live transcriptions are taken: what you say is not transcribed "
                              "until one ends (uploads still work)."), "", hidden, None
        return live_html("", "", listening=True), "", hidden, None  # the first chunk starts a new LiveSession

    def on_chunk(chunk: tuple[int, np.ndarray] | None, live: LiveSession | None, language: str, task: str,
                 draft_length: str, prompt: str, request: gr.Request) -> tuple[str | dict, str | dict, LiveSession | None]:
        if live is None:
            began = time.monotonic()
            if chunk is None:
                return live_html("", "", listening=True), gr.skip(), None
            try:
                # Checked before a session (and its worker) starts: a refused chunk started one per call.
                rate, samples = chunk[0], microphone_chunk(*chunk)
                live = LiveSession(engine, Settings(language, task, draft_length, prompt))
            except ValueError as error:
                return error_html(str(error)), gr.skip(), None
            recordings[request.session_hash] = live
            record_of[live] = records.get(request.session_hash)
            # The visitor left as this made it, and on_leave found none. (One gone before: a tab
            # whose connection dropped and came back records anew.)
            if departed.get(request.session_hash, 0.0) >= began:
                recordings.pop(request.session_hash, None)
                live.cancel()
                return gr.skip(), gr.skip(), None
            live.feed(rate, samples)
            return show(live)
        if live.finished:  # a chunk late for a stopped recording: its final transcript (or error) stays
            return show(live)
        if live.recorded_seconds() > LIVE_TIME_LIMIT_S:  # left running: it ends here, with its final text
            live.finish()
            return show(live)
        if chunk is not None:
            try:
                live.feed(*chunk)
            except AudioError as error:  # this chunk only: the recording goes on
                return error_html(str(error)), gr.skip(), live
        return show(live)

    def on_stop(live: LiveSession | None, subtitles: str,
                request: gr.Request) -> Iterator[tuple[str | dict, str | dict, dict]]:
        """Not an output: the session. Record pressed while this waits for the final decode has
        reset it for the next recording (on_start), and writing this finished one back would
        hand that recording's chunks to it, which takes no more audio."""
        if live is None:  # Stop as the first chunk's handler was making it: not yet in the state, but here
            live = recordings.get(request.session_hash)
        if live is None:  # stopped before a chunk arrived: nothing was heard
            yield live_html("", "", listening=False), gr.skip(), hidden
            return
        if recordings.get(request.session_hash) is live:
            recordings.pop(request.session_hash, None)  # the unload may have taken it meanwhile
        # Stopped first: a page closed while this waits ends the handler at its yield, and the
        # worker must not go on recording for nobody (the session is no longer in recordings).
        live.stop()
        if not live.finished:  # the last decode takes a second or two: the figures said "recording"
            yield gr.skip(), figures_html(live_figures(live.summary(), live.recorded_seconds(),
                                                       "finishing: decoding the last of it")), hidden
        live.finish()
        if records.get(request.session_hash) != record_of.get(live):  # Record pressed since: the page is the next one's
            return
        files = live_downloads(live, downloads_dir / uuid.uuid4().hex, SUBTITLE_LAYOUTS[subtitles])
        yield *show(live)[:2], gr.update(value=[str(f) for f in files] or None, visible=bool(files))

    def on_leave(request: gr.Request) -> None:
        # Nobody sees what a decode would show: the recording's slot and the batch's rows are freed now.
        departed[request.session_hash] = time.monotonic()  # before the lookup: a session made meanwhile finds it
        if len(departed) > DEPARTED_KEPT:
            departed.popitem(last=False)
        records.pop(request.session_hash, None)
        if (live := recordings.pop(request.session_hash, None)) is not None:
            live.cancel()

    microphone.start_recording(on_start, None, [text, figures, downloads, session], show_progress="hidden")
    microphone.stream(on_chunk, [microphone, session, *settings], [text, figures, session],
                      concurrency_limit=LIVE_SESSIONS, time_limit=LIVE_TIME_LIMIT_S, show_progress="hidden")
    microphone.stop_recording(on_stop, [session, subtitles], [text, figures, downloads], concurrency_limit=LIVE_SESSIONS,
                              show_progress="hidden")
    return on_leave


def live_downloads(live: LiveSession, folder: Path, layout: SubtitleLayout) -> list[Path]:
    """A finished recording's committed words (an error's too: what came before it) as txt,
    srt and vtt in folder, named by when it started; none for no words or a full disk (the
    text stays on the page)."""
    segments = stream_segments([word for update in live.updates for word in update.committed])
    if not segments:
        return []
    stem = "recording-" + time.strftime("%Y-%m-%d-%H%M%S", time.localtime(live.created))
    info = TranscriptionInfo("", 0.0, live.summary().audio_seconds, False)
    try:
        return write_transcript(Transcript(stem, segments, info), folder, stem, ["txt", "srt", "vtt"], layout)
    except OSError:
        traceback.print_exc()
        return []


def serve(engine: Engine, host: str, port: int, keep_seconds: float = 3600.0) -> None:
    """Blocks until interrupted (Ctrl-C, or SIGTERM as systemd, docker stop and kill send)."""
    engine.warm_up()
    release_freed_memory()
    if threading.current_thread() is threading.main_thread():
        # SIGTERM's default ends Python without cleaning up: every visitor's uploads and
        # transcripts stayed on disk. Taken as Ctrl-C, on which Gradio closes the server.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    with tempfile.TemporaryDirectory(prefix="asr-app-") as downloads:
        demo = build(engine, Path(downloads), keep_seconds)
        stop_sweeping = sweeping(Path(downloads), keep_seconds, sweep_interval(keep_seconds),
                                 Path(gr.utils.get_upload_folder()))
        try:
            demo.queue(max_size=QUEUE_SIZE, default_concurrency_limit=LIVE_SESSIONS)
            demo.launch(
                server_name=host, server_port=port, max_file_size=MAX_UPLOAD, footer_links=[],
                theme=gr.themes.Soft(font=FONTS, font_mono=MONO_FONTS), css=CSS,
                share=False,  # Gradio turns a public link on by itself with GRADIO_SHARE, on Kaggle and SageMaker
                # Quiet: Gradio's own lines told to "set share=True" for a public link, which this never makes.
                quiet=True, prevent_thread_lock=True,
            )
            print(f"asr app: serving {demo.local_url or f'http://{host}:{port}/'} (no public link; Ctrl-C stops it)",
                  flush=True)
            demo.block_thread()
        finally:
            stop_sweeping.set()
            # Gradio removes its files as it stops, and leaves their folders and its empty
            # files (hundreds after a day of uploads): all of them, whatever their age.
            sweep_cache(Path(gr.utils.get_upload_folder()), 0.0)
