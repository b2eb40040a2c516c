"""Inference over a static KV cache for a Whisper decoder (target or draft).

Each row of a batch keeps its own length: the caller passes where each row's new tokens
start, the runner writes their keys/values there and attends only to what lies before.
Entries past a row's length are stale, never read, and overwritten later: that is how
rejected draft tokens are rolled back, by moving a position rather than copying.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from asr import triton_ops


def attention_without_cudnn(device: torch.device, where: bool = True) -> ContextManager:
    """Attention by the flash and memory-efficient kernels, not cuDNN's, on CUDA. cuDNN's is
    PyTorch's choice on an H100 and the fastest per call, but it builds a plan at the first
    call of every new shape: 60 to 1,000 ms each, measured on an H100, against 0.1 ms for the
    others (docs/gpu-check-2026-11-25.md; scripts/attention_first_use.py). Worth it for the
    target's verification, one shape per batch size replayed thousands of times; not for the
    draft's many shapes (catch-ups of 1 to 256 tokens at each batch size), nor for passes made
    once a window or of one-off widths. The flags it sets are the process's: the engine's
    passes run on one thread at a time (the scheduler's, or under the web page's engine
    lock). where: False for a no-op."""
    if device.type != "cuda" or not where:
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


LENGTHS_KERNELS = ("flash", "triton")  # attention by row lengths: flash-attention's kernel, or ours (asr/triton_ops.py)


def lengths_kernel(choice: bool | str | None) -> str | None:
    """Attention by row lengths as asked (True: flash-attention's kernel; a kernel's name),
    as the kernel's name, or None for masked attention."""
    if choice is None or (not isinstance(choice, str) and type(choice).__name__ in ("bool", "bool_")):  # numpy's too
        return LENGTHS_KERNELS[0] if choice else None
    if choice not in LENGTHS_KERNELS:
        raise ValueError(f"attention by row lengths runs {' or '.join(LENGTHS_KERNELS)}'s kernel, not {choice!r}")
    return choice


def lengths_attention_unavailable(device: torch.device, dtype: torch.dtype, head_dim: int | None = None,
                                  kernel: str = "flash") -> str | None:
    """Why attention by row lengths (ByLengths) in this kernel cannot run here, or None.
    flash-attention's kernel wants an NVIDIA GPU from Ampere on, float16 or bfloat16, and
    heads of a multiple of 8 up to 256 wide (head_dim None: not asked, Whisper's are 64);
    ours Triton's, as asr/triton_ops.unavailable says."""
    if kernel == "triton":
        return triton_ops.unavailable(device, dtype, 64 if head_dim is None else head_dim)
    if device.type != "cuda":
        return f"it needs a CUDA device, not {device.type}"
    if torch.version.hip is not None:
        return "it has not been tried on ROCm"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attention computes in float16 or bfloat16, not {str(dtype).removeprefix('torch.')}"
    if not torch.backends.cuda.is_flash_attention_available():
        return "this build of PyTorch has no flash-attention kernel"
    if (capability := torch.cuda.get_device_capability(device)) < (8, 0):
        return f"flash-attention needs a GPU of compute capability 8.0 or later, not {capability[0]}.{capability[1]}"
    if head_dim is not None and (head_dim % 8 or head_dim > 256):
        return f"flash-attention takes heads of a multiple of 8 up to 256 wide, not {head_dim}"
    return None


# flash-attention's kernel for rows of their own lengths (CUDA only); tests put a CPU copy of its semantics here.
flash_varlen = torch.ops.aten._flash_attention_forward


