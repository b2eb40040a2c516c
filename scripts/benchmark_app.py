"""Load and soak test of the web page through its public API, as visitors would use it.

For each server mode (batched: every visitor's uploads decode together in the scheduler's
batches; lock: one request at a time, `asr app --no-batching`) it starts `python -m app` on
a free localhost port, and N clients (gradio_client) upload clips for a warm-up period, then
for the measured period: English clips of 1-35 s cut from the given audio, and a share of
bad files (not audio, empty, NaN samples). It prints, for each mode, throughput (audio
seconds served per wall second), latency percentiles, outcomes (transcripts, clear errors,
anything else), the server's resident memory over time and the size of its upload cache and
download folder; then the batched / lock throughput ratio, measured in this one run (the
modes one after the other: a server each).

    python scripts/benchmark_app.py --clients 8 --warmup 120 --seconds 600 --out out/app-bench

Only the `soundfile` and `gradio_client` that `make install` installs are needed."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import soundfile
from gradio_client import Client, handle_file

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from asr.audio import SAMPLE_RATE, load_audio  # noqa: E402
from asr.writers import DEFAULT_FORMATS, write_files_atomic  # noqa: E402

DEV = REPO.parent / "shared" / "eval" / "dev"
MODES = {"batched": [], "lock": ["--no-batching"]}
STARTUP_S = 600
PEAK_WINDOW_S = 120.0  # memory: the peak of the measured period's first and last 2 minutes


@dataclass
class Request:
    clip: str
    seconds: float  # audio duration (0 for a bad file)
    bad: bool
    started: float
    ended: float
    outcome: str  # transcript | clear-error | wrong | exception
    detail: str = ""


@dataclass
class ModeResult:
    mode: str
    requests: list[Request] = field(default_factory=list)
    memory: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, RSS MB)
    disk: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, MB under the server's temp dir)
    measure_from: float = 0.0
    measure_to: float = 0.0


def make_clips(sources: list[Path], scratch: Path, max_seconds: float) -> list[tuple[Path, float]]:
    """Each source cut to at most max_seconds; a source longer than that also gives a cut of
    about half of it, so the mix spans 1 s to max_seconds."""
    clips = []
    scratch.mkdir(parents=True, exist_ok=True)
    for source in sources:
        samples = load_audio(source)
        cuts = [samples[: int(max_seconds * SAMPLE_RATE)]]
        if len(samples) > max_seconds * SAMPLE_RATE:
            cuts.append(samples[int(max_seconds * SAMPLE_RATE) : int(1.6 * max_seconds * SAMPLE_RATE)])
        for i, cut in enumerate(cuts):
            path = scratch / f"{source.stem}-{i}.flac"
            soundfile.write(path, cut, SAMPLE_RATE)
            clips.append((path, len(cut) / SAMPLE_RATE))
    return clips


def make_bad_files(scratch: Path) -> list[Path]:
    scratch.mkdir(parents=True, exist_ok=True)
    not_audio, empty, nan = scratch / "notes.wav", scratch / "empty.wav", scratch / "nan.wav"
    not_audio.write_text("these are meeting notes, not a recording\n" * 50)
    empty.write_bytes(b"")
    samples = np.random.default_rng(0).normal(0, 0.1, 3 * SAMPLE_RATE).astype(np.float32)
    samples[SAMPLE_RATE : SAMPLE_RATE + 100] = np.nan
    soundfile.write(nan, samples, SAMPLE_RATE, subtype="FLOAT")
    return [not_audio, empty, nan]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def tree_mb(root: Path) -> float:
    """Bytes under root; files the server removes meanwhile are skipped."""
    total = 0
    for folder, _, names in os.walk(root):  # os.walk ignores folders that vanish under it
        for name in names:
            try:
                total += os.stat(os.path.join(folder, name)).st_size
            except FileNotFoundError:
                continue
    return total / 2**20


def judge(result: tuple, bad: bool, name: str) -> tuple[str, str]:
    """A good file must give timed segments and a download of each format; a bad one an
    error naming the file."""
    transcript = result[1] if isinstance(result, (list, tuple)) and len(result) > 1 else str(result)
    if "asr-error" in transcript:
        return ("clear-error" if bad and name in transcript else "wrong"), transcript[:300]
    if "asr-segment" in transcript or "No speech found" in transcript:
        if bad:
            return "wrong", ""
        offered = sorted(Path(f["path"]).suffix.lstrip(".") for f in downloads(result[2]))
        return ("transcript", "") if offered == sorted(DEFAULT_FORMATS) else ("wrong", f"downloads offered: {offered}")
    return "wrong", transcript[:300]


def downloads(output: object) -> list[dict]:
    """The files the page offers (gr.update's value, or the value itself), as the server's FileData."""
    value = output.get("value", output) if isinstance(output, dict) else output
    return value if isinstance(value, list) else []


def visitor(url: str) -> Client:
    """A client that, like a visitor, leaves the transcript's files on the server until asked
    for: gradio_client would fetch them all, and for a generator's endpoint twice (with the
    last progress message, then with the completion), from the server under test."""
    return Client(url, verbose=False, download_files=False)


def upload(api: Client, path: Path, language: str) -> tuple:
    """The page's upload with its default settings, through its public API: (figures, transcript, downloads)."""
    return api.predict(handle_file(str(path)), language, "transcribe", "auto", "", False, False, "segments",
                       api_name="/transcribe")


