"""scripts/distill_draft.py end to end on a tiny random target, and resuming it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import soundfile
import torch

from asr.audio import SAMPLE_RATE
from asr.models import load_pair
from asr.transcribe import TranscribeOptions, Transcriber
from conftest import REPO, save_tiny, tiny_target


def distill_main():
    spec = importlib.util.spec_from_file_location("distill_draft", REPO / "scripts" / "distill_draft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_distill_runs_end_to_end_resumes_and_loads_as_a_draft(tmp_path: Path, capsys):
    target_dir = save_tiny(tiny_target(0, dtype=torch.float32, frames=3000), tmp_path / "target")
    audio_dir = tmp_path / "audio"
    audio_dir.mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):
        seconds = 1 + i / 2
        t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
        clip = 0.3 * np.sin(2 * np.pi * (200 + 50 * i) * t) + 0.05 * rng.normal(size=t.size)
        soundfile.write(audio_dir / f"clip{i}.wav", clip.astype(np.float32), SAMPLE_RATE)
    (audio_dir / "broken.wav").write_bytes(b"not audio")
    out = tmp_path / "draft"
    main = distill_main()
    common = ["--target", str(target_dir), "--audio", str(audio_dir), "--out", str(out), "--layers", "1",
              "--batch-size", "2", "--label-batch-size", "4", "--holdout", "0.34"]
    assert main(common + ["--epochs", "1"]) == 0
    first = capsys.readouterr()
    assert "held-out agreement" in first.out and "broken.wav" in first.out + first.err
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert main(common + ["--epochs", "2"]) == 2  # refuses to overwrite work without --resume
    assert main(common + ["--epochs", "2", "--resume"]) == 0
    assert "resumed after epoch 1" in capsys.readouterr().out

    pair = load_pair(str(target_dir), str(out))
    assert pair.draft.encoder is None and not pair.draft_has_own_encoder
    assert pair.draft.head_token_ids is not None and len(pair.draft.head_token_ids) < pair.target.config.vocab_size
    assert pair.draft.decoder.embed_tokens.weight is pair.target.decoder.embed_tokens.weight  # shared, not copied
    options = dict(language="en", temperatures=(0.0,), max_new_tokens=40)
    clip = audio_dir / "clip2.wav"
    plain = Transcriber(pair, TranscribeOptions(speculative=False, **options)).transcribe(clip)
    fast = Transcriber(pair, TranscribeOptions(speculative=True, **options)).transcribe(clip)
    assert [s.tokens for s in fast.segments] == [s.tokens for s in plain.segments]
    assert fast.info.stats.draft_proposed > 0
