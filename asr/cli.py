"""`asr transcribe PATH...`: files or folders in, one transcript per file out.
`asr evaluate MANIFEST.tsv --out DIR`: WER and speed of speculative vs target-only decoding.
`asr app`: the web page (upload a file, or transcribe the microphone live).
`asr stream FILE`: a file fed to the streaming transcriber as if it were a live microphone."""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import math
import os
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from asr import triton_ops, vad
from asr.decoder import LENGTHS_KERNELS, lengths_attention_unavailable
from asr.batch import (
    DEFAULT_BATCH_SIZE, FolderRun, OutputError, PipelineSpec, RayOptions, transcribe_folder, transcribe_folder_on_ray,
    transcript_settings,
)
from asr.evaluate import PEERS, EvaluateOptions, evaluate, system_names, write_report
from asr.metrics import read_manifest
from asr.models import DEFAULT_PRESET, PRESETS, choose_dtypes, device_problem, load_pair, resolve_device
from asr.audio import AudioWarning, load_audio
from asr.features import WINDOW_SECONDS
from asr.streaming import MIN_STEP_SECONDS, StreamingTranscriber, StreamUpdate, feed_recording, summarize
from asr.transcribe import Scheduler, TranscribeOptions, Transcriber
from asr.vocab import language_code
from asr.writers import DEFAULT_FORMATS, FORMATS, SubtitleLayout, unwritable

LOCAL_RAY = "local"  # --ray without an address
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def count(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number, at least `minimum`."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is less than {minimum}")
        return value

    parse.__name__ = "whole number"  # argparse's "invalid whole number value: 'x'"
    return parse


def number(minimum: float, *, above: bool = False, below: float = math.inf) -> Callable[[str], float]:
    """An argparse type: a finite number, at least `minimum` (above it, with `above`), below `below`."""

    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):  # "inf is not above 0" gave the wrong reason
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if value < minimum or (above and value == minimum):
            raise argparse.ArgumentTypeError(f"{text} is not {'above' if above else 'at least'} {minimum:g}")
        if value >= below:
            raise argparse.ArgumentTypeError(f"{text} is not below {below:g}")
        return value

    parse.__name__ = "number"
    return parse


def threshold(text: str) -> float | None:
    """An argparse type: a finite number, or "none" for no threshold."""
    if text.lower() == "none":
        return None
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


def ratio_threshold(text: str) -> float | None:
    """An argparse type: a compression ratio above 0 (at 0 every window fell back), or "none"."""
    value = threshold(text)
    if value is not None and value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not above 0")
    return value


def language(text: str, auto: bool = True) -> str | None:
    """An argparse type: a language as Whisper's command line takes it (a code or a name, in
    any case), or "auto" to detect where `auto`; one Whisper does not know is told before any
    model loads."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    if text.strip().lower() == "auto":
        if auto:
            return None
        raise argparse.ArgumentTypeError("evaluation needs the clips' language, to normalise their text (not auto)")
    if (code := language_code(text)) not in LANGUAGES:
        raise argparse.ArgumentTypeError(f"{text} is not a language Whisper knows (a code such as en or de, a name "
                                         f"such as German{', or auto to detect' if auto else ''})")
    return code


def evaluated_language(text: str) -> str:
    """An argparse type: a language (not auto: a clip is scored with its language's normaliser)."""
    return language(text, auto=False)


def prompt_text(text: str) -> str:
    """An argparse type: text that is UTF-8 (a Latin-1 file's names given through $(cat ...)
    failed every file, as a TypeError blamed on the audio)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("is not UTF-8 text (convert it, e.g. with iconv -f latin1 -t utf-8)") from None
    return text


def clip_seconds(text: str) -> tuple[float, ...]:
    """An argparse type: --clip-timestamps' times, each seconds (90.5) or a clock (1:30.5, 1:02:03)."""
    def seconds(time: str) -> float:
        parts = time.strip().split(":")
        if len(parts) > 3 or any(not part.strip() for part in parts) or any(not 0 <= float(p) < 60 for p in parts[1:]):
            raise ValueError(time)
        return sum(float(part) * 60 ** place for place, part in enumerate(reversed(parts)))

    try:
        return TranscribeOptions(clip_timestamps=tuple(seconds(time) for time in text.split(","))).clip_timestamps
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected start,end,start,... times, each seconds or [H:]MM:SS, "
                                         "from 0 up and each after the one before") from None


def token_ids(text: str) -> tuple[int, ...]:
    """An argparse type: --suppress-tokens' ids between commas ("" for none)."""
    try:
        return TranscribeOptions(suppress_tokens=text).suppress_tokens
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected token ids between commas, -1 for the model's "
                                         "own list, or '' for none") from None


