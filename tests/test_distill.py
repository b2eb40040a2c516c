"""scripts/distill_draft.py end to end on a tiny random target, and resuming it."""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import random
import re
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import soundfile
import torch

from asr.audio import SAMPLE_RATE
from asr.distill import (DraftDecoder, Label, length_batches, list_audio, previous_text_prompts,
                         split_holdout, teacher_forced_logits)
from asr.models import IncompatibleModels, load_model, load_pair
from asr.transcribe import TranscribeOptions, Transcriber
from asr.features import WINDOW_FRAMES, content_frames, first_window, log_mel
from conftest import DEV, EOT, REPO, end_rows_at_different_lengths, save_tiny, tiny_target


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def script_main(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def distill_main():
    return script_main("distill_draft")


def tiny_corpus(tmp_path: Path) -> tuple[Path, Path]:
    """Six tones in noise, and a tiny target that ends its transcripts of them: (audio, target)."""
    audio_dir = tmp_path / "audio"
    audio_dir.mkdir()
    rng = np.random.default_rng(0)
    clips = []
    for i in range(6):
        seconds = 1 + i / 2
        t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
        clips.append((0.3 * np.sin(2 * np.pi * (200 + 50 * i) * t) + 0.05 * rng.normal(size=t.size)).astype(np.float32))
        soundfile.write(audio_dir / f"clip{i}.wav", clips[-1], SAMPLE_RATE)
    model = tiny_target(0, dtype=torch.float32, frames=3000)
    # A random model rarely ends a transcript, and clips that never end are not learnt from.
    end_rows_at_different_lengths(model, torch.stack([log_mel(clip, 80)[:, :WINDOW_FRAMES] for clip in clips]))
    return audio_dir, save_tiny(model, tmp_path / "target")


def test_distill_runs_end_to_end_resumes_and_loads_as_a_draft(tmp_path: Path, capsys, monkeypatch):
    audio_dir, target_dir = tiny_corpus(tmp_path)
    (audio_dir / "broken.wav").write_bytes(b"not audio")
    out = tmp_path / "draft"
    main = distill_main()
    common = ["--target", str(target_dir), "--audio", str(audio_dir), "--out", str(out), "--layers", "1",
              "--batch-size", "2", "--label-batch-size", "4", "--holdout", "0.34"]
    assert main(common + ["--epochs", "1"]) == 0
    first = capsys.readouterr()
    assert "held-out agreement" in first.out and "broken.wav" in first.out + first.err
    assert int(re.search(r"(\d+) clips to train on", first.out).group(1)) >= 1  # clips that end, learnt from
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert main(common + ["--epochs", "2"]) == 2  # refuses to overwrite work without --resume
    assert main(common + ["--epochs", "2", "--resume"]) == 0
    assert "resumed after epoch 1" in capsys.readouterr().out
    # Resumed in another language, or with other layers: refused, saying which.
    assert main(common + ["--epochs", "3", "--resume", "--language", "de"]) == 2
    assert "another language than 'de'" in capsys.readouterr().err
    assert main(common + ["--epochs", "3", "--resume", "--layers", "2"]) == 2
    assert "trained with other options (--layers" in capsys.readouterr().err
    # Another split (it was told as "audio was added?", or went on training on held-out clips).
    usable = sum(map(int, re.search(r"(\d+) clips to train on, (\d+) held back", first.out).groups()))
    seed = next(s for s in range(1, 100) if split_holdout(usable, 0.34, s) != split_holdout(usable, 0.34, 0))
    assert main(common + ["--epochs", "3", "--resume", "--seed", str(seed)]) == 2
    assert "another split of the clips (--seed 0, --holdout 0.34)" in capsys.readouterr().err
    weights = out / "model.safetensors"
    assert weights.stat().st_mode & 0o777 == 0o666 & ~current_umask()  # safetensors' own writer made it 0600

    # More audio appended: only it is labelled; the old checkpoint no longer matches.
    soundfile.write(audio_dir / "clip6.wav", (0.3 * np.sin(np.arange(SAMPLE_RATE) / 30)).astype(np.float32), SAMPLE_RATE)
    assert main(common + ["--epochs", "1", "--resume"]) == 2
    assert "checkpoint.pt" in capsys.readouterr().err
    (out / "work" / "checkpoint.pt").unlink()
    assert main(common + ["--epochs", "1", "--resume"]) == 0
    assert "pseudo-labelling: 100%|██████████| 8/8" in capsys.readouterr().err
    # A full disk at an epoch's end: told in a line (it was a traceback); the checkpoint before stays.
    saved = (out / "work" / "checkpoint.pt").read_bytes()
    fsync = os.fsync

    def disk_full(descriptor):  # the checkpoint's temporary file fills the disk
        if Path(os.readlink(f"/proc/self/fd/{descriptor}")).name.startswith(".checkpoint.pt."):
            raise OSError(errno.ENOSPC, "No space left on device")
        return fsync(descriptor)

    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", disk_full)
        assert main(common + ["--epochs", "3", "--resume"]) == 2
    assert (f"epoch 2 could not be saved: {out / 'work' / 'checkpoint.pt'}: could not be written ([Errno 28] No space"
            in capsys.readouterr().err)
    assert (out / "work" / "checkpoint.pt").read_bytes() == saved
    assert not list((out / "work").glob("*.part")) and not list(out.glob(".*.part"))
    # The same audio named relative to another folder: the same (it was "labelled for other audio").
    monkeypatch.chdir(audio_dir)
    relative = ["--audio" if a == "--audio" else "." if a == str(audio_dir) else a for a in common]
    assert main(relative + ["--epochs", "2", "--resume"]) == 0
    assert "resumed after epoch 1" in capsys.readouterr().out
    # Encoder outputs deleted to free space: their clips trained on zeros, without a word.
    encoder_outputs = (out / "work" / "encoder.f16").read_bytes()
    (out / "work" / "encoder.f16").unlink()
    assert main(common + ["--epochs", "2", "--resume"]) == 2
    assert f"encoder.f16: missing, though 8 clips were labelled: delete {out / 'work' / 'labels.pt'}" in capsys.readouterr().err
    (out / "work" / "encoder.f16").write_bytes(encoder_outputs)
    (audio_dir / "clip0.wav").unlink()  # labels no longer match the list: refused, not silently misaligned
    assert main(common + ["--epochs", "1", "--resume"]) == 2
    assert f"labelled for other audio ({audio_dir / 'clip0.wav'} is now {audio_dir / 'clip1.wav'};" in capsys.readouterr().err

    pair = load_pair(str(target_dir), str(out))
    assert pair.draft.encoder is None and not pair.draft_has_own_encoder
    assert pair.draft.head_token_ids is not None and len(pair.draft.head_token_ids) < pair.target.config.vocab_size
    assert pair.draft.decoder.embed_tokens.weight is pair.target.decoder.embed_tokens.weight  # shared, not copied
    # Cross-attention K/V projections stayed the target's: not stored, and decoding reuses the target's K/V.
    stored = safetensors.torch.load_file(str(out / "model.safetensors"))
    assert not [name for name in stored if ".encoder_attn.k_proj." in name or ".encoder_attn.v_proj." in name]
    assert pair.draft.runner.cross_layers_shared_with(pair.target.runner) == [0]
    encoded = pair.target.encode(torch.zeros(1, pair.target.config.num_mel_bins, 3000))
    target_cache = pair.target.runner.new_cache(encoded, capacity=4)
    draft_cache = pair.draft.runner.new_cache(encoded, capacity=4, cross_from=target_cache, cross_layers=[0])
    assert draft_cache.cross_k[0] is target_cache.cross_k[0]
    assert torch.allclose(pair.draft.runner.new_cache(encoded, capacity=4).cross_v[0], target_cache.cross_v[0])
    options = dict(language="en", temperatures=(0.0,), max_new_tokens=40)
    clip = audio_dir / "clip2.wav"
    plain = Transcriber(pair, TranscribeOptions(speculative=False, **options)).transcribe(clip)
    own_cross_kv = []
    pair.draft.decoder.layers[0].encoder_attn.k_proj.register_forward_hook(lambda *_: own_cross_kv.append(1))
    fast = Transcriber(pair, TranscribeOptions(speculative=True, **options)).transcribe(clip)
    assert [s.tokens for s in fast.segments] == [s.tokens for s in plain.segments]
    assert fast.info.stats.draft_proposed > 0
    assert not own_cross_kv  # the draft read the target's cross-attention K/V

    # Its target in float16 (as on a GPU; these float32 weights round twice on the way to the
    # check's bfloat16) is still its target; another is not.
    assert load_pair(str(target_dir), str(out), dtype=torch.float16).draft.head_token_ids is not None
    config = json.loads((out / "config.json").read_text())  # as a draft distilled before 2026-11-26 named its target
    conv1 = pair.target.encoder.conv1.weight.detach().to(torch.bfloat16).contiguous()
    config["asr_draft"]["target_encoder"] = hashlib.sha256(conv1.view(torch.int16).numpy().tobytes()).hexdigest()[:16]
    (out / "config.json").write_text(json.dumps(config))
    assert load_pair(str(target_dir), str(out)).draft.head_token_ids is not None
    other = save_tiny(tiny_target(1, dtype=torch.float32, frames=3000), tmp_path / "other")
    with pytest.raises(IncompatibleModels, match="distilled for"):
        load_pair(str(other), str(out))


def test_a_resumed_training_ends_as_one_never_stopped_at_the_rate_asked_for(tmp_path: Path, capsys):
    """Dropout's random draws started again from the seed on --resume, so the draft differed
    from an unbroken run's; --lr was ignored, and more --epochs began at the rate 0."""
    audio_dir, target_dir = tiny_corpus(tmp_path)
    spec = importlib.util.spec_from_file_location("distill_draft", REPO / "scripts" / "distill_draft.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    common = ["--target", str(target_dir), "--audio", str(audio_dir), "--layers", "1", "--batch-size", "1",
              "--dropout", "0.3", "--previous-text", "0", "--holdout", "0", "--epochs", "2"]
    assert script.main(common + ["--out", str(tmp_path / "whole")]) == 0
    said = capsys.readouterr().out
    assert "0 held back" in said and "epoch 1: no clip held back (--holdout 0) to measure agreement on" in said
    assert int(re.search(r"(\d+) clips to train on", said).group(1)) >= 2  # steps enough that the schedule moves

    epochs = []
    batches = script.length_batches

    def interrupted(*args):  # Ctrl-C as the second epoch begins, its first saved
        epochs.append(1)
        if len(epochs) == 2:
            raise KeyboardInterrupt
        return batches(*args)

    script.length_batches = interrupted
    with pytest.raises(KeyboardInterrupt):
        script.main(common + ["--out", str(tmp_path / "parts")])
    script.length_batches = batches
    assert script.main(common + ["--out", str(tmp_path / "parts"), "--resume"]) == 0
    whole, parts = ((tmp_path / name / "model.safetensors").read_bytes() for name in ("whole", "parts"))
    assert whole == parts
    capsys.readouterr()
    assert script.main(common[:-1] + ["3", "--out", str(tmp_path / "parts"), "--resume", "--lr", "0.001"]) == 0
    assert "resumed after epoch 2, at --lr 0.001 (it was 0.0003)" in capsys.readouterr().out
    state = torch.load(tmp_path / "parts" / "work" / "checkpoint.pt", weights_only=True)
    assert state["optimizer"]["param_groups"][0]["initial_lr"] == 0.001 and state["lr"] == 0.001
    assert (tmp_path / "parts" / "model.safetensors").read_bytes() != parts  # epoch 3 trained, at a rate above 0


def test_distilling_refuses_what_it_cannot_use_and_never_trains_over_a_finished_draft(tmp_path: Path, capsys):
    target = str(save_tiny(tiny_target(0, dtype=torch.float32, frames=3000), tmp_path / "target"))
    main = distill_main()
    finished = tmp_path / "finished"
    finished.mkdir()
    (finished / "config.json").write_text("{}")  # a draft there, with no work folder (as the bundled one)
    for resume in ([], ["--resume"]):
        assert main(["--target", target, "--audio", str(tmp_path), "--out", str(finished), *resume]) == 2
        assert f"{finished} holds a draft and no training to continue" in capsys.readouterr().err

    audio = tmp_path / "audio"
    (audio / "sub").mkdir(parents=True)
    (audio / "sub" / "broken.wav").write_bytes(b"not audio")  # found in a subfolder, and unusable
    soundfile.write(audio / "long.wav", np.zeros(31 * SAMPLE_RATE, np.float32), SAMPLE_RATE)
    assert main(["--target", target, "--audio", str(audio), "--out", str(tmp_path / "a")]) == 2
    captured = capsys.readouterr()
    assert "0 usable clip(s) of 2" in captured.err and "broken.wav" in captured.out + captured.err
    assert not (tmp_path / "a" / "config.json").exists()
    assert not (tmp_path / "a" / "work").exists()  # it refused the run after the folder was mended, wanting --resume

    manifest = tmp_path / "list.tsv"
    manifest.write_text("path\ttext\nclip.wav\thello\n")
    assert main(["--target", target, "--audio", str(manifest), "--out", str(tmp_path / "b")]) == 2
    assert f"{manifest}: a manifest needs the column file (tab-separated); missing file" in capsys.readouterr().err
    # Read as `asr evaluate` reads one: a spreadsheet's byte-order mark and "File" header were
    # refused, a row without a file became the manifest's folder, Latin-1 failed naming no file.
    manifest.write_bytes(b"\xef\xbb\xbfFile\tnotes\na.wav\tx\nsub/b.wav\n")
    assert list_audio(manifest, "en") == [tmp_path / "a.wav", tmp_path / "sub" / "b.wav"]
    manifest.write_text("file\tnotes\na.wav\n\tquiet\n")
    with pytest.raises(ValueError, match=f"{manifest}:3: no file named"):
        list_audio(manifest, "en")
    manifest.write_bytes("file\nsof\u00eda.wav\n".encode("latin-1"))
    with pytest.raises(ValueError, match=f"{manifest}:2: not UTF-8 text"):
        list_audio(manifest, "en")
    # Each clip's language, as `asr evaluate` reads it: the dev set's multilingual manifest was
    # labelled as English (the target translated its Spanish, German and French into English).
    multilingual = DEV / "manifest_multilingual.tsv"
    assert main(["--target", target, "--audio", str(multilingual), "--out", str(tmp_path / "e")]) == 2
    assert re.search(f"{re.escape(str(multilingual))}:2: .*picovoice_test_es.wav is in es, not en \\(--language\\): the "
                     "target would translate it.*3 of its 3 clips are not in en", capsys.readouterr().err)
    assert not (tmp_path / "e").exists()
    manifest.write_text("file\tlanguage\tnotes\na.wav\tGerman\nb.wav\t\tlang=de\nc.wav\n")
    assert list_audio(manifest, "de") == [tmp_path / "a.wav", tmp_path / "b.wav", tmp_path / "c.wav"]
    with pytest.raises(ValueError, match=f"{manifest}:2: a.wav is in de, not en"):
        list_audio(manifest, "en")
    assert main(["--target", str(tmp_path / "nowhere"), "--audio", str(audio), "--out", str(tmp_path / "c")]) == 2
    assert "nowhere" in capsys.readouterr().err
    # Values that failed late (a ZeroDivisionError after the labelling) or saved a draft that could not decode.
    for flag, value, message in [("--layers", "0", "0 is less than 1"), ("--epochs", "0", "0 is less than 1"),
                                 ("--batch-size", "0", "0 is less than 1"), ("--holdout", "1", "1 is not below 1"),
                                 ("--dropout", "2", "2 is not below 1"), ("--lr", "-1", "-1 is not above 0"),
                                 ("--previous-text", "1.5", "1.5 is more than 1")]:
        with pytest.raises(SystemExit):
            main(["--target", target, "--audio", str(audio), "--out", str(tmp_path / "d"), flag, value])
        assert f"argument {flag}: {message}" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["--target", target, "--audio", str(audio), "--out", str(tmp_path / "file")]) == 2
    # It failed once the target had loaded, as "[Errno 20] Not a directory: 'file/work'".
    assert f"--out {tmp_path / 'file'}: exists and is not a folder" in capsys.readouterr().err
    # A mistyped --audio is told before the target loads (--target is not even read).
    assert main(["--target", str(tmp_path / "nowhere"), "--audio", str(tmp_path / "typo"), "--out", str(tmp_path / "f")]) == 2
    assert capsys.readouterr().err.strip() == f"{tmp_path / 'typo'}: no such folder or manifest"
    assert main(["--target", target, "--audio", str(audio), "--out", str(tmp_path / "e"), "--layers", "3", "--resume"]) == 2
    said = capsys.readouterr().err  # --resume with no work there started afresh without a word
    assert "--resume: " in said and "nothing to resume: training from the start" in said
    assert f"--layers 3: {target} has 2 decoder layers" in said