def run_mode(mode: str, args: argparse.Namespace, clips: list[tuple[Path, float]], bad: list[Path],
             scratch: Path) -> ModeResult:
    port, temp = free_port(), scratch / f"server-{mode}"
    temp.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False", "TMPDIR": str(temp),
           "GRADIO_TEMP_DIR": str(temp / "gradio")}
    log_path = scratch / f"server-{mode}.log"
    command = [sys.executable, "-m", "app", "--port", str(port), "--keep-files-minutes", str(args.keep_minutes),
               *MODES[mode], *args.server_args]
    with log_path.open("w") as log:
        server = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    result = ModeResult(mode)
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if server.poll() is not None:
                raise SystemExit(f"{mode} server exited:\n{log_path.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(url, timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{mode} server did not answer in {STARTUP_S} s") from None
                time.sleep(1)
        # One upload first: the clients would otherwise ask a server whose endpoint fails at
        # once again and again in a tight loop, and the figures would mean nothing.
        try:
            outcome, detail = judge(upload(visitor(url), clips[0][0], args.language), False, "")
        except Exception as error:
            outcome, detail = "exception", f"{type(error).__name__}: {error}"
        if outcome != "transcript":
            raise SystemExit(f"{mode} server: the first upload gave {outcome}: {detail}")
        start = time.monotonic()
        result.measure_from, result.measure_to = args.warmup, args.warmup + args.seconds
        stop = threading.Event()

        def client(index: int) -> None:
            rng = random.Random(index)
            api = visitor(url)
            while not stop.is_set():
                is_bad = rng.random() < args.bad_share
                path, seconds = (rng.choice(bad), 0.0) if is_bad else rng.choice(clips)
                began = time.monotonic() - start
                try:
                    outcome, detail = judge(upload(api, path, args.language), is_bad, path.name)
                except Exception as error:  # what a visitor would see as a failed request
                    outcome, detail = "exception", f"{type(error).__name__}: {error}"[:300]
                result.requests.append(Request(path.name, seconds, is_bad, began, time.monotonic() - start,
                                               outcome, detail))

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
        for thread in threads:
            thread.start()
        while (now := time.monotonic() - start) < result.measure_to:
            result.memory.append((round(now, 1), round(rss_mb(server.pid), 1)))
            result.disk.append((round(now, 1), round(tree_mb(temp), 2)))
            time.sleep(min(args.sample_every, max(0.1, result.measure_to - now)))
        stop.set()
        for thread in threads:
            thread.join(timeout=300)
        result.memory.append((round(time.monotonic() - start, 1), round(rss_mb(server.pid), 1)))
        result.disk.append((round(time.monotonic() - start, 1), round(tree_mb(temp), 2)))
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    return result


