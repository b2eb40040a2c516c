"""Tiny Whisper models with random weights, built so their logits are well separated
(random tiny models are otherwise full of near-ties), plus paths to real data.

Importing this needs torch and transformers only (a GPU machine without the audio
extras or the packaged weights runs the GPU tests); what needs more skips, saying why."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import copy
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import GenerationConfig, WhisperConfig, WhisperForCausalLM, WhisperForConditionalGeneration

from asr.models import packaged_directory

REPO = Path(__file__).resolve().parent.parent
# The dev recordings; ASR_DEV_SET points elsewhere (a GPU machine: scripts/gpu_check.py --dev).
DEV = Path(os.environ.get("ASR_DEV_SET") or REPO.parent / "shared" / "eval" / "dev")
SAMPLES = REPO / "samples"

EOT, SOT, EN, TRANSCRIBE, NO_TIMESTAMPS = 50257, 50258, 50259, 50359, 50363
# Control tokens never worth emitting (what the pipeline suppresses too).
SUPPRESS = [1, 2, 7, 8, 9, 10, 14, 25] + list(range(50258, 50363))
BEGIN_SUPPRESS = [220, EOT]
MAX_TARGET_POSITIONS = 64
FRAMES = 60  # mel frames per window of the tiny models
SPECIAL_TOKEN_IDS = dict(decoder_start_token_id=SOT, eos_token_id=EOT, pad_token_id=EOT, bos_token_id=EOT)


def tiny_config(d_model: int = 64, decoder_layers: int = 2, num_mel_bins: int = 80, vocab_size: int = 51865,
                frames: int = FRAMES, max_target_positions: int = MAX_TARGET_POSITIONS) -> WhisperConfig:
    return WhisperConfig(
        vocab_size=vocab_size,
        num_mel_bins=num_mel_bins,
        d_model=d_model,
        encoder_layers=2,
        decoder_layers=decoder_layers,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=2 * d_model,
        decoder_ffn_dim=2 * d_model,
        max_source_positions=frames // 2,
        max_target_positions=max_target_positions,
        tie_word_embeddings=False,
        **SPECIAL_TOKEN_IDS,
    )


@torch.no_grad()
def separate_logits(model: torch.nn.Module) -> None:
    """A sharp output head, an encoder that matters, and end-of-text that sometimes wins,
    so rows end at different lengths."""
    model.proj_out.weight.normal_(0, 1)
    model.model.decoder.embed_tokens.weight.normal_(0, 1)
    if getattr(model.model, "encoder", None) is not None:
        model.model.encoder.conv1.weight.mul_(8)  # content, not position, dominates the encoding
        model.model.encoder.layer_norm.weight.mul_(10)
    for layer in model.model.decoder.layers:
        layer.encoder_attn.out_proj.weight.mul_(4)


def tiny_target(seed: int, dtype: torch.dtype = torch.float64, **config) -> WhisperForConditionalGeneration:
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(tiny_config(**config))
    separate_logits(model)
    return model.to(dtype).eval()


@torch.no_grad()
def end_rows_at_different_lengths(model: WhisperForConditionalGeneration, features: torch.Tensor) -> None:
    """Random models rarely say end-of-text. Give end-of-text the output row of a token
    that some windows emit early and others late or never, scaled to win where it would."""
    from asr.decoder import DecoderRunner
    from asr.rules import DecodingRules
    from asr.speculative import SpeculativeDecoder

    rules = DecodingRules(vocab_size=model.config.vocab_size, eot=EOT, no_timestamps=NO_TIMESTAMPS,
                          suppress=SUPPRESS, begin_suppress=BEGIN_SUPPRESS, timestamps=False)
    encoded = model.model.encoder(features).last_hidden_state
    decoder = SpeculativeDecoder(DecoderRunner(model.model.decoder, model.proj_out.weight))
    rows = [s.tokens for s in decoder.decode(encoded, [[SOT, EN, 50359, NO_TIMESTAMPS]] * len(features), rules, max_new_tokens=30)]

    def spread(token: int) -> int:
        firsts = {row.index(token) if token in row else len(row) for row in rows}
        return len(firsts)

    candidates = {t for row in rows for t in row[6:24]}
    best = max(sorted(candidates), key=lambda t: (spread(t), min(r.index(t) if t in r else 99 for r in rows)))
    model.proj_out.weight[EOT] = 1.05 * model.proj_out.weight[best]


@torch.no_grad()
def perturbed(model: torch.nn.Module, noise: float, seed: int) -> torch.nn.Module:
    """A copy whose weights are jittered: it agrees with the original often, not always."""
    torch.manual_seed(seed)
    twin = copy.deepcopy(model)
    for p in twin.parameters():
        p.add_(noise * p.std() * torch.randn_like(p))
    return twin


@torch.no_grad()
def decoder_only_draft(target: WhisperForConditionalGeneration, noise: float, seed: int) -> WhisperForCausalLM:
    """A decoder-only draft (WhisperForCausalLM, as transformers loads distil-whisper's
    assistant) reading the target's encoder output: the target's decoder, jittered."""
    draft = WhisperForCausalLM(copy.deepcopy(target.config)).to(target.dtype).eval()
    source = perturbed(target, noise, seed)
    draft.model.decoder.load_state_dict(source.model.decoder.state_dict())
    draft.proj_out.load_state_dict(source.proj_out.state_dict())
    return draft


def generation_config(timestamps: bool, max_new_tokens: int) -> GenerationConfig:
    return GenerationConfig(
        **SPECIAL_TOKEN_IDS,
        no_timestamps_token_id=NO_TIMESTAMPS,
        suppress_tokens=SUPPRESS,
        begin_suppress_tokens=BEGIN_SUPPRESS,
        max_initial_timestamp_index=50,
        lang_to_id={"<|en|>": EN},
        task_to_id={"transcribe": TRANSCRIBE, "translate": 50358},
        is_multilingual=True,
        return_timestamps=timestamps,
        max_new_tokens=max_new_tokens,
        do_sample=False,
    )


def packaged_weights() -> Path:
    """The packaged whisper-base directory; skips the calling test where it is not installed."""
    try:
        return packaged_directory("whisper-base")[0]
    except FileNotFoundError as error:
        pytest.skip(f"the packaged weights are not installed: {error}")


def save_tiny(model: torch.nn.Module, directory: Path, timestamps: bool = True) -> Path:
    """The layout of a hub repo or save_pretrained: weights, config, generation config,
    tokenizer (whisper-base's, from the packaged weights)."""
    tokenizer = packaged_weights() / "tokenizer.json"
    model.save_pretrained(directory)
    generation_config(timestamps, 40).save_pretrained(directory)
    shutil.copy(tokenizer, directory / "tokenizer.json")
    return directory


@pytest.fixture(scope="session")
def dev_clips() -> list[Path]:
    if not (DEV / "en_short").is_dir():
        pytest.skip(f"no dev recordings at {DEV}")
    for module in ("soundfile", "soxr"):
        pytest.importorskip(module, reason=f"reading the dev recordings needs {module} (the audio extras)")
    clips = sorted((DEV / "en_short").iterdir())
    assert clips, f"no dev clips under {DEV}"
    return clips


def speech_between_silences(silence_seconds: float = 40.0) -> np.ndarray:
    """JFK (11 s), faint noise, a 12 s LibriSpeech clip, 5 s more of noise: a recording that is
    mostly silence, which Whisper decodes window by window and a voice activity filter cuts."""
    from asr.audio import SAMPLE_RATE, load_audio

    noise = (np.random.default_rng(0).standard_normal(int(silence_seconds * SAMPLE_RATE)) * 1e-3).astype(np.float32)
    first, second = load_audio(DEV / "en_short" / "jfk.flac"), load_audio(DEV / "en_short" / "2412-153948-0000.flac")
    return np.concatenate([first, noise, second, noise[: 5 * SAMPLE_RATE]])


def mp3_bytes(samples: np.ndarray, bit_rate: int, xing: bool = True, rate: int = 16_000, title: str = "") -> bytes:
    """Mono samples at `rate` as an MP3 (xing: with the Xing header that states its length;
    title: in its ID3 tag)."""
    import io

    import av

    out = io.BytesIO()
    options = {} if xing else {"write_xing": "0", "id3v2_version": "0"}  # no Xing: a reader can only estimate the length
    with av.open(out, "w", format="mp3", options=options) as container:
        if title:
            container.metadata["title"] = title
        stream = container.add_stream("libmp3lame", rate=rate, layout="mono")
        stream.bit_rate = bit_rate
        frame = av.AudioFrame.from_ndarray(samples[None].astype(np.float32), format="flt", layout="mono")
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    return out.getvalue()


def damaged_mp3_bytes(samples: np.ndarray, bit_rate: int) -> bytes:
    """An MP3 of these 16 kHz samples with 300 bytes zeroed a seventh of the way in: packets
    FFmpeg cannot decode, a tenth of a second or so lost."""
    data = bytearray(mp3_bytes(samples, bit_rate))
    data[len(data) // 7 : len(data) // 7 + 300] = bytes(300)
    return bytes(data)


def encoded(path: Path, parts: list[tuple[np.ndarray, int, str]], codec: str, container: str) -> Path:
    """Writes one stream of these parts (samples at 16 kHz, the part's rate, its layout) with
    FFmpeg's encoder: a stream whose rate or channels change midway where they differ."""
    import av
    import soxr

    from asr.audio import SAMPLE_RATE

    with av.open(str(path), "w", format=container) as output:
        stream = output.add_stream(codec, rate=parts[0][1], layout=parts[0][2])
        for samples, rate, layout in parts:
            channels = 1 if layout == "mono" else 2
            resampled = np.tile(soxr.resample(samples, SAMPLE_RATE, rate)[None], (channels, 1)).astype(np.float32)
            frame = av.AudioFrame.from_ndarray(resampled, format="fltp", layout=layout)
            frame.sample_rate = rate
            for packet in stream.encode(frame):
                output.mux(packet)
        for packet in stream.encode(None):
            output.mux(packet)
    return path