def vad_parameters(text: str) -> vad.VadParameters:
    """An argparse type: --vad-parameters' NAME=VALUE,... (faster-whisper's VadOptions; none for no neg_threshold)."""
    given = {}
    for item in text.split(","):
        name, equals, value = item.partition("=")
        if not equals or not name.strip():
            raise argparse.ArgumentTypeError(f"{item!r}: expected NAME=VALUE, e.g. threshold=0.4,min_silence_duration_ms=500")
        try:
            given[name.strip()] = None if value.strip().lower() == "none" else float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: {value!r} is not a number") from None
    try:
        return vad.VadParameters.of(given)
    except (ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("vad_parameters: ")) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asr", description="Speculative Whisper transcription")
    commands = parser.add_subparsers(dest="command", required=True)
    t = commands.add_parser("transcribe", help="transcribe audio files or folders of them")
    t.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="audio files, or folders of audio files")
    t.add_argument("--out-dir", type=Path, default=Path("."), help="where transcripts go (default: .)")
    t.add_argument("--formats", default=",".join(DEFAULT_FORMATS),
                   help=f"comma-separated, from {','.join(FORMATS)}, or all (default: %(default)s)")
    add_model_arguments(t)
    t.add_argument("--no-speculation", action="store_true", help="decode with the target alone")
    t.add_argument("--batch-size", type=count(1), default=DEFAULT_BATCH_SIZE,
                   help="windows (of different files) decoded together (default: %(default)s)")
    t.add_argument("--num-draft-tokens", type=count(0), help="fixed k (default: adaptive)")
    t.add_argument("--language", type=language, help="e.g. en, de, German (default, or auto: detect)")
    t.add_argument("--language-detection-segments", type=count(1), default=1, metavar="N",
                   help="detecting the language, hear up to N windows of 30 s while the likeliest language of one is "
                        "no more than --language-detection-threshold likely (a recording that starts with silence or "
                        "music; faster-whisper's option; default: %(default)s)")
    t.add_argument("--language-detection-threshold", type=number(0), default=0.5, metavar="P",
                   help="a window's likeliest language above this probability is taken (default: %(default)s)")
    t.add_argument("--task", choices=["transcribe", "translate"], default="transcribe",
                   help="translate: into English (default: %(default)s)")
    t.add_argument("--temperature", type=number(0), default=0.0, help="first temperature (default 0: greedy)")
    t.add_argument("--temperature-increment", type=number(0), default=0.2,
                   help="fallback step up to 1.0 when output looks wrong (0 disables fallback; default: %(default)s)")
    t.add_argument("--compression-ratio-threshold", type=ratio_threshold, default=2.4, metavar="X",
                   help="retry a window at the next temperature when its text's gzip compression ratio is above X "
                        "(repetition); none: never (default: %(default)s)")
    t.add_argument("--logprob-threshold", type=threshold, default=-1.0, metavar="X",
                   help="retry a window whose average token log-probability is below X (unless it is judged silent); "
                        "none: never (default: %(default)s)")
    t.add_argument("--no-speech-threshold", type=threshold, default=0.6, metavar="X",
                   help="skip a window as silence when its no-speech probability is above X, unless its average "
                        "log-probability is above --logprob-threshold (with that none: on the no-speech probability "
                        "alone); none: never (default: %(default)s)")
    t.add_argument("--no-condition-on-previous-text", action="store_true",
                   help="decode each window without the previous window's text as its prompt (less prone to "
                        "repetition loops, less consistent in style)")
    t.add_argument("--without-timestamps", action="store_true",
                   help="no timestamp tokens: one segment per window (with --word-timestamps a window ends at its "
                        "last word's end, as in faster-whisper)")
    t.add_argument("--word-timestamps", action="store_true",
                   help="time each word (json: segments[].words), from the target's cross-attention")
    t.add_argument("--keep-greedy-copies", action="store_true",
                   help="keep a greedy window heard as silence that copies the text before it, as Whisper and "
                        "faster-whisper do (default: decode it again without that text)")
    t.add_argument("--hallucination-silence-threshold", type=number(0), metavar="S",
                   help="with --word-timestamps: skip a segment whose words look hallucinated (improbable, or said "
                        "too fast or too slowly) with more than S seconds of silence around it, and decode on from "
                        "there, as Whisper's and faster-whisper's option of that name (2 is usual; default: off)")
    t.add_argument("--prompt", type=prompt_text, default="",
                   help="text said before the audio (names and spellings to expect): the first window's previous text")
    t.add_argument("--multilingual", action="store_true",
                   help="detect each 30 s window's language (speakers who change language; not with --language), as "
                        "faster-whisper's multilingual; the JSON's segments say theirs")
    t.add_argument("--hotwords", type=prompt_text, default="",
                   help="words and names to expect, before every window's previous text (faster-whisper's hotwords)")
    t.add_argument("--prefix", type=prompt_text, default="",
                   help="text the transcript starts with, forced, then decoded on from (faster-whisper's prefix: at "
                        "0 s, not where --clip-timestamps start later; that window reads no --hotwords)")
    t.add_argument("--suppress-tokens", type=token_ids, default=(-1,), metavar="IDS",
                   help="token ids never decoded, between commas: -1 stands for the model's own list of symbols "
                        "speech is not written with, '' for none (Whisper's option; default: -1)")
    t.add_argument("--max-line-width", type=count(1), metavar="N",
                   help="srt/vtt: break each segment's text into lines of at most N characters (a Chinese, Japanese "
                        "or Korean one counts two, as wide on a screen; a longer word has a line of its own)")
    t.add_argument("--max-line-count", type=count(1), metavar="N",
                   help="srt/vtt, with --max-line-width: cues of at most N lines; with --word-timestamps timed by "
                        "their words, which flow across segments (a pause of over 3 s starts a new cue), without it "
                        "sharing their segment's time by their characters")
    t.add_argument("--vad", action="store_true",
                   help="cut silences out before decoding (Silero VAD, as faster-whisper's vad_filter; needs asr[vad]), "
                        "times stay the recording's")
    t.add_argument("--vad-parameters", type=vad_parameters, metavar="NAME=VALUE[,...]",
                   help="implies --vad; faster-whisper's VAD options: threshold (0.5), neg_threshold, "
                        "min_speech_duration_ms (0), max_speech_duration_s (inf), min_silence_duration_ms (2000), "
                        "speech_pad_ms (400)")
    t.add_argument("--clip-timestamps", type=clip_seconds, default=(), metavar="START,END[,...]",
                   help="transcribe only these parts: start,end,start,end,... in seconds or [H:]MM:SS, the last end "
                        "left out for the recording's end (as Whisper's option); times stay the recording's")
    t.add_argument("--seed", type=int, default=0, help="random seed for sampling (default: %(default)s)")
    t.add_argument("--best-of", type=count(1), default=1, metavar="N",
                   help="at a temperature above 0, sample N attempts side by side (rows beyond --batch-size) and keep the "
                        "likeliest (Whisper's command line and faster-whisper default to 5; default: %(default)s)")
    t.add_argument("--overwrite", action="store_true", help="redo files whose outputs are complete (default: skip them)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar (shown when stderr is a terminal)")
    t.add_argument("--ray", nargs="?", const=LOCAL_RAY, metavar="ADDRESS",
                   help="spread the files over a Ray cluster: the ADDRESS of a running one (auto, ray://HEAD:10001), "
                        "or none to start one on this machine; put it after the paths or write --ray=ADDRESS")
    t.add_argument("--workers", type=count(1), help="with --ray: model pipelines (default: one per GPU, else per --cpus-per-worker CPUs)")
    t.add_argument("--cpus-per-worker", type=count(1), help="with --ray: CPUs (threads) per pipeline (default: 1 with GPUs, else up to 4)")

    e = commands.add_parser("evaluate", help="WER and speed of speculative vs target-only decoding on a labelled manifest")
    e.add_argument("manifest", type=Path, metavar="MANIFEST.tsv",
                   help="tab-separated, with a header and columns file (relative to the manifest's folder) and reference")
    e.add_argument("--out", type=Path, required=True, metavar="DIR", help="where report.json, report.md and the plots go")
    add_model_arguments(e)
    e.add_argument("--batch-size", type=count(1), default=DEFAULT_BATCH_SIZE,
                   help="our engine's batch, as `asr transcribe`'s (default: %(default)s; the peers decode one file at a time)")
    e.add_argument("--limit", type=count(1), help="only the first N files of the manifest")
    e.add_argument("--language", type=evaluated_language, default="en",
                   help="the clips' language where the manifest gives none in a language (or lang, locale) column or "
                        "as lang=xx in notes (default: %(default)s)")
    e.add_argument("--repeats", type=count(1), default=1,
                   help="timed runs of each batch per system, in turns; the run of median time is kept (default: 1)")
    e.add_argument("--vad", action="store_true",
                   help="every system decodes the speech kept by faster-whisper's Silero VAD (as asr transcribe --vad)")
    e.add_argument("--vad-parameters", type=vad_parameters, metavar="NAME=VALUE[,...]",
                   help="implies --vad; faster-whisper's VAD options: threshold (0.5), neg_threshold, "
                        "min_speech_duration_ms (0), max_speech_duration_s (inf), min_silence_duration_ms (2000), "
                        "speech_pad_ms (400)")
    e.add_argument("--keep-greedy-copies", action="store_true",
                   help="keep a greedy window heard as silence that copies its previous text, as Whisper and the peers "
                        "do (default: decode it again without that text; `asr transcribe`'s option)")
    e.add_argument("--peers", choices=sorted(PEERS), action="append", default=[],
                   help="also run transformers' generate and its assisted generation with the same draft (transformers), "
                        "or faster-whisper on the same target weights (faster-whisper); repeat for both")

    s = commands.add_parser("stream", help="feed a file to the streaming transcriber as if it were a live microphone")
    s.add_argument("file", type=Path, metavar="FILE", help="an audio file")
    s.add_argument("--chunk-seconds", type=number(0, above=True), default=0.5, help="audio per microphone chunk (default: %(default)s)")
    s.add_argument("--json", action="store_true", help="one JSON object per update, the last one a summary")
    s.add_argument("--realtime", action="store_true",
                   help="wait for each chunk on the wall clock (default: an audio-time clock, chunks arriving as "
                        "they would while each update takes its measured compute time)")
    s.add_argument("--no-hypothesis-draft", action="store_true",
                   help="re-decode the buffer without proposing the previous hypothesis first")
    s.add_argument("--buffer-trim-seconds", type=number(0, above=True, below=WINDOW_SECONDS), default=15.0,
                   help="cut the buffer at a committed segment once it is longer, below Whisper's 30 s window "
                        "(default: %(default)s)")
    s.add_argument("--min-step-seconds", type=number(0, below=WINDOW_SECONDS), default=MIN_STEP_SECONDS, metavar="S",
                   help="decode once S seconds of audio came since the last decode (default: %(default)s; shorter "
                        "steps commit words cut off at the buffer's end)")
    s.add_argument("--encoder-padding-seconds", type=number(0), metavar="S",
                   help="encode only the buffer plus S seconds of padding: cheaper updates, less accurate "
                        "(default: Whisper's whole 30 s window)")
    s.add_argument("--language", type=language,
                   help="e.g. en, de, German (default, or auto: detect, once, from the first words committed)")
    s.add_argument("--task", choices=["transcribe", "translate"], default="transcribe",
                   help="translate: English text of what is said (default: %(default)s)")
    s.add_argument("--prompt", type=prompt_text, default="", help="text said before the stream (names and spellings to expect)")
    s.add_argument("--word-timestamps", action="store_true",
                   help="time each word from the target's cross-attention, as `transcribe --word-timestamps` "
                        "(one more target pass per update; default: a segment's time shared among its words)")
    add_model_arguments(s)
    s.add_argument("--no-speculation", action="store_true", help="decode with the target alone (no draft model)")

    a = commands.add_parser("app", help="the web page: transcribe an uploaded file, or the microphone live")
    a.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: %(default)s, this machine only; 0.0.0.0 opens it to the network)")
    a.add_argument("--port", type=int, default=7860, help="(default: %(default)s)")
    a.add_argument("--batch-rows", type=count(1), default=4,
                   help="recordings from different visitors decoded together; more rows serve more at once but "
                        "stretch a long recording's wait (default: %(default)s)")
    a.add_argument("--no-batching", action="store_true",
                   help="one request at a time on the models (the pre-batching server, for comparison)")
    a.add_argument("--keep-files-minutes", type=number(0, above=True), default=60.0,
                   help="uploads and transcripts to download are removed after this long (default: %(default)s)")
    add_model_arguments(a)
    return parser


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    models = parser.add_mutually_exclusive_group()
    models.add_argument("--preset", choices=sorted(PRESETS), help=f"target + draft pair (default: {DEFAULT_PRESET})")
    models.add_argument("--target", help="hub id, save_pretrained dir, CTranslate2 dir, or packaged:NAME")
    parser.add_argument("--draft", help="the draft for --target (same kinds of source; 'target' drafts with itself)")
    parser.add_argument("--draft-encoder", choices=["auto", "shared", "own"], default="auto",
                        help="shared: the draft reads the target's encoder output; own: a full Whisper draft runs its encoder")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (default: cuda when present)")
    parser.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                        help="auto (default): float16 on a GPU; on a CPU float32 decoders with a bfloat16 encoder where the "
                             "CPU computes in bfloat16 (avx512_bf16 / AMX), else float32")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="on a GPU, run the decoder's steps eagerly rather than as CUDA graphs (slower; for debugging)")
    parser.add_argument("--compile", action="store_true",
                        help="compile the engine's steps whole with torch.compile (Inductor; the decoder's pass, the rules "
                             "and the bookkeeping fused into fewer kernels inside the CUDA graphs), for a GPU: each new shape "
                             "compiles at first use, which takes a while; slower on a CPU")
    parser.add_argument("--lengths-attention", action="store_true",
                        help="on a GPU in float16 or bfloat16, the draft's steps and the verification attend by each row's "
                             "length rather than under a mask (12 %% less time per token at large-v3's size on an H200 at "
                             "batch 1, none with whisper-base)")
    parser.add_argument("--lengths-kernel", choices=LENGTHS_KERNELS,
                        help="--lengths-attention by this kernel: flash-attention's for rows of their own lengths (flash, "
                             "the default), or ours in Triton (triton: not yet run on a GPU); implies --lengths-attention")
    parser.add_argument("--fused-layers", action="store_true",
                        help="on a GPU in float16 or bfloat16, each linear map of the decoder's steps runs with the layer "
                             "norm before it and the GELU or residual add after it in one Triton kernel of ours (not yet "
                             "run on a GPU)")


