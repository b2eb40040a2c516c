"""scripts/benchmark_app.py's summary of a run: what counts, the memory measure, and the
tables it prints (the load test itself runs for minutes and is not part of the suite)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from conftest import REPO


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("benchmark_app", REPO / "scripts" / "benchmark_app.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


def run(bench, mode: str, latency_of_long: float) -> object:
    requests = [bench.Request("long.flac", 30.0, False, 100.0, 100.0 + latency_of_long, "transcript"),
                bench.Request("short.flac", 2.0, False, 100.0, 101.0, "transcript"),
                bench.Request("short.flac", 2.0, False, 110.0, 113.0, "transcript"),
                bench.Request("nan.wav", 0.0, True, 120.0, 120.1, "clear-error"),
                bench.Request("short.flac", 2.0, False, 10.0, 12.0, "transcript"),  # ended in the warm-up
                bench.Request("late.flac", 2.0, False, 395.0, 401.0, "transcript")]  # ended after the period
    memory = [(50.0, 900.0), (60.0, 1000.0), (120.0, 1200.0), (200.0, 1500.0), (300.0, 1100.0), (350.0, 1150.0)]
    return bench.ModeResult(mode, requests, memory, [(60.0, 1.0), (360.0, 2.0)], measure_from=60.0, measure_to=360.0)


def test_a_run_is_summarized_over_its_measured_period(bench):
    summary = bench.summarize(run(bench, "batched", 8.0))
    assert (summary["requests"], summary["transcript"], summary["clear-error"], summary["bad_files"]) == (4, 3, 1, 1)
    assert summary["throughput"] == pytest.approx(34.0 / 300.0, abs=1e-3)
    assert (summary["latency_p50"], summary["latency_p95"], summary["latency_max"]) == (3.0, 8.0, 8.0)
    # Peaks of the first and last 2 minutes (60-180 s, 240-360 s), not single samples.
    assert (summary["rss_mb_peak_first"], summary["rss_mb_peak_last"]) == (1200.0, 1150.0)
    assert summary["rss_peak_growth"] == pytest.approx(1150 / 1200 - 1, abs=1e-3)
    assert summary["latency_by_clip"] == {"long.flac (30.0 s)": [8.0, 8.0, 1], "short.flac (2.0 s)": [2.0, 3.0, 2]}


def test_the_tables_compare_the_modes_clip_by_clip_longest_first(bench):
    table = bench.tables([bench.summarize(run(bench, "lock", 5.0)), bench.summarize(run(bench, "batched", 8.0))])
    rows = table.splitlines()
    clip_header = rows.index("| clip (longest first) | lock mean / max s (n) | batched mean / max s (n) |")
    assert rows[clip_header + 2] == "| long.flac (30.0 s) | 5.0 / 5.0 (1) | 8.0 / 8.0 (1) |"
    assert rows[clip_header + 3] == "| short.flac (2.0 s) | 2.0 / 3.0 (2) | 2.0 / 3.0 (2) |"
    assert rows[-1].startswith("throughput batched / lock: 1.00x (the modes ran one after the other")


def test_a_transcript_counts_only_with_a_download_of_each_format(bench):
    segments = '<div class="asr-segment">[0.0 - 2.1] Hello.</div>'
    offered = {"value": [{"path": f"/tmp/gradio/abc/clip.{f}", "meta": {"_type": "gradio.FileData"}}
                         for f in ("txt", "srt", "vtt", "json")], "visible": True}
    assert bench.judge(("figures", segments, offered), False, "clip.flac") == ("transcript", "")
    outcome, detail = bench.judge(("figures", segments, {"value": offered["value"][:2]}), False, "clip.flac")
    assert (outcome, detail) == ("wrong", "downloads offered: ['srt', 'txt']")
    assert bench.judge(("figures", segments, offered), True, "nan.wav")[0] == "wrong"  # a bad file transcribed
    error = '<div class="asr-error">nan.wav: contains NaN samples</div>'
    assert bench.judge(("", error, {"value": None}), True, "nan.wav")[0] == "clear-error"
    assert bench.judge(("", error, {"value": None}), True, "empty.wav")[0] == "wrong"  # names another file
