"""Encoder cost per window: one batch of N windows against N windows one at a time, in
turns in one process (why WhisperModel.encode splits a batch on CPU), in each dtype given
(float32 against bfloat16: what `--dtype auto` gains on a CPU with bf16 arithmetic).

    python scripts/benchmark_encoder.py [--preset embedded] [--windows 8] [--repeats 3] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch

from asr.models import DEFAULT_PRESET, PRESETS, load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", default="float32", help="comma-separated, e.g. float32,bfloat16")
    args = parser.parse_args()
    if args.windows < 1 or args.repeats < 1:
        parser.error("--windows and --repeats: whole numbers from 1")
    if bad := [d for d in args.dtypes.split(",") if not isinstance(getattr(torch, d, None), torch.dtype)]:
        parser.error(f"--dtypes: {', '.join(bad)}: not a torch dtype (float32, bfloat16, float16)")
    model = load_model(PRESETS[args.preset][0])
    print(f"{model.name} encoder, {args.windows} windows, {torch.get_num_threads()} threads, device {model.device}")
    for dtype in args.dtypes.split(","):
        model.encoder.to(getattr(torch, dtype))
        features = torch.randn(args.windows, model.config.num_mel_bins, 2 * model.config.max_source_positions,
                               dtype=getattr(torch, dtype))
        print(dtype)
        time_encoder(model, features, args.repeats)


def time_encoder(model, features: torch.Tensor, repeats: int) -> None:
    windows = len(features)
    with torch.inference_mode():
        model.encoder(features[:1])  # first-call costs out of the timings
        for _ in range(repeats):
            started = time.perf_counter()
            for window in features:
                model.encoder(window[None])
            single = time.perf_counter() - started
            started = time.perf_counter()
            model.encoder(features)
            batched = time.perf_counter() - started
            print(f"one at a time {single / windows:.3f} s/window, batched {batched / windows:.3f} s/window "
                  f"(batched / one at a time: {batched / single:.2f})")


if __name__ == "__main__":
    main()