def engine_options(args: argparse.Namespace) -> dict:
    """The TranscribeOptions that say how the engine runs (graphs, compiled steps, attention by lengths, fused layers)."""
    return dict(cuda_graphs=not args.no_cuda_graphs, compile=args.compile, lengths_attention=lengths_of(args),
                fused_layers=args.fused_layers)


def lengths_of(args: argparse.Namespace) -> str | None:
    """--lengths-attention's kernel (--lengths-kernel, flash by default), or None for masked attention."""
    kernel = getattr(args, "lengths_kernel", None)
    return kernel or (LENGTHS_KERNELS[0] if getattr(args, "lengths_attention", False) else None)


# A model that cannot load (or fit on the GPU), input or options it refuses: one line, no traceback.
CANNOT_RUN = (ValueError, OSError, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError))  # torch < 2.5: cuda's


def device_and_dtypes(args: argparse.Namespace) -> tuple[str, torch.dtype, torch.dtype]:
    """The device, the decoders' dtype and the encoders' (choose_dtypes)."""
    device = resolve_device(args.device)
    return device, *choose_dtypes(device, DTYPES.get(args.dtype))


def model_sources(args: argparse.Namespace) -> tuple[str, str | None]:
    return (args.target, args.draft) if args.target else PRESETS[args.preset or DEFAULT_PRESET]


