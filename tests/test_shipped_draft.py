"""The embedded preset's distilled draft, shipped in the repo."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch

from asr.audio import load_audio
from asr.metrics import read_manifest
from asr.models import BUNDLED_DRAFTS, PRESETS, IncompatibleModels, load_model, load_pair
from asr.transcribe import AudioInput, TranscribeOptions, Transcriber
from conftest import DEV

SHIPPED = PRESETS["embedded"][1]


@pytest.fixture(scope="module")
def embedded():
    return load_pair(*PRESETS["embedded"])


def test_shipped_draft_is_small_and_self_describing():
    directory = BUNDLED_DRAFTS / SHIPPED.split(":", 1)[1]
    size = sum(p.stat().st_size for p in directory.iterdir() if p.is_file())
    assert size < 20 * 2**20
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= {p.name for p in directory.iterdir()}


def test_shipped_draft_shares_the_targets_encoder_and_embedding(embedded):
    assert embedded.draft.encoder is None and not embedded.draft_has_own_encoder
    assert embedded.draft.decoder.embed_tokens.weight is embedded.target.decoder.embed_tokens.weight
    assert embedded.draft.config.decoder_layers < embedded.target.config.decoder_layers
    assert len(embedded.draft.head_token_ids) < embedded.target.config.vocab_size
    # Its cross-attention K/V projections are the target's: decoding reuses the target's K/V.
    assert embedded.draft.runner.cross_layers_shared_with(embedded.target.runner) == [0, 5]


def test_a_damaged_draft_or_one_for_other_weights_of_the_same_shape_is_told(embedded, tmp_path: Path):
    """A damaged draft failed as a bare KeyError or IndexError; an int8 conversion of the
    very target was told to distil a draft of its own, not why its draft did not fit."""
    def damaged(name: str, meta: dict | None = None, drop: str | None = None, head: int | None = None) -> str:
        folder = shutil.copytree(BUNDLED_DRAFTS / SHIPPED.split(":", 1)[1], tmp_path / name)
        config = json.loads((folder / "config.json").read_text())
        config["asr_draft"].update(meta or {})
        (folder / "config.json").write_text(json.dumps(config))
        tensors = safetensors.torch.load_file(str(folder / "model.safetensors"))
        if head is not None:
            tensors["head_token_ids"][-1] = head
        safetensors.torch.save_file({k: v for k, v in tensors.items() if k != drop}, str(folder / "model.safetensors"))
        return str(folder)

    with pytest.raises(ValueError, match="damaged draft: its head_token_ids are missing"):
        load_model(damaged("no-head", drop="head_token_ids"), target=embedded.target)
    with pytest.raises(ValueError, match="damaged draft: its head_token_ids .* outside"):
        load_model(damaged("bad-head", head=99999), target=embedded.target)
    with pytest.raises(ValueError, match=r"damaged draft: its cross_kv_from_target \[0, 9\] does not fit"):
        load_model(damaged("bad-kv", {"cross_kv_from_target": [0, 9]}), target=embedded.target)
    fingerprint = json.loads((BUNDLED_DRAFTS / SHIPPED.split(":", 1)[1] / "config.json").read_text())["asr_draft"]["target_encoder"]
    moved = {**fingerprint, "sample": [1.05 * x for x in fingerprint["sample"]]}  # int8 rounding moves weights so
    with pytest.raises(IncompatibleModels, match="the same model quantised, e.g. an int8"):
        load_model(damaged("moved", {"target_encoder": moved}), target=embedded.target)


def test_shipped_draft_keeps_transcripts_identical(embedded):
    clips = read_manifest(DEV / "manifest.tsv")
    audio = [AudioInput(str(c.path), load_audio(c.path)) for c in clips if c.duration <= 30]
    plain = {t.source: t for t in Transcriber(embedded, TranscribeOptions(speculative=False)).transcribe_many(audio)}
    # One proposal a round: the acceptance is the share of the draft's next-token guesses the
    # target keeps, which the adaptive length (chosen from measured timings) would blur.
    options = TranscribeOptions(speculative=True, num_draft_tokens=1)
    fast = {t.source: t for t in Transcriber(embedded, options, batch_size=2).transcribe_many(audio)}
    proposed = accepted = 0
    for name, transcript in plain.items():
        assert [s.tokens for s in fast[name].segments] == [s.tokens for s in transcript.segments], name
        proposed += fast[name].info.stats.draft_proposed
        accepted += fast[name].info.stats.draft_accepted
    assert accepted / proposed > 0.7  # a real draft, on real speech it never trained on (0.84 here)


def test_sampled_transcripts_follow_the_seed_alone(embedded):
    """At temperature 1 from the first token (Whisper's last fallback), a recording's
    transcript is target-only's for the same seed, whether decoded alone or batched beside
    other recordings, speculatively or not; another seed draws otherwise. Before, the draws
    came from one generator per batch, used at a rate that depended on the draft's k: the
    speculative and target-only texts differed, and so did a recording's alone and batched."""
    clips = [c for c in read_manifest(DEV / "manifest.tsv") if c.duration <= 30][:3]
    audio = [AudioInput(str(c.path), load_audio(c.path)) for c in clips]
    sampled = dict(temperatures=(1.0,), language="en")

    def texts(speculative: bool, batch: list[AudioInput], seed: int = 0) -> dict[str, list[list[int]]]:
        options = TranscribeOptions(speculative=speculative, num_draft_tokens=3 if speculative else None, seed=seed, **sampled)
        return {t.source: [s.tokens for s in t.segments]
                for t in Transcriber(embedded, options, batch_size=len(batch)).transcribe_many(batch)}

    plain = texts(False, audio)
    assert texts(True, audio) == plain
    assert texts(True, audio[1:2]) == {audio[1].name: plain[audio[1].name]}
    assert texts(False, audio[1:2], seed=1) != {audio[1].name: plain[audio[1].name]}