def by_clip(requests: list[Request]) -> dict[str, list[float]]:
    latencies: dict[str, list[float]] = {}
    for r in requests:
        latencies.setdefault(f"{r.clip} ({r.seconds:.1f} s)", []).append(r.ended - r.started)
    return latencies


def summarize(result: ModeResult) -> dict:
    """Over the requests that ended in the measured period."""
    window = [r for r in result.requests if result.measure_from <= r.ended < result.measure_to]
    good = [r for r in window if r.outcome == "transcript"]
    latencies = sorted(r.ended - r.started for r in window if r.outcome in ("transcript", "clear-error"))

    def quantile(q: float) -> float | None:
        return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 2) if latencies else None

    def memory_at(t: float) -> float | None:
        after = [mb for at, mb in result.memory if at >= t]
        return after[0] if after else None

    def peak(start: float, end: float) -> float | None:
        """The highest sample in [start, end): the server hands freed memory back every
        minute, so single samples saw-tooth and peaks show the trend."""
        inside = [mb for at, mb in result.memory if start <= at < end]
        return max(inside) if inside else None

    outcomes = {name: sum(r.outcome == name for r in window) for name in ("transcript", "clear-error", "wrong", "exception")}
    seconds = result.measure_to - result.measure_from
    memory_start, memory_end = memory_at(result.measure_from), result.memory[-1][1] if result.memory else None
    return {
        "mode": result.mode,
        "requests": len(window),
        **outcomes,
        "bad_files": sum(r.bad for r in window),
        "audio_seconds": round(sum(r.seconds for r in good), 1),
        "throughput": round(sum(r.seconds for r in good) / seconds, 3),
        "latency_p50": quantile(0.5),
        "latency_p95": quantile(0.95),
        "latency_max": latencies[-1] if latencies else None,
        "rss_mb_at_measure_start": memory_start,
        "rss_mb_at_end": memory_end,
        "rss_growth": round(memory_end / memory_start - 1, 3) if memory_start and memory_end else None,
        "rss_mb_peak_first": (first := peak(result.measure_from, result.measure_from + PEAK_WINDOW_S)),
        "rss_mb_peak_last": (last := peak(result.measure_to - PEAK_WINDOW_S, result.measure_to + 1)),
        "rss_peak_growth": round(last / first - 1, 3) if first and last else None,
        "rss_mb_max": max(mb for _, mb in result.memory) if result.memory else None,
        "temp_mb_max": max(mb for _, mb in result.disk) if result.disk else None,
        "temp_mb_at_end": result.disk[-1][1] if result.disk else None,
        "latency_by_clip": {clip: [round(float(np.mean(ls)), 2), round(max(ls), 2), len(ls)] for clip, ls in sorted(
            by_clip(good).items())},  # mean s, max s, count: which recordings make the tail
        "problems": sorted({f"{r.clip}: {r.outcome}: {r.detail}" for r in window if r.outcome in ("wrong", "exception")})[:10],
    }