def temperatures(start: float, increment: float) -> tuple[float, ...]:
    if increment <= 0:
        return (start,)
    if increment < 0.01:  # 0.000001 made a million temperatures, each a retry of a window that keeps failing
        raise ValueError(f"--temperature-increment {increment:g}: at least 0.01 (at most 101 temperatures up to 1.0), "
                         "or 0 for no fallback")
    steps = math.floor((1.0 - start) / increment + 1e-6) if start < 1.0 else 0  # up to 1.0, as Whisper's
    return tuple(round(start + i * increment, 4) for i in range(steps + 1))


def transcribe_options(args: argparse.Namespace) -> TranscribeOptions:
    """`asr transcribe`'s options (a ValueError where a value is refused)."""
    return TranscribeOptions(
        language=args.language,
        language_detection_segments=args.language_detection_segments,
        language_detection_threshold=args.language_detection_threshold,
        multilingual=args.multilingual,
        task=args.task,
        temperatures=temperatures(args.temperature, args.temperature_increment),
        compression_ratio_threshold=args.compression_ratio_threshold,
        log_prob_threshold=args.logprob_threshold,
        no_speech_threshold=args.no_speech_threshold,
        condition_on_previous_text=not args.no_condition_on_previous_text,
        speculative=not args.no_speculation,
        num_draft_tokens=args.num_draft_tokens,
        without_timestamps=args.without_timestamps,
        initial_prompt=args.prompt,
        hotwords=args.hotwords,
        prefix=args.prefix,
        suppress_tokens=args.suppress_tokens,
        word_timestamps=args.word_timestamps,
        hallucination_silence_threshold=args.hallucination_silence_threshold,
        retry_greedy_copies=not args.keep_greedy_copies,
        vad_filter=args.vad or args.vad_parameters is not None,
        vad_parameters=args.vad_parameters,
        clip_timestamps=args.clip_timestamps,
        seed=args.seed,
        best_of=args.best_of,
        **engine_options(args),
    )


