"""What an attention call costs the first time a shape is met, and afterwards, with PyTorch's
own choice of kernel (cuDNN's on an H100) and without cuDNN (asr.decoder.attention_without_cudnn),
at the decoder's shapes: whisper-base's 8 heads and large-v3's 20 (of 64 dimensions), a few
query widths and batch sizes, over the self-attention cache (448 positions, masked) and the
encoder's 1,500 frames. Each shape is new to the process when first timed, so the first call
includes what a kernel builds for it (cuDNN builds a plan per shape).

A second table times each kernel alone at large-v3's decode shapes (the verification's 9
queries and a draft step's 1, over the cache's 464 masked positions and the 1,500 frames, at
batch 1 and 16): on CUDA per call as replays of a CUDA graph of 20 calls, as the engine runs
them (kernel time, not launches); each of SDPA's backends where it takes the shape, and the
attention written out as two matrix products around a softmax. On a GPU at batch 1 the
verification's attention was 0.93 of 3.17 ms of kernel time per token, cuDNN's kernel 14.5
us a call (docs/gpu-check-2026-11-26.md), and at batch 16 43 us, 2.76 of 5.97 ms: which
kernel serves these shapes best.

For the masked self-attention it also times kernels that take each row's length instead of
a mask (flash's and the memory-efficient kernel's variable-length forms, causal from the
bottom right), over a cache laid out position-major ([rows x positions, heads, 64]), with
64 and with all 464 positions in use: they need no mask and skip the positions past a row's
length, where a masked kernel reads all 464. Their outputs are checked against masked
attention (the largest difference is printed). Ours in Triton (asr/triton_ops.py,
`--lengths-attention triton`) is timed both ways: over every key, and by row lengths over
the cache as the engine keeps it ([rows, heads, positions, 64], in place).

    python scripts/attention_first_use.py                 # CUDA, float16
    python scripts/attention_first_use.py --device cpu    # runs anywhere (no cuDNN there)"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from asr.decoder import attention_without_cudnn
from asr.triton_ops import decode_attention

OURS = "ours (Triton)"  # asr/triton_ops.py's kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=50, help="timed calls after the first (mean)")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    torch.ones(1, device=device)  # the device's context, before any timing
    print(f"{device}, {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, {dtype}, torch {torch.__version__}")
    print()
    print("| kernels | heads | rows | queries | keys | first call ms | later calls us |")
    print("|---|---|---|---|---|---|---|")
    # Each setting gets shapes of its own (other row counts), so that its first calls are first.
    for name, rows, without in (("PyTorch's choice", (8, 1), False), ("without cuDNN", (7, 2), True)):
        for heads in (8, 20):
            for n, queries in ((rows[0], 1), (rows[0], 16), (rows[1], 9), (rows[1], 32)):
                for keys, masked in ((448, True), (1500, False)):
                    query = torch.randn(n, heads, queries, 64, device=device, dtype=dtype)
                    key, value = (torch.randn(n, heads, keys, 64, device=device, dtype=dtype) for _ in range(2))
                    mask = torch.zeros(n, 1, queries, keys, device=device, dtype=dtype) if masked else None

                    def call() -> None:
                        with attention_without_cudnn(device, without):
                            F.scaled_dot_product_attention(query, key, value, attn_mask=mask)

                    first, later = timed(call, device, args.repeats)
                    print(f"| {name} | {heads} | {n} | {queries} | {keys}{' masked' if masked else ''} "
                          f"| {first * 1e3:.1f} | {later * 1e6:.1f} |")
    print()
    kernels = {"cuDNN": [SDPBackend.CUDNN_ATTENTION], "flash": [SDPBackend.FLASH_ATTENTION],
               "memory-efficient": [SDPBackend.EFFICIENT_ATTENTION], "math": [SDPBackend.MATH], "written out": None,
               OURS: OURS}
    by_length = [(kind, used) for kind in ("flash", "memory-efficient", OURS) for used in (64, 464)]
    print("| heads | rows | queries | keys | " + " | ".join(f"{name} us" for name in kernels) + " | "
          + " | ".join(f"{kind}, row lengths ({used} used) us" for kind, used in by_length) + " |")
    print("|---|---|---|---|" + "---|" * (len(kernels) + len(by_length)))
    differences: dict[str, float] = {}
    for n in (1, 16):
        for queries in (9, 1):
            for keys, masked in ((464, True), (1500, False)):
                query = torch.randn(n, 20, queries, 64, device=device, dtype=dtype)
                key, value = (torch.randn(n, 20, keys, 64, device=device, dtype=dtype) for _ in range(2))
                mask = torch.zeros(n, 1, queries, keys, device=device, dtype=dtype) if masked else None
                cells = []
                for backends in kernels.values():
                    def call(backends=backends) -> None:
                        if backends is None:
                            written_out(query, key, value, mask)
                            return
                        if backends == OURS:  # every key (the mask hides none)
                            decode_attention(query.transpose(1, 2), key, value, None, False)
                            return
                        with sdpa_kernel(backends):
                            F.scaled_dot_product_attention(query, key, value, attn_mask=mask)

                    try:
                        call()  # eagerly: a backend that does not take the shape (or the device) raises
                    except (RuntimeError, ImportError):  # ours without Triton
                        cells.append("-")
                        continue
                    try:
                        cells.append(f"{replayed(call, device, args.repeats) * 1e6:.1f}")
                    except RuntimeError:
                        cells.append("capture failed")
                for kind, used in by_length:
                    cells.append(lengths_cell(kind, query, key, value, used, device, args.repeats, differences)
                                 if masked else "n/a")
                print(f"| 20 | {n} | {queries} | {keys}{' masked' if masked else ''} | " + " | ".join(cells) + " |")
    if differences:
        print()
        print("Row lengths against a mask, largest difference: "
              + ", ".join(f"{kind} {difference:.2g}" for kind, difference in differences.items()))


def lengths_cell(kind: str, query: Tensor, key: Tensor, value: Tensor, used: int, device: torch.device, repeats: int,
                 differences: dict[str, float]) -> str:
    """The table's cell for a kernel taking row lengths (`used` positions of each row): its
    time per call, '-' where this build or device has no such kernel; records how far its
    output lies from masked attention's."""
    n, heads, queries, width = query.shape
    keys = key.shape[2]
    # Laid out as the kernels read them, once (a cache kept so would need no copy).
    packed = [t.transpose(1, 2).reshape(-1, heads, width).contiguous() for t in (query, key, value)]
    starts_q = torch.arange(0, (n + 1) * queries, queries, dtype=torch.int32, device=device)
    starts_k = torch.arange(0, (n + 1) * keys, keys, dtype=torch.int32, device=device)
    lengths = torch.full((n,), used, dtype=torch.int32, device=device)

    def call() -> Tensor:
        q, k, v = packed
        if kind == OURS:  # reads the keys in place, [rows, heads, positions, 64]
            return decode_attention(query.transpose(1, 2), key, value, lengths, True).transpose(1, 2)
        if kind == "flash":
            out = torch.ops.aten._flash_attention_forward(q, k, v, starts_q, starts_k, queries, keys, 0.0, True, False,
                                                          seqused_k=lengths)[0]
        else:  # mask type 2: causal from the bottom right
            out = torch.ops.aten._efficient_attention_forward(q[None], k[None], v[None], None, starts_q, starts_k, queries,
                                                              keys, 0.0, 2, False, seqlen_k=lengths)[0][0]
        return out.view(n, queries, heads, width).transpose(1, 2)

    # Query i of a row sits at position used - queries + i and sees the positions up to it.
    positions = torch.arange(used - queries, used, device=device)
    mask = torch.full((queries, keys), float("-inf"), device=device, dtype=torch.float32)
    mask.masked_fill_(torch.arange(keys, device=device)[None, :] <= positions[:, None], 0.0)
    try:
        out = call()
        with sdpa_kernel([SDPBackend.MATH]):
            expected = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=mask)
        difference = (out.float() - expected).abs().max().item()  # where a kernel's fault surfaces
    except (RuntimeError, TypeError, NotImplementedError, ImportError):
        return "-"
    label = f"{kind}, row lengths"
    differences[label] = max(differences.get(label, 0.0), difference)
    if difference > 1e-2:  # float16's rounding is about 1e-3 here: not the masked attention
        return f"wrong ({difference:.2g})"
    try:
        return f"{replayed(call, device, repeats) * 1e6:.1f}"
    except RuntimeError:
        return "capture failed"