def tables(summaries: list[dict]) -> str:
    lines = ["| server | requests | transcripts | clear errors | wrong | exceptions | audio s / wall s | "
             "p50 s | p95 s | RSS MB at start -> end (growth) | RSS MB peak, first -> last 2 min (growth) | "
             "temp dir MB max / end |", "|" + "---|" * 12]
    for s in summaries:
        lines.append(f"| {s['mode']} | {s['requests']} | {s['transcript']} | {s['clear-error']} | {s['wrong']} | "
                     f"{s['exception']} | {s['throughput']:.2f} | {s['latency_p50']} | {s['latency_p95']} | "
                     f"{s['rss_mb_at_measure_start']} -> {s['rss_mb_at_end']} ({s['rss_growth']:+.1%}) | "
                     f"{s['rss_mb_peak_first']} -> {s['rss_mb_peak_last']} ({s['rss_peak_growth']:+.1%}) | "
                     f"{s['temp_mb_max']} / {s['temp_mb_at_end']} |")
    clips = sorted({c for s in summaries for c in s.get("latency_by_clip", {})},
                   key=lambda c: -float(c.rsplit("(", 1)[1].split()[0]))
    if clips:
        lines += ["", "| clip (longest first) | " + " | ".join(f"{s['mode']} mean / max s (n)" for s in summaries) + " |",
                  "|" + "---|" * (len(summaries) + 1)]
        for clip in clips:
            cells = [s.get("latency_by_clip", {}).get(clip) for s in summaries]
            lines.append(f"| {clip} | " + " | ".join(f"{c[0]} / {c[1]} ({c[2]})" if c else "" for c in cells) + " |")
    by_mode = {s["mode"]: s for s in summaries}
    if "batched" in by_mode and "lock" in by_mode and by_mode["lock"]["throughput"]:
        # The modes ran one after the other (a server each, minutes apart): drift in a shared machine's load is in the ratio.
        lines.append(f"\nthroughput batched / lock: {by_mode['batched']['throughput'] / by_mode['lock']['throughput']:.2f}x "
                     "(the modes ran one after the other, not in turns: on a machine shared with other work, run it again)")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--warmup", type=float, default=120.0, help="seconds of load before measuring")
    parser.add_argument("--seconds", type=float, default=600.0, help="measured seconds per mode")
    parser.add_argument("--modes", default="lock,batched", help="comma-separated: " + ", ".join(MODES))
    parser.add_argument("--bad-share", type=float, default=0.15)
    parser.add_argument("--language", default="auto", help="the page's language setting (auto: detect)")
    parser.add_argument("--audio", type=Path, nargs="*",
                        default=sorted((DEV / "en_short").iterdir()) + sorted((DEV / "en_long").iterdir()))
    parser.add_argument("--max-clip-seconds", type=float, default=35.0)
    parser.add_argument("--keep-minutes", type=float, default=5.0, help="the server's --keep-files-minutes")
    parser.add_argument("--sample-every", type=float, default=10.0, help="seconds between memory samples")
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="passed on to `python -m app`")
    parser.add_argument("--out", type=Path, default=REPO / "out" / "benchmark-app")
    parser.add_argument("--summarize", type=Path, metavar="REPORT_JSON",
                        help="print the tables of an earlier run's report.json again (current summary rules)")
    args = parser.parse_args()
    if unknown := set(args.modes.split(",")) - set(MODES):
        parser.error(f"--modes: {', '.join(sorted(unknown))}: not one of {', '.join(MODES)}")
    # SIGTERM (kill, a CI's timeout) ended this script and left its server running: as Ctrl-C,
    # it now runs the finally that stops the server.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if args.summarize:
        runs = json.loads(args.summarize.read_text())["runs"]
        results = [ModeResult(**{**run, "requests": [Request(**r) for r in run["requests"]]}) for run in runs]
        print(tables([summarize(r) for r in results]))
        return 0

    audio = [p for p in args.audio if p.suffix.lower() in (".flac", ".wav", ".mp3", ".ogg", ".m4a")]
    if not audio:
        raise SystemExit("no audio: give --audio FILES (the dev set is at ../shared/eval/dev)")
    scratch = args.out / "scratch"
    clips, bad = make_clips(audio, scratch / "clips", args.max_clip_seconds), make_bad_files(scratch / "bad")
    durations = sorted(s for _, s in clips)
    print(f"{len(clips)} clips of {durations[0]:.1f}-{durations[-1]:.1f} s, {len(bad)} bad files "
          f"({args.bad_share:.0%} of uploads), {args.clients} clients, {args.warmup:.0f} s warm-up, "
          f"{args.seconds:.0f} s measured per mode", flush=True)

    summaries, results = [], []
    for mode in args.modes.split(","):
        result = run_mode(mode, args, clips, bad, scratch)
        results.append(result)
        summaries.append(summarize(result))
        print(json.dumps(summaries[-1]), flush=True)

    report = tables(summaries)
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    write_files_atomic({args.out / "report.md": " ".join(sys.argv) + "\n\n" + report + "\n",
                        args.out / "report.json": json.dumps({"summaries": summaries, "runs": [asdict(r) for r in results]},
                                                             indent=1)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
