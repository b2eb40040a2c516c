"""Folder transcription: trees of audio in, a mirrored tree of transcripts out
(IN/a/b.flac -> OUT/a/b.json), built to run unattended over hundreds of hours.

- Resumable: outputs are written under temporary names and renamed when complete, so a
  file whose every requested output exists is finished, and is skipped by the next run;
  leftover temporary files of a killed run are removed and their files redone.
- Robust: a file that cannot be read or transcribed becomes one line of
  OUT/errors.jsonl (file and reason) and the run goes on.
- Fast: files are sorted by duration (from their headers) so the rows of a batch end
  together, and decoded in batches; recordings longer than STREAM_ABOVE_SECONDS are read
  block by block.
- Scales out: the same files, outputs and resume rules on a Ray cluster
  (transcribe_folder_on_ray), one model pipeline per actor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import socket
import sys
import tempfile
import time
import unicodedata
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from stat import S_ISREG
from typing import Callable, Iterable, Iterator

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

import torch
from tqdm import tqdm

from asr.audio import AUDIO_EXTENSIONS, AudioError, audio_seconds
from asr.models import TARGET_AS_DRAFT, choose_dtypes, load_pair, resolve_device
from asr.transcribe import STREAM_ABOVE_SECONDS, AudioInput, Progress, TranscribeOptions, Transcriber, Transcript
from asr.writers import (DEFAULT_FORMATS, FORMATS, NAME_MAX, NAME_UNIT, TEMPORARY_END, SubtitleLayout, name_length, render,
                         temporary_prefix, unwritable, write_atomic, write_files_atomic)

ERRORS_FILE = "errors.jsonl"
SOURCES_FILE = ".sources.jsonl"  # which recording each finished file's outputs are of
LOCK_FILE = ".asr-run.lock"  # held by the run writing into OUT
LAYOUT_SETTINGS = {"max_line_width", "max_line_count"}  # transcript_settings that only subtitles depend on
# transcript_settings recorded only where set: missing, they are these (the options' defaults,
# which a ledger from before an option holds too), so that setting one, or no longer, differs.
UNSET_SETTINGS = {"hotwords": "", "multilingual": False, "vad_parameters": {}, "hallucination_silence_threshold": None,
                  "retry_greedy_copies": True, "prefix": "", "suppress_tokens": [-1], "language_detection": [1, 0.5]}
SUBTITLE_FORMATS = {"srt", "vtt"}
# Windows of different files decoded together: of 1, 8 and 16, 8 was the fastest on 2 CPU
# cores (scripts/benchmark_folder.py --batch-sizes 1,8,16).
DEFAULT_BATCH_SIZE = 8
WORKER_TRIES = 3  # on Ray: a batch whose worker dies is tried this many times in all


def _amount(seconds: float) -> str:
    """Audio's length in the unit that shows it (a clip was "0.000 h"), chosen as rounded (not "60.0 s")."""
    if round(seconds / 60, 1) >= 60:
        return f"{seconds / 3600:.3f} h"
    return f"{seconds / 60:.1f} min" if round(seconds, 1) >= 60 else f"{seconds:.1f} s"


@dataclass(frozen=True)
class PipelineSpec:
    """How to build the model pipeline: picklable, so every Ray actor builds its own."""

    target: str
    draft: str | None
    draft_encoder: str = "auto"
    device: str = "auto"  # cuda when present
    dtype: torch.dtype | None = None  # None: choose_dtypes' choice for the device
    options: TranscribeOptions = TranscribeOptions()
    batch_size: int = DEFAULT_BATCH_SIZE

    def build(self) -> Transcriber:
        device = resolve_device(self.device)
        dtype, encoder_dtype = choose_dtypes(device, self.dtype)
        pair = load_pair(self.target, self.draft, draft_encoder=self.draft_encoder, device=device, dtype=dtype,
                         encoder_dtype=encoder_dtype)
        return Transcriber(pair, self.options, batch_size=max(1, self.batch_size))


@dataclass(frozen=True)
class FolderRun:
    inputs: tuple[Path, ...]  # folders (walked recursively) and files
    out_dir: Path
    formats: tuple[str, ...] = DEFAULT_FORMATS
    layout: SubtitleLayout = SubtitleLayout()  # of srt and vtt cues
    overwrite: bool = False  # redo files whose outputs are complete
    stream_above_seconds: float = STREAM_ABOVE_SECONDS
    progress: bool = True  # a progress bar on stderr
    echo: bool = True  # one line per file on stdout (and errors on stderr)
    # What the transcripts depend on (transcript_settings), recorded beside each file's
    # outputs: a later run with others still skips the file, and says so.
    settings: dict = field(default_factory=dict)


def transcript_settings(target: str, options: TranscribeOptions, layout: SubtitleLayout = SubtitleLayout()) -> dict:
    """The settings a file's transcript depends on, as .sources.jsonl records them. Not the
    draft, its length or the batch size (greedy output is the target's, whatever drafts for
    it), nor the device and dtype (which can tip a near tie, but are not a choice of text).
    The seed and best_of only where some temperature samples (a fallback's included)."""
    local = Path(target)  # a folder of weights, however it was named (./w, w/, /abs/w)
    settings = {"target": str(local.resolve()) if local.exists() else target,
                "language": options.language or "detect", "task": options.task, "temperatures": list(options.temperatures),
                "compression_ratio_threshold": options.compression_ratio_threshold,
                "log_prob_threshold": options.log_prob_threshold, "no_speech_threshold": options.no_speech_threshold,
                "condition_on_previous_text": options.condition_on_previous_text, "prompt": options.initial_prompt,
                "without_timestamps": options.without_timestamps, "word_timestamps": options.word_timestamps,
                "vad": options.vad_filter, "max_line_width": layout.max_line_width,
                "max_line_count": layout.max_line_count,
                # Only where set (UNSET_SETTINGS): the ledgers of runs from before the option still match.
                **({} if options.hallucination_silence_threshold is None
                   else {"hallucination_silence_threshold": options.hallucination_silence_threshold}),
                **({} if options.retry_greedy_copies else {"retry_greedy_copies": False}),
                **({"hotwords": options.hotwords.strip()} if options.hotwords.strip() else {}),
                **({"multilingual": True} if options.multilingual else {}),
                **({"prefix": options.prefix.strip()} if options.prefix.strip() else {}),
                **({"language_detection": [options.language_detection_segments, options.language_detection_threshold]}
                   if options.language_detection_segments > 1 else {}),
                **({"suppress_tokens": sorted(set(options.suppress_tokens))}
                   if set(options.suppress_tokens) != {-1} else {}),
                **({"vad_parameters": options.vad_parameters.changed()}
                   if options.vad_parameters is not None and options.vad_parameters.changed() else {}),
                # Always, even empty: a clipped run's files were taken as done by a whole one after it.
                "clip_timestamps": list(options.clip_timestamps),
                **({"seed": options.seed, "best_of": options.best_of} if any(t > 0 for t in options.temperatures)
                   else {"seed": None, "best_of": None})}
    return json.loads(json.dumps(settings))  # as read back: tuples are lists


@dataclass(frozen=True)
class RayOptions:
    address: str | None = None  # None: start a local cluster on this machine
    workers: int | None = None  # actors, each with its own model pipeline (default: one per GPU, else per cpus_per_worker CPUs)
    cpus_per_worker: int | None = None  # default: 1 beside a GPU, else up to 4


@dataclass(frozen=True)
class PlannedFile:
    source: Path
    stem: Path  # the outputs' path without the format: OUT/a/b for IN/a/b.flac
    seconds: float | None = None  # duration from the header, when known

    def output(self, fmt: str) -> Path:
        return self.stem.with_name(f"{self.stem.name}.{fmt}")


@dataclass
class FileResult:
    """One file's outcome, as it crosses from a transcribing process to the writer."""

    source: str
    texts: dict[str, str] = field(default_factory=dict)  # rendered outputs by format; empty on failure
    error: str | None = None
    text: str = ""
    seconds: float = 0.0  # audio duration
    busy_seconds: float = 0.0  # encoder + decoder time
    draft_proposed: int = 0
    draft_accepted: int = 0
    recording: dict | None = None  # the file's size, time and fingerprint when it was read (recording_of)
    warnings: tuple[str, ...] = ()  # what reading it lost (TranscriptionInfo.warnings): told by the writer, here or from Ray


