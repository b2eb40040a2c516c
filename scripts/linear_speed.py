"""What a decoder layer's linear maps cost at large-v3's shapes (width 1,280, feed-forward
5,120, 51,866 tokens), per call as replays of a CUDA graph (kernel time, not launches), as
the engine runs them: PyTorch's kernels (the layer norm, the matrix product, the GELU or the
residual add, one kernel each) against our fused kernel (asr/triton_ops.fused_linear: all
of it in one, `--fused-layers`) in the configuration the engine uses and in a few others
(columns and depth a program's block, warps, pipeline stages), at 1, 9 and 144 rows (a
target-only step at batch 1, a verification of 9 positions, 16 rows of 9). Each
configuration's result is checked against PyTorch's (the largest difference), and a row
alone against the same row among the others (to the bit, as the kernel is written to give).
The replayed calls take turns over copies of the weight, more than twice an H200's L2 cache
(50 MB) in all: one weight replayed stayed in L2 (a decoder's step reads ~39 MB a layer, each
once), and timed our kernel and PyTorch's on reads a step never gets.

    python scripts/linear_speed.py                                     # CUDA, float16
    TRITON_INTERPRET=1 python scripts/linear_speed.py --device cpu --geometry tiny   # runs anywhere Triton is"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, installed or not

from attention_first_use import replayed  # noqa: E402  (beside this script)
from asr import triton_ops  # noqa: E402
from asr.triton_ops import LinearConfig, launch_linear, linear_config  # noqa: E402

GEOMETRIES = {"large-v3": (1280, 5120, 51866), "tiny": (64, 256, 1000)}  # width, feed-forward, vocabulary
ROTATED_BYTES = 128 * 2**20  # the weight copies the calls take turns over, at least (up to 64 copies)
# Configurations tried beside the engine's (a column count of None: the engine's for the weight).
CONFIGS = [LinearConfig(None, 256), LinearConfig(None, 256, stages=4), LinearConfig(None, 512),
           LinearConfig(None, 128, warps=2, stages=4), LinearConfig(None, 128, warps=8), LinearConfig(32, 128),
           LinearConfig(32, 256, stages=4), LinearConfig(64, 128)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="large-v3")
    parser.add_argument("--rows", default="1,9,144", help="rows a call (comma-separated)")
    parser.add_argument("--repeats", type=int, default=50, help="timed replays (mean)")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    if reason := triton_ops.unavailable(device, dtype):
        parser.error(f"our kernel cannot run here: {reason}")
    width, ffn, vocab = GEOMETRIES[args.geometry]
    # Each map: its name, depth, columns, and what comes with it (a norm before; GELU; a residual after).
    maps = [("query/key/value + norm", width, 3 * width, True, False, False),
            ("attention out + residual", width, width, False, False, True),
            ("feed-forward 1 + norm + GELU", width, ffn, True, True, False),
            ("feed-forward 2 + residual", ffn, width, False, False, True),
            ("output head + norm", width, vocab, True, False, False)]
    torch.manual_seed(0)
    torch.ones(1, device=device)  # the device's context, before any timing
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton's interpreter)"
    print(f"{device}, {name}, {str(dtype).removeprefix('torch.')}, torch {torch.__version__}, {args.geometry}")
    print()
    print("| map | rows | kernels | columns, depth, warps, stages | us a call | vs PyTorch | largest difference | a row alone |")
    print("|---|---|---|---|---|---|---|---|")
    for label, depth, cols, norm, gelu, residual in maps:
        weight = torch.randn(cols, depth, device=device, dtype=dtype) / depth**0.5
        copies = min(64, -(-ROTATED_BYTES // (weight.numel() * weight.element_size())))  # 40 of the 1,280-square map
        weights = [weight] + [weight.clone() for _ in range(copies - 1)]
        bias = None if label.startswith("output") else torch.randn(cols, device=device, dtype=dtype)
        gain, shift = (torch.rand(depth, device=device, dtype=dtype) + 0.5, torch.randn(depth, device=device, dtype=dtype))
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, depth, device=device, dtype=dtype)
            added = torch.randn(rows, cols, device=device, dtype=dtype) if residual else None
            fused = dict(bias=bias, norm_weight=gain if norm else None, norm_bias=shift if norm else None, eps=1e-5,
                         gelu=gelu, residual=added)

            def plain(weight: torch.Tensor = weight) -> torch.Tensor:
                h = F.layer_norm(x, (depth,), gain, shift, 1e-5) if norm else x
                y = F.linear(h, weight, bias)
                y = F.gelu(y) if gelu else y
                return y if added is None else added + y

            reference = plain()
            turns = itertools.cycle(weights)
            base = replayed(lambda: plain(next(turns)), device, args.repeats, calls=max(20, copies))
            kernels = (1 if norm else 0) + 1 + (1 if gelu or residual else 0)
            print(f"| {label} | {rows} | PyTorch | {kernels} kernels | {1e6 * base:.2f} | 1.00x | - | - |", flush=True)
            engine = linear_config(cols)
            for config in [engine] + [LinearConfig(c.columns or engine.columns, c.depth, c.warps, c.stages)
                                      for c in CONFIGS]:
                if config == engine and config is not engine:
                    continue
                try:
                    def ours(config: LinearConfig = config, weight: torch.Tensor = weight) -> torch.Tensor:
                        return launch_linear(x, weight, config=config, **fused)

                    out = ours()
                    turns = itertools.cycle(weights)
                    seconds = replayed(lambda: ours(weight=next(turns)), device, args.repeats, calls=max(20, copies))
                except Exception as error:  # noqa: BLE001  (a configuration Triton refuses: say so, go on)
                    print(f"| {label} | {rows} | ours | {described(config)} | failed: {type(error).__name__} | | | |")
                    continue
                alone = launch_linear(x[-1:], weight, config=config,
                                      **{**fused, "residual": None if added is None else added[-1:]})
                difference = (out.float() - reference.float()).abs().max().item()
                same = "same" if torch.equal(alone[0], out[-1]) else "DIFFERS"
                mark = " (engine's)" if config is engine else ""
                print(f"| {label} | {rows} | ours{mark} | {described(config)} | {1e6 * seconds:.2f} | {base / seconds:.2f}x "
                      f"| {difference:.2e} | {same} |", flush=True)


def described(config: LinearConfig) -> str:
    return f"{config.columns}, {config.depth}, {config.warps}, {config.stages}"


if __name__ == "__main__":
    main()