@dataclass
class ByLengths:
    """Self-attention over a static cache told each row's length, not masked: the kernel reads
    only the keys a row has, where masked attention reads the whole window. flash-attention's
    kernel for rows of their own lengths (on an H200 at large-v3's shapes, batch 1, 7.5 us
    and 4.2 for its combining kernel against cuDNN's 13 masked; docs/gpu-check-2026-11-30-h200.md),
    or ours in Triton (asr/triton_ops.py). The cache [2, B, H, C, Dh] is read in
    place; the queries [n, q, H * Dh] are the projection's own layout, and so is the output.
    The cross-attention goes by the same kernel (cross). Made once a pass, for every layer."""

    starts_q: Tensor  # [n + 1] int32: where each row's queries start among the n * q
    starts_k: Tensor  # [n + 1] int32: where each row's keys start, in positions of the cache seen as flash reads it
    used: Tensor  # [n] int32: each row's keys, up to its last query's position
    capacity: int
    window: int
    kernel: str = "flash"  # LENGTHS_KERNELS

    @classmethod
    def of(cls, positions: Tensor, heads: int, capacity: int, window: int, kernel: str = "flash") -> "ByLengths":
        n, q = positions.shape
        rows = torch.arange(n + 1, dtype=torch.int32, device=positions.device)
        used = (positions[:, -1] + 1).clamp(max=window).to(torch.int32)
        return cls(rows * q, rows * (heads * capacity), used, capacity, window, kernel)

    def __call__(self, query: Tensor, kv: Tensor) -> Tensor:
        """query [n, q, H * Dh], kv a layer's cache: the attention's output [n, q, H * Dh]. Query i
        of a row sees the keys up to its own position (used - q + i: the kernel's causal mask
        meets the last key at the last query)."""
        n, q, width = query.shape
        heads, head_dim = kv.shape[2], kv.shape[4]
        if self.kernel == "triton":
            return triton_ops.decode_attention(query.view(n, q, heads, head_dim), kv[0], kv[1], self.used,
                                               True).view(n, q, width)
        # flash-attention's kernel: each row of the cache a sequence whose positions lie Dh apart and
        # heads C * Dh apart, the rows H * C positions apart.
        if not kv.is_contiguous():  # the strides below would read other entries
            raise ValueError("attention by row lengths reads a cache laid out [2, B, H, C, Dh], contiguous")
        # Spans the cache up to the last row's first head's C positions, all its heads reached by stride.
        extent = ((n - 1) * heads + 1) * self.capacity
        keys, values = (torch.as_strided(kv[j], (extent, heads, head_dim), (head_dim, self.capacity * head_dim, 1))
                        for j in (0, 1))
        out = flash_varlen(query.view(n * q, heads, head_dim), keys, values, self.starts_q, self.starts_k, q, self.window,
                           0.0, True, False, seqused_k=self.used)[0]
        return out.view(n, q, width)

    def cross(self, query: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        """The cross-attention of query [n, q, H * Dh] over every frame of keys and values [n, H,
        frames, Dh]: [n, q, H * Dh], by our kernel, or by PyTorch's (flash's: cuDNN is off)."""
        n, q, width = query.shape
        heads, head_dim = keys.shape[1], keys.shape[3]
        if self.kernel == "triton":
            return triton_ops.decode_attention(query.view(n, q, heads, head_dim), keys, values, None,
                                               False).view(n, q, width)
        out = F.scaled_dot_product_attention(query.view(n, q, heads, head_dim).transpose(1, 2), keys, values)
        return out.transpose(1, 2).reshape(n, q, width)


@dataclass
class KVCache:
    """Per layer: self-attention K and V in one tensor [2, B, H, capacity, Dh] (a step
    writes both in one operation); cross-attention K/V [B, H, frames, Dh], computed once
    per window from the encoder output."""

    self_kv: list[Tensor]
    cross_k: list[Tensor]
    cross_v: list[Tensor]
    # Where cross_k/cross_v are another cache's (empty_cache's or new_cache's cross_from): that
    # cache, and the layer of it each of ours is. Filling that cache's rows fills ours.
    cross_from: "KVCache | None" = None
    cross_layers: list[int] | None = None

    @property
    def capacity(self) -> int:
        return self.self_kv[0].shape[3]

    def select(self, rows: Tensor, cross_from: "KVCache | None" = None) -> "KVCache":
        """A cache of these rows only. One sharing another's cross-attention K/V takes them
        from cross_from, that cache's selection."""
        def pick(tensors: list[Tensor], dim: int = 0) -> list[Tensor]:
            return [t.index_select(dim, rows) for t in tensors]

        if self.cross_from is None:
            return KVCache(pick(self.self_kv, 1), pick(self.cross_k), pick(self.cross_v))
        return KVCache(pick(self.self_kv, 1), [cross_from.cross_k[i] for i in self.cross_layers],
                       [cross_from.cross_v[i] for i in self.cross_layers], cross_from, self.cross_layers)

    def copy_rows(self, source: "KVCache", rows: Tensor, count: int) -> None:
        """Copies source's rows (indices [count]) into this cache's first `count` rows; a
        cache sharing another's cross-attention K/V gets them when that one is copied."""
        for a, b in zip(self.self_kv, source.self_kv):
            a[:, :count].copy_(b.index_select(1, rows))
        if self.cross_from is None:
            for a, b in zip(self.cross_k + self.cross_v, source.cross_k + source.cross_v):
                a[:count].copy_(b.index_select(0, rows))


class DecoderRunner:
    """Runs a transformers `WhisperDecoder`'s weights over our own static cache."""

    def __init__(
        self, decoder: nn.Module, output_projection: Tensor, head_token_ids: Tensor | None = None, int8: bool = False
    ):
        """head_token_ids: for a draft whose output head covers only some tokens, the token
        id of each head row; logits of the other tokens come back as -inf.

        int8: run the linear maps with int8 weights (dynamic quantisation, CPU only): a
        draft's step is bound by reading its weights, and its proposals need not be exact."""
        self.decoder = decoder
        # The dtype the cross-attention keys and values are projected in (None: the decoder's),
        # kept in the decoder's: a CPU's bfloat16 encoder's (WhisperModel.cast_encoder), whose
        # output holds bfloat16 values (cast to the decoder's dtype and back exactly). Those
        # projections of 1,500 frames a window are compute-bound, unlike the decoder's steps;
        # their weights are cast per call, not held twice.
        self.cross_dtype: torch.dtype | None = None
        self.layers = list(decoder.layers)
        self.head_token_ids = head_token_ids
        self.vocab_size = decoder.embed_tokens.num_embeddings
        linear = int8_linear if int8 else fast_linear
        self._head = linear(output_projection, None)
        self._projections = [_Projections.of(layer, linear) for layer in self.layers]
        first = self.layers[0].self_attn
        self.num_heads = first.num_heads
        self.head_dim = first.head_dim
        self.max_positions = decoder.embed_positions.weight.shape[0]
        self.embed_scale = getattr(decoder, "embed_scale", 1.0)

    @property
    def cross_attention_width(self) -> int:
        return self.layers[0].encoder_attn.k_proj.in_features

    def _heads(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)

    def cross_layers_shared_with(self, other: "DecoderRunner") -> list[int] | None:
        """For each of this decoder's layers, the layer of `other` whose cross-attention key
        and value projections are the very same tensors (an early exit of `other`, or a
        draft distilled with them frozen), so that other's cross K/V can serve it too;
        None unless every layer has one."""
        def projections(layer: nn.Module) -> tuple:
            attention = layer.encoder_attn
            biases = (attention.k_proj.bias, attention.v_proj.bias)
            return (attention.k_proj.weight.data_ptr(), attention.v_proj.weight.data_ptr(),
                    *(None if b is None else b.data_ptr() for b in biases))

        index = {projections(layer): i for i, layer in enumerate(other.layers)}
        found = [index.get(projections(layer)) for layer in self.layers]
        return None if None in found else found

    def empty_cache(
        self, rows: int, frames: int, capacity: int, dtype: torch.dtype, device: torch.device,
        cross_from: KVCache | None = None, cross_layers: list[int] | None = None,
    ) -> KVCache:
        """An unfilled cache: stale self-attention entries are never read (each is written
        before anything attends to it), and cross-attention rows are filled per window
        (fill_cross). Unfilled rows are zeros, not uninitialised memory: fixed shapes compute
        empty slots too, and NaN there would reach their self-attention entries, which a
        later window's masked attention does not stop (NaN + -inf is NaN). cross_from: the
        cache of a runner sharing cross-attention K/V projections with this one
        (cross_layers: the layer of it each of ours shares, cross_layers_shared_with), whose
        cross-attention K/V serve this one too."""
        shape = (2, rows, self.num_heads, capacity, self.head_dim)
        if cross_from is not None:
            if cross_layers is None:
                raise ValueError("sharing another cache's cross-attention K/V needs the layers it comes from")
            cross_k, cross_v = [cross_from.cross_k[i] for i in cross_layers], [cross_from.cross_v[i] for i in cross_layers]
        else:
            cross_shape = (rows, self.num_heads, frames, self.head_dim)
            cross_k = [torch.zeros(cross_shape, dtype=dtype, device=device) for _ in self.layers]
            cross_v = [torch.zeros(cross_shape, dtype=dtype, device=device) for _ in self.layers]
        return KVCache(
            self_kv=[torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers],
            cross_k=cross_k,
            cross_v=cross_v,
            cross_from=cross_from,
            cross_layers=cross_layers if cross_from is not None else None,
        )

    @torch.inference_mode()
    def fill_cross(self, cache: KVCache, rows: Tensor, encoder_output: Tensor) -> None:
        """Computes the cross-attention K/V of encoder_output [n, frames, width] into the
        cache's rows [n] (once per window)."""
        dtype = self.cross_dtype or self.decoder.embed_tokens.weight.dtype
        encoder_output = encoder_output.to(dtype)

        def project(linear: nn.Linear, index: int) -> Tensor:
            if dtype == linear.weight.dtype == torch.float32:  # oneDNN's path where it pays (not in bfloat16)
                return self._heads(self._cross_maps[index](encoder_output))
            bias = None if linear.bias is None else linear.bias.to(dtype)
            return self._heads(F.linear(encoder_output, linear.weight.to(dtype), bias))

        # Made contiguous in the cache's dtype first, in one pass: index_copy_ from the heads' transposed
        # view took 3x as long on a CPU (6 against 2 ms for a batch of 8 windows of whisper-base).
        for i, (layer, k, v) in enumerate(zip(self.layers, cache.cross_k, cache.cross_v)):
            k.index_copy_(0, rows, project(layer.encoder_attn.k_proj, 2 * i).to(k.dtype, memory_format=torch.contiguous_format))
            v.index_copy_(0, rows, project(layer.encoder_attn.v_proj, 2 * i + 1).to(v.dtype, memory_format=torch.contiguous_format))

    @cached_property
    def _cross_maps(self) -> list[Linear]:
        """Each layer's cross-attention key and value maps (fill_cross), over the modules' own
        weights: at a window's 1,500 rows through oneDNN in float32 on a CPU, 1.9x F.linear's
        speed."""
        return [fast_linear(p.weight, p.bias, prepacked=False) for layer in self.layers
                for p in (layer.encoder_attn.k_proj, layer.encoder_attn.v_proj)]

    def copy_cross(self, cache: KVCache, rows: Tensor, cross: list[tuple[list[Tensor], list[Tensor]]]) -> None:
        """Writes cross-attention K/V computed elsewhere (per row: K and V per layer) into
        the cache's rows [n]."""
        for layer, (k, v) in enumerate(zip(cache.cross_k, cache.cross_v)):
            k.index_copy_(0, rows, torch.stack([keys[layer] for keys, _ in cross]))
            v.index_copy_(0, rows, torch.stack([values[layer] for _, values in cross]))

    def new_cache(
        self, encoder_output: Tensor, capacity: int, cross_from: KVCache | None = None, cross_layers: list[int] | None = None
    ) -> KVCache:
        """A cache for these rows of encoder output (see empty_cache)."""
        rows, frames = encoder_output.shape[:2]
        cache = self.empty_cache(rows, frames, capacity, encoder_output.dtype, encoder_output.device, cross_from, cross_layers)
        if cross_from is None:
            self.fill_cross(cache, torch.arange(rows, device=encoder_output.device), encoder_output)
        return cache

    @torch.inference_mode()
    def cross_attention_scores(self, tokens: Tensor, encoder_output: Tensor,
                               layers: set[int]) -> tuple[Tensor, dict[int, Tensor]]:
        """One eager pass over tokens [1, q] from position 0 (word alignment, asr/words.py):
        the logits [1, q, V] and, for these layers, the cross-attention scores before the
        softmax [1, H, q, frames]."""
        cache = self.new_cache(encoder_output, capacity=-(-tokens.shape[1] // 16) * 16)
        scores: dict[int, Tensor] = {}
        start = torch.zeros(1, dtype=torch.long, device=tokens.device)
        with attention_without_cudnn(tokens.device):  # a new width nearly every window
            return self._pass(tokens, start, cache, None, None, None, (layers, scores)), scores

    def fused_unavailable(self) -> str | None:
        """Why this decoder's layers cannot run fused (forward's fused), or None: besides
        Triton's needs (asr/triton_ops.unavailable), the kernel's GELU is the exact one."""
        weight = self.decoder.embed_tokens.weight
        if reason := triton_ops.unavailable(weight.device, weight.dtype):
            return reason
        activation = getattr(self.decoder.config, "activation_function", None)
        return None if activation == "gelu" else f"the fused kernel computes GELU, not {activation}"

    @torch.no_grad()  # not inference_mode: a step compiled whole traces through this, and Dynamo cannot enter it
    def forward(
        self, tokens: Tensor, start: Tensor, cache: KVCache, logits_at: Tensor | None = None,
        window: int | None = None, rows: Tensor | None = None, by_lengths: bool | str = False, fused: bool = False,
    ) -> Tensor:
        """tokens [n, q] placed at positions start[b] .. start[b]+q-1 of each row.
        Returns logits [n, m, V] at the query indices logits_at [n, m] (all q if None).

        rows [n]: the cache rows the tokens belong to (default: all, n = the cache's rows).
        window: attend over the cache's first `window` positions (every row's last position
        must lie below it), a shape fitted to the data that the caller knows; None: over its
        whole capacity. A mask hides each row's positions past its own; with one row and one
        token, the window is exactly what it attends to and no mask is needed. Nothing here
        reads a value back to the host or shapes a tensor by one, so the pass can be
        captured as a CUDA graph. Positions past the decoder's last (proposals never kept)
        take the last position's embedding. by_lengths: self-attention told each row's
        length instead of masked (ByLengths; CUDA only, lengths_attention_unavailable), for
        passes over all the cache's rows: True or "flash" by flash-attention's kernel,
        "triton" by ours (lengths_kernel). fused: each linear map with the layer norm before it
        and the GELU or residual add after it in one kernel of ours (asr/triton_ops.fused_linear;
        CUDA, fused_unavailable), in passes of up to triton_ops.FUSED_ROWS tokens."""
        return self._pass(tokens, start, cache, logits_at, window, rows, by_lengths=by_lengths, fused=fused)

    def _pass(self, tokens: Tensor, start: Tensor, cache: KVCache, logits_at: Tensor | None, window: int | None,
              rows: Tensor | None, scores: tuple[set[int], dict[int, Tensor]] | None = None,
              by_lengths: bool | str = False, fused: bool = False) -> Tensor:
        batch, q = tokens.shape
        positions = start[:, None] + torch.arange(q, device=tokens.device)  # [n, q]
        attended = cache.capacity if window is None else window
        mask = lengths = None
        if by_lengths:
            if rows is not None or scores is not None:
                raise ValueError("attention by row lengths reads every row of the cache, not some, and keeps no scores")
            lengths = ByLengths.of(positions, self.num_heads, cache.capacity, attended, lengths_kernel(by_lengths))
        elif window is None or batch > 1 or q > 1:
            # Additive, in the model's dtype, made once for every layer (SDPA would convert a
            # boolean mask in each call).
            keys = torch.arange(attended, device=tokens.device)
            dtype = self.decoder.embed_tokens.weight.dtype
            mask = torch.full((batch, 1, q, attended), float("-inf"), dtype=dtype, device=tokens.device)
            mask.masked_fill_((keys[None, None, :] <= positions[:, :, None])[:, None], 0.0)
        where = torch.arange(batch, device=tokens.device) if rows is None else rows
        where = where[:, None].expand(batch, q)

        def rows_of(tensor: Tensor) -> Tensor:
            return tensor if rows is None else tensor.index_select(0, rows)

        embedded = F.embedding(positions.clamp(max=self.max_positions - 1), self.decoder.embed_positions.weight)
        x = self.decoder.embed_tokens(tokens) * self.embed_scale + embedded
        width = self.num_heads * self.head_dim
        fused = fused and batch * q <= triton_ops.FUSED_ROWS  # a prefill, a long catch-up: PyTorch's

        def normed(x: Tensor, norm: nn.LayerNorm, linear: Linear, activation: Callable | None = None) -> Tensor:
            if fused:
                return triton_ops.fused_linear(x, linear.weight, linear.bias, norm.weight, norm.bias, norm.eps,
                                               activation is not None, None)
            h = linear(norm(x))
            return h if activation is None else activation(h)

        def added(x: Tensor, out: Tensor, linear: Linear) -> Tensor:
            if fused:
                return triton_ops.fused_linear(out, linear.weight, linear.bias, None, None, 0.0, False, x)
            return x + linear(out)

        # The keys and values written by the fused kernel itself, but not in a step compiled whole: a
        # custom operator that writes its input is one torch.compile would copy the cache around.
        to_cache = fused and not torch.compiler.is_compiling()
        # Laid out once for every layer (one row's index is an expanded view, whose copy would be a kernel a layer).
        cache_rows, cache_positions = ((where.reshape(-1).contiguous(), positions.reshape(-1).contiguous()) if to_cache
                                       else (None, None))
        for i, (layer, project) in enumerate(zip(self.layers, self._projections)):
            if to_cache:
                norm = layer.self_attn_layer_norm
                query = triton_ops.fused_qkv(x, project.qkv.weight, project.qkv.bias, norm.weight, norm.bias, norm.eps,
                                             cache.self_kv[i], cache_rows, cache_positions)
            else:
                qkv = normed(x, layer.self_attn_layer_norm, project.qkv)
                query = qkv[..., :width]
                # K and V [2, n, q, H, Dh], written at (row, position) of the cache seen as
                # [2, B, capacity, H, Dh]: one operation, no copy of K and V beforehand
                new = qkv[..., width:].view(batch, q, 2, self.num_heads, self.head_dim).permute(2, 0, 1, 3, 4)
                cache.self_kv[i].transpose(2, 3)[:, where, positions] = new
            if lengths is not None:
                out = lengths(query, cache.self_kv[i])
            else:
                keys = rows_of(cache.self_kv[i][0, :, :, :attended])
                values = rows_of(cache.self_kv[i][1, :, :, :attended])
                out = F.scaled_dot_product_attention(self._heads(query), keys, values, attn_mask=mask)
                out = out.transpose(1, 2).reshape(batch, q, -1)
            x = added(x, out, project.out)

            cross_query = normed(x, layer.encoder_attn_layer_norm, project.cross_q)
            if lengths is not None:
                out = lengths.cross(cross_query, cache.cross_k[i], cache.cross_v[i])
            else:
                cross_query = self._heads(cross_query)
                if scores is not None and i in scores[0]:
                    keys = rows_of(cache.cross_k[i]).float().transpose(-1, -2)  # float32: fp16/bf16 blur near-ties
                    scores[1][i] = cross_query.float() @ keys * self.head_dim**-0.5
                out = F.scaled_dot_product_attention(cross_query, rows_of(cache.cross_k[i]), rows_of(cache.cross_v[i]))
                out = out.transpose(1, 2).reshape(batch, q, -1)
            x = added(x, out, project.cross_out)
            x = added(x, normed(x, layer.final_layer_norm, project.fc1, layer.activation_fn), project.fc2)

        if logits_at is not None:
            x = x.gather(1, logits_at[:, :, None].expand(-1, -1, x.shape[-1]))
        logits = normed(x, self.decoder.layer_norm, self._head)
        if self.head_token_ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.head_token_ids, logits)


@dataclass(frozen=True, eq=False)
class Linear:
    """x @ weight.T + bias (then the GELU where made so), plus `added` where given, by `run`;
    the weight and bias kept for a kernel that fuses the map with what comes before and after
    it (asr/triton_ops.fused_linear)."""

    weight: Tensor
    bias: Tensor | None
    run: Callable[[Tensor, Tensor | None], Tensor]

    def __call__(self, x: Tensor, added: Tensor | None = None) -> Tensor:
        return self.run(x, added)


def fast_linear(weight: Tensor, bias: Tensor | None, gelu: bool = False, prepacked: bool = True) -> Linear:
    """x @ weight.T + bias (then the exact GELU, as Whisper's, where gelu), plus `added` (of the
    output's shape and dtype). On a CPU in float32, or bfloat16 where oneDNN takes it,
    through oneDNN with the GELU or the addition fused: the default BLAS path is slower at
    one row (a target-only step) as at the few rows of verifying, most of all at the output
    head's 51,865 rows (one row through it took most of a whisper-base target-only step),
    and in float32 at an encoder's 1,500 rows (2-2.6x, whisper-base's maps; in bfloat16
    about level). prepacked: the weight reordered once into oneDNN's layout, a second copy
    of it (a step's few rows need it; the encoder's compute-bound maps were ~4 % slower
    without it, and keep no copy). Elsewhere (GPU, float16, float64): plain F.linear."""

    def plain(x: Tensor, added: Tensor | None) -> Tensor:
        y = F.linear(x, weight, bias)
        y = F.gelu(y) if gelu else y
        return y if added is None else added + y

    if weight.device.type == "cpu" and torch.backends.mkldnn.is_available() and (
            weight.dtype == torch.float32
            or weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None) if prepacked else weight.detach()

            def run(x: Tensor, added: Tensor | None) -> Tensor:
                if torch.compiler.is_compiling() or (gelu and added is not None):  # Inductor packs its own
                    return plain(x, added)
                flat = x.reshape(-1, x.shape[-1])
                if added is None:  # algorithm "none": the exact GELU, not tanh's
                    y = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "gelu" if gelu else "none", [],
                                                           "none" if gelu else "")
                else:
                    y = torch.ops.mkldnn._linear_pointwise.binary(flat, added.reshape(len(flat), -1), packed, bias, "add")
                return y.view(*x.shape[:-1], -1)

            for rows in (1, 2):  # an unsupported build fails here, not mid-decode
                zeros = weight.new_zeros(rows, weight.shape[1])
                run(zeros, None if gelu else run(zeros, None))
            return Linear(weight, bias, run)
        except (RuntimeError, AttributeError):
            pass
    return Linear(weight, bias, plain)


def int8_linear(weight: Tensor, bias: Tensor | None) -> Linear:
    """x @ weight.T + bias with the weight quantised to int8 per output row and the input
    quantised on the fly (fbgemm's dynamic linear): a quarter of the float32 weight's
    memory traffic. Falls back to fast_linear off the CPU, in other dtypes, or where this
    build has no quantised engine."""
    if weight.device.type == "cpu" and weight.dtype == torch.float32:
        try:
            w = weight.detach()
            scales = (w.abs().amax(1).clamp(min=1e-8) / 127).double()
            with warnings.catch_warnings():
                # Quantised tensors are deprecated, with no CPU replacement as fast on AVX2 yet
                # (aten's weight-only int8 matmul was slower than float32 on an AVX2 CPU).
                warnings.filterwarnings("ignore", message=".*quantized tensor creation.*")
                quantised = torch.quantize_per_channel(w, scales, torch.zeros(len(w), dtype=torch.long), 0, torch.qint8)
            packed = torch.ops.quantized.linear_prepack(quantised, None if bias is None else bias.detach())

            def run(x: Tensor, added: Tensor | None) -> Tensor:
                if torch.compiler.is_compiling():  # quantised ops do not trace: the float weight
                    y = F.linear(x, weight, bias)
                else:
                    flat = x.reshape(-1, x.shape[-1])
                    y = torch.ops.quantized.linear_dynamic(flat, packed, True).view(*x.shape[:-1], -1)
                return y if added is None else added + y

            run(weight.new_zeros(2, weight.shape[1]), None)  # an unsupported build fails here, not mid-decode
            return Linear(weight, bias, run)
        except (RuntimeError, AttributeError):
            pass
    return fast_linear(weight, bias)


@dataclass
class _Projections:
    """One decoder layer's linear maps, self-attention's query, key and value fused into one
    (cross-attention K/V are computed once per window, from the layer's own modules, by
    fill_cross)."""

    qkv: Linear
    out: Linear
    cross_q: Linear
    cross_out: Linear
    fc1: Linear
    fc2: Linear

    @classmethod
    def of(cls, layer: nn.Module, linear: Callable[[Tensor, Tensor | None], Linear] = fast_linear) -> "_Projections":
        def wrap(module: nn.Linear) -> Linear:
            return linear(module.weight, module.bias)

        attn, cross = layer.self_attn, layer.encoder_attn
        return cls(fuse_qkv(attn, linear), wrap(attn.out_proj), wrap(cross.q_proj), wrap(cross.out_proj),
                   wrap(layer.fc1), wrap(layer.fc2))


def fuse_qkv(attention: nn.Module, linear: Callable[[Tensor, Tensor | None], Linear]) -> Linear:
    """One matrix product for query, key and value. The module's three weights become views
    of the fused one, so they are not held beside it, and stay the module's own and of their
    kind: made in inference mode, ordinary weights became inference tensors that could never
    be trained again (and inference weights refuse an ordinary tensor)."""
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    with torch.inference_mode(attention.q_proj.weight.is_inference()), torch.no_grad():
        weight = torch.cat([p.weight for p in projections])
        biases = [p.bias if p.bias is not None else weight.new_zeros(p.out_features) for p in projections]
        for p, part in zip(projections, weight.split([p.out_features for p in projections])):
            p.weight.data = part
        return linear(weight, torch.cat(biases))