@dataclass
class FolderSummary:
    ok: int = 0
    failed: int = 0
    skipped: int = 0  # outputs already complete
    skipped_other_settings: int = 0  # of those, made with other settings (transcript_settings) than this run's
    # Of those transcribed, files whose outputs in formats not asked for stay, made with other settings.
    beside_other_settings: int = 0
    # Of those transcribed, files that had some of the formats asked for: only the others were written.
    completed: int = 0
    audio_seconds: float = 0.0  # of the files transcribed by this run
    wall_seconds: float = 0.0  # transcribing, after the models loaded
    load_seconds: float = 0.0  # loading the models (in this process; a Ray run's workers load in its wall time)
    draft_proposed: int = 0
    draft_accepted: int = 0
    errors_file: Path | None = None  # set when something failed

    @property
    def rtfx(self) -> float:
        """Seconds of audio transcribed per second of wall time."""
        return self.audio_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def acceptance(self) -> float | None:
        return self.draft_accepted / self.draft_proposed if self.draft_proposed else None

    def describe(self) -> str:
        other = (f", {self.skipped_other_settings} of them with other settings: --overwrite redoes them"
                 if self.skipped_other_settings else "")
        beside = (f" ({self.beside_other_settings} beside their outputs in other formats made with other settings: "
                  "ask for those formats too, with --overwrite, to redo them)" if self.beside_other_settings else "")
        completed = (f" ({self.completed} of them only into the formats they lacked, their other outputs kept as they "
                     "were: --overwrite redoes those too)" if self.completed else "")
        line = f"{self.ok} transcribed{beside}{completed}, {self.failed} failed, {self.skipped} skipped (already done{other}); "
        # Nothing decoded (all done already, or every file failed): no speed to tell.
        line += (f"{_amount(self.audio_seconds)} of audio in {self.wall_seconds:.1f} s, RTFx {self.rtfx:.1f}"
                 if self.audio_seconds else "no audio decoded")
        if self.load_seconds:
            line += f", after loading the models in {self.load_seconds:.1f} s"
        if self.draft_proposed:
            line += f", draft acceptance {self.acceptance:.0%}"
        if self.errors_file is not None:
            line += f"; failures listed in {self.errors_file}"
        return line


def find_audio(root: Path, unreadable: list[OSError] | None = None) -> list[Path]:
    """Audio files under root, recursively (linked folders outside it too, each once), in a stable
    order; hidden files and folders are not (".git", macOS's "._NAME.wav" resource files beside
    real recordings). The output folder is walked too where it lies inside: `cd day1; asr
    transcribe ..` skipped day1's recordings, saying nothing. Folders that cannot be listed go
    to `unreadable`."""
    found = []

    def visible(subfolders: list[str]) -> list[str]:
        return sorted(d for d in subfolders if not d.startswith("."))

    # The tree's own folders are walked under their own paths: a link to one that sorts
    # first (a_view -> z) took its files, and moved their outputs, for as long as it stayed.
    own: set[Path] = set()
    for folder, subfolders, _ in os.walk(root):
        own.add(Path(folder).resolve())
        subfolders[:] = visible(subfolders)
    walked: set[Path] = set()
    walk = os.walk(root, followlinks=True, onerror=None if unreadable is None else unreadable.append)
    for folder, subfolders, names in walk:
        if (real := Path(folder).resolve()) in walked:  # a link back up the tree, or two links to one folder
            subfolders[:] = []
            continue
        walked.add(real)
        subfolders[:] = [d for d in visible(subfolders)
                         if not ((Path(folder) / d).is_symlink() and (Path(folder) / d).resolve() in own)]
        found += [Path(folder) / n for n in sorted(names)
                  if not n.startswith(".") and Path(n).suffix.lower() in AUDIO_EXTENSIONS]
    return found


def plan_outputs(inputs: Iterable[Path], out_dir: Path, formats: Iterable[str] = DEFAULT_FORMATS,
                 fold_case: bool = False, holds: Callable[[PlannedFile], bool] = lambda item: False,
                 ) -> tuple[list[PlannedFile], list[FileResult]]:
    """Each audio file with the stem of its outputs: a folder's tree is mirrored under
    out_dir, a file named directly lands at its top. Inputs that are missing, empty
    folders, files whose outputs' names would be too long and files whose outputs would
    collide (fold_case: in names differing only in case too) come back as failures. Of
    files whose outputs collide, the one whose transcript they hold already (holds:
    Sources.holds) keeps them, else the first met."""
    formats = tuple(formats)
    longest = max(formats, key=len)
    candidates: list[PlannedFile] = []
    failures: list[FileResult] = []
    sources: set[Path] = set()  # the recordings' real paths
    # A file met twice under one name from two inputs (named, and inside a folder named) is
    # done once; a link of another name to it gets its own outputs (b.wav -> a.wav named was
    # dropped unsaid), as does each path of a folder's tree (x/a.wav and y/a.wav linked to one).
    met: dict[tuple[Path, str], int] = {}  # -> the input it was met in
    for index, path in enumerate(inputs):
        try:
            is_dir, exists = path.is_dir(), path.exists()
        except OSError as error:  # pathlib takes only a missing file for False: not a folder it may not enter
            failures.append(FileResult(str(path), error=f"cannot be read ({error.strerror or error})"))
            continue
        if is_dir:
            unreadable: list[OSError] = []
            files = [(f, f.relative_to(path)) for f in find_audio(path, unreadable=unreadable)]
            failures += [FileResult(str(e.filename), error=f"cannot read this folder ({e.strerror})") for e in unreadable]
            if not files and not unreadable:
                failures.append(FileResult(str(path), error=f"folder holds no audio files ({', '.join(sorted(AUDIO_EXTENSIONS))})"))
        elif exists or path.is_symlink():  # a link named that leads nowhere is told as such below
            files = [(path, Path(path.name))]
        else:
            failures.append(FileResult(str(path), error="no such file or folder"))
            files = []
        for source, relative in files:
            try:
                # Through links: /dev/stdin's leads to a pipe, which resolve() takes for a file that does not exist.
                regular = S_ISREG(source.stat().st_mode)
                real = source.resolve(strict=True) if regular else source
            except FileNotFoundError:
                failures.append(FileResult(str(source), error="a symbolic link to a file that does not exist"))
                continue
            except (RuntimeError, OSError) as error:  # a loop: RuntimeError before Python 3.13, OSError (ELOOP) since
                loop = isinstance(error, RuntimeError) or error.errno == errno.ELOOP
                failures.append(FileResult(str(source), error="a symbolic link that leads back to itself" if loop
                                           else f"cannot be read ({error.strerror or error})"))
                continue
            if not regular:  # reading a named pipe would wait for a writer, and the run with it, for ever
                failures.append(FileResult(str(source), error="not a regular file (a named pipe, socket or device)"))
                continue
            if met.setdefault((real, source.name), index) != index:
                continue  # a file failed here is reported once, too
            sources.add(real)
            stem = out_dir / relative.parent / relative.stem
            if name_length(f"{stem.name}.{longest}") > NAME_MAX:
                failures.append(FileResult(str(source), error=f"the name of its outputs ({stem.name}.{longest}) would be "
                                                              f"longer than a file name can be ({NAME_MAX} {NAME_UNIT})"))
                continue
            candidates.append(PlannedFile(source, stem))
    def key(item: PlannedFile) -> str:
        return folded(str(item.stem)) if fold_case else str(item.stem)

    claims: dict[str, list[PlannedFile]] = {}  # output stem (case-folded with fold_case) -> the files that would write it
    for item in candidates:
        claims.setdefault(key(item), []).append(item)
    # A recording added beside a finished one of the same name (a.mp3 beside a.wav) does not take its outputs.
    owners = {stem: next((rival for rival in rivals if holds(rival)), rivals[0]) if len(rivals) > 1 else rivals[0]
              for stem, rivals in claims.items()}
    def same_file_key(path: Path) -> str:
        return folded(os.path.realpath(path)) if fold_case else os.path.realpath(path)

    # talk.json named, transcribed beside itself: --overwrite replaced the recording with its
    # transcript. Only inputs named like an output can be one (an output's path resolved each).
    named_like_outputs = {same_file_key(s) for s in sources if s.suffix[1:].lower() in formats}
    # a.wav's a.txt and the folder a.txt/ of a mirrored tree cannot both be: told before transcribing, not after.
    def name_key(path: Path) -> str:
        return folded(str(path)) if fold_case else str(path)
    folders = set()
    for item in candidates:
        parts = item.stem.parent.relative_to(out_dir).parts
        folders.update(name_key(out_dir.joinpath(*parts[:depth])) for depth in range(1, len(parts) + 1))
    planned = []
    for item in candidates:
        owner = owners[key(item)]
        if named_like_outputs and (replaced := next(
                (fmt for fmt in formats if same_file_key(item.output(fmt)) in named_like_outputs), None)):
            failures.append(FileResult(str(item.source), error=f"its {replaced} output would be {item.output(replaced)}, "
                                                               "a file also given to transcribe: give another --out-dir"))
        elif folder := next((item.output(fmt) for fmt in formats if name_key(item.output(fmt)) in folders
                             or item.output(fmt).is_dir()), None):
            failures.append(FileResult(str(item.source), error=f"its output {folder} would be a file where a folder of "
                                                               "outputs is: rename one, or give another --out-dir"))
        elif owner is item:
            planned.append(item)
        else:
            case = "" if owner.stem == item.stem else " (the output folder's file system ignores case in names)"
            # Of one name in two trees: two folders given, each mirrored into OUT's top.
            trees = "; each folder given is mirrored into --out-dir: give each its own" \
                if owner.source.name == item.source.name else ""
            failures.append(FileResult(str(item.source), error=f"same output name as {owner.source}: both would write "
                                                               f"{item.stem}.*{case}{trees}"))
    return planned, failures