def written_out(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None) -> Tensor:
    """Attention as two matrix products (in the inputs' dtype) around a softmax in float32."""
    scores = query @ key.transpose(-1, -2) * query.shape[-1] ** -0.5
    if mask is not None:
        scores = scores + mask
    return torch.softmax(scores, -1, dtype=torch.float32).to(value.dtype) @ value


def replayed(call, device: torch.device, repeats: int, calls: int = 20) -> float:
    """Seconds per call: on CUDA of `calls` calls captured in one graph and replayed
    `repeats` times (after a warm-up outside it), elsewhere of eager calls."""
    if device.type != "cuda":
        return timed(call, device, repeats)[1]
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream(device).wait_stream(stream)
    # As asr/cudagraphs.py captures: a capture that fails leaves no capture stream current.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            for _ in range(calls):
                call()
        finally:
            graph.capture_end()
    return timed(graph.replay, device, repeats)[1] / calls


def timed(call, device: torch.device, repeats: int) -> tuple[float, float]:
    """Seconds of the first call, and the mean of `repeats` later ones (after 3 untimed)."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    sync()
    started = time.perf_counter()
    call()
    sync()
    first = time.perf_counter() - started
    for _ in range(3):
        call()
    sync()
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    sync()
    return first, (time.perf_counter() - started) / repeats


if __name__ == "__main__":
    main()
