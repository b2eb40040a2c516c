"""Distilling a shared-encoder draft for a target (distil-whisper's recipe, small): the
target pseudo-labels audio greedily with our engine; a decoder of a few of the target's
own layers (first and last by default), reading the target's frozen encoder output and
sharing its token embedding, learns those labels with cross-entropy plus KL to the
target's distribution. Its output head covers only the tokens the target emitted: a
cheap head is most of a cheap draft, and exactness never depends on the draft."""

from __future__ import annotations

import copy
import io
import itertools
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm
from transformers.models.whisper.modeling_whisper import WhisperDecoder

from asr.audio import AudioError, load_audio
from asr.batch import find_audio
from asr.decoder import DecoderRunner
from asr.features import WINDOW_SAMPLES, first_window
from asr.metrics import manifest_rows, row_language
from asr.models import DRAFT_WEIGHTS, ModelPair, WhisperModel, encoder_fingerprint
from asr.speculative import SpeculativeDecoder
from asr.transcribe import TranscribeOptions, Transcriber
from asr.writers import write_atomic, write_files_atomic

TOP_K = 32  # teacher probabilities kept per position for the KL term


def list_audio(source: Path, language: str) -> list[Path]:
    """A folder of audio files, or a manifest (.tsv with a `file` column, relative paths) of
    clips in `language` (the target is prompted in it: a clip in another language is
    translated, and the draft would learn translations; where a row names none, language)."""
    if not source.exists():
        raise ValueError(f"{source}: no such folder or manifest")
    if source.is_dir():
        files = find_audio(source)  # as `asr transcribe` walks folders
    elif source.suffix == ".tsv":  # read as `asr evaluate` reads one, a reference column not needed
        rows = manifest_rows(source, ("file",))
        others = [(line, row["file"].strip(), spoken) for line, row in rows
                  if (spoken := row_language(source, line, row, language)) != language]
        if others:
            line, name, spoken = others[0]
            raise ValueError(f"{source}:{line}: {name} is in {spoken}, not {language} (--language): the target would "
                             f"translate it, and the draft learn the translation; {len(others)} of its {len(rows)} "
                             f"clips are not in {language}: list one language's clips")
        files = [source.parent / row["file"].strip() for _, row in rows]
    else:
        raise ValueError(f"{source}: expected a folder of audio files or a .tsv manifest with a 'file' column")
    if not files:
        raise ValueError(f"{source}: no audio files")
    return list(dict.fromkeys(files))  # a file listed twice is labelled once


def resolved(files: list[Path] | list[str]) -> list[str]:
    """Audio files as a work folder records them: the same file is the same name."""
    return [str(Path(f).resolve()) for f in files]


@dataclass
class Label:
    """A window the target transcribed: its tokens (prompt, output, end-of-text) and, for
    each predicted position, the target's top-k token ids and log-probabilities."""

    path: str
    tokens: list[int]
    prompt_length: int
    top_ids: Tensor  # [predicted positions, TOP_K]
    top_logprobs: Tensor  # [predicted positions, TOP_K], float16


