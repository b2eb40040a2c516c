"""The decoder's steps on a GPU in our own Triton kernels: attention, and linear maps fused with
the layer norm before them and the GELU or residual add after them.

Attention (decode_attention): a few queries per row
(a verification's 9, a draft step's 1) over keys read in place, each row told how many it
has (the self-attention cache's positions up to the row's length) or all of them (the
encoder's 1,500 frames), split over the keys so that one row's heads fill more of the GPU
than one block each, and the splits' partial softmaxes combined in a second kernel.

Why not PyTorch's kernels: at large-v3's shapes on an H200, batch 1, 9 queries, flash's
kernel by row lengths took 7.5 us plus 4.2 for its combining kernel over the cache, and
9.8 us over the 1,500 frames (docs/gpu-check-2026-11-30-h200.md), where reading those keys
takes about 1 and 3.6 us; cuDNN's masked kernel 13 and 20. A query's output never depends
on how many queries the call computes (each block of 16 queries is a program of its own),
nor on the other rows' keys; how its keys are split depends on the batch's size, as with
flash's kernel. Speculative decoding keeps its exactness as with PyTorch's kernels: a
verification computes its fixed width whatever k is, in batches of the same size.

Linear maps (fused_linear): a decoder step's few rows (a row of the batch times the positions
it computes) through a weight read once per 16 rows, in blocks of 16 rows and some columns, with
the layer norm before it (a decoder layer's three, and the final one before the output head)
computed in the same kernel, and the bias, GELU and residual add after it, or for the
self-attention's keys and values their write into the cache (fused_qkv): one kernel where
PyTorch runs two to four (on an H200, large-v3's layer norm took 4.1 us, the residual add 1.4,
the matrix products 4.3-6.6 at 9 rows: docs/gpu-check-2026-11-30-h200.md). Like the
attention's, a row's result never depends on how many rows the call has. Exactness needs no
more: a verification computes its fixed width whatever k is (what runs after the layers, the
rules' sums and the log-softmax, takes rows in PyTorch's kernels, whose order depends on a
row's place). Passes of more than FUSED_ROWS rows (a prefill, a draft's long catch-up) run
PyTorch's kernels, which read a weight once for all rows.

Triton comes with PyTorch's CUDA builds; `unavailable()` says why it cannot run here, if it cannot.
`TRITON_INTERPRET=1` runs the kernels on a CPU (tests/test_gpu_paths.py, where Triton is
installed)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch
from torch import Tensor

BLOCK_KEYS = 64  # keys a loop step reads
BLOCK_QUERIES = 16  # queries a program computes (the matrix unit's smallest block): more, in more programs
SPLIT_KEYS = 128  # at least this many keys a split (a program) reads, where there are enough programs without
FILLED = 264  # programs that keep an H200's 132 SMs busy twice over: no split beyond that


def unavailable(device: torch.device, dtype: torch.dtype, head_dim: int | None = None) -> str | None:
    """Why the kernels cannot run here, or None (head_dim None: not asked, for the linear maps)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpreted:
        return f"it needs a CUDA device, not {device.type}"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (it comes with PyTorch's CUDA builds)"
    if device.type == "cuda" and torch.version.hip is not None:
        return "it has not been tried on ROCm"
    if device.type == "cuda" and (capability := torch.cuda.get_device_capability(device)) < (8, 0):
        # bfloat16's matrix products, and the tests', need Ampere's tensor cores
        return f"it needs a GPU of compute capability 8.0 or later, not {capability[0]}.{capability[1]}"
    if dtype not in (torch.float16, torch.bfloat16) and not interpreted:
        return f"it computes in float16 or bfloat16, not {str(dtype).removeprefix('torch.')}"
    if head_dim is not None and head_dim not in (16, 32, 64, 128, 256):
        return f"it takes heads 16, 32, 64, 128 or 256 wide, not {head_dim}"
    return None


def splits_for(programs: int, keys: int) -> int:
    """Splits over the keys (a power of two): enough programs to fill the GPU, none of them
    with fewer than SPLIT_KEYS keys."""
    splits = 1
    while programs * splits * 2 <= FILLED and keys >= SPLIT_KEYS * splits * 2:
        splits *= 2
    return splits


@torch.library.custom_op("asr::decode_attention", mutates_args=())
def decode_attention(query: Tensor, keys: Tensor, values: Tensor, used: Tensor | None, causal: bool) -> Tensor:
    """query [n, q, H, Dh] (any strides but the last), keys and values [n, H, K, Dh] read in
    place (a cache's rows; the last stride 1); used [n] int32: the keys each row has (its
    first ones), or None: all K. causal: query i of q sees the keys up to used - q + i (the
    last query meets the last key). Returns [n, q, H, Dh], contiguous, in the query's dtype.
    One operator to torch.compile (a compiled step calls it as it is)."""
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError("decode_attention reads heads whose last dimension is contiguous")
    if not query.dtype == keys.dtype == values.dtype:  # the kernel's dot would not compile, on a GPU alone
        raise ValueError(f"decode_attention: query, keys and values of one dtype, not {query.dtype}, {keys.dtype}, "
                         f"{values.dtype}")
    return launch(query, keys, values, used, causal)


@decode_attention.register_fake
def _(query: Tensor, keys: Tensor, values: Tensor, used: Tensor | None, causal: bool) -> Tensor:
    return query.new_empty(query.shape)


def launch(query: Tensor, keys: Tensor, values: Tensor, used: Tensor | None, causal: bool) -> Tensor:
    """decode_attention's kernels (tests put a plain-PyTorch stand-in here)."""
    from asr import _triton_kernels as kernels  # Triton is imported only where it runs

    n, q, heads, head_dim = query.shape
    capacity = keys.shape[2]
    blocks = -(-q // BLOCK_QUERIES)  # a verification's 9 queries in one, a draft's catch-up of 256 in 16
    splits = splits_for(n * heads, capacity)
    chunk = -(-capacity // (splits * BLOCK_KEYS)) * BLOCK_KEYS
    out = torch.empty((n, q, heads, head_dim), dtype=query.dtype, device=query.device)
    lengths = used if used is not None else out  # not read without used (HAS_USED False)
    common = dict(HAS_USED=used is not None, CAUSAL=causal, QUERIES=BLOCK_QUERIES, HEAD_DIM=head_dim, BLOCK=BLOCK_KEYS)
    strides = (*query.stride()[:3], *keys.stride()[:3], *values.stride()[:3], *out.stride()[:3])
    if splits == 1:
        kernels.attend[(n * heads, 1, blocks)](query, keys, values, lengths, out, out, out, out, *strides,
                                               heads, q, capacity, chunk, head_dim ** -0.5, SPLIT=False, **common)
        return out
    padded = blocks * BLOCK_QUERIES
    partial = torch.empty((n * heads, splits, padded, head_dim), dtype=torch.float32, device=query.device)
    maxima = torch.empty((n * heads, splits, padded), dtype=torch.float32, device=query.device)
    sums = torch.empty_like(maxima)
    kernels.attend[(n * heads, splits, blocks)](query, keys, values, lengths, out, partial, maxima, sums, *strides,
                                                heads, q, capacity, chunk, head_dim ** -0.5, SPLIT=True, **common)
    kernels.combine[(n * heads, blocks)](partial, maxima, sums, out, *out.stride()[:3], heads, q,
                                         SPLITS=splits, QUERIES=BLOCK_QUERIES, HEAD_DIM=head_dim)
    return out


LINEAR_ROWS = 16  # rows a program computes (the matrix unit's smallest block)
FUSED_ROWS = 256  # rows past which a pass's linear maps run PyTorch's kernels (ours runs a program per 16
# rows and block of columns, made for the few rows of a decoding step)


@dataclass(frozen=True)
class LinearConfig:
    """How fused_linear's kernel covers a weight: the columns and the depth of a program's
    blocks, and Triton's warps a program and pipeline stages (scripts/linear_speed.py times others)."""

    columns: int
    depth: int = 128
    warps: int = 4
    stages: int = 3


def linear_config(cols: int) -> LinearConfig:
    """The kernel's blocks for a weight of `cols` columns: 16 to 128 columns a program, the
    fewest for which no more than FILLED programs cover them. Fixed by the weight's shape,
    never by the rows, so that a row's sums run in one order whatever the call's rows."""
    block = 16
    while block < 128 and -(-cols // block) > FILLED:
        block *= 2
    return LinearConfig(block)


@torch.library.custom_op("asr::fused_linear", mutates_args=())
def fused_linear(x: Tensor, weight: Tensor, bias: Tensor | None, norm_weight: Tensor | None,
                 norm_bias: Tensor | None, eps: float, gelu: bool, residual: Tensor | None) -> Tensor:
    """layer_norm(x) @ weight.T + bias, then GELU, plus residual: x [..., depth] (the last
    stride 1), weight [cols, depth] contiguous, bias [cols] or None; norm_weight and norm_bias
    [depth] (a LayerNorm's, eps its epsilon) or None: no norm; residual [..., cols] or None.
    Returns [..., cols] in x's dtype, contiguous. One operator to torch.compile."""
    if x.stride(-1) != 1 or not weight.is_contiguous() or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("fused_linear reads rows whose last dimension is contiguous and a contiguous weight")
    if (norm_weight is None) != (norm_bias is None):
        raise ValueError("fused_linear's layer norm takes a weight and a bias")
    return launch_linear(x, weight, bias, norm_weight, norm_bias, eps, gelu, residual)


@fused_linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, norm_weight: Tensor | None, norm_bias: Tensor | None,
      eps: float, gelu: bool, residual: Tensor | None) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("asr::fused_qkv", mutates_args=("cache",))
def fused_qkv(x: Tensor, weight: Tensor, bias: Tensor | None, norm_weight: Tensor, norm_bias: Tensor, eps: float,
              cache: Tensor, cache_rows: Tensor, cache_positions: Tensor) -> Tensor:
    """The self-attention's query, key and value map with its layer norm (fused_linear's, weight
    [3 * H * Dh, depth]), the keys and values written into a layer's cache [2, B, H, C, Dh]
    (the last stride 1) at each row's cache row and position (cache_rows, cache_positions:
    [rows] integers, x's rows in order; a row or position outside the cache is not written),
    where PyTorch writes them in a kernel of their own; returns the query [..., H * Dh].
    Not for torch.compile (a step compiled whole writes the cache itself)."""
    if cache.dim() != 5 or cache.stride(-1) != 1 or weight.shape[0] != 3 * cache.shape[2] * cache.shape[4]:
        raise ValueError("fused_qkv writes a cache [2, B, H, C, Dh] of a query/key/value weight [3 * H * Dh, depth]")
    if cache.dtype != x.dtype:
        raise ValueError(f"fused_qkv writes a cache in its input's dtype, {x.dtype}, not {cache.dtype}")
    return launch_linear(x, weight, bias, norm_weight, norm_bias, eps, False, None,
                         cache=(cache, cache_rows, cache_positions))


@fused_qkv.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, norm_weight: Tensor, norm_bias: Tensor, eps: float,
      cache: Tensor, cache_rows: Tensor, cache_positions: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 3))


def launch_linear(x: Tensor, weight: Tensor, bias: Tensor | None, norm_weight: Tensor | None,
                  norm_bias: Tensor | None, eps: float, gelu: bool, residual: Tensor | None,
                  config: LinearConfig | None = None, cache: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """fused_linear's kernel (tests put a plain-PyTorch stand-in here); config: linear_config's
    by default; cache: fused_qkv's (a layer's cache, its rows and positions)."""
    from asr import _triton_kernels as kernels

    cols, depth = weight.shape
    config = config or linear_config(cols)
    flat = x.reshape(-1, depth)  # a view where the rows lie evenly apart (a projection's slice does)
    rows = flat.shape[0]
    kept = cols if cache is None else cols // 3
    out = torch.empty((rows, kept), dtype=x.dtype, device=x.device)
    added = out if residual is None else residual.reshape(rows, cols)
    kv, kv_rows, kv_positions = cache if cache is not None else (out, out, out)  # not read without TO_CACHE
    # Read as laid out one after another: an expanded row index (one row's positions) has a stride of 0.
    kv_rows, kv_positions = kv_rows.contiguous(), kv_positions.contiguous()
    # Blocks of rows first: the programs that run side by side share a block of the weight,
    # read once from memory for all rows (the head's 133 MB, by columns first, was read again
    # for each block of 16 rows: it does not stay in L2).
    kernels.linear[(-(-rows // LINEAR_ROWS), -(-cols // config.columns))](
        flat, weight, out if bias is None else bias, out if norm_weight is None else norm_weight,
        out if norm_bias is None else norm_bias, added, out, kv, kv_rows, kv_positions, rows, cols, depth,
        flat.stride(0), weight.stride(0), added.stride(0), out.stride(0), eps, kept,
        *((kv.shape[-1], kv.shape[1], kv.shape[3], *kv.stride()[:4]) if cache is not None else (1, 0, 0, 0, 0, 0, 0)),
        HAS_BIAS=bias is not None, NORM=norm_weight is not None, GELU=gelu, HAS_RESIDUAL=residual is not None,
        TO_CACHE=cache is not None, BLOCK_M=LINEAR_ROWS, BLOCK_N=config.columns, BLOCK_K=config.depth,
        num_warps=config.warps, num_stages=config.stages)
    return out.view(*x.shape[:-1], kept)