def test_length_batches_cover_every_index_once_in_batches_of_similar_length():
    lengths = [random.Random(i).randint(1, 200) for i in range(1000)]
    batches = length_batches(lengths, 16, random.Random(0))
    assert sorted(i for batch in batches for i in batch) == list(range(1000))
    assert all(len(batch) <= 16 for batch in batches)
    spread = np.mean([max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches])
    assert spread < 20  # random batches of 16 would spread over ~180


def test_the_draft_learns_the_head_it_decodes_with_and_knows_its_target_by_more_than_the_first_layer(tmp_path: Path,
                                                                                                      capsys):
    """A draft of every layer of a target whose head is not tied to its embedding (as the
    tiny targets are) predicts as the target, in training and once saved and loaded: it was
    trained through the embedding's rows, a head the loaded draft never ran, and agreed
    with its own target on none of its tokens. A target whose encoder differs past its first
    convolution (a fine-tune) was taken for the one the draft was distilled on."""
    target_dir = save_tiny(tiny_target(0, dtype=torch.float32, frames=3000), tmp_path / "target")
    target = load_model(str(target_dir))
    assert not torch.equal(target.model.proj_out.weight, target.decoder.embed_tokens.weight)
    head = torch.tensor(sorted({EOT, *range(300, 700)}))
    draft = DraftDecoder(target, [0, 1], head).eval()
    encoded = target.encode(torch.randn(2, 80, 3000))
    rows = [[50258, 50259, 50359, 50363] + list(range(300, 300 + n)) for n in (9, 5)]
    wanted = teacher_forced_logits(target.runner, encoded, rows, EOT)[..., head]
    width = max(map(len, rows))
    with torch.no_grad():
        got = draft(torch.tensor([r + [EOT] * (width - len(r)) for r in rows]), encoded)
    assert torch.allclose(got, wanted, atol=1e-3)
    draft.save(tmp_path / "draft", target)
    pair = load_pair(str(target_dir), str(tmp_path / "draft"))
    loaded = teacher_forced_logits(pair.draft.runner, encoded, rows, EOT)  # int8 on a CPU: the same choices
    assert (loaded.argmax(-1) == head[wanted.argmax(-1)]).float().mean() > 0.95  # in token ids

    tuned = tiny_target(0, dtype=torch.float32, frames=3000)
    with torch.no_grad():
        tuned.model.encoder.layers[-1].fc2.weight.mul_(1.1)
    save_tiny(tuned, tmp_path / "tuned")
    with pytest.raises(IncompatibleModels, match="distilled for"):
        load_pair(str(tmp_path / "tuned"), str(tmp_path / "draft"))
    # A draft distilled before 2026-11-29 recorded the first convolution only: still loads.
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    del config["asr_draft"]["target_encoder"]["last"]
    (tmp_path / "draft" / "config.json").write_text(json.dumps(config))
    assert load_pair(str(tmp_path / "tuned"), str(tmp_path / "draft")).draft.head_token_ids is not None

    # scripts/draft_agreement.py: a clip it cannot read is skipped, saying so (a traceback
    # after the models loaded); a language given by name is taken, one unknown told.
    audio = tmp_path / "audio"
    audio.mkdir()
    soundfile.write(audio / "a.wav", (0.3 * np.sin(np.arange(SAMPLE_RATE) / 20)).astype(np.float32), SAMPLE_RATE)
    (audio / "b.wav").write_bytes(b"not audio")
    agreement = script_main("draft_agreement")
    assert agreement(["--target", str(target_dir), "--draft", str(tmp_path / "draft"), "--audio", str(audio)]) == 0
    said = capsys.readouterr()
    assert "over 1 clips (1 skipped)" in said.out and "b.wav" in said.out + said.err
    assert agreement(["--target", str(target_dir), "--draft", str(tmp_path / "draft"), "--audio", str(audio),
                      "--language", "English"]) == 0
    assert agreement(["--target", str(target_dir), "--draft", str(tmp_path / "draft"), "--audio", str(audio),
                      "--language", "klingon"]) == 2
    assert "unknown language 'klingon'" in capsys.readouterr().err