class PseudoLabels:
    """Encoder outputs (a float16 memmap) and labels, in a work folder; resumable, and
    extendable by appending audio to the list it was made for."""

    def __init__(self, work: Path, files: list[Path], frames: int, width: int, made_for: dict):
        """made_for: the target (encoder_fingerprint) and language the labels are made with."""
        work.mkdir(parents=True, exist_ok=True)
        self.path = work / "labels.pt"
        self.files = resolved(files)
        self.made_for = made_for
        saved = {"files": [], "labels": [], "next": 0, "made_for": made_for}
        if self.path.exists():
            with torch.serialization.safe_globals([Label]):
                saved = torch.load(self.path, weights_only=True)
        # Resolved: the same audio named from another folder, or relative then absolute, was other audio.
        if mismatch := next((f"{was} is now {now}" if now else f"{was} is no longer listed"
                             for was, now in itertools.zip_longest(resolved(saved["files"]), self.files[: len(saved["files"])])
                             if was != now), None):
            raise ValueError(f"{work}: labelled for other audio ({mismatch}; more audio may only be appended to the "
                             "list): delete it to label afresh")
        was = saved.get("made_for", made_for)  # a work folder of before 2026-11-29 has a fingerprint of fewer samples
        if was["language"] != made_for["language"] or any(was["target"].get(key, value) != value
                                                          for key, value in made_for["target"].items()):
            # its encoder outputs and labels would be another model's
            raise ValueError(f"{work}: labelled by another target or in another language than "
                             f"{made_for['language']!r}: resume with the same --target and --language")
        if saved["labels"] and was.get("windows", "padded") != made_for["windows"]:
            # Still the target's transcripts of the audio (the drafts before 2026-11-30 learnt from such alone): kept.
            self.made_for = {**made_for, "windows": "padded, then zeroed"}
            tqdm.write(f"note: {work}: clips labelled there before 2026-11-30 were cut into windows padded with the "
                       "log-mel of silence, those labelled now into windows zeroed past the audio, as transcription "
                       "cuts them: delete it to label all afresh", file=sys.stderr)
        encoder_file = work / "encoder.f16"
        row = frames * width * np.dtype(np.float16).itemsize
        have = encoder_file.stat().st_size if encoder_file.exists() else 0
        if have < saved["next"] * row:  # deleted to free space, or cut short: its clips would train on zeros
            raise ValueError(f"{encoder_file}: {'holds fewer encoder outputs than' if have else 'missing, though'} "
                             f"{saved['next']} clips were labelled: delete {self.path} to label them again")
        size = len(files) * row
        if encoder_file.exists() and encoder_file.stat().st_size < size:
            os.truncate(encoder_file, size)  # grows it: audio was appended
        mode = "r+" if encoder_file.exists() else "w+"
        self.encoded = np.memmap(encoder_file, dtype=np.float16, mode=mode, shape=(len(files), frames, width))
        self.labels: list[Label | None] = saved["labels"]
        self.next: int = saved["next"]  # inputs handled so far (unreadable ones are None)

    def save(self) -> None:
        self.encoded.flush()
        save_whole({"files": self.files[: self.next], "labels": self.labels, "next": self.next, "made_for": self.made_for},
                   self.path)


def save_whole(state: dict, path: Path) -> None:
    """torch.save to path through write_atomic: it holds the old state until the new is
    whole; a write that fails (a full disk) is an OSError naming it."""
    data = io.BytesIO()
    torch.save(state, data)
    try:
        write_atomic(path, data.getvalue())
    except OSError as error:
        raise OSError(f"{path}: could not be written ({error})") from error


@torch.inference_mode()
def pseudo_label(
    target: WhisperModel, files: list[Path], work: Path, language: str, batch_size: int, max_new_tokens: int = 224
) -> PseudoLabels:
    transcriber = Transcriber(ModelPair(target, None), TranscribeOptions(language=language))
    rules = transcriber.rules(timestamps=True)
    prompt = target.vocab.sot_sequence(language, "transcribe")
    runner = target.runner
    store = PseudoLabels(work, files, target.config.max_source_positions, target.config.d_model,
                         {"target": encoder_fingerprint(target.encoder), "language": language, "windows": "zeroed"})
    progress = tqdm(total=len(files), initial=store.next, desc="pseudo-labelling", unit="clip")
    saved_at = time.monotonic()
    while store.next < len(files):
        batch = files[store.next : store.next + batch_size]
        windows, kept = [], []
        for path in batch:
            try:
                audio = load_audio(path)
            except AudioError as error:
                tqdm.write(f"skipped: {error}")
                continue
            if len(audio) > WINDOW_SAMPLES:
                tqdm.write(f"skipped: {path}: longer than one 30 s window")
                continue
            windows.append(first_window(audio, target.config.num_mel_bins))
            kept.append(path)
        labels: dict[Path, Label] = {}
        max_new = min(max_new_tokens, runner.max_positions - 1 - len(prompt))
        if windows:
            encoded = target.encode(torch.stack(windows))
            sequences = SpeculativeDecoder(runner).decode(encoded, [prompt] * len(kept), rules, max_new_tokens=max_new)
            # A window that runs into the cap is a loop, not a transcript: not worth imitating.
            endless = {i for i, s in enumerate(sequences) if len(s.tokens) >= max_new}
            for i in sorted(endless):
                tqdm.write(f"skipped: {kept[i]}: no end-of-text within {max_new} tokens")
            kept = [p for i, p in enumerate(kept) if i not in endless]
            encoded = encoded[[i for i in range(len(sequences)) if i not in endless]]
            rows = [prompt + s.tokens + [target.vocab.eot] for i, s in enumerate(sequences) if i not in endless]
        if windows and rows:
            logprobs = torch.log_softmax(teacher_forced_logits(runner, encoded, rows, target.vocab.eot).float(), -1)
            for i, (path, row) in enumerate(zip(kept, rows)):
                predicted = logprobs[i, len(prompt) - 1 : len(row) - 1]
                top = predicted.topk(TOP_K, dim=-1)
                store.encoded[store.next + batch.index(path)] = encoded[i].cpu().numpy().astype(np.float16)
                labels[path] = Label(str(path), row, len(prompt), top.indices.cpu().int(), top.values.cpu().half())
        store.labels += [labels.get(path) for path in batch]
        store.next += len(batch)
        if time.monotonic() - saved_at > 60 or store.next >= len(files):  # saving is O(labels): not every batch
            store.save()
            saved_at = time.monotonic()
        progress.update(len(batch))
    progress.close()
    return store


