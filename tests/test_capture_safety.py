"""CUDA graph capture forbids host-device copies, host reads and data-dependent shapes
inside a captured step. CI has no GPU, so the engine's steps run here on meta tensors
under capture_guard (tests/capture_guard.py), at tiny and at large-v3 geometry (32 + 2
layers of width 1280 cost nothing on meta), with and without timestamps and sampling,
both draft kinds; and the guard itself is shown to catch each forbidden pattern, the one
that crashed the first capture on an H100 included (rules.py wrote -inf through an index
tensor)."""

from __future__ import annotations

import pytest
import torch
from transformers import WhisperConfig, WhisperForCausalLM, WhisperForConditionalGeneration

from asr.decoder import DecoderRunner
from asr.rules import DecodingRules
from asr.slots import Window
from asr.speculative import SpeculativeDecoder
from capture_guard import CaptureViolation, capture_guard
from conftest import BEGIN_SUPPRESS, EOT, NO_TIMESTAMPS, SOT, SUPPRESS

META = torch.device("meta")


def logits_and_index():
    return torch.empty(4, 10, device=META), torch.empty(2, dtype=torch.long, device=META)


FORBIDDEN = {
    "scalar through an index tensor": lambda x, i: x.__setitem__((slice(None), i), float("-inf")),
    "tensor from host data": lambda x, i: torch.tensor([1, 2], device=META),
    "item": lambda x, i: x.sum().item(),
    "tolist": lambda x, i: x.tolist(),
    "bool": lambda x, i: bool(x.any()),
    "int": lambda x, i: int(i[0]),
    "to cpu": lambda x, i: x.to("cpu"),
    "nonzero": lambda x, i: x.nonzero(),
    "boolean mask": lambda x, i: x[x > 0],
    "CPU tensor mixed in": lambda x, i: x + torch.ones(10),
}
ALLOWED = {
    "index_fill_": lambda x, i: x.index_fill_(1, i, float("-inf")),
    "masked_fill_": lambda x, i: x.masked_fill_(x > 0, float("-inf")),
    "slices and a column": lambda x, i: x[:, 2:5].select(1, 0).fill_(0.0),
    "where with a scalar": lambda x, i: torch.where(x > 0, x, 0.0),
    "scatter_ a scalar": lambda x, i: x.scatter_(1, i[None].expand(4, 2), 1.0),
    "index_copy_": lambda x, i: x.index_copy_(1, i, x[:, :2]),
    "gather": lambda x, i: x.gather(1, i[None].expand(4, 2)),
}


@pytest.mark.parametrize("name", FORBIDDEN)
def test_the_guard_catches_what_capture_forbids(name: str):
    x, i = logits_and_index()
    with pytest.raises(CaptureViolation), capture_guard():
        FORBIDDEN[name](x, i)


@pytest.mark.parametrize("name", ALLOWED)
def test_the_guard_lets_capture_safe_operations_through(name: str):
    x, i = logits_and_index()
    with capture_guard():
        ALLOWED[name](x, i)


def meta_runners(geometry: str, own_cross: bool = True) -> tuple[DecoderRunner, DecoderRunner]:
    d_model, layers, heads, ffn, vocab, positions, frames = {
        "tiny": (64, 2, 4, 128, 51865, 64, 30),
        "large-v3": (1280, 32, 20, 5120, 51866, 448, 1500),
    }[geometry]
    config = WhisperConfig(vocab_size=vocab, num_mel_bins=128, d_model=d_model, encoder_layers=1, decoder_layers=layers,
                           encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn,
                           decoder_ffn_dim=ffn, max_source_positions=frames, max_target_positions=positions)
    with torch.device(META):
        target = WhisperForConditionalGeneration(config)
        draft = WhisperForCausalLM(WhisperConfig.from_dict({**config.to_dict(), "decoder_layers": 2}))
    if not own_cross:  # a distilled draft: the target's cross-attention K/V projections
        for own, source in zip(draft.model.decoder.layers, (0, layers - 1)):
            own.encoder_attn.k_proj = target.model.decoder.layers[source].encoder_attn.k_proj
            own.encoder_attn.v_proj = target.model.decoder.layers[source].encoder_attn.v_proj
    return DecoderRunner(target.model.decoder, target.proj_out.weight), DecoderRunner(draft.model.decoder, draft.proj_out.weight)


@pytest.mark.parametrize("geometry", ["tiny", "large-v3"])
@pytest.mark.parametrize("timestamps", [False, True], ids=["no-timestamps", "timestamps"])
@pytest.mark.parametrize("draft_kind", ["own-cross", "shared-cross"])
@torch.inference_mode()
def test_the_engines_steps_are_capture_safe(geometry: str, timestamps: bool, draft_kind: str):
    """Every step the engine captures on a GPU: a row's prefill, a draft step (feeding one
    token, two, or a catch-up width up to the whole cache; greedy and sampling), the
    verification (of a fixed width for every k, greedy and sampling)."""
    target, draft = meta_runners(geometry, own_cross=draft_kind == "own-cross")
    engine = SpeculativeDecoder(target, draft, max_draft_tokens=8, fixed_shapes=True)
    rules = DecodingRules(vocab_size=target.vocab_size, eot=EOT, no_timestamps=NO_TIMESTAMPS, suppress=SUPPRESS,
                          begin_suppress=BEGIN_SUPPRESS, timestamps=timestamps, device=META)
    frames = 30 if geometry == "tiny" else 1500
    encoded = torch.empty(frames, target.cross_attention_width, device=META)
    batch = engine.batch(rules, rows=4, no_speech_token=50362)
    prompt = [SOT, 50259, 50359] + ([] if timestamps else [NO_TIMESTAMPS])
    batch.add([Window(encoded, prompt, max_new_tokens=20, temperature=t) for t in (0.0, 0.0, 0.7)])  # one slot free
    state = batch.state
    with capture_guard():
        batch._prefill(state.prefill_row, 8)
        for width in (1, 2, 16, engine.capacity):
            for sample in (False, True):
                state.step.zero_()
                batch._draft_step(width, sample, None)
        state.k.fill_(3)
        for sample in (False, True):
            batch._verify(engine.verify_width, sample, None)
    assert state.tokens.shape == (4, engine.capacity) and state.out.shape == (6, 4)