def test_previous_text_prompts_keep_timestamps_as_long_form_transcription_does():
    """Long-form transcription conditions a window on the last one's tokens, timestamps
    included; the draft was trained on prompts without them."""
    prompt, begin = [50258, 50259, 50359], 50364
    labels = [Label(f"{i}.wav", prompt + [begin, 400 + i, 401 + i, begin + 50, EOT], len(prompt), torch.zeros(0),
                    torch.zeros(0)) for i in range(4)]
    prompts = previous_text_prompts(labels, [0, 1, 2], [0, 1, 2, 3], 1.0, random.Random(0), 50361, EOT, 64)
    assert all(p[0] == 50361 and EOT not in p for p in prompts)
    assert any(t >= begin for p in prompts for t in p[1:]) and any(t < EOT for p in prompts for t in p[1:])
    assert split_holdout(10, 0.0, 0) == (list(range(10)), [])  # --holdout 0 held one back


def test_a_draft_learns_and_is_measured_on_windows_cut_as_transcription_cuts_them():
    """Zeros past the audio (features.window_at), not the log-mel of the padding's silence:
    pseudo-labels and agreement were taken on windows the draft never decodes."""
    clip = (0.3 * np.sin(np.arange(int(1.5 * SAMPLE_RATE)) / 30)).astype(np.float32)
    window, mel, frames = first_window(clip, 80), log_mel(clip, 80), content_frames(clip)
    assert window.shape == (80, WINDOW_FRAMES) and frames == 150
    assert torch.equal(window[:, :frames], mel[:, :frames]) and not window[:, frames:].any()
    assert mel[:, frames:WINDOW_FRAMES].any()  # what the windows held before