def teacher_forced_logits(runner: DecoderRunner, encoded: Tensor, rows: list[list[int]], pad: int) -> Tensor:
    """Logits [B, T, V] at every position of each row (rows right-padded with `pad`)."""
    width = max(map(len, rows))
    padded = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=encoded.device)
    cache = runner.new_cache(encoded, capacity=width)
    return runner.forward(padded, torch.zeros(len(rows), dtype=torch.long, device=encoded.device), cache)


class DraftDecoder(nn.Module):
    """The student: a few of the target's decoder layers, its token and position
    embeddings shared and frozen, and an output head over `head_token_ids` only: those rows
    of the target's own output head, frozen, as the loaded draft decodes with them (Whisper
    ties its head to the embedding; a target that does not was trained for a head it never ran).

    share_cross_kv: keep each layer's cross-attention key/value projections frozen at the
    target layer it starts from, so that decoding reuses the target's cross-attention K/V
    (computing them over 1,500 encoder frames per window is a draft's biggest fixed cost)."""

    def __init__(self, target: WhisperModel, layers: list[int], head_token_ids: Tensor, dropout: float = 0.0,
                 share_cross_kv: bool = True):
        super().__init__()
        config = copy.deepcopy(target.config)
        config.decoder_layers = len(layers)
        config.dropout = dropout  # training only: a small draft memorises a small corpus
        self.config = config
        self.decoder = WhisperDecoder(config).to(target.dtype)
        source = target.decoder
        for own, index in zip(self.decoder.layers, layers):
            own.load_state_dict(source.layers[index].state_dict())
        self.decoder.layer_norm.load_state_dict(source.layer_norm.state_dict())
        self.decoder.embed_tokens.weight = nn.Parameter(source.embed_tokens.weight.detach(), requires_grad=False)
        self.decoder.embed_positions.weight = nn.Parameter(source.embed_positions.weight.detach(), requires_grad=False)
        self.register_buffer("head_token_ids", head_token_ids.long())
        self.register_buffer("head", target.model.proj_out.weight.detach()[head_token_ids], persistent=False)
        self.layers_from = layers
        self.share_cross_kv = share_cross_kv
        if share_cross_kv:
            for layer in self.decoder.layers:
                for parameter in (*layer.encoder_attn.k_proj.parameters(), *layer.encoder_attn.v_proj.parameters()):
                    parameter.requires_grad_(False)

    def forward(self, input_ids: Tensor, encoder_output: Tensor) -> Tensor:
        """Teacher-forced logits over the head's tokens [B, T, len(head_token_ids)]."""
        hidden = self.decoder(input_ids=input_ids, encoder_hidden_states=encoder_output, use_cache=False).last_hidden_state
        return hidden @ self.head.t()

    def trainable_state(self) -> dict[str, Tensor]:
        """What the draft stores: everything but the frozen, shared weights (embeddings, and
        cross-attention K/V projections when shared)."""
        return {f"model.decoder.{k}": v for k, v in self.decoder.named_parameters() if v.requires_grad}

    def save(self, out: Path, target: WhisperModel) -> None:
        """transformers' layout (config.json + safetensors, WhisperForCausalLM names) minus
        the shared embeddings, plus the head's token ids and the target it belongs to."""
        from safetensors.torch import save

        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in self.trainable_state().items()}
        tensors["head_token_ids"] = self.head_token_ids.cpu().int()
        config = self.config.to_dict()
        config["architectures"] = ["WhisperForCausalLM"]
        config["asr_draft"] = {
            "target_name": target.name,
            "target_encoder": encoder_fingerprint(target.encoder),
            "layers_from_target": self.layers_from,
            "head_size": int(self.head_token_ids.numel()),
            "shares_target_embedding": True,
            "cross_kv_from_target": self.layers_from if self.share_cross_kv else None,
        }
        # All three written first, then renamed, the config last: a kill between the renames
        # leaves this epoch's weights beside the last epoch's config, the same within a run.
        write_files_atomic({out / DRAFT_WEIGHTS: save(tensors), out / "tokenizer.json": target.vocab.tokenizer.to_str(),
                            out / "config.json": json.dumps(config, indent=2) + "\n"})