def folded(name: str) -> str:
    """A name as a file system that ignores case compares it: APFS also takes é written as
    one character or two for the same (lower(), not casefold(): none of them takes ß for ss)."""
    return unicodedata.normalize("NFC", name).lower()


def ignores_case(folder: Path) -> bool:
    """Whether this folder's file system takes names differing only in case for one file
    (macOS and Windows by default, FAT): there, "Talk.wav" and "talk.mp3" share outputs."""
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".case-") as probe:
        name = Path(probe.name).name
        return (folder / name.swapcase()).exists()


def is_complete(item: PlannedFile, formats: Iterable[str]) -> bool:
    """Outputs are renamed into place only when fully written, so existing means complete."""
    return all(item.output(fmt).is_file() for fmt in formats)


def remove_partials(files: Iterable[PlannedFile], formats: Iterable[str], also: Iterable[Path] = ()) -> int:
    """Deletes the temporary files (`.NAME.*.part`, see writers.write_atomic) that a killed
    run left beside these outputs, and beside the files `also` (a run's ledgers); returns
    how many."""
    wanted: dict[Path, set[str]] = {}
    for output in [item.output(fmt) for item in files for fmt in formats] + list(also):
        wanted.setdefault(output.parent, set()).add(temporary_prefix(output.name))
    removed = 0
    for folder, prefixes in wanted.items():
        if not folder.is_dir():
            continue
        for entry in folder.iterdir():
            name = entry.name
            if name.endswith(".part") and name[:-TEMPORARY_END] in prefixes:
                entry.unlink(missing_ok=True)
                removed += 1
    return removed


class OutputError(RuntimeError):
    """The output folder takes no transcripts (it cannot be made or written, its disk is
    full, its file system read-only): the run stops; transcripts written stay.
    before_work: found before any file was transcribed (there are none to keep)."""

    def __init__(self, message: str, before_work: bool = False):
        super().__init__(message)
        self.before_work = before_work


FULL = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}  # write errors after which no other file's would succeed


