"""Distil a shared-encoder draft for a Whisper target.

    python scripts/distill_draft.py --target packaged:whisper-base --audio corpus/manifest.tsv \\
        --out drafts/whisper-base-2l --layers 2 --epochs 4

Pseudo-labels the audio with the target (greedy, batched, our engine), then trains a
decoder of --layers of the target's layers on those labels (cross-entropy + KL), reading
the target's encoder output and sharing its token embedding. Saves config.json +
model.safetensors (+ tokenizer.json) into --out after every epoch, so the result loads
with `--draft OUT` anywhere a draft can be given. Work files (encoder outputs, labels,
the training checkpoint) go to OUT/work; --resume continues from them, and labels only
the new files when audio was appended to the list (delete OUT/work/checkpoint.pt then, to
train afresh on all the labels)."""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from asr.distill import (
    DraftDecoder,
    agreement,
    distillation_loss,
    head_vocabulary,
    length_batches,
    list_audio,
    make_batch,
    previous_text_prompts,
    pseudo_label,
    resolved,
    save_whole,
    split_holdout,
    spread_layers,
)
from asr.cli import count, number
from asr.models import load_model
from asr.vocab import language_code


def fraction(text: str) -> float:
    """An argparse type: a number from 0 to 1."""
    value = number(0)(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text} is more than 1")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="hub id, directory, or packaged:NAME")
    parser.add_argument("--audio", type=Path, required=True, help="folder of audio files or a .tsv manifest")
    parser.add_argument("--out", type=Path, required=True)
    # Bad values failed late (a ZeroDivisionError after the labelling) or saved nothing usable.
    parser.add_argument("--layers", type=count(1), default=2, help="decoder layers, at most the target's")
    parser.add_argument("--epochs", type=count(1), default=4)
    parser.add_argument("--batch-size", type=count(1), default=16)
    parser.add_argument("--label-batch-size", type=count(1), default=8)
    parser.add_argument("--lr", type=number(0, above=True), default=3e-4)
    parser.add_argument("--dropout", type=number(0, below=1), default=0.1)
    parser.add_argument("--train-cross-kv", action="store_true",
                        help="train the cross-attention key/value projections too (by default they stay the target's, "
                             "so decoding reuses the target's cross-attention K/V)")
    parser.add_argument("--previous-text", type=fraction, default=0.5,
                        help="fraction of training rows given another clip's transcript as a previous-text prompt")
    parser.add_argument("--holdout", type=number(0, below=1), default=0.05,
                        help="fraction of clips held back to measure agreement")
    parser.add_argument("--language", type=language_code, default="en")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true", help="continue from OUT/work (labels and checkpoint)")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    if args.out.exists() and not args.out.is_dir():
        print(f"--out {args.out}: exists and is not a folder", file=sys.stderr)
        return 2
    work = args.out / "work"
    if work.exists() and not args.resume:
        print(f"{work} exists: pass --resume to continue that training, or choose another --out", file=sys.stderr)
        return 2
    if (args.out / "config.json").exists() and not work.exists():  # a finished draft (as the bundled one)
        print(f"{args.out} holds a draft and no training to continue: choose another --out", file=sys.stderr)
        return 2
    if args.resume and not work.exists():
        print(f"--resume: {work} does not exist, nothing to resume: training from the start", file=sys.stderr)
    try:
        files = list_audio(args.audio, args.language)  # before the target loads: a mistyped path is told at once
        target = load_model(args.target)
        if args.layers > target.config.decoder_layers:
            raise ValueError(f"--layers {args.layers}: {args.target} has {target.config.decoder_layers} decoder layers")
        print(f"target {args.target}: {target.config.decoder_layers} decoder layers; {len(files)} clips")
        store = pseudo_label(target, files, work, args.language, args.label_batch_size)
    except (ValueError, OSError) as error:
        print(error, file=sys.stderr)
        return 2
    labels = store.labels
    usable = [i for i, label in enumerate(labels) if label is not None]
    if len(usable) < 2:
        # Labels of nothing usable are worth nothing, and the folder they were in refused the next run without --resume.
        shutil.rmtree(work, ignore_errors=True)
        print(f"{args.audio}: {len(usable)} usable clip(s) of {len(files)}: a draft needs clips of speech up to 30 s "
              "that the target transcribes (the reasons are above)", file=sys.stderr)
        return 2
    train, held = split_holdout(len(usable), args.holdout, args.seed)
    train, held = [usable[i] for i in train], [usable[i] for i in held]
    if not train:
        print(f"--holdout {args.holdout} holds back all {len(usable)} usable clips: none is left to train on", file=sys.stderr)
        return 2
    eot = target.vocab.eot
    head = head_vocabulary([labels[i] for i in train], eot)
    head_index = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    head_index[head] = torch.arange(len(head))
    layers = spread_layers(target.config.decoder_layers, args.layers)
    draft = DraftDecoder(target, layers, head, args.dropout, share_cross_kv=not args.train_cross_kv)
    print(f"draft: target layers {layers}, head of {len(head)} tokens; {len(train)} clips to train on, {len(held)} held back")

    def measure(when: str) -> str:
        draft.eval()  # dropout off: the same draft measured twice gave two figures
        if not held:
            return f"{when}: no clip held back (--holdout 0) to measure agreement on"
        return f"{when}: held-out agreement (teacher-forced) {agreement(draft, labels, held, store, head_index, eot):.1%}"

    parameters = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=args.lr, weight_decay=0.01)
    steps_per_epoch = -(-len(train) // args.batch_size)
    total_steps = steps_per_epoch * args.epochs
    warmup = min(50, total_steps // 10 + 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) * max(0.0, 1 - step / max(total_steps, 1))
    )
    checkpoint = work / "checkpoint.pt"
    first_epoch = 0
    if args.resume and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)
        # Another split would train on clips held out before, and inflate the agreement.
        same_files = resolved(state["files"]) == store.files  # named as given until 2026-11-30
        if same_files and state.get("train", train) != train:
            print(f"{checkpoint} was trained on another split of the clips (--seed {state['seed']}, --holdout "
                  f"{state['holdout']}): resume with those, or delete it to train afresh", file=sys.stderr)
            return 2
        if not same_files or state["head"].tolist() != head.tolist():
            print(f"{checkpoint} was trained on other labels (audio was added?): delete it to train on all of them",
                  file=sys.stderr)
            return 2
        try:
            draft.load_state_dict(state["draft"])
            optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as error:
            print(f"{checkpoint} was trained with other options (--layers, --train-cross-kv): resume with the same "
                  f"ones, or delete it to train afresh ({type(error).__name__})", file=sys.stderr)
            return 2
        schedule.load_state_dict(state["schedule"])
        first_epoch = state["epoch"]
        if "rng" in state:  # dropout's draws go on as in a run never stopped
            torch.set_rng_state(state["rng"])
        # The schedule as this run's --lr and --epochs make it: the saved rate had decayed to 0
        # at the last epoch (the first step of more --epochs ran at 0), and --lr was ignored.
        schedule.base_lrs = [args.lr for _ in schedule.base_lrs]
        for group in optimizer.param_groups:
            group["lr"], group["initial_lr"] = args.lr * schedule.lr_lambdas[0](schedule.last_epoch), args.lr
        was = state.get("lr", args.lr)
        print(f"resumed after epoch {first_epoch}" + (f", at --lr {args.lr} (it was {was})" if was != args.lr else ""))
    if first_epoch == 0:
        print(measure("before training"))

    for epoch in range(first_epoch, args.epochs):
        batches = length_batches([len(labels[i].tokens) for i in train], args.batch_size, random.Random(args.seed * 1000 + epoch))
        draft.train()
        started = time.perf_counter()
        progress = tqdm(batches, desc=f"epoch {epoch + 1}/{args.epochs}", unit="step")
        rng = random.Random(args.seed * 1000 + epoch)
        for rows in progress:
            indices = [train[r] for r in rows]
            previous = previous_text_prompts(labels, indices, train, args.previous_text, rng, target.vocab.sot_prev, eot,
                                             target.runner.max_positions)
            batch = make_batch(labels, indices, store, head_index, eot, previous)
            loss = distillation_loss(draft(batch.input_ids, batch.encoder_output), batch)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            optimizer.step()
            schedule.step()
            progress.set_postfix(loss=f"{loss.item():.3f}")
        print(f"{measure(f'epoch {epoch + 1}')} ({time.perf_counter() - started:.0f} s)")
        try:  # a full disk: told in a line; what was saved before stays whole (each file is replaced when written)
            draft.save(args.out, target)  # first: a checkpoint past the draft would resume with none to train
            save_whole({"draft": draft.state_dict(), "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(),
                        "epoch": epoch + 1, "head": head, "files": store.files, "train": train, "seed": args.seed,
                        "holdout": args.holdout, "lr": args.lr, "rng": torch.get_rng_state()}, checkpoint)
        except OSError as error:
            print(f"epoch {epoch + 1} could not be saved: {error}", file=sys.stderr)
            return 2
    print(f"draft saved to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
