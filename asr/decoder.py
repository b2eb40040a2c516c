"""Inference over a static KV cache for a Whisper decoder (target or draft).

Each row of a batch keeps its own length: the caller passes where each row's new tokens
start, the runner writes their keys/values there and attends only to what lies before.
Entries past a row's length are stale, never read, and overwritten later: that is how
rejected draft tokens are rolled back, by moving a position rather than copying.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def capacity(self) -> int:
        return self.self_k[0].shape[2]

    def keep_rows(self, rows: Tensor) -> None:
        """Drops finished rows so they stop costing work (a copy, once per finished row)."""
        for tensors in (self.self_k, self.self_v, self.cross_k, self.cross_v):
            tensors[:] = [t.index_select(0, rows) for t in tensors]


class DecoderRunner:
    """Runs a transformers `WhisperDecoder`'s weights over our own static cache."""

    def __init__(self, decoder: nn.Module, output_projection: Tensor, head_token_ids: Tensor | None = None):
        """head_token_ids: for a draft whose output head covers only some tokens, the token
        id of each head row; logits of the other tokens come back as -inf."""
        self.decoder = decoder
        self.layers = list(decoder.layers)
        self.output_projection = output_projection  # [V or len(head_token_ids), D]
        self.head_token_ids = head_token_ids
        self.vocab_size = decoder.embed_tokens.num_embeddings
        # On CPU, BLAS reads a [D, V] copy fastest for one row and the [V, D] original
        # fastest for several (2x each way, measured: scripts/benchmark.py --head); a GPU needs neither.
        self._projection_rows = output_projection.t().contiguous() if output_projection.device.type == "cpu" else None
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

    @torch.inference_mode()
    def new_cache(self, encoder_output: Tensor, capacity: int, cross_from: KVCache | None = None) -> KVCache:
        """cross_from: a cache of a runner with these very weights over the same encoder
        output, whose cross-attention K/V are reused rather than computed again."""
        batch = encoder_output.shape[0]
        dtype, device = encoder_output.dtype, encoder_output.device
        shape = (batch, self.num_heads, capacity, self.head_dim)
        if cross_from is not None:
            cross_k, cross_v = list(cross_from.cross_k), list(cross_from.cross_v)
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
        )

    @torch.inference_mode()
    def forward(self, tokens: Tensor, start: Tensor, cache: KVCache, logits_at: Tensor | None = None) -> Tensor:
        """tokens [B, q] placed at positions start[b] .. start[b]+q-1 of each row.
        Returns logits [B, m, V] at the query indices logits_at [B, m] (all q if None)."""
        batch, q = tokens.shape
        offsets = torch.arange(q, device=tokens.device)
        positions = start[:, None] + offsets  # [B, q]
        attended = int(start.max()) + q
        if attended > cache.capacity or attended > self.max_positions:
            raise ValueError(f"decoder input reaches position {attended}, past the limit")
        # Key j is visible to the query at position p when j <= p; None lets SDPA skip masking.
        mask = None
        if q > 1 or bool((start != start[0]).any()):
            keys = torch.arange(attended, device=tokens.device)
            mask = (keys[None, None, :] <= positions[:, :, None])[:, None]

        x = self.decoder.embed_tokens(tokens) * self.embed_scale + self.decoder.embed_positions.weight[positions]
        rows = torch.arange(batch, device=tokens.device)[:, None].expand(batch, q)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.self_attn_layer_norm(x)
            query = self._heads(attn.q_proj(h))
            k_new = attn.k_proj(h).view(batch, q, self.num_heads, self.head_dim)
            v_new = attn.v_proj(h).view(batch, q, self.num_heads, self.head_dim)
            cache.self_k[i][rows, :, positions] = k_new
            cache.self_v[i][rows, :, positions] = v_new
            keys = cache.self_k[i][:, :, :attended]
            values = cache.self_v[i][:, :, :attended]
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask)
            x = x + attn.out_proj(out.transpose(1, 2).reshape(batch, q, -1))

            cross = layer.encoder_attn
            h = layer.encoder_attn_layer_norm(x)
            out = F.scaled_dot_product_attention(self._heads(cross.q_proj(h)), cache.cross_k[i], cache.cross_v[i])
            x = x + cross.out_proj(out.transpose(1, 2).reshape(batch, q, -1))

            h = layer.final_layer_norm(x)
            x = x + layer.fc2(layer.activation_fn(layer.fc1(h)))

        if logits_at is not None:
            x = x.gather(1, logits_at[:, :, None].expand(-1, -1, x.shape[-1]))
        return self._project(self.decoder.layer_norm(x))

    def _project(self, hidden: Tensor) -> Tensor:
        logits = self._project_head(hidden)
        if self.head_token_ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.head_token_ids] = logits
        return full

    def _project_head(self, hidden: Tensor) -> Tensor:
        if self._projection_rows is None:
            return F.linear(hidden, self.output_projection)
        batch, length, width = hidden.shape
        if batch * length == 1:
            return hidden @ self._projection_rows
        flat = hidden.reshape(batch * length, width)
        return (self.output_projection @ flat.t()).t().contiguous().view(batch, length, -1)