def fingerprint(path: Path, sampled: bool = False) -> str:
    """Which recording a file holds, as a copy or a move keeps it: its size and a hash of its
    bytes. sampled: of its start, middle and end (64 KiB each), as records before 2026-11-29
    hold it; a stretch muted in place, which keeps the size, went unseen."""
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        digest = hashlib.sha256()
        if not sampled:
            while block := file.read(1 << 20):
                digest.update(block)
            return f"sha256:{size}:{digest.hexdigest()}"
        for offset in sorted({0, max(size // 2 - 32768, 0), max(size - 65536, 0)}):
            file.seek(offset)
            digest.update(file.read(65536))
    return f"{size}:{digest.hexdigest()[:32]}"


def size_and_time(path: Path) -> list[int]:
    """A file's size and modification time (ns), as Sources records them."""
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


def recording_of(path: Path, stat: list[int] | None = None) -> dict | None:
    """What Sources records of a file: its size and modification time, and its fingerprint;
    None where it cannot be read. stat: its size and time when it was read, hashed since (in
    a thread): a file changed meanwhile gets a fingerprint that matches none, so that a later
    run does not take its outputs, of the audio read, for the file's now."""
    try:
        now = size_and_time(path)
        digest = fingerprint(path)
        if stat is not None and (stat != now or stat != size_and_time(path)):
            digest = "changed while it was read"
        return {"stat": stat or now, "fingerprint": digest}
    except OSError:  # gone or unreadable since it was read (moved away, a new one in its place): no match either
        return None if stat is None else {"stat": stat, "fingerprint": "unreadable after it was read"}


def _written_at(record: dict) -> float:
    """When a ledger line was written (0: before lines told it, or a hand-edited time that is no number)."""
    at = record.get("time")
    return at if isinstance(at, (int, float)) else 0.0


class Sources:
    """OUT/.sources.jsonl: for each file transcribed, the stem of its outputs (relative to OUT),
    its source, size, modification time, fingerprint and settings, appended as its outputs
    are about to be written ("writing": true) and again once they are complete. A later run
    that finds outputs, complete or not, under a file's name takes them for its own only
    where they are of the same recording (the same size and time, or else the same
    fingerprint): recorders reuse names (REC001.wav every day), and a second day's folder
    into the same OUT would otherwise be skipped as done, or replace the first's transcript.
    Outputs it has no line for were not written by a run (a reference talk.txt beside
    talk.wav, in the default --out-dir "."): not the file's to replace, nor done. A line of
    another OUT's file, in a folder above or below this OUT, counts too: `asr transcribe .`
    in a folder, then in the folder above it, failed every file done the first time."""

    def __init__(self, out_dir: Path, fold_case: bool):
        self.out_dir, self.fold_case = out_dir, fold_case
        self.path = out_dir / SOURCES_FILE
        self._known, lines = self._read(self.path)
        # Up to three lines a file a run (to be redone with --overwrite, being written, written);
        # files redone leave lines that no longer count.
        if len(lines) > 3 * len(self._known):
            write_atomic(self.path, "".join(json.dumps(record) + "\n" for record in self._known.values()))
        # Other OUTs' lines: of folders below this OUT (read as met), and above it, each with
        # this OUT's path from there.
        self._below: dict[Path, dict[str, dict]] = {}
        here = Path(os.path.abspath(out_dir))
        self._above = [(here.relative_to(folder).as_posix(), self._other(folder)) for folder in here.parents
                       if (folder / SOURCES_FILE).is_file()]
        self._handle = None

    def _other(self, folder: Path) -> dict[str, dict]:
        try:
            return self._read(folder / SOURCES_FILE)[0]
        except OSError:  # unreadable: it tells nothing
            return {}

    def _read(self, path: Path) -> tuple[dict[str, dict], list[str]]:
        known = {}
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines() if path.is_file() else []
        for line in lines:
            with contextlib.suppress(ValueError, KeyError, TypeError):  # a line cut short by a kill
                record = json.loads(line)
                known[self._key(record["stem"])] = record
        return known, lines

    def _key(self, stem: str) -> str:
        return folded(stem) if self.fold_case else stem

    def _stem(self, item: PlannedFile) -> str:
        return item.stem.relative_to(self.out_dir).as_posix()

    def _record(self, item: PlannedFile) -> dict | None:
        """The line of the run that wrote item's outputs last, of this OUT's ledger or another's
        (one redone into a folder below with --overwrite: this OUT's own line was older)."""
        stem = self._stem(item)
        found = [self._known.get(self._key(stem))]
        parts = stem.split("/")
        for depth in range(len(parts) - 1, 0, -1):
            folder = self.out_dir.joinpath(*parts[:depth])
            if folder not in self._below:
                self._below[folder] = self._other(folder)
            found.append(self._below[folder].get(self._key("/".join(parts[depth:]))))
        found += [ledger.get(self._key(f"{prefix}/{stem}")) for prefix, ledger in self._above]
        # Lines before 2026-11-30 have no time: older than any that has; among them, this OUT's first.
        return max((record for record in found if record is not None), key=_written_at, default=None)

    def formats(self, item: PlannedFile) -> set[str]:
        """The formats of item's outputs that a run wrote (or began to write)."""
        record = self._record(item)
        if record is None:
            return set()
        return set(record.get("formats", DEFAULT_FORMATS))  # lines before 2026-11-28 name none: all four were a run's

    def foreign(self, item: PlannedFile, formats: Iterable[str]) -> list[str]:
        """Those of item's outputs in these formats that exist and no run wrote."""
        ours = self.formats(item)
        return [fmt for fmt in formats if fmt not in ours and item.output(fmt).is_file()]

    def redo(self, item: PlannedFile) -> None:
        """item's outputs are to be written again (--overwrite): recorded as being written,
        so that a run cut short leaves them to the next, with or without --overwrite."""
        if (record := self._record(item)) is not None and not record.get("writing"):
            # Still of the recording its outputs are of (writing them tells another's apart, to
            # remove its other formats), but redone whatever it is: a recording changed since is
            # what --overwrite is for.
            self._append({**record, "stem": self._stem(item), "writing": True, "redo": True,
                          "time": round(time.time(), 3)})

    def redoing(self, item: PlannedFile) -> bool:
        """Whether an --overwrite run cut short was to redo item's outputs, of whatever recording."""
        return bool((self._record(item) or {}).get("redo"))

    def writing(self, item: PlannedFile) -> bool:
        """Whether the run that wrote item's outputs was stopped before they were all written."""
        return bool((self._record(item) or {}).get("writing"))

    def holds(self, item: PlannedFile) -> bool:
        """Whether item's outputs are recorded as the transcript of this very recording."""
        return self._record(item) is not None and self.other_recording(item) is None

    def other_recording(self, item: PlannedFile) -> str | None:
        """The source of another recording whose transcript item's outputs hold, or None."""
        record = self._record(item)
        if record is None or record.get("fingerprint") is None:  # unreadable when recorded: nothing to compare
            return None
        try:
            stat = item.source.stat()
            if [stat.st_size, stat.st_mtime_ns] == record.get("stat"):  # untouched since: no need to read it
                return None
            was = str(record.get("fingerprint"))
            same = fingerprint(item.source, sampled=not was.startswith("sha256:")) == was
        except OSError:  # unreadable now: nothing says the outputs are not its
            return None
        if same and record is self._known.get(self._key(self._stem(item))):
            # Copied without its times: recorded as it is now, so the next run need not read it whole again.
            self._append({**record, "stat": [stat.st_size, stat.st_mtime_ns]})
        return None if same else str(record.get("source"))

    def settings(self, item: PlannedFile, fmt: str) -> dict | None:
        """The settings item's output in this format was made with (transcript_settings), where
        recorded. Of a run stopped while it wrote, an output it had not replaced yet (the same
        file as when it began) keeps the settings it had: it was taken for the stopped run's,
        then skipped as done with those (a German txt recorded as detected)."""
        record = self._record(item)
        if record is None:
            return None
        before = record.get("replacing", {}).get(fmt) if record.get("writing") else None
        if before is not None and before["file"] == file_identity(item.output(fmt)):
            return before["settings"]
        return record.get("kept", {}).get(fmt, record.get("settings"))

    def add(self, item: PlannedFile, recording: dict | None, settings: dict, formats: Iterable[str],
            writing: Iterable[str] | None = None, kept: dict[str, dict | None] | None = None) -> None:
        """item's outputs in these formats are complete (writing: those of them about to be
        written, not yet), of this recording (recording_of, taken as the file was read: one
        replaced since, a recorder reusing its name mid-run, is not the one transcribed), made
        with these settings, but for those kept from an earlier run with others (format: its
        settings)."""
        replacing = {} if writing is None else {  # each output there now, as it is, with its settings
            fmt: {"file": identity, "settings": self.settings(item, fmt)}
            for fmt in sorted(writing) if (identity := file_identity(item.output(fmt))) is not None}
        record = {"stem": self._stem(item), "source": str(item.source),
                  **(recording or {"stat": None, "fingerprint": None}),  # unreadable since: it says nothing
                  "formats": sorted(formats), "settings": settings, **({"kept": kept} if kept else {}),
                  **({"writing": True} if writing is not None else {}), **({"replacing": replacing} if replacing else {}),
                  "time": round(time.time(), 3)}
        self._append(record)

    def _append(self, record: dict) -> None:
        self._known[self._key(record["stem"])] = record
        try:
            if self._handle is None:
                self._handle = open(self.path, "a", encoding="ascii")  # names not UTF-8 as JSON's \udcXX escapes
                if self._handle.tell():  # a last line that a full disk cut short: this run's first goes below it
                    with open(self.path, "rb") as ledger:
                        ledger.seek(-1, os.SEEK_END)
                        if ledger.read(1) != b"\n":
                            self._handle.write("\n")
            self._handle.write(json.dumps(record) + "\n")
            self._handle.flush()
            # On disk before the outputs it tells of (write_files_atomic syncs them): after a power
            # cut, outputs no surviving line tells of are refused as not a run's, till --overwrite.
            os.fsync(self._handle.fileno())
        except OSError as error:
            raise OutputError(f"{self.path}: cannot record a finished file ({error.strerror or error})") from error

    def close(self) -> None:
        if self._handle is not None:
            with contextlib.suppress(OSError):
                self._handle.close()


def file_identity(path: Path) -> list[int] | None:
    """A file as it is (inode, modification time, size): a file renamed over it is another; None where none is."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return [stat.st_ino, stat.st_mtime_ns, stat.st_size]


def _alive(pid: int) -> bool:
    """Whether a process of this number runs here (a lock file locked read-only, another
    user's, still names the run that wrote it last)."""
    try:
        os.kill(pid, 0)  # no signal: whether it could be sent
    except PermissionError:  # another user's
        return True
    except (ProcessLookupError, OverflowError):  # none; a number no process can have
        return False
    return pid > 0  # 0 would be this process's group


class FolderLock:
    """OUT/.asr-run.lock, locked while a run writes into OUT. A second run into the same
    folder would take the first's temporary files for a killed run's and remove them (the
    first then fails to rename them into place), and start errors.jsonl afresh under it: it
    is refused instead, naming the process that holds the folder. The lock is the kernel's
    (flock): a killed run's goes with it, and the file, left in place, means nothing alone.
    Not taken where the platform has no flock (Windows), nor where the file system takes no
    locks (NFS without its lock service): said, with echo, and the run goes on."""

    def __init__(self, out_dir: Path, echo: bool = True):
        self._handle = None
        if fcntl is None:
            return
        try:
            handle = open(out_dir / LOCK_FILE, "a+", encoding="ascii")
        except PermissionError:  # another user's, in a shared folder: locked read-only as well (it stopped every run)
            try:
                handle = open(out_dir / LOCK_FILE, encoding="ascii")
            except OSError as error:
                raise OutputError(f"{out_dir / LOCK_FILE}: cannot be opened to lock --out-dir "
                                  f"({error.strerror or error})", before_work=True) from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip()
            handle.close()
            raise OutputError(f"--out-dir {out_dir}: another run is writing into it"
                              + (f" (process {holder})" if holder.isdigit() and _alive(int(holder)) else "")
                              + ": wait for it to end, or give another --out-dir", before_work=True) from None
        except OSError as error:  # ENOLCK, EOPNOTSUPP: a bare "[Errno 37] No locks available" ended the run
            handle.close()
            if echo:
                tqdm.write(f"asr: warning: --out-dir {out_dir} cannot be locked ({error.strerror or error}): another "
                           "run writing into it at the same time would spoil this one's files", file=sys.stderr)
            return
        if handle.writable():  # for the run refused meanwhile to name
            handle.truncate(0)
            handle.write(f"{os.getpid()}\n")
            handle.flush()
        self._handle = handle

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()  # closing the file releases its lock
            self._handle = None


class ErrorLog:
    """OUT/errors.jsonl: one JSON object per failed file, appended and flushed as it
    happens. Each run starts afresh the records of its inputs, since it retries every file
    of them that failed before, and keeps those of others (yesterday's folder, transcribed
    into the same OUT); a run stopped early (Ctrl-C, a model that cannot load) puts back the
    earlier records of the files it did not get to. The earlier records stay in the file
    while the run goes on (it is rewritten only whole, by renaming), so a run killed at any
    point, kill -9 included, loses none of them: it may only leave the earlier record of a
    file it redid beside the new one, until the next run."""

    def __init__(self, path: Path, inputs: Iterable[Path] = ()):
        self.path = path
        roots = [_where(str(p)) for p in inputs]
        self._earlier, self._elsewhere, self._new = [], [], []
        if path.is_file():
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    if isinstance(record := json.loads(line), dict):
                        file = _record_where(record)
                        ours = any(file == root or file.startswith(root.rstrip(os.sep) + os.sep) for root in roots)
                        (self._earlier if ours else self._elsewhere).append(record)
        self._rewrite(self._elsewhere + self._earlier)  # lines not JSON go
        self._handle = None

    def covers(self, files: Iterable[str]) -> None:
        """Files the run found besides its inputs' own (in a linked folder, whose records lie
        elsewhere): their earlier records are the run's to redo too. A fixed file's stayed,
        and one still failing got one more record each run."""
        if not self._elsewhere:
            return
        found = {_where(file) for file in files}
        self._earlier += [record for record in self._elsewhere if _record_where(record) in found]
        self._elsewhere = [record for record in self._elsewhere if _record_where(record) not in found]

    def add(self, file: str, reason: str) -> None:
        record = {"file": file, "path": _where(file), "reason": reason,
                  "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        self._new.append(record)
        try:
            if self._handle is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._handle = open(self.path, "a", encoding="utf-8", errors="backslashreplace")
            self._handle.write(_error_line(record))
            self._handle.flush()
            os.fsync(self._handle.fileno())
        except OSError as error:
            raise OutputError(f"{self.path}: cannot record a failure ({error.strerror or error})") from error

    def close(self, pending: Iterable[str] | None = ()) -> None:
        """pending: the files this run did not get to, whose earlier records are kept
        (None: every earlier record, for a run stopped before it began)."""
        pending = None if pending is None else {_where(file) for file in pending}
        if self._handle is not None:
            # Every record was flushed when written: closing fails only after a write that
            # raised (a full disk), whose error is the one to tell.
            with contextlib.suppress(OSError):
                self._handle.close()
            self._handle = None
        self._rewrite(self._elsewhere + [r for r in self._earlier if pending is None or _record_where(r) in pending]
                      + self._new)

    def _rewrite(self, records: list[dict]) -> None:
        """The file holds these records (no file for none), by renaming a whole one into place."""
        try:
            if records:
                # A file name that is not UTF-8 is written as JSON's \udcXX escapes (its bytes, for os.fsencode).
                write_atomic(self.path, "".join(_error_line(r) for r in records))
            else:
                self.path.unlink(missing_ok=True)
        except OSError as error:
            raise OutputError(f"{self.path}: cannot record the failures ({error.strerror or error})") from error


def _where(file: str) -> str:
    """A path as errors.jsonl's records compare them: absolute, links resolved but for a
    file's own (a link to a recording elsewhere is a file of the folder it lies in). As
    typed, from another folder or through a linked one, it named another file or none: a
    record of a file done since stayed for good."""
    absolute = os.path.abspath(file)
    if os.path.isdir(absolute):
        return os.path.realpath(absolute)
    return os.path.join(os.path.realpath(os.path.dirname(absolute)), os.path.basename(absolute))


def _record_where(record: dict) -> str:
    # Records before 2026-11-29 have no "path": their file as typed, from where this run is
    return str(record.get("path") or _where(str(record.get("file"))))


def _error_line(record: dict) -> str:
    return json.dumps(record, ensure_ascii=False) + "\n"


def transcribe_files(
    transcriber: Transcriber,
    files: Iterable[Path],
    formats: Iterable[str],
    stream_above_seconds: float = STREAM_ABOVE_SECONDS,
    layout: SubtitleLayout = SubtitleLayout(),
    on_progress: Callable[[Path, float], None] | None = None,
    typed: dict[str, str] | None = None,
) -> Iterator[FileResult]:
    """Transcribes files in the order given, decoding transcriber.batch_size of them at a
    time, and yields each file's result as soon as it is done. A file that cannot be read
    fails alone. Should decoding itself fail, the files of that batch are redone one at a
    time, so only a file that fails alone is reported, and the rest go on. on_progress:
    called as each window of a file starts and ends, with the file and its seconds decoded so far.
    typed: a file's name as the user typed it, by the path given here (a Ray worker's absolute
    one), for the warnings written with its transcript."""
    formats = tuple(formats)
    queue = iter(files)
    unreadable: list[FileResult] = []
    in_flight: dict[str, Path] = {}  # name given to the transcriber -> source
    # Each file's as it was read (recording_of), in a thread: hashing a large video whole
    # held up the batch's decoding, which waits for the next file's read.
    hashing = ThreadPoolExecutor(1, thread_name_prefix="asr-hash")
    recordings: dict[Path, Future[dict | None]] = {}

    def read(path: Path) -> AudioInput | FileResult:
        try:
            stat = size_and_time(path)
        except OSError:
            stat = None
        recordings[path] = hashing.submit(recording_of, path, stat)
        try:
            audio = transcriber.read(path, stream_above_seconds=stream_above_seconds)
        except Exception as error:  # AudioError names the problem; anything else is still this file's
            recordings.pop(path).cancel()  # not hashed for nothing, ahead of the next files'
            return FileResult(str(path), error=_reason(error, path))
        if on_progress is None:
            return audio
        return dataclasses.replace(audio, progress=Progress(lambda p: on_progress(path, p.fraction * p.duration)))

    def inputs() -> Iterator[AudioInput]:
        for path in queue:
            audio = read(path)
            if isinstance(audio, FileResult):
                unreadable.append(audio)
                continue
            in_flight[audio.name] = path
            yield audio

    try:
        while True:
            try:
                for transcript in transcriber.transcribe_many(inputs()):
                    yield from _drain(unreadable)
                    source = in_flight[transcript.source]
                    rendered = _rendered(transcript, source, formats, layout, recordings.pop(source).result(), typed)
                    del in_flight[transcript.source]  # only now: a file whose rendering raised is retried, then reported
                    yield rendered
                yield from _drain(unreadable)
                return
            except Exception:  # in decoding: retry this batch's files alone, then go on
                if not in_flight:
                    raise  # not about any file
                yield from _drain(unreadable)
                alone = Transcriber(transcriber.models, transcriber.options, batch_size=1)
                stuck = list(in_flight.values())
                in_flight.clear()
                for source in stuck:
                    audio = read(source)
                    if isinstance(audio, FileResult):
                        yield audio
                        continue
                    try:
                        transcript = next(iter(alone.transcribe_many([audio])))
                        yield _rendered(transcript, source, formats, layout, recordings.pop(source).result(), typed)
                    except Exception as again:
                        yield FileResult(str(source), error=f"transcription failed: {_reason(again, source)}")
    finally:
        hashing.shutdown(wait=False, cancel_futures=True)


def printable(name: str) -> str:
    """A file name that prints on any UTF-8 console, on one line: bytes that are not UTF-8
    become U+FFFD, control characters (a newline in a name) escapes as Python writes them."""
    text = name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return "".join(c.encode("unicode_escape").decode("ascii") if unicodedata.category(c) == "Cc" else c for c in text)


def _echo(line: str) -> None:
    """A file's transcript on stdout. Once its reader has gone (`asr transcribe DIR | head`),
    the lines go nowhere and the run goes on: the files are the product (the closed pipe
    stopped it, as a usage error, exit 2)."""
    try:
        tqdm.write(line, file=sys.stdout)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _drain(results: list[FileResult]) -> Iterator[FileResult]:
    while results:
        yield results.pop(0)


def _reason(error: Exception, path: Path) -> str:
    message = str(error).removeprefix(f"{path}: ")  # AudioError messages start with the file
    return message if isinstance(error, AudioError) else f"{type(error).__name__}: {message}"


def _rendered(transcript: Transcript, source: Path, formats: tuple[str, ...], layout: SubtitleLayout,
              recording: dict | None, typed: dict[str, str] | None = None) -> FileResult:
    if (name := (typed or {}).get(str(source))) is not None:  # reading's warnings start with the path read
        warnings = tuple(w.replace(str(source), name, 1) for w in transcript.info.warnings)
        transcript = dataclasses.replace(transcript, info=dataclasses.replace(transcript.info, warnings=warnings))
    info = transcript.info
    return FileResult(
        str(source),
        texts={fmt: render(transcript, fmt, layout) for fmt in formats},
        text=transcript.text,
        seconds=info.duration,
        busy_seconds=info.encoder_seconds + info.decoder_seconds,
        draft_proposed=info.stats.draft_proposed if info.speculative else 0,
        draft_accepted=info.stats.draft_accepted if info.speculative else 0,
        recording=recording,
        warnings=info.warnings,
    )


class WorkerError(ValueError):
    """A Ray worker could not start (its models did not load there)."""


class _Recorder:
    """The one writer of a run: plans, skips finished files, writes outputs atomically,
    logs failures, keeps the progress bar and the summary."""

    def __init__(self, run: FolderRun):
        self.run = run
        if problem := unwritable(run.out_dir):
            raise OutputError(f"--out-dir {run.out_dir}: {problem}", before_work=True)
        # The folders this run makes, deepest first: gone again if the run stops before writing (a model
        # that cannot load). Resolved: "new/../old" names an existing folder.
        out = run.out_dir.resolve()
        self.made = [folder for folder in [out, *out.parents] if not folder.exists()]
        try:
            run.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:  # permissions pass, the file system refuses (/sys, a read-only mount)
            raise OutputError(f"--out-dir {run.out_dir}: {error.strerror or error}", before_work=True) from error
        self.lock = FolderLock(run.out_dir, run.echo)
        try:
            self.log = ErrorLog(run.out_dir / ERRORS_FILE, run.inputs)
        except BaseException as error:
            self.lock.release()
            if isinstance(error, OutputError):
                error.before_work = True  # nothing is transcribed yet
            raise
        self.summary = FolderSummary()
        try:  # reading thousands of headers takes a while: Ctrl-C here leaves the earlier failures' records
            fold_case = ignores_case(run.out_dir)
            self.sources = Sources(run.out_dir, fold_case)
            files, failures = plan_outputs(run.inputs, run.out_dir, run.formats, fold_case, self.sources.holds)
            self.log.covers([str(item.source) for item in files] + [failure.source for failure in failures])
            for failure in failures:
                self._failed(failure.source, failure.error or "")
            # A killed run's may be of formats not asked for now, or of its ledgers.
            remove_partials(files, FORMATS, also=[run.out_dir / ERRORS_FILE, run.out_dir / SOURCES_FILE])
            todo, changed = [], {}
            self.present: dict[str, set[str]] = {}  # of files to transcribe, their outputs in formats asked for, kept
            for item in files:
                # Of another recording, even in part (an earlier run asked for other formats): not this one's to replace.
                written = not run.overwrite and any(item.output(fmt).is_file() for fmt in FORMATS)
                if written and not self.sources.redoing(item) and (other := self.sources.other_recording(item)) is not None:
                    if other == str(item.source):
                        self._failed(str(item.source), f"its outputs {item.stem}.* are the transcript of an earlier "
                                                       "version of this file (its contents changed since): remove them "
                                                       "to transcribe it again (--overwrite redoes every file), or give "
                                                       "another --out-dir")
                    else:
                        self._failed(str(item.source), f"its outputs {item.stem}.* are the transcript of another "
                                                       f"recording, {other}: --overwrite replaces them, or give another "
                                                       "--out-dir")
                elif not run.overwrite and (foreign := self.sources.foreign(item, run.formats)):
                    found = ", ".join(item.output(fmt).name for fmt in foreign)
                    self._failed(str(item.source), f"{found} already in {item.stem.parent}, and "
                                                   f"{run.out_dir / SOURCES_FILE} does not list it as a run's output: "
                                                   "--overwrite replaces it, or give another --out-dir")
                elif run.overwrite or not is_complete(item, run.formats) or self.sources.writing(item):
                    if run.overwrite:
                        self.sources.redo(item)
                    elif not self.sources.writing(item) and not self.sources.redoing(item):
                        # Asked for formats it lacks: those it has stay as they are (edited by hand, say).
                        # Those made with other settings are made again, with the new formats' (a German
                        # srt beside an English json was said nowhere).
                        if present := {fmt for fmt in run.formats if item.output(fmt).is_file()
                                       and not self._differs(self.sources.settings(item, fmt), fmt)}:
                            self.present[str(item.source)] = present
                    todo.append(dataclasses.replace(item, seconds=audio_seconds(item.source)))
                else:
                    self.summary.skipped += 1
                    self._note_settings(item, changed)
            if changed and run.echo:
                tqdm.write(f"note: {self.summary.skipped_other_settings} of the files skipped as done were transcribed "
                           f"with other settings ({'; '.join(changed.values())}): --overwrite redoes them",
                           file=sys.stderr)
        except BaseException:
            self.log.close(pending=None)
            self.lock.release()
            raise
        # Longest first, so that files of similar length share batches and end together.
        self.todo = sorted(todo, key=lambda item: -(item.seconds or 0.0))
        self.by_source = {str(item.source): item for item in self.todo}
        # In seconds of audio, not files: the longest files come first, so a count of files
        # would make the first minutes' estimate of the time left far too long.
        self.credited: dict[str, float] = {}  # audio seconds of each file in progress on the bar
        self.decoded = 0.0  # audio seconds on the bar
        # Not rounded: credits of files' exact seconds passed a total rounded down (tqdm warned mid-run).
        self.bar = tqdm(total=sum(item.seconds or 0.0 for item in self.todo), unit="s",
                        bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s of audio [{elapsed}<{remaining}{postfix}]",
                        disable=not run.progress or not self.todo, file=sys.stderr, dynamic_ncols=True)
        self.started = time.perf_counter()  # after reading the headers; loaded() restarts it

    def _note_settings(self, item: PlannedFile, changed: dict[str, str]) -> None:
        """Counts a file skipped as done whose outputs were made with other settings than this
        run's; changed: each setting that differs, with the first such file's value."""
        # Outputs of an older run (or of the API without settings) record none: nothing says they differ.
        differ = {fmt: self._differs(self.sources.settings(item, fmt), fmt) for fmt in self.run.formats}
        if not any(differ.values()):
            return
        self.summary.skipped_other_settings += 1
        for names in differ.values():
            for name in names:
                now = self.run.settings.get(name, UNSET_SETTINGS.get(name))
                changed.setdefault(name, f"{name} {json.dumps(names[name])}, now {json.dumps(now)}")

    def _differs(self, was: dict | None, fmt: str) -> dict:
        """The settings that an output in this format, made with `was` (recorded), was made
        with other than this run's, with their values then: a setting recorded only since a
        later version (the seed) says nothing where missing, nor the subtitle layout outside
        subtitles."""
        if not was or not self.run.settings:
            return {}
        was, now = {**UNSET_SETTINGS, **was}, {**UNSET_SETTINGS, **self.run.settings}
        return {name: was[name] for name, value in now.items() if name in was and was[name] != value
                and (fmt in SUBTITLE_FORMATS or name not in LAYOUT_SETTINGS)}

    def advanced(self, source: Path, seconds: float) -> None:
        """A file in progress has `seconds` of its audio decoded (transcribe_files' on_progress)."""
        item = self.by_source.get(str(source))
        if item is not None:
            self._credit(str(source), min(seconds, item.seconds or 0.0))

    def _credit(self, source: str, seconds: float, decoded: bool = True) -> None:
        """Moves the bar to `seconds` of this file's audio (never back: a file redone alone
        starts again); decoded: count them in the bar's RTFx (not a failed file's rest)."""
        gained = max(seconds - self.credited.get(source, 0.0), 0.0)
        self.credited[source] = self.credited.get(source, 0.0) + gained
        self.decoded += gained if decoded else 0.0
        elapsed = time.perf_counter() - self.started
        self.bar.set_postfix_str(f"{len(self.todo) - len(self.by_source)}/{len(self.todo)} files, RTFx "
                                 f"{self.decoded / elapsed if elapsed else 0:.1f}", refresh=False)
        self.bar.update(gained)  # redrawn at most every 0.1 s

    def record(self, result: FileResult) -> None:
        item = self.by_source.pop(result.source, None)
        if item is None:
            return  # a repeat (Ray may run a lost batch again)
        if result.error is None:
            try:
                # A file's outputs all come from one run (an --overwrite cut short), and from one
                # recording: a run's of another in formats not asked for now go too. Files no
                # run wrote, in formats not asked for, stay.
                ours, asked = self.sources.formats(item), set(self.run.formats)
                present = self.present.pop(result.source, set())  # asked for, and there already: kept
                if self.sources.other_recording(item) is not None:
                    replaced, formats = ours | asked, asked
                else:
                    replaced, formats = asked, asked | {fmt for fmt in ours if item.output(fmt).is_file()}
                # Those kept keep the settings they were made with (all were recorded as this run's).
                kept = {fmt: was for fmt in sorted((formats - asked) | present)
                        if (was := self.sources.settings(item, fmt)) != self.run.settings}
                # Recorded first: outputs a kill leaves half written are then known for this file's.
                written = [fmt for fmt in self.run.formats if fmt not in present]
                self.sources.add(item, result.recording, self.run.settings, formats, writing=written, kept=kept)
                for fmt in replaced - asked:  # another recording's, in formats not rewritten: first, as recorded
                    item.output(fmt).unlink(missing_ok=True)
                # All written before any replaces its old one: a full disk leaves the old set whole.
                write_files_atomic({item.output(fmt): result.texts[fmt] for fmt in written})
                self.sources.add(item, result.recording, self.run.settings, formats, kept=kept)
                self.summary.beside_other_settings += any(self._differs(was, fmt) for fmt, was in kept.items())
                self.summary.completed += bool(present)
            except (OutputError, KeyboardInterrupt):  # the ledger full, or Ctrl-C: not done, its earlier failure kept
                self.by_source[result.source] = item
                raise
            except OSError as error:
                if error.errno in FULL:
                    self.by_source[result.source] = item  # not done: left to the next run
                    raise OutputError(f"{error.filename or self.run.out_dir}: {error.strerror}") from error
                result = dataclasses.replace(result, error=f"writing the transcript failed: {error}")
        if self.run.echo:  # also before an error in writing the transcript: what reading the file lost stays true
            for warning in result.warnings:  # above the progress bar, as the other commands' (asr.cli.show_warning)
                tqdm.write(f"asr: warning: {printable(warning)}", file=sys.stderr)
        if result.error is not None:
            self._failed(result.source, result.error)
        else:
            summary = self.summary
            summary.ok += 1
            summary.audio_seconds += result.seconds
            summary.draft_proposed += result.draft_proposed
            summary.draft_accepted += result.draft_accepted
            if self.run.echo:
                # Nothing decoded (no audio frames, or no speech kept by --vad) takes no time: no speed to tell.
                rtf = f", {result.seconds / result.busy_seconds:.1f}x real time" if result.busy_seconds else ""
                drafted = f", acceptance {result.draft_accepted / result.draft_proposed:.0%}" if result.draft_proposed else ""
                _echo(f"{printable(result.source)} ({result.seconds:.1f} s audio, {result.busy_seconds:.2f} s{rtf}"
                      f"{drafted}): {result.text or '(no speech found)'}")
        if item.seconds is None:  # its header did not tell: out of the bar's total until now
            self.bar.total += result.seconds
        self._credit(result.source, item.seconds or result.seconds, decoded=result.error is None)
        self.credited.pop(result.source, None)

    def loaded(self) -> None:
        """The models have loaded: the run's clock (its RTFx, the bar's estimate) starts now."""
        now = time.perf_counter()
        self.summary.load_seconds, self.started = now - self.started, now
        self.bar.reset(total=self.bar.total)

    def finish(self, lost_reason: str) -> FolderSummary:
        """lost_reason: for files that never came back (a worker lost for good)."""
        for source in list(self.by_source):
            self.record(FileResult(source, error=lost_reason))
        self.bar.close()
        self.log.close()
        self.sources.close()
        self.lock.release()
        self.summary.wall_seconds = time.perf_counter() - self.started
        if self.summary.failed:
            self.summary.errors_file = self.log.path
        return self.summary

    def stop(self) -> None:
        """Ends a run cut short: the files left are neither done nor failed. Folders it made
        and left empty but for its lock go (a model that could not load left --out-dir behind)."""
        self.bar.close()
        self.log.close(pending=self.by_source)
        self.sources.close()
        try:  # while the folder is locked: no other run has begun in it
            empty = bool(self.made) and all(entry.name == LOCK_FILE for entry in self.made[0].iterdir())
            if empty:
                (self.made[0] / LOCK_FILE).unlink(missing_ok=True)  # none where nothing locks (Windows)
        except OSError:  # the folder gone or unreadable meanwhile: the run's own error is the one to tell
            empty = False
        self.lock.release()
        for folder in self.made if empty else []:
            try:
                folder.rmdir()
            except OSError:  # another's file meanwhile: kept
                return

    def _failed(self, source: str, reason: str) -> None:
        self.summary.failed += 1
        self.log.add(source, reason)
        if self.run.echo:
            tqdm.write(printable(f"error: {source}: {reason}"), file=sys.stderr)  # reasons name files too


def transcribe_folder(run: FolderRun, build: Callable[[], Transcriber]) -> FolderSummary:
    """Transcribes run.inputs in this process (see the module's description). build: makes
    the transcriber, once the inputs and the output folder are checked and some file is left
    to do (a model loads only then)."""
    recorder = _Recorder(run)
    try:
        if recorder.todo:
            files = [item.source for item in recorder.todo]
            transcriber = build()
            recorder.loaded()
            for result in transcribe_files(transcriber, files, run.formats, run.stream_above_seconds, run.layout,
                                           recorder.advanced):
                recorder.record(result)
    except BaseException:
        recorder.stop()
        raise
    return recorder.finish("not transcribed")


def transcribe_folder_on_ray(run: FolderRun, spec: PipelineSpec, options: RayOptions = RayOptions(),
                             on_cluster: Callable[[str], None] | None = None) -> FolderSummary:
    """The same on a Ray cluster with Ray Data: files (longest first) are handed to a pool
    of actors, each holding one model pipeline (one GPU each where the cluster has GPUs),
    which transcribe batches of files and return the rendered outputs. Only this driver
    writes, so outputs, errors.jsonl and the resume rules are those of the local run, and
    OUT_DIR need not be shared; the inputs must be readable by every node at the same path.
    on_cluster receives a line describing the pool."""
    try:
        import ray
    except ImportError as error:
        raise RuntimeError("--ray needs Ray Data: pip install 'asr[ray]'") from error
    if not ray.is_initialized() and (unreachable := _unreachable(options.address, os.environ.get("RAY_ADDRESS"))):
        raise WorkerError(unreachable)  # said before the output folder is locked
    recorder = _Recorder(run)
    lost = "its Ray worker died each time it was tried (killed for memory? a crash?)"
    if not recorder.todo:
        return recorder.finish(lost)
    started_here, saved = not ray.is_initialized(), {}
    try:
        if started_here:
            # Workers load models as this process would: pass on the offline switches and cache location.
            env = {k: os.environ[k] for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME", "HF_HUB_CACHE", "HF_TOKEN")
                   if k in os.environ}
            # "local": a cluster of its own, as README says, not one a `ray start` left running
            # here; but RAY_ADDRESS (set by `ray job submit`) is the cluster the run is on.
            address = options.address or (None if os.environ.get("RAY_ADDRESS") else "local")
            try:
                ray.init(address=address, include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING,
                         runtime_env={"env_vars": env} if env else None)
            except ConnectionError as error:  # Ray's own message told to set "the --address flag", which asr has not
                if address != "auto" or not str(error).startswith("Could not find any running Ray instance"):
                    raise
                raise WorkerError("--ray auto: no Ray cluster runs on this machine (`ray start --head` starts one; "
                                  "--ray alone starts one for this run)") from error
        resources = ray.cluster_resources()
        node_cpus = max((int(node["Resources"].get("CPU", 0)) for node in ray.nodes() if node.get("Alive")), default=0)
        workers, cpus_per_worker, gpu = _pool(resources, node_cpus, options, spec.device)
        if cpus_per_worker > node_cpus:  # Ray waits for a node that can hold a worker, for ever
            problem = f"--cpus-per-worker {cpus_per_worker}: the cluster's largest node has {node_cpus} CPU(s)"
            if started_here:  # a cluster of this machine alone: none will join
                raise WorkerError(problem)
            if on_cluster is not None:  # an autoscaling cluster may yet add one
                on_cluster(f"asr: warning: {problem}; no worker starts until a larger node joins")
        if on_cluster is not None:
            on_cluster(pool_line(resources, workers, cpus_per_worker, gpu))
        context = ray.data.DataContext.get_current()
        saved = {name: getattr(context, name) for name in ("enable_progress_bars", "max_errored_blocks",
                                                           "target_max_block_size")}
        context.enable_progress_bars = False  # ours counts audio, files and RTFx
        context.max_errored_blocks = -1  # a lost batch is reported per file below, not fatal
        # Each file's result its own block, passed on as it ends: Ray Data gathered a call's
        # results into one block, so the driver wrote none of a call's files (16) until all had
        # ended, and a stopped run lost them.
        context.target_max_block_size = 1
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        # Paths as every node sees them: a worker's working directory is not this process's.
        absolute = {os.path.abspath(item.source): str(item.source) for item in recorder.todo}
        spec = _for_workers(spec)
        arguments = {"spec": spec, "formats": run.formats, "threads": cpus_per_worker,
                     "stream_above_seconds": run.stream_above_seconds, "layout": run.layout}

        def run_pool(sources: list[str], per_call: int) -> None:
            rows = [{"source": source, "typed": absolute[source]} for source in sources]
            dataset = ray.data.from_items(rows, override_num_blocks=max(1, -(-len(rows) // per_call)))
            with warnings.catch_warnings():
                # max_task_retries has no named parameter yet (Ray 2.60): a warning on every run, read as an error.
                warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
                results = dataset.map_batches(
                    _RayWorker, fn_constructor_kwargs=arguments, batch_size=per_call,
                    # One batch at a time per worker: one queued behind a batch that kills its worker died with
                    # it, and used up its own tries (a file that never crashed was reported lost).
                    compute=ray.data.ActorPoolStrategy(size=min(workers, len(rows)), max_tasks_in_flight_per_actor=1),
                    num_cpus=cpus_per_worker, num_gpus=gpu,
                    # A worker that dies is restarted, and its batch tried again, WORKER_TRIES times in
                    # all: Ray's default, without limit, held the run on a file that kills its worker.
                    max_task_retries=WORKER_TRIES - 1,
                )
            try:
                for row in results.iter_rows():
                    result = FileResult(**json.loads(row["result"]))
                    # The path as the user gave it (its warnings already name it so: transcribe_files' typed).
                    recorder.record(dataclasses.replace(result, source=absolute.get(result.source, result.source)))
            except ray.exceptions.RayActorError as error:  # its message ends with the worker's own error
                raise WorkerError(f"a Ray worker could not start: {str(error).strip().splitlines()[-1]}") from error

        # Up to two decode batches per call (the actor keeps its batch full as files end),
        # fewer when that leaves workers idle.
        per_call = max(1, min(2 * spec.batch_size, -(-len(absolute) // workers)))
        run_pool(list(absolute), per_call)
        # A batch whose worker died every time is lost whole: its files go again one per call,
        # so that only the file that kills its worker is reported.
        if per_call > 1 and (left := [os.path.abspath(source) for source in recorder.by_source]):
            run_pool(left, 1)
    except BaseException:
        recorder.stop()
        raise
    finally:
        if saved:  # the caller's later Ray Data jobs get its own settings back
            for name, value in saved.items():
                setattr(context, name, value)
        if started_here:
            ray.shutdown()
    return recorder.finish(lost)


def _pool(resources: dict, node_cpus: int, options: RayOptions, device: str) -> tuple[int, int, int]:
    """Workers, CPUs each and GPUs each (0 or 1) on a cluster of these resources, whose
    largest node has node_cpus. With --device cpu, as on a cluster without GPUs: each
    worker held a GPU it never used."""
    gpus = 0 if device == "cpu" else int(resources.get("GPU", 0))
    cpus = max(1, int(resources.get("CPU", 1)))
    # Not above a node's CPUs: on nodes of 2, the default of 4 held every worker for ever.
    cpus_per_worker = options.cpus_per_worker or (1 if gpus else max(1, min(4, node_cpus)))
    workers = options.workers or (gpus if gpus else max(1, cpus // cpus_per_worker))
    return workers, cpus_per_worker, 1 if gpus else 0


def pool_line(resources: dict, workers: int, cpus_per_worker: int, gpu: int) -> str:
    """What the run's workers hold, and how many of them the cluster holds at once now (with
    --workers 2 on 2 CPUs it said 2 workers of 2 CPUs each; one ran)."""
    cpus, gpus = int(resources.get("CPU", 1)), int(resources.get("GPU", 0))
    fit = min(cpus // cpus_per_worker, gpus if gpu else workers)
    line = (f"Ray: {workers} worker(s), {cpus_per_worker} CPU(s){' + 1 GPU' if gpu else ''} each; cluster has {cpus} "
            f"CPU(s), {gpus} GPU(s)")
    return line + (f": {fit} of the workers run at once, the rest when it grows" if fit < workers else "")


def _unreachable(address: str | None, environment: str | None = None) -> str | None:
    """Why a cluster's HOST:PORT cannot be reached, in a few seconds: ray.init tried one
    that does not answer for over ten minutes, holding the output folder's lock. environment:
    RAY_ADDRESS, which ray.init takes where --ray names no address, or names "auto"."""
    named = f"--ray {address}"
    if address in (None, "auto") and environment:
        address, named = environment, f"RAY_ADDRESS={environment} (--ray names no address: Ray takes this one)"
    if address is None or address == "auto" or "://" in address or ":" not in address:
        return None
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()  # [::1]:6379 too
    except (OSError, ValueError) as error:
        return f"{named}: no Ray cluster answers there ({getattr(error, 'strerror', None) or error})"
    return None


def _for_workers(spec: PipelineSpec) -> PipelineSpec:
    """Model folders as every node sees them (a worker's working directory is not this
    process's); "target" as a draft stays the target's own decoder, whatever folder is here
    named so (cargo's and Maven's target/)."""
    target = _local_absolute(spec.target)
    draft = (spec.draft if spec.draft in (None, TARGET_AS_DRAFT) else target if spec.draft == spec.target
             else _local_absolute(spec.draft))
    return dataclasses.replace(spec, target=target, draft=draft)


def _local_absolute(source: str) -> str:
    """A model source that is a folder here, as an absolute path; any other as it is."""
    path = Path(source).expanduser()
    return os.path.abspath(path) if path.exists() else source


class _RayWorker:
    """One Ray actor: builds the pipeline once, then transcribes batches of files."""

    def __init__(self, spec: PipelineSpec, formats: tuple[str, ...], threads: int, stream_above_seconds: float,
                 layout: SubtitleLayout):
        torch.set_num_threads(threads)
        self.transcriber = spec.build()
        self.formats = formats
        self.stream_above_seconds = stream_above_seconds
        self.layout = layout

    def __call__(self, batch: dict) -> Iterator[dict]:
        """Each file's result as soon as it ends, for the driver to write at once."""
        files = [Path(source) for source in batch["source"]]
        typed = dict(zip(map(str, batch["source"]), map(str, batch["typed"])))
        done = set()
        try:
            for result in transcribe_files(self.transcriber, files, self.formats, self.stream_above_seconds, self.layout,
                                           typed=typed):
                done.add(result.source)
                yield {"result": [json.dumps(dataclasses.asdict(result))]}
        except Exception as error:  # a batch Ray drops would reach the driver as "no result": say why instead
            failed = [FileResult(str(file), error=f"transcription failed: {type(error).__name__}: {error}")
                      for file in files if str(file) not in done]
            if failed:
                yield {"result": [json.dumps(dataclasses.asdict(result)) for result in failed]}
