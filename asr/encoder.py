"""The audio encoder: a transformers `WhisperEncoder`'s weights run by our own forward, over a
30 s window's 3,000 frames or fewer (an even number: whisper.cpp's audio_ctx, for short audio).

Its linear maps are the decoder's (fast_linear) over the module's own weights (no copy): on
a CPU through oneDNN, the GELU and the residual additions fused into them; query, key and
value in one matrix product, attended over as views of it. transformers' layers run the maps
through the default BLAS, copy the query, key, value and the attention's output to
contiguous tensors and scale the query in a pass of their own: their encoder took 1.54x as
long as this one on whisper-base in float32 on a 2-core CPU, 1.04x in bfloat16, where
attention is most of the time (`python scripts/benchmark_encoder.py --windows 4 --repeats 3
--dtypes float32,bfloat16`, README's Speed)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from asr.decoder import Linear, fast_linear, fuse_qkv

linear = partial(fast_linear, prepacked=False)  # 1,500 rows: a second copy of the weights would gain ~4 %


@dataclass(frozen=True)
class _Layer:
    attention_norm: nn.Module
    qkv: Linear
    out: Linear
    feed_forward_norm: nn.Module
    fc1: Linear  # the GELU fused
    fc2: Linear
    heads: int


class EncoderRunner:
    """Runs an encoder's weights (read where they are: changed in place, they are used as
    changed); made again for another dtype or device (WhisperModel.encode)."""

    def __init__(self, encoder: nn.Module):
        if encoder.config.activation_function != "gelu":
            raise ValueError(f"a Whisper encoder's activation is GELU, not {encoder.config.activation_function!r}")
        self.encoder = encoder
        self.weights = (encoder.conv1.weight.dtype, encoder.conv1.weight.device)
        self.max_frames = 2 * encoder.config.max_source_positions
        self.layers = [
            _Layer(layer.self_attn_layer_norm, fuse_qkv(layer.self_attn, linear),
                   linear(layer.self_attn.out_proj.weight, layer.self_attn.out_proj.bias), layer.final_layer_norm,
                   linear(layer.fc1.weight, layer.fc1.bias, gelu=True), linear(layer.fc2.weight, layer.fc2.bias),
                   layer.self_attn.num_heads)
            for layer in encoder.layers
        ]

    @torch.inference_mode()
    def __call__(self, features: Tensor) -> Tensor:
        """features [B, mels, frames] -> [B, frames / 2, width], at the first frames / 2 positions."""
        if features.shape[-1] > self.max_frames or features.shape[-1] % 2:
            raise ValueError(f"the encoder takes an even number of frames up to {self.max_frames}, "
                             f"not {features.shape[-1]}")
        encoder = self.encoder
        hidden = F.gelu(encoder.conv2(F.gelu(encoder.conv1(features)))).permute(0, 2, 1)
        hidden = hidden + encoder.embed_positions.weight[: hidden.shape[1]]
        batch, frames, width = hidden.shape
        for layer in self.layers:
            q, k, v = layer.qkv(layer.attention_norm(hidden)).view(batch, frames, 3, layer.heads, -1).permute(2, 0, 3, 1, 4)
            # SDPA's default scale, head_dim ** -0.5, is Whisper's query scaling (0.125: a power of
            # two, applied to the products rather than the query, equal up to rounding).
            attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, frames, width)
            hidden = layer.out(attended, hidden)
            hidden = layer.fc2(layer.fc1(layer.feed_forward_norm(hidden)), hidden)
            if hidden.dtype == torch.float16:  # as transformers' layer: an overflow stays finite
                limit = torch.finfo(torch.float16).max - 1000
                hidden = hidden.clamp(-limit, limit)
        return encoder.layer_norm(hidden)
