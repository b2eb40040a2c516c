"""Encoder cost per window: one batch of N windows against N windows one at a time, in
turns in one process (why WhisperModel.encode splits a batch on CPU), in each dtype given
(float32 against bfloat16: what `--dtype auto` gains on a CPU with bf16 arithmetic).

    python scripts/benchmark_encoder.py [--preset embedded] [--windows 8] [--repeats 3] [--dtypes float32,bfloat16]

Each dtype has its own copy of the encoder; every repeat runs each dtype's two ways, the
dtypes and the two ways in an order that rotates from repeat to repeat, so that drift in a
shared machine's load weighs on all alike (all of one dtype first put it all in the ratio).
The last lines are each figure's median over the repeats.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from asr.metrics import load_note, machine_load
from asr.models import DEFAULT_PRESET, PRESETS, load_model

ONE, BATCHED = "one at a time", "batched"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", default="float32", help="comma-separated, e.g. float32,bfloat16")
    args = parser.parse_args()
    if args.windows < 1 or args.repeats < 1:
        parser.error("--windows and --repeats: whole numbers from 1")
    names = list(dict.fromkeys(args.dtypes.split(",")))  # each once
    if bad := [d for d in names if not isinstance(getattr(torch, d, None), torch.dtype)]:
        parser.error(f"--dtypes: {', '.join(bad)}: not a torch dtype (float32, bfloat16, float16)")
    model = load_model(PRESETS[args.preset][0])
    print(f"{model.name} encoder, {args.windows} windows, {torch.get_num_threads()} threads, device {model.device}")
    features = torch.randn(args.windows, model.config.num_mel_bins, 2 * model.config.max_source_positions)
    encoders = {name: (copy.deepcopy(model.encoder).to(getattr(torch, name)), features.to(getattr(torch, name)))
                for name in names}
    seconds: dict[tuple[str, str], list[float]] = {(name, way): [] for name in names for way in (ONE, BATCHED)}
    load = 0.0
    with torch.inference_mode():
        for encoder, inputs in encoders.values():
            encoder(inputs[:1])  # first-call costs out of the timings
        for repeat in range(args.repeats):
            shift = repeat % len(names)
            for name in names[shift:] + names[:shift]:
                encoder, inputs = encoders[name]
                for way in (ONE, BATCHED) if repeat % 2 == 0 else (BATCHED, ONE):
                    started = time.perf_counter()
                    for batch in (inputs.split(1) if way == ONE else [inputs]):
                        encoder(batch)
                    seconds[name, way].append((time.perf_counter() - started) / args.windows)
            load = max(load, machine_load())  # the load average of the run's own minutes, not of the one before
            print(f"repeat {repeat + 1}: " + "; ".join(_line(name, seconds[name, ONE][-1], seconds[name, BATCHED][-1])
                                                     for name in names))
    medians = {key: statistics.median(values) for key, values in seconds.items()}
    print("median: " + "; ".join(_line(name, medians[name, ONE], medians[name, BATCHED]) for name in names))
    for name in names[1:]:  # each repeat's ratio, its two dtypes timed in the same round
        ratios = [a / b for a, b in zip(seconds[name, ONE], seconds[names[0], ONE])]
        print(f"{name} / {names[0]}, one at a time: median {statistics.median(ratios):.2f} "
              f"(repeats {min(ratios):.2f}-{max(ratios):.2f})")
    print(load_note(load, torch.get_num_threads()))


def _line(name: str, one: float, batched: float) -> str:
    return (f"{name} {ONE} {one:.3f} s/window, {BATCHED} {batched:.3f} s/window "
            f"({BATCHED} / {ONE}: {batched / one:.2f})")


if __name__ == "__main__":
    main()
