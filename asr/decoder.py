"""Inference over a static KV cache for a Whisper decoder (target or draft).

Each row of a batch keeps its own length: the caller passes where each row's new tokens
start, the runner writes their keys/values there and attends only to what lies before.
Entries past a row's length are stale, never read, and overwritten later: that is how
rejected draft tokens are rolled back, by moving a position rather than copying.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class KVCache:
    """Per layer: self-attention K/V [B, H, capacity, Dh]; cross-attention K/V
    [B, H, frames, Dh], computed once per window from the encoder output."""

    self_k: list[Tensor]
    self_v: list[Tensor]
    cross_k: list[Tensor]
    cross_v: list[Tensor]
    # Where cross_k/cross_v are another cache's (DecoderRunner.new_cache's cross_from):
    # that cache, and the layer of it each of ours is.
    cross_from: "KVCache | None" = None
    cross_layers: list[int] | None = None

    @property
    def capacity(self) -> int:
        return self.self_k[0].shape[2]

    def keep_rows(self, rows: Tensor) -> None:
        """Drops finished rows so they stop costing work (a copy, once per finished row). A
        cache sharing another's cross-attention K/V takes them again from it, so that one
        must be cut first."""
        shared = self.cross_from is not None
        owned = (self.self_k, self.self_v) if shared else (self.self_k, self.self_v, self.cross_k, self.cross_v)
        for tensors in owned:
            tensors[:] = [t.index_select(0, rows) for t in tensors]
        if shared:
            self.cross_k[:] = [self.cross_from.cross_k[i] for i in self.cross_layers]
            self.cross_v[:] = [self.cross_from.cross_v[i] for i in self.cross_layers]


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

    @torch.inference_mode()
    def new_cache(
        self, encoder_output: Tensor, capacity: int, cross_from: KVCache | None = None, cross_layers: list[int] | None = None
    ) -> KVCache:
        """cross_from: the cache of a runner sharing cross-attention K/V projections with
        this one (cross_layers: the layer of it each of ours shares, cross_layers_shared_with)
        over the same encoder output, whose cross-attention K/V are reused rather than
        computed again."""
        batch = encoder_output.shape[0]
        dtype, device = encoder_output.dtype, encoder_output.device
        shape = (batch, self.num_heads, capacity, self.head_dim)
        if cross_from is not None:
            if cross_layers is None:
                raise ValueError("sharing another cache's cross-attention K/V needs the layers it comes from")
            cross_k, cross_v = [cross_from.cross_k[i] for i in cross_layers], [cross_from.cross_v[i] for i in cross_layers]
        else:
            cross_k, cross_v = [], []
            for layer in self.layers:
                cross_k.append(self._heads(layer.encoder_attn.k_proj(encoder_output)).contiguous())
                cross_v.append(self._heads(layer.encoder_attn.v_proj(encoder_output)).contiguous())
        return KVCache(
            self_k=[torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers],
            self_v=[torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers],
            cross_k=cross_k,
            cross_v=cross_v,
            cross_from=cross_from,
            cross_layers=cross_layers if cross_from is not None else None,
        )

    @torch.inference_mode()
    def forward(
        self, tokens: Tensor, start: Tensor, cache: KVCache, logits_at: Tensor | None = None, static: bool = False
    ) -> Tensor:
        """tokens [B, q] placed at positions start[b] .. start[b]+q-1 of each row.
        Returns logits [B, m, V] at the query indices logits_at [B, m] (all q if None).

        static: attend over the cache's whole capacity under a mask built on the device and
        check nothing on the host, so that no value is read back and shapes depend only on
        the arguments' shapes (what CUDA graph capture needs, asr/graphs.py). The caller
        keeps positions within the capacity; positions past the decoder's last (which
        asr/graphs.py never keeps) take the last position's embedding."""
        batch, q = tokens.shape
        offsets = torch.arange(q, device=tokens.device)
        positions = start[:, None] + offsets  # [B, q]
        embedded = positions
        if static:
            attended = cache.capacity
            keys = torch.arange(attended, device=tokens.device)
            mask = (keys[None, None, :] <= positions[:, :, None])[:, None]
            embedded = positions.clamp(max=self.max_positions - 1)
        else:
            attended = int(start.max()) + q
            if attended > cache.capacity or attended > self.max_positions:
                raise ValueError(f"decoder input reaches position {attended}, past the limit")
            # Key j is visible to the query at position p when j <= p; None lets SDPA skip masking.
            mask = None
            if q > 1 or bool((start != start[0]).any()):
                keys = torch.arange(attended, device=tokens.device)
                mask = (keys[None, None, :] <= positions[:, :, None])[:, None]

        x = self.decoder.embed_tokens(tokens) * self.embed_scale + self.decoder.embed_positions.weight[embedded]
        rows = torch.arange(batch, device=tokens.device)[:, None].expand(batch, q)
        for i, (layer, project) in enumerate(zip(self.layers, self._projections)):
            h = layer.self_attn_layer_norm(x)
            query = self._heads(project.q(h))
            k_new = project.k(h).view(batch, q, self.num_heads, self.head_dim)
            v_new = project.v(h).view(batch, q, self.num_heads, self.head_dim)
            cache.self_k[i][rows, :, positions] = k_new
            cache.self_v[i][rows, :, positions] = v_new
            keys = cache.self_k[i][:, :, :attended]
            values = cache.self_v[i][:, :, :attended]
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask)
            x = x + project.out(out.transpose(1, 2).reshape(batch, q, -1))

            h = layer.encoder_attn_layer_norm(x)
            out = F.scaled_dot_product_attention(self._heads(project.cross_q(h)), cache.cross_k[i], cache.cross_v[i])
            x = x + project.cross_out(out.transpose(1, 2).reshape(batch, q, -1))

            h = layer.final_layer_norm(x)
            x = x + project.fc2(layer.activation_fn(project.fc1(h)))

        if logits_at is not None:
            x = x.gather(1, logits_at[:, :, None].expand(-1, -1, x.shape[-1]))
        return self._project(self.decoder.layer_norm(x))

    def _project(self, hidden: Tensor) -> Tensor:
        logits = self._head(hidden)
        if self.head_token_ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.head_token_ids] = logits
        return full