def test_labels_of_windows_padded_the_old_way_are_kept_and_said_to_be(tmp_path: Path, capsys):
    """A work folder labelled before windows were zeroed past the audio: resumed, its labels
    are kept (still the target's transcripts), and the mix is said, on every resume."""
    from asr.distill import PseudoLabels

    clip = tmp_path / "a.wav"
    clip.write_bytes(b"")
    made_for = {"target": {}, "language": "en"}
    (tmp_path / "work").mkdir()
    torch.save({"files": [str(clip)], "labels": [None], "next": 1, "made_for": made_for}, tmp_path / "work" / "labels.pt")
    (tmp_path / "work" / "encoder.f16").write_bytes(bytes(4 * 2 * 2))  # one clip's rows: 4 frames of width 2
    for _ in range(2):
        store = PseudoLabels(tmp_path / "work", [clip], 4, 2, {**made_for, "windows": "zeroed"})
        assert store.labels == [None] and store.next == 1
        assert "windows padded with the log-mel of silence" in capsys.readouterr().err
        store.save()
    assert torch.load(tmp_path / "work" / "labels.pt", weights_only=True)["made_for"]["windows"] == "padded, then zeroed"
    fresh = PseudoLabels(tmp_path / "fresh", [clip], 4, 2, {**made_for, "windows": "zeroed"})
    assert fresh.next == 0 and "note" not in capsys.readouterr().err
