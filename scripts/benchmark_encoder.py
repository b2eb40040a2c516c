"""Encoder cost per window: our encoder (asr/encoder.py, what transcription runs) one window
at a time, against one batch of N windows (why WhisperModel.encode splits a batch) and
against transformers' own encoder over the same weights one window at a time, in turns in
one process, in each dtype given (float32 against bfloat16: what `--dtype auto` gains on a
CPU with bf16 arithmetic).

    python scripts/benchmark_encoder.py [--preset embedded] [--windows 8] [--repeats 3] [--dtypes float32,bfloat16]
                                        [--device cuda]

Each dtype has its own copy of the encoder; every repeat runs each dtype's three ways, the
dtypes and the ways in an order that rotates from repeat to repeat, so that drift in a
shared machine's load weighs on all alike (all of one kind first put it all in the ratio).
The last lines are each figure's median over the repeats and each repeat's ratios.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch

from asr.cudagraphs import device_clock
from asr.encoder import EncoderRunner
from asr.metrics import load_note, machine_load
from asr.models import DEFAULT_PRESET, PRESETS, load_model

ONE, BATCHED, THEIRS = "ours one at a time", "ours batched", "transformers one at a time"
WAYS = (ONE, BATCHED, THEIRS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", default="float32", help="comma-separated, e.g. float32,bfloat16")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (timed to the GPU's end of the work)")
    args = parser.parse_args()
    if args.windows < 1 or args.repeats < 1:
        parser.error("--windows and --repeats: whole numbers from 1")
    names = list(dict.fromkeys(args.dtypes.split(",")))  # each once
    if bad := [d for d in names if not isinstance(getattr(torch, d, None), torch.dtype)]:
        parser.error(f"--dtypes: {', '.join(bad)}: not a torch dtype (float32, bfloat16, float16)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device here")
    device = torch.device(args.device)
    model = load_model(PRESETS[args.preset][0], device=device)
    print(f"{model.name} encoder, {args.windows} windows, {torch.get_num_threads()} threads, device {model.device}")
    features = torch.randn(args.windows, model.config.num_mel_bins, 2 * model.config.max_source_positions, device=device)
    runs = {}
    for name in names:
        encoder = copy.deepcopy(model.encoder).to(getattr(torch, name))
        ours, theirs = EncoderRunner(encoder), (lambda batch, encoder=encoder: encoder(batch).last_hidden_state)
        inputs = features.to(getattr(torch, name))
        runs[name] = {ONE: (ours, inputs.split(1)), BATCHED: (ours, [inputs]), THEIRS: (theirs, inputs.split(1))}
    seconds: dict[tuple[str, str], list[float]] = {(name, way): [] for name in names for way in WAYS}
    load = 0.0
    with torch.inference_mode():
        for name in names:
            for way in WAYS:  # first-call costs out of the timings
                run, batches = runs[name][way]
                run(batches[0])
        for repeat in range(args.repeats):
            kinds = [(name, way) for name in names for way in WAYS]
            shift = repeat % len(kinds)
            for name, way in kinds[shift:] + kinds[:shift]:
                run, batches = runs[name][way]
                started = device_clock(device)
                for batch in batches:
                    run(batch)
                seconds[name, way].append((device_clock(device) - started) / args.windows)
            load = max(load, machine_load())  # the load average of the run's own minutes, not of the one before
            print(f"repeat {repeat + 1}: " + "; ".join(_line(name, {w: seconds[name, w][-1] for w in WAYS})
                                                     for name in names))
    medians = {key: statistics.median(values) for key, values in seconds.items()}
    print("median: " + "; ".join(_line(name, {w: medians[name, w] for w in WAYS}) for name in names))
    for name in names:  # each repeat's ratio, its two ways timed in the same round
        _ratios(f"{name}: transformers / ours, one at a time", seconds[name, THEIRS], seconds[name, ONE])
    for name in names[1:]:
        _ratios(f"{name} / {names[0]}, ours one at a time", seconds[name, ONE], seconds[names[0], ONE])
    print(load_note(load, torch.get_num_threads()))


def _ratios(label: str, numerators: list[float], denominators: list[float]) -> None:
    ratios = [a / b for a, b in zip(numerators, denominators)]
    print(f"{label}: median {statistics.median(ratios):.2f} (repeats {min(ratios):.2f}-{max(ratios):.2f})")


def _line(name: str, times: dict[str, float]) -> str:
    return f"{name} " + ", ".join(f"{way} {times[way]:.3f} s/window" for way in WAYS)


if __name__ == "__main__":
    main()