def spread_layers(total: int, count: int) -> list[int]:
    """First and last, and evenly between: distil-whisper's initialisation."""
    if count == 1:
        return [0]
    return [round(i * (total - 1) / (count - 1)) for i in range(count)]


@dataclass
class Batch:
    encoder_output: Tensor
    input_ids: Tensor  # [B, T]
    targets: Tensor  # [B, T] head index of the next token; -1 outside the head, -100 where not scored
    teacher_ids: Tensor  # [B, T, K] head indices, -1 where the token is outside the head
    teacher_logprobs: Tensor  # [B, T, K]


def make_batch(labels: list[Label], indices: list[int], store: PseudoLabels, head_index: Tensor, eot: int,
               previous: list[list[int]] | None = None) -> Batch:
    """previous[row]: a previous-text prompt (<|startofprev|> text) to put before that
    row's label, as long-form transcription conditions each window on the last one's text."""
    previous = previous or [[] for _ in indices]
    width = max(len(p) + len(labels[i].tokens) for p, i in zip(previous, indices)) - 1
    count = len(indices)
    input_ids = torch.full((count, width), eot, dtype=torch.long)
    targets = torch.full((count, width), -100, dtype=torch.long)
    teacher_ids = torch.full((count, width, TOP_K), -1, dtype=torch.long)
    teacher_logprobs = torch.zeros(count, width, TOP_K)
    for row, i in enumerate(indices):
        label = labels[i]
        tokens = torch.tensor(previous[row] + label.tokens)
        first_output = len(previous[row]) + label.prompt_length
        input_ids[row, : len(tokens) - 1] = tokens[:-1]
        scored = slice(first_output - 1, len(tokens) - 1)
        targets[row, scored] = head_index[tokens[first_output:]]
        teacher_ids[row, scored] = head_index[label.top_ids.long()]
        teacher_logprobs[row, scored] = label.top_logprobs.float()
    encoded = torch.from_numpy(np.asarray(store.encoded[sorted(indices)], dtype=np.float32))
    order = [sorted(indices).index(i) for i in indices]
    return Batch(encoded[order], input_ids, targets, teacher_ids, teacher_logprobs)