def _missing(path: Path) -> bool:
    """No such path (not one this user may not look at: the run says that one's reason)."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except ValueError:  # a name no file can have here (one the locale's encoding lacks, a NUL)
        return True
    except OSError:
        pass
    return False


def transcribe_command(args: argparse.Namespace) -> int:
    """Files and folders alike go through asr.batch (mirrored outputs, resume, errors.jsonl)."""
    formats = list(dict.fromkeys(f.strip().lower() for f in args.formats.split(",") if f.strip()))  # SRT as srt
    formats = list(FORMATS) if formats == ["all"] else formats  # openai/whisper's --output_format all
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        print(f"asr: unknown format(s) {unknown or args.formats!r}; choose from {', '.join(FORMATS)}, or all alone",
              file=sys.stderr)
        return 2
    if args.ray is not None and importlib.util.find_spec("ray") is None:
        print("asr: --ray needs Ray Data: pip install 'asr[ray]'", file=sys.stderr)
        return 2
    if args.ray is None and (args.workers or args.cpus_per_worker):
        print("asr: --workers and --cpus-per-worker go with --ray (without it, one process decodes)", file=sys.stderr)
        return 2
    if args.max_line_count is not None and not args.max_line_width:
        print("asr: --max-line-count needs --max-line-width (where lines break)", file=sys.stderr)
        return 2
    if args.max_line_width is not None and not {"srt", "vtt"} & set(formats):
        print("asr: --max-line-width lays out srt and vtt cues, and --formats asks for neither", file=sys.stderr)
        return 2
    if args.out_dir.exists() and not args.out_dir.is_dir():
        print(f"asr: --out-dir {args.out_dir}: exists and is not a folder", file=sys.stderr)
        return 2
    # Nothing given exists (a mistyped path): said before a folder, an error log or a lock is made.
    if all(_missing(path) for path in args.paths):
        for path in args.paths:
            print(f"asr: {path}: no such file or folder", file=sys.stderr)
        return 2
    if args.hallucination_silence_threshold is not None and not args.word_timestamps:
        print("asr: --hallucination-silence-threshold judges segments by their timed words: add --word-timestamps",
              file=sys.stderr)
        return 2
    target, draft = model_sources(args)
    try:
        options = transcribe_options(args)
    except ValueError as error:  # a value the options refuse: one line, exit 2 (it was a traceback, exit 1)
        print(f"asr: {error}", file=sys.stderr)
        return 2
    spec = PipelineSpec(target, None if args.no_speculation else draft, args.draft_encoder, args.device,
                        DTYPES.get(args.dtype), options, args.batch_size)
    layout = SubtitleLayout(args.max_line_width, args.max_line_count)
    run = FolderRun(tuple(args.paths), args.out_dir, tuple(formats), layout=layout, overwrite=args.overwrite,
                    progress=not args.no_progress and sys.stderr.isatty(),
                    settings=transcript_settings(target, options, layout))
    # With --overwrite the same command would redo the files this run finished.
    resume = "the same command without --overwrite resumes" if args.overwrite else "the same command resumes"
    try:
        if args.ray is None:
            summary = transcribe_folder(run, spec.build)
        else:
            cluster = RayOptions(None if args.ray == LOCAL_RAY else args.ray, args.workers, args.cpus_per_worker)
            summary = transcribe_folder_on_ray(run, spec, cluster, on_cluster=lambda line: print(line, file=sys.stderr))
    except OutputError as error:
        if error.before_work:  # nothing written to keep or resume
            print(f"asr: {error}", file=sys.stderr)
            return 2
        print(f"asr: {error}; transcripts written so far stay, and {resume}", file=sys.stderr)
        return 1
    except CANNOT_RUN as error:
        print(f"asr: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"asr: interrupted; transcripts written so far stay, and {resume}", file=sys.stderr)
        return 130
    print(summary.describe(), file=sys.stderr)
    return 1 if summary.failed else 0


def evaluate_command(args: argparse.Namespace) -> int:
    target, draft = model_sources(args)
    if draft is None:
        print("asr: evaluation compares speculative with target-only decoding: give --draft with --target", file=sys.stderr)
        return 2
    device, dtype, encoder_dtype = device_and_dtypes(args)
    preset = None if args.target else args.preset or DEFAULT_PRESET
    options = EvaluateOptions(batch_size=args.batch_size, peers=tuple(dict.fromkeys(args.peers)), preset=preset,
                              transcribe=TranscribeOptions(vad_filter=args.vad or args.vad_parameters is not None,
                                                           vad_parameters=args.vad_parameters,
                                                           retry_greedy_copies=not args.keep_greedy_copies,
                                                           **engine_options(args)),
                              progress=sys.stderr.isatty(), repeats=args.repeats)
    try:
        # a messy manifest's later rows are not read
        clips = read_manifest(args.manifest, default_language=args.language, limit=args.limit)
        if not clips:
            raise ValueError(f"{args.manifest}: no files to evaluate")
        if problem := unwritable(args.out):  # said now, not after the whole evaluation has run
            raise ValueError(f"--out {args.out}: {problem}")
        system_names(options.peers)  # a peer that cannot run, said before the models load
        missing = [c.path for c in clips if _missing(c.path)]  # one that cannot be looked at fails alone, later
        if len(missing) == len(clips):  # said before the models load for nothing
            raise ValueError(f"{args.manifest}: none of its {len(clips)} files exists (the first: {missing[0]}; "
                             "a relative path in it is from the manifest's folder)")
        if missing:  # told at the end only, after every other file
            print(f"asr: warning: {len(missing)} of the manifest's files do not exist (the first: {missing[0]}); "
                  "they are left out of every figure and listed as failed", file=sys.stderr)
        pair = load_pair(target, draft, draft_encoder=args.draft_encoder, device=device, dtype=dtype,
                         encoder_dtype=encoder_dtype)
        vocab = pair.target.vocab
        # Said now: every batch of a language the target lacks would fail, and the run end with nothing scored.
        if unknown := sorted({c.language for c in clips} - (set(vocab.languages) if vocab.multilingual else {"en"})):
            first = next(c for c in clips if c.language == unknown[0])
            raise ValueError(f"{args.manifest}: {pair.target.name} does not know the language "
                             f"{', '.join(map(repr, unknown))} (first in {first.path})"
                             + ("; it is English-only" if not vocab.multilingual else ""))
        report = evaluate(clips, pair, options)  # files that fail are in the report: a ValueError is a peer that cannot run
    except CANNOT_RUN as error:
        print(f"asr: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"asr: interrupted; no report was written, {args.out} is left as it was", file=sys.stderr)
        return 130
    for failure in report["failures"]:
        print(f"failed: {failure['file']} ({failure['system'] or 'audio'}): {failure['reason']}", file=sys.stderr)
    if not report["n_files"]:
        print(f"asr: no file could be scored; {args.out} is left as it was", file=sys.stderr)
        return 1
    try:
        markdown = write_report(report, args.out, title=str(args.manifest))
    except KeyboardInterrupt:  # while writing: the files already renamed are put back (write_files_atomic)
        print(f"asr: interrupted while writing the report into {args.out}, which keeps its previous one: run the "
              "evaluation again", file=sys.stderr)
        return 130
    except OSError as error:  # the figures are not lost: report.json goes where it can
        handle, kept = tempfile.mkstemp(prefix="asr-report-", suffix=".json")
        with os.fdopen(handle, "w", encoding="utf-8", errors="backslashreplace") as out:
            json.dump(report, out, ensure_ascii=False, indent=2)
        print(f"asr: writing the report to {args.out} failed ({error}); its report.json is {kept}", file=sys.stderr)
        return 1
    print(markdown)  # not read back: in the locale's encoding, a non-ASCII file name failed a finished run
    return 1 if report["failures"] else 0


def app_command(args: argparse.Namespace) -> int:
    target, draft = model_sources(args)
    device, dtype, encoder_dtype = device_and_dtypes(args)
    try:
        pair = load_pair(target, draft, draft_encoder=args.draft_encoder, device=device, dtype=dtype,
                         encoder_dtype=encoder_dtype)
    except CANNOT_RUN as error:
        print(f"asr: {error}", file=sys.stderr)
        return 2
    from app.engine import Engine  # gradio takes seconds to import: only this command pays
    from app.ui import serve

    try:
        description = f"Target {target} · draft {draft or 'none'} · {device}, {pair.target.dtype_label}"
        scheduler = None if args.no_batching else Scheduler(rows=args.batch_rows)
        engine = Engine(pair, description, engine_options(args), scheduler=scheduler)
        serve(engine, args.host, args.port, keep_seconds=args.keep_files_minutes * 60)
    except OSError as error:  # the port is taken, or the address is not this machine's
        print(f"asr: cannot serve on {args.host}:{args.port}: {error}", file=sys.stderr)
        return 2
    return 0


def stream_command(args: argparse.Namespace) -> int:
    target, draft = model_sources(args)
    device, dtype, encoder_dtype = device_and_dtypes(args)
    try:
        samples = load_audio(args.file)
        pair = load_pair(target, None if args.no_speculation else draft, draft_encoder=args.draft_encoder,
                         device=device, dtype=dtype, encoder_dtype=encoder_dtype)
        transcriber = Transcriber(pair, TranscribeOptions(language=args.language, task=args.task,
                                                          speculative=not args.no_speculation, initial_prompt=args.prompt,
                                                          word_timestamps=args.word_timestamps, **engine_options(args)))
        stream = StreamingTranscriber(transcriber, hypothesis_draft=not args.no_hypothesis_draft,
                                      buffer_trim_seconds=args.buffer_trim_seconds, min_step_seconds=args.min_step_seconds,
                                      encoder_padding_seconds=args.encoder_padding_seconds,
                                      clock=(lambda: time.monotonic() - started) if args.realtime else None)
        stream.warm_up()
    except CANNOT_RUN as error:
        print(f"asr: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the stream started: nothing heard to finish
        print("asr: interrupted", file=sys.stderr)
        return 130
    started = time.monotonic()  # the stream starts once the models are warm
    updates: list[StreamUpdate] = []

    shown = [""]  # the tentative text of the last update printed

    def show(update: StreamUpdate) -> None:
        # Kept for the summary without its texts: each holds all committed so far (GBs for hours of audio).
        updates.append(replace(update, committed_text="", tentative_text="", committed=[], tentative=[]))
        if not (update.buffer_seconds or update.committed or update.final):
            return  # a call before a step of audio came (min_step_seconds): the update before again
        if args.json:  # each update's committed words, not committed_text (all so far: lines would grow with the stream)
            fields = {key: value for key, value in asdict(update).items() if key != "committed_text"}
            print(json.dumps({"type": "update", **fields}), flush=True)
        # Not a bare clock over silence, but one that withdraws a guess shown ("Thank you." heard in noise).
        elif update.committed or update.tentative_text or update.final or shown[0]:
            print(describe_update(update), flush=True)
            shown[0] = update.tentative_text

    try:
        stopped = False
        try:
            for update in feed_recording(stream, samples, args.chunk_seconds, stream.clock):
                show(update)
        except KeyboardInterrupt:
            # A microphone's stop: what was heard is decoded and committed, not lost to a traceback.
            print(f"asr: stopped at {stream.audio_seconds:.1f} s: finishing what was heard (Ctrl-C again to quit)",
                  file=sys.stderr)
            try:
                show(stream.finish())  # a stream already finished gives an empty last update
            except KeyboardInterrupt:
                print("asr: interrupted", file=sys.stderr)
                return 130
            stopped = True
        summary = asdict(replace(summarize(updates), committed_text=stream.committed_text))
        if args.json:
            print(json.dumps({"type": "summary", **summary}))
        else:
            print(summary.pop("committed_text"))
            print(", ".join(f"{k}: {round(v, 3) if isinstance(v, float) else v}" for k, v in summary.items()), file=sys.stderr)
        return 130 if stopped else 0
    except BrokenPipeError:
        # The reader has gone (`asr stream FILE | head`): the stream stops, quietly, as a
        # pipe's writer does (a traceback, exit 1); the exit status is SIGPIPE's.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def describe_update(update: StreamUpdate) -> str:
    """[clock] the words this update committed, then the tentative rest in angle brackets."""
    committed = "".join(w.text for w in update.committed).strip()
    tentative = f" \u27e8{update.tentative_text}\u27e9" if update.tentative_text else ""
    return f"[{update.now:7.2f}s]{' final' if update.final else ''} {committed}{tentative}"


def main(argv: list[str] | None = None) -> int:
    # A transcript or file name the console's encoding lacks (Cyrillic on cp1252, any on a
    # redirect under an ASCII locale) is escaped, not an error that ended a folder's run.
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="backslashreplace")
    args = build_parser().parse_args(argv)
    if getattr(args, "draft", None) and not getattr(args, "target", None):  # every command takes model arguments
        print("asr: --draft goes with --target (a preset names its own draft)", file=sys.stderr)
        return 2
    alone = ("--no-speculation" if getattr(args, "no_speculation", False)
             else "--target without --draft" if getattr(args, "target", None) and not args.draft else None)
    tuning = [flag for flag, given in (("--num-draft-tokens", getattr(args, "num_draft_tokens", None) is not None),
                                       ("--draft-encoder", getattr(args, "draft_encoder", "auto") != "auto")) if given]
    if alone and tuning and args.command != "evaluate":  # evaluate refuses a run without a draft itself
        print(f"asr: {' and '.join(tuning)} set the draft, and {alone} decodes with the target alone", file=sys.stderr)
        return 2
    if alone == "--target without --draft" and args.command != "evaluate":  # a user's own target: speculation is off
        print("asr: --target without --draft decodes with the target alone, without speculation: give --draft "
              "(a distil-whisper decoder, a smaller Whisper of the same vocabulary, or one scripts/distill_draft.py "
              "made)", file=sys.stderr)
    # On a remote Ray cluster the workers' machines decode, not this one: a GPU is theirs to have.
    remote = getattr(args, "ray", None) not in (None, LOCAL_RAY)
    problem = device_problem(getattr(args, "device", "auto"), here=not remote)
    if (getattr(args, "vad", False) or getattr(args, "vad_parameters", None)) and not vad.available():  # said before any model loads, here or on Ray
        problem = vad.NEEDS
    if not problem and (kernel := lengths_of(args)) and not remote:
        device, dtype, _ = device_and_dtypes(args)
        if reason := lengths_attention_unavailable(torch.device(device), dtype, kernel=kernel):
            problem = f"--lengths-attention cannot run here: {reason}"
    if not problem and getattr(args, "fused_layers", False) and not remote:
        device, dtype, _ = device_and_dtypes(args)
        if reason := triton_ops.unavailable(torch.device(device), dtype):
            problem = f"--fused-layers cannot run here: {reason}"
    if problem:
        print(f"asr: {problem}", file=sys.stderr)
        return 2
    commands = {"transcribe": transcribe_command, "evaluate": evaluate_command, "app": app_command, "stream": stream_command}
    with warnings.catch_warnings():
        warnings.showwarning = partial(show_warning, warnings.showwarning)
        return commands[args.command](args)


def show_warning(shown: Callable, message, category, *where) -> None:
    """A damaged file's warning as a line of the command's own, not a source location."""
    if issubclass(category, AudioWarning):
        from tqdm import tqdm

        tqdm.write(f"asr: warning: {message}", file=sys.stderr)  # above a folder run's progress bar, not through it
    else:
        shown(message, category, *where)


if __name__ == "__main__":
    sys.exit(main())