Linear = Callable[[Tensor], Tensor]


def fast_linear(weight: Tensor, bias: Tensor | None) -> Linear:
    """x @ weight.T + bias. On CPU in float32, one row goes through the default BLAS
    (its matrix-vector path is the fastest here) and several rows through oneDNN with a
    pre-packed weight, which the default BLAS path is much slower at for the few rows of
    verifying; elsewhere (GPU, float64) it is plain F.linear."""
    if weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available():
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

            def run(x: Tensor) -> Tensor:
                flat = x.reshape(-1, x.shape[-1])
                if flat.shape[0] == 1:
                    return F.linear(x, weight, bias)
                return torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "").view(*x.shape[:-1], -1)

            run(weight.new_zeros(2, weight.shape[1]))  # an unsupported build fails here, not mid-decode
            return run
        except (RuntimeError, AttributeError):
            pass
    return lambda x: F.linear(x, weight, bias)


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

            def run(x: Tensor) -> Tensor:
                flat = x.reshape(-1, x.shape[-1])
                return torch.ops.quantized.linear_dynamic(flat, packed, True).view(*x.shape[:-1], -1)

            run(weight.new_zeros(2, weight.shape[1]))  # an unsupported build fails here, not mid-decode
            return run
        except (RuntimeError, AttributeError):
            pass
    return fast_linear(weight, bias)


@dataclass
class _Projections:
    """One decoder layer's linear maps (cross-attention K/V are computed once per window
    by the layer's own modules, over 1,500 rows, where the default path is faster)."""

    q: Linear
    k: Linear
    v: Linear
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
        return cls(wrap(attn.q_proj), wrap(attn.k_proj), wrap(attn.v_proj), wrap(attn.out_proj),
                   wrap(cross.q_proj), wrap(cross.out_proj), wrap(layer.fc1), wrap(layer.fc2))