def previous_text_prompts(labels: list[Label], rows: list[int], pool: list[int], fraction: float, rng: random.Random,
                          sot_prev: int, eot: int, max_positions: int) -> list[list[int]]:
    """For about `fraction` of the rows, a previous-text prompt made of other clips'
    transcripts (their text and timestamp tokens, as long-form transcription keeps the last
    window's, up to the 223 Whisper keeps): the draft learns to read
    past a prompt, at the later positions prompted windows use. The target's labels were
    made without one, so the text the draft learns to predict is approximately, not
    exactly, what the target says after that prompt."""
    prompts = []
    for i in rows:
        room = min(max_positions // 2 - 1, max_positions - len(labels[i].tokens) - 1)
        if rng.random() >= fraction or room < 1:
            prompts.append([])
            continue
        length, text = rng.randint(1, room), []
        for _ in range(50):  # transcripts of other clips, as many as the length takes
            if len(text) >= length:
                break
            other = labels[rng.choice(pool)]
            text = [t for t in other.tokens[other.prompt_length :] if t != eot] + text  # labels hold no other special token
        prompts.append([sot_prev] + text[-length:] if text else [])
    return prompts


def distillation_loss(logits: Tensor, batch: Batch) -> Tensor:
    """Cross-entropy on the target's tokens + KL(target || draft) over the target's top-k
    tokens that the head covers (renormalised)."""
    logprobs = torch.log_softmax(logits.float(), -1)
    scored = batch.targets >= 0
    cross_entropy = F.nll_loss(logprobs[scored], batch.targets[scored])
    inside = batch.teacher_ids >= 0
    # Finite everywhere (an -inf here would turn the gradient into NaN through 0 * inf).
    teacher = torch.where(inside, batch.teacher_logprobs, -1e9).softmax(-1) * inside
    student = logprobs.gather(-1, batch.teacher_ids.clamp(min=0))
    kl = (teacher * (teacher.clamp(min=1e-12).log() - student)).sum(-1)
    return cross_entropy + kl[scored & inside.any(-1)].mean()


@torch.inference_mode()
def agreement(draft: DraftDecoder, labels: list[Label], indices: list[int], store: PseudoLabels, head_index: Tensor,
              eot: int, batch_size: int = 16) -> float:
    """Teacher-forced top-1 agreement with the target's own tokens (end-of-text included)."""
    hits = total = 0
    for start in range(0, len(indices), batch_size):
        batch = make_batch(labels, indices[start : start + batch_size], store, head_index, eot)
        predicted = draft(batch.input_ids, batch.encoder_output).argmax(-1)
        scored = batch.targets != -100  # a token outside the head counts as a miss
        hits += int((predicted[scored] == batch.targets[scored]).sum())
        total += int(scored.sum())
    return hits / max(total, 1)


def head_vocabulary(labels: list[Label], eot: int) -> Tensor:
    emitted = {eot}
    for label in labels:
        emitted.update(label.tokens[label.prompt_length :])
    return torch.tensor(sorted(emitted))


def length_batches(lengths: list[int], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Shuffled batches of indices into `lengths`, each of similar lengths (padding costs
    as much as tokens): shuffle, sort within pools of 50 batches, shuffle the batches."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    pool = 50 * batch_size
    order = [i for start in range(0, len(order), pool) for i in sorted(order[start : start + pool], key=lengths.__getitem__)]
    batches = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
    rng.shuffle(batches)
    return batches


def split_holdout(count: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    order = list(range(count))
    random.Random(seed).shuffle(order)
    held = max(1, round(count * fraction)) if count > 1 and fraction > 0 else 0
    return sorted(order[held:]), sorted(order[:held])


@torch.inference_mode()
def teacher_forced_agreement(pair: ModelPair, files: list[Path], language: str,
                             batch_size: int = 8) -> tuple[int, int, int]:
    """How often the draft, fed the target's own greedy transcript of each clip's first
    window, predicts the target's next token (end-of-text included). Returns (hits, tokens,
    clips); a clip that cannot be read is skipped, saying why."""
    target, draft = pair.target, pair.draft
    rules = Transcriber(ModelPair(target, None), TranscribeOptions(language=language)).rules(timestamps=True)
    prompt = target.vocab.sot_sequence(language, "transcribe")
    hits = total = clips = 0
    for start in range(0, len(files), batch_size):
        windows = []
        for path in files[start : start + batch_size]:
            try:
                windows.append(first_window(load_audio(path), target.config.num_mel_bins))
            except AudioError as error:
                tqdm.write(f"skipped: {error}")
        if not windows:
            continue
        clips += len(windows)
        features = torch.stack(windows)
        encoded = target.encode(features)
        max_new = min(224, target.runner.max_positions - 1 - len(prompt))  # as pseudo_label labels them
        sequences = SpeculativeDecoder(target.runner).decode(encoded, [prompt] * len(windows), rules, max_new_tokens=max_new)
        rows = [prompt + s.tokens + [target.vocab.eot] for s in sequences]
        draft_encoded = draft.encode(features) if pair.draft_has_own_encoder else encoded
        predicted = teacher_forced_logits(draft.runner, draft_encoded, rows, target.vocab.eot).argmax(-1)
        for i, row in enumerate(rows):
            expected = torch.tensor(row[len(prompt) :], device=predicted.device)
            hits += int((predicted[i, len(prompt) - 1 : len(row) - 1] == expected).sum())
            total += len(expected)
    return hits, total, clips
