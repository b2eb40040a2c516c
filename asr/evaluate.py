"""`asr evaluate`: does speculative decoding keep the answer, and how much faster is it?
On a labelled manifest, every file is transcribed by our engine target-only and
speculatively (and, on request, by transformers' `generate` and its assisted generation
with the same draft), in one process, the systems taking turns in a rotating order so
that none is favoured by the machine's drift. The result is report.json, report.md and
PNG plots in one folder."""

from __future__ import annotations

import copy
import importlib.util
import io
import json
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterable, Iterator

import torch
import transformers
from torch import nn
from tqdm import tqdm
from transformers import GenerationConfig, GenerationMixin, WhisperForCausalLM, WhisperForConditionalGeneration
from transformers.generation.streamers import BaseStreamer

from asr import vad
from asr.audio import SAMPLE_RATE, load_audio
from asr.cudagraphs import GraphCounts, device_clock
from asr.decoder import lengths_kernel
from asr.features import WINDOW_FRAMES, WINDOW_SAMPLES, content_frames, log_mel
from asr.metrics import (NORMALIZER, SCORED_BY_LETTER, LabelledClip, load_note, machine_load, normalize, normalized_wer,
                         word_errors)
from asr.models import ModelPair, ctranslate2_directory, quiet_transformers
from asr.peer_process import FasterWhisperProcess
from asr.slots import DecodeStats
from asr.transcribe import AudioInput, TranscribeOptions, Transcriber, check_whole
from asr.writers import write_files_atomic

TARGET, SPECULATIVE = "target", "speculative"
TRANSFORMERS_TARGET, TRANSFORMERS_ASSISTED = "transformers_target", "transformers_assisted"
FASTER_WHISPER = "faster_whisper"
# faster-whisper's time limit for a file, far beyond what a file takes on a CPU: a file it hangs
# on (its process is then stopped, and the next file gets a new one) fails, not the evaluation.
PEER_SECONDS, PEER_SECONDS_PER_AUDIO_SECOND = 120.0, 10.0
PEER_LOAD_SECONDS = 600.0  # a model read that hangs (a stalled network drive) fails after this
PEERS = {"transformers": (TRANSFORMERS_TARGET, TRANSFORMERS_ASSISTED), "faster-whisper": (FASTER_WHISPER,)}
# TranscribeOptions the transformers peers cannot decode with, and their defaults (faster-whisper takes all).
TRANSFORMERS_LACKS = {"initial_prompt": "", "hotwords": "", "prefix": "", "clip_timestamps": (), "word_timestamps": False,
                      "hallucination_silence_threshold": None}
SPECULATIVE_SYSTEMS = (SPECULATIVE, TRANSFORMERS_ASSISTED)
LABELS = {
    TARGET: "ours, target only",
    SPECULATIVE: "ours, speculative",
    TRANSFORMERS_TARGET: "transformers generate",
    TRANSFORMERS_ASSISTED: "transformers assisted",
    FASTER_WHISPER: "faster-whisper",
}
PLOTS = ("speedup_vs_duration.png", "acceptance_histogram.png", "wer.png", "time_split.png")
NOTES = [
    "Timing: each file is decoded by every system in one process, in an order that rotates from batch to batch; "
    "seconds are end to end (log-mel features, encoder, decoder), audio loading excluded; each language's first "
    "batch, cut to 30 s, is decoded once beforehand, untimed, to warm up (by a peer, its first file); on a GPU our engines capture every step their batches can meet "
    "beforehand too (Transcriber.warm_up), also untimed.",
    "identical: speculative and target-only transcripts have the same text tokens and segment times.",
]
# In the report where a peer ran: where ours decodes otherwise than Whisper's rules (README, Retries).
RULES_NOTE = ("Ours follows Whisper's rules and two more, which the peers lack: a greedy window heard as silence that "
              "copies its previous text is decoded again without it (retry_greedy_copies; --keep-greedy-copies turns it "
              "off), and a sampled attempt repeating 6 words in a row of its previous text fails. Where they apply, the "
              "peers' text repeats what ours does not.")
RULES_KEPT_NOTE = ("Ours follows Whisper's rules and one more, which the peers lack: a sampled attempt repeating 6 words "
                   "in a row of its previous text fails (greedy copies kept, as the peers keep them: --keep-greedy-copies).")
# Notes on a peer, in the report where it ran.
PEER_NOTES = {
    "transformers": [
        "identical, for the transformers systems: the same text tokens as our target-only transcript.",
        "The transformers peers decode one file at a time (assisted generation supports no more), with the same "
        "language, task, timestamps, suppressed tokens, temperature fallback and thresholds as ours; their decoder "
        "seconds are all but the features and the encoder (their host work included: no rest), and with --vad their "
        "features include the voice filter, which ours count in the rest.",
        "Tokens a window may generate: ours 224 (Whisper's), less where the prompt leaves less room; transformers' "
        "its own, up to the decoder's 448 positions less the prompt, which a window that loops until its limit reaches.",
        "transformers drops Whisper's begin-suppress rule when an assistant model is given, so its assisted "
        "transcripts can differ from its own target-only ones.",
        "For its no-speech check transformers runs the model again from the audio features: its encoder seconds "
        "count one more encoder pass per window than ours, two more with an assistant.",
        "transformers' assistant is the draft as a WhisperForCausalLM; a draft distilled by this project scores only "
        "the tokens its target emitted (a reduced head), and transformers cannot restrict a head, so there it scores "
        "every token with the shared (tied) embedding as its head.",
        "transformers_assisted: draft tokens proposed = the assistant's decoder passes; accepted = tokens kept minus "
        "target passes (each pass keeps its accepted draft tokens plus one of its own).",
    ],
    "faster-whisper": [
        "faster-whisper decodes one file at a time on the same target weights (a CTranslate2 directory), float32 on a "
        "CPU and on a GPU in our decoders' dtype (float16 unless --dtype), greedy (beam_size=1), with the same language, task, temperatures, best_of, "
        "thresholds, previous-text conditioning and options as ours (with --vad given the speech our filter keeps: "
        "faster-whisper's Silero VAD, after raising a quiet recording, which its own does not), on as many "
        "CPU threads as ours, in a process of its own (in ours, CTranslate2's threads slowed our decoding); it computes "
        "its own log-mel features from the same samples; its time is end to end only (no encoder / decoder split); "
        "a window of ours ends at 224 new tokens (Whisper's), one of faster-whisper's at 448 with its prompt "
        "(its max_new_tokens is refused where a long previous text leaves less room), so on a window that repeats "
        "itself to the limit it decodes up to twice our tokens; "
        f"a file it has not transcribed within {PEER_SECONDS:.0f} s plus {PEER_SECONDS_PER_AUDIO_SECOND:.0f} s per second "
        "of audio fails, and the next gets a new process, not warmed; a model not loaded within "
        f"{PEER_LOAD_SECONDS / 60:.0f} minutes ends the evaluation before any file, or after a crash fails every "
        "later file.",
    ],
}


@dataclass(frozen=True)
class EvaluateOptions:
    batch_size: int = 1  # our engine's; the transformers peers decode one file at a time
    peers: tuple[str, ...] = ()  # keys of PEERS
    preset: str | None = None  # recorded in the report
    transcribe: TranscribeOptions = TranscribeOptions()  # the language is each clip's own
    progress: bool = True
    # Timed runs of each batch per system, in turns; each system's run of median time is kept
    # (a GPU decodes the dev set in under a second, where one run's noise outweighs a difference).
    repeats: int = 1

    def __post_init__(self) -> None:
        check_whole("batch_size", self.batch_size, 1)  # 0 and -1 failed mid-run, naming nothing
        check_whole("repeats", self.repeats, 1)
        # Each clip is decoded and scored in its manifest's language: multilingual (and language
        # detection over windows) failed every file.
        if self.transcribe.multilingual or self.transcribe.language_detection_segments > 1:
            raise ValueError("an evaluation decodes each clip in its manifest's language: without multilingual "
                             "or language_detection_segments")
        # Options transformers' generate has no equal of reached ours alone, and the systems decoded unlike.
        if "transformers" in self.peers and (unlike := [name for name, default in TRANSFORMERS_LACKS.items()
                                                        if getattr(self.transcribe, name) != default]):
            raise ValueError(f"--peers transformers decodes without {', '.join(unlike)}: "
                             "evaluate with these options without it (faster-whisper takes them)")


@dataclass
class Run:
    """One system's output on one file."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)  # text tokens, timestamps left out
    segment_times: list[tuple[float, float]] = field(default_factory=list)  # ours only
    seconds: float = 0.0  # end to end: features, encoder, decoder and the host's work around them
    features_seconds: float | None = 0.0  # None: the system does not tell (faster-whisper)
    encoder_seconds: float | None = 0.0
    decoder_seconds: float | None = 0.0
    stats: DecodeStats = field(default_factory=DecodeStats)
    # Ours on a GPU: the graph work (first uses, captures, replays) of the batch the file was
    # decoded in, on the batch's first file and zero on the others, so that runs add up.
    graphs: GraphCounts = field(default_factory=GraphCounts)
    error: str | None = None


@dataclass(eq=False)  # compared by identity: a manifest may list one file twice
class FileResult:
    clip: LabelledClip
    duration: float = 0.0
    runs: dict[str, Run] = field(default_factory=dict)
    error: str | None = None  # the audio could not be read
    # With --repeats: each system's seconds for this file in every timed run (runs holds the median one).
    repeat_seconds: dict[str, list[float]] = field(default_factory=dict)

    def ok(self, system: str) -> bool:
        run = self.runs.get(system)
        return self.error is None and run is not None and run.error is None


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


class OurSystem:
    """Our engine, target-only or speculative, on a batch of files of one language."""

    def __init__(self, pair: ModelPair, options: TranscribeOptions, batch_size: int):
        self.pair = pair
        self.options = options
        self.batch_size = batch_size
        self._transcribers: dict[str, Transcriber] = {}
        self.warm_up_graphs = GraphCounts()  # the graph work of Transcriber.warm_up, untimed

    def draft_length(self) -> dict | None:
        """The speculative engine's draft length, as DraftLength.summary says it, after every
        run of this process (warm-ups included); None for target-only or before any run."""
        transcriber = next(iter(self._transcribers.values()), None)
        if transcriber is None or not self.options.speculative:
            return None
        return transcriber.engine.draft_length(self.options.num_draft_tokens).summary()

    def run(self, items: list[AudioInput], language: str) -> list[Run]:
        try:
            if language not in self._transcribers:
                transcriber = Transcriber(self.pair, replace(self.options, language=language), self.batch_size)
                before = copy.copy(transcriber.engine.graphs.counts)
                transcriber.warm_up()
                self.warm_up_graphs += transcriber.engine.graphs.counts - before
                self._transcribers[language] = transcriber
            transcriber = self._transcribers[language]
            graphs = copy.copy(transcriber.engine.graphs.counts)
            started = time.perf_counter()
            transcripts = {t.source: t for t in transcriber.transcribe_many(items)}
            wall = device_clock(self.pair.target.device) - started
            graphs = transcriber.engine.graphs.counts - graphs
        except Exception as error:  # the batch fails for this system; the evaluation goes on
            if len(items) == 1:
                return [Run(error=_describe(error))]
            # Each file alone says which fails; the others are not measured (a batch of one is
            # not what the other systems' figures are), and say why.
            alone = [self.run([item], language)[0] for item in items]
            culprits = ", ".join(item.name for item, run in zip(items, alone) if run.error)
            why = f"not measured: its batch failed{f' on {culprits}' if culprits else ''} ({_describe(error)})"
            return [run if run.error else Run(error=why) for run in alone]
        infos = [transcripts[item.name].info for item in items]
        busy = [info.features_seconds + info.encoder_seconds + info.decoder_seconds for info in infos]
        runs = []
        for item, info, spent in zip(items, infos, busy):
            transcript = transcripts[item.name]
            runs.append(Run(
                text=transcript.text,
                tokens=[t for s in transcript.segments for t in s.tokens if t < transcriber.vocab.eot],
                segment_times=[(s.start, s.end) for s in transcript.segments],
                # The batch's wall time, shared out as the engine attributes its features, encoder and decoder time.
                seconds=wall * (spent / sum(busy) if sum(busy) else 1 / len(items)),
                features_seconds=info.features_seconds,
                encoder_seconds=info.encoder_seconds,
                decoder_seconds=info.decoder_seconds,
                stats=info.stats,
                graphs=graphs if not runs else GraphCounts(),
            ))
        return runs


class _TokenCounter(BaseStreamer):
    """Counts the tokens transformers keeps and the rounds that kept them: `generate` hands
    a streamer its prompt first, then the tokens of each step (one target pass each)."""

    def __init__(self) -> None:
        self.prompt_pending = True
        self.per_round: list[int] = []

    @property
    def tokens(self) -> int:
        return sum(self.per_round)

    @property
    def rounds(self) -> int:
        return len(self.per_round)

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_pending:
            self.prompt_pending = False
            return
        self.per_round.append(value.numel())

    def end(self) -> None:
        self.prompt_pending = True  # long-form audio: one `generate` per window


@contextmanager
def _timed(module: nn.Module, device: torch.device) -> Iterator[list[float]]:
    """Seconds spent in module's forward, summed over its calls while the block runs."""
    total, started = [0.0], [0.0]

    def before(*_):
        started[0] = device_clock(device)

    def after(*_):
        total[0] += device_clock(device) - started[0]

    handles = [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    try:
        yield total
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _encoder_output_as(module: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """An encoder in another dtype than the decoder (--dtype auto on a bf16 CPU) hands
    transformers' decoder its output in the decoder's dtype, as ours does."""

    def cast(_module, _inputs, output):
        output.last_hidden_state = output.last_hidden_state.to(dtype)
        return output

    handle = module.register_forward_hook(cast)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def _counted(module: nn.Module | None) -> Iterator[list[int]]:
    """Calls to module's forward while the block runs."""
    calls = [0]
    handle = module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) if module is not None else None
    try:
        yield calls
    finally:
        if handle is not None:
            handle.remove()


class _Assistant(WhisperForCausalLM):
    """transformers' long-form loop hands a decoder-only assistant the target's
    `decoder_attention_mask`, which it also copies to `attention_mask`, and then refuses the
    unused key. At batch 1 that mask is all ones (nothing is padded), so it is dropped."""

    def prepare_inputs_for_generation(self, *args, decoder_attention_mask=None, **kwargs):
        return super().prepare_inputs_for_generation(*args, **kwargs)


class _WholeAssistant(WhisperForConditionalGeneration):
    """A draft with an encoder of its own, as transformers' assistant: candidates come from
    plain `generate`. Whisper's own ran its no-speech check on the candidates, calling the
    model without the audio features, and failed on every file."""

    def generate(self, *args, **kwargs):
        return GenerationMixin.generate(self, *args, **kwargs)


def transformers_assistant(pair: ModelPair) -> nn.Module:
    """Our draft as transformers' `assistant_model`. A draft that runs its own encoder is a
    whole Whisper; any other (a decoder-only draft, a full checkpoint whose encoder copy was
    freed because it shares the target's, or the target itself) becomes a WhisperForCausalLM
    view over its decoder and head, which transformers gives the target's encoder output."""
    draft = pair.draft
    if pair.draft_has_own_encoder:
        with torch.device("meta"):
            whole = _WholeAssistant(copy.deepcopy(draft.config))
        whole.model, whole.proj_out, whole.generation_config = draft.model.model, draft.model.proj_out, draft.model.generation_config
        return whole.eval()
    with torch.device("meta"):
        view = _Assistant(copy.deepcopy(draft.config))  # its __init__ edits the config it is given
    view.model.decoder = draft.decoder
    view.proj_out = draft.model.proj_out
    return view.eval()


class _OneFileAtATime:
    """A peer that decodes file by file: a file it fails on is marked, and it goes on."""

    def run(self, items: list[AudioInput], language: str) -> list[Run]:
        runs = []
        for item in items:
            try:
                runs.append(self._one(item, language))
            except Exception as error:
                runs.append(Run(error=_describe(error)))
        return runs

    def _one(self, item: AudioInput, language: str) -> Run:
        raise NotImplementedError


class TransformersSystem(_OneFileAtATime):
    """transformers' own Whisper `generate` on the target's weights, alone or with our draft
    as `assistant_model`, one file at a time, given our log-mel features."""

    def __init__(self, pair: ModelPair, options: TranscribeOptions, assisted: bool):
        self.target = pair.target
        self.options = options
        self.assistant = transformers_assistant(pair) if assisted else None
        vocab = self.target.vocab
        rules = Transcriber(pair, options).rules(timestamps=not options.without_timestamps)
        self.config = GenerationConfig(
            decoder_start_token_id=vocab.sot,
            eos_token_id=vocab.eot,
            pad_token_id=vocab.eot,
            bos_token_id=vocab.eot,
            no_timestamps_token_id=vocab.no_timestamps,
            prev_sot_token_id=vocab.sot_prev,
            # Our rules' lists: the checkpoint's suppressed tokens plus the control tokens we suppress.
            suppress_tokens=rules.suppress.tolist(),
            begin_suppress_tokens=self.target.begin_suppress,
            max_initial_timestamp_index=rules.max_initial_timestamp_index,
            lang_to_id={f"<|{code}|>": token for code, token in vocab.languages.items()},
            task_to_id={"transcribe": vocab.transcribe, "translate": vocab.translate},
            is_multilingual=vocab.multilingual,
            max_length=self.target.config.max_target_positions,
        )

    def _one(self, item: AudioInput, language: str) -> Run:
        target, options, vocab = self.target, self.options, self.target.vocab
        multilingual = vocab.multilingual
        extra = {"assistant_model": self.assistant} if self.assistant is not None else {}
        counter = _TokenCounter()
        started = time.perf_counter()
        samples = vad.speech_only(item.samples, options.vad_parameters)[0] if options.vad_filter else item.samples
        if not len(samples):  # no speech kept: nothing to decode, as ours and faster-whisper (not 30 s of padding)
            seconds = time.perf_counter() - started
            return Run(seconds=seconds, features_seconds=seconds, encoder_seconds=0.0, decoder_seconds=0.0)
        mel = log_mel(samples, target.config.num_mel_bins, device=target.device)
        # Up to 30 s: one window, the audio padded with silence as transformers' feature
        # extractor pads it (what its users get); longer: transformers' long-form loop.
        features = mel[:, : max(content_frames(samples), WINDOW_FRAMES)][None].to(target.encoder_dtype)
        featured = device_clock(target.device)
        torch.manual_seed(options.seed)  # its temperature fallback samples from torch's global generator: reruns agree
        with (
            _timed(target.encoder, target.device) as encoder,
            _encoder_output_as(target.encoder, target.dtype),
            _counted(self.assistant) as draft_passes,  # not its decoder: the target's own, with --draft target
            quiet_transformers(),
            torch.inference_mode(),
        ):
            output = target.model.generate(
                features,
                generation_config=self.config,
                language=language if multilingual else None,
                task=options.task if multilingual else None,
                return_timestamps=not options.without_timestamps,
                condition_on_prev_tokens=options.condition_on_previous_text,
                temperature=options.temperatures,
                compression_ratio_threshold=options.compression_ratio_threshold,
                logprob_threshold=options.log_prob_threshold,
                no_speech_threshold=options.no_speech_threshold,
                streamer=counter,
                **extra,
            )
        finished = device_clock(target.device)
        sequence = output[0] if isinstance(output, torch.Tensor) else output["sequences"][0]
        tokens = [t for t in sequence.tolist() if t < vocab.eot]
        proposed = draft_passes[0]
        stats = DecodeStats(
            draft_proposed=proposed,
            draft_accepted=counter.tokens - counter.rounds if proposed else 0,
            target_passes=counter.rounds,
            tokens=counter.tokens,
            tokens_per_pass=counter.per_round,
            accepted_per_pass=[n - 1 for n in counter.per_round] if proposed else [],
        )
        return Run(
            text=vocab.decode(tokens).strip(),
            tokens=tokens,
            seconds=finished - started,
            features_seconds=featured - started,
            encoder_seconds=encoder[0],
            decoder_seconds=finished - featured - encoder[0],
            stats=stats,
        )


class FasterWhisperSystem(_OneFileAtATime):
    """faster-whisper (CTranslate2) on the target's weights, one file at a time, greedy, in a
    process of its own (asr/peer_process.py)."""

    def __init__(self, pair: ModelPair, options: TranscribeOptions):
        self.target = pair.target
        self.options = options
        device, dtype = pair.target.device, pair.target.dtype
        # Our decoders' precision where CTranslate2 has it (a GPU's float16, bfloat16, float32); float32 on a CPU.
        precise = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16, torch.float32)
        # Its temperature fallback samples from CTranslate2's generator, seeded (a random seed
        # unless set) at its first sample: the dev set's sonnet's sampled tail differed from
        # run to run until --seed was set.
        try:
            directory = ctranslate2_directory(pair.target.name, pair.target.model.config.num_mel_bins)
            self.process = FasterWhisperProcess(dict(
                model_size_or_path=str(directory), device=device.type,
                device_index=device.index or 0, compute_type=str(dtype).removeprefix("torch.") if precise else "float32",
                cpu_threads=torch.get_num_threads(), num_workers=1), options.seed, load_timeout=PEER_LOAD_SECONDS)
        except RuntimeError as error:  # its model or its imports failed: a usage error, before anything decodes
            raise ValueError(f"--peers faster-whisper could not start ({error})") from error
        except OSError as error:  # the cache folder (ASR_CACHE) cannot be made or written
            raise ValueError(f"--peers faster-whisper: its CTranslate2 copy of {pair.target.name} could not be made "
                             f"({error}); ASR_CACHE sets where it goes") from error

    def _one(self, item: AudioInput, language: str) -> Run:
        options, vocab = self.options, self.target.vocab
        # Given the speech our filter keeps, as transformers is: its own filter skips the step
        # that first raises a quiet recording (vad.speech_only), and kept other audio (JFK at
        # -53 dBFS: 73 % WER against our 5 %).
        started = time.perf_counter()
        samples = vad.speech_only(item.samples, options.vad_parameters)[0] if options.vad_filter else item.samples
        filtered = time.perf_counter() - started
        if not len(samples):  # no speech kept: nothing to decode
            return Run(seconds=filtered, features_seconds=None, encoder_seconds=None, decoder_seconds=None)
        segments, seconds = self.process.transcribe(
            timeout=PEER_SECONDS + PEER_SECONDS_PER_AUDIO_SECOND * len(samples) / SAMPLE_RATE,
            audio=samples, language=language if vocab.multilingual else "en", task=options.task, beam_size=1,
            best_of=options.best_of, temperature=list(options.temperatures),
            compression_ratio_threshold=options.compression_ratio_threshold,
            log_prob_threshold=options.log_prob_threshold, no_speech_threshold=options.no_speech_threshold,
            condition_on_previous_text=options.condition_on_previous_text, without_timestamps=options.without_timestamps,
            vad_filter=False, suppress_tokens=list(options.suppress_tokens),
            initial_prompt=options.initial_prompt or None, hotwords=options.hotwords or None,
            prefix=options.prefix or None, clip_timestamps=list(options.clip_timestamps) or "0",
            word_timestamps=options.word_timestamps,
            hallucination_silence_threshold=options.hallucination_silence_threshold)
        tokens = [t for _, segment_tokens, _, _ in segments for t in segment_tokens if t < vocab.eot]
        return Run(text="".join(text for text, _, _, _ in segments).strip(), tokens=tokens, seconds=filtered + seconds, features_seconds=None, encoder_seconds=None, decoder_seconds=None)


def system_names(peers: tuple[str, ...]) -> list[str]:
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(unknown)}; choose from {', '.join(PEERS)}")
    if "faster-whisper" in peers and importlib.util.find_spec("faster_whisper") is None:  # imported in its process only
        raise ValueError("--peers faster-whisper needs faster-whisper: pip install 'asr[faster-whisper]'")
    return [TARGET, SPECULATIVE] + [name for peer in peers for name in PEERS[peer]]


def evaluate(clips: list[LabelledClip], pair: ModelPair, options: EvaluateOptions = EvaluateOptions()) -> dict:
    """Transcribes every clip with every system and returns the report (see build_report)."""
    warm_up: dict[str, dict] = {}
    loads: list[float] = []
    draft_lengths: dict[str, dict] = {}
    results = run_systems(clips, pair, options, warm_up, loads, draft_lengths)
    environment = describe_environment(pair, options)
    if SPECULATIVE in draft_lengths:
        environment["draft_length"] = draft_lengths[SPECULATIVE]
    # The highest of the 1-minute averages after each batch and at the end: other work on the
    # machine skews every speed figure (sampled at the end only, a run's busy start went unsaid).
    environment["load_average"] = max([*loads, machine_load()])
    if environment["cuda_graphs"]:
        environment["warm_up_graphs"] = warm_up
    return build_report(results, system_names(options.peers), environment)


def run_systems(clips: list[LabelledClip], pair: ModelPair, options: EvaluateOptions,
                warm_up: dict[str, dict] | None = None, loads: list[float] | None = None,
                draft_lengths: dict[str, dict] | None = None) -> list[FileResult]:
    """Each clip's audio is read once and decoded by every system; a file that cannot be
    read, or that a system fails on, is marked and the others go on. loads: the machine's
    load average after each batch is appended to it; draft_lengths: our speculative system's
    draft length at the end (OurSystem.draft_length) is put in it."""
    if pair.draft is None:
        raise ValueError("evaluation compares speculative decoding with target-only decoding: it needs a draft")
    results = [FileResult(clip) for clip in clips]
    # A batch holds files of one language (a decoding option); manifest order otherwise.
    batches: list[list[FileResult]] = []
    for language in dict.fromkeys(r.clip.language for r in results):
        same = [r for r in results if r.clip.language == language]
        batches += [same[i : i + options.batch_size] for i in range(0, len(same), options.batch_size)]

    systems: dict[str, OurSystem | TransformersSystem | FasterWhisperSystem] = {}
    try:
        for name in system_names(options.peers):
            if name in (TARGET, SPECULATIVE):
                systems[name] = OurSystem(pair, replace(options.transcribe, speculative=name == SPECULATIVE), options.batch_size)
            elif name == FASTER_WHISPER:
                systems[name] = FasterWhisperSystem(pair, options.transcribe)
            else:
                systems[name] = TransformersSystem(pair, options.transcribe, assisted=name == TRANSFORMERS_ASSISTED)
        names = list(systems)
        warmed: set[str] = set()
        with tqdm(total=len(results), desc="evaluate", unit="file", disable=not options.progress) as bar:
            for index, batch in enumerate(batches):
                loaded: list[tuple[FileResult, AudioInput]] = []
                for result in batch:
                    try:
                        # A silent clip is scored: what a system writes for it is all insertions.
                        samples = load_audio(result.clip.path, allow_silence=True)
                    except Exception as error:
                        result.error = _describe(error)
                        continue
                    result.duration = len(samples) / SAMPLE_RATE
                    # Named by path (a failed batch's message names its culprits), unique in the batch.
                    name = str(result.clip.path)
                    if any(item.name == name for _, item in loaded):  # a manifest may list a file twice
                        name = f"{name} #{results.index(result) + 1}"
                    loaded.append((result, AudioInput(name, samples)))
                items = [item for _, item in loaded]
                language = batch[0].clip.language
                if items and language not in warmed:
                    # First calls pay one-off costs (weight packing, allocations; on a GPU our new
                    # Transcriber for each language too): each language's first batch, cut to 30 s, untimed.
                    warm = [AudioInput(item.name, item.samples[:WINDOW_SAMPLES]) for item in items]
                    for system in systems.values():
                        system.run(warm if isinstance(system, OurSystem) else warm[:1], language)
                    warmed.add(language)
                if items:
                    # The systems take turns, starting one further on each batch and repeat, to share the machine's drift.
                    attempts: dict[str, list[list[Run]]] = {name: [] for name in names}
                    for repeat in range(options.repeats):
                        shift = (index + repeat) % len(names)
                        for name in names[shift:] + names[:shift]:
                            attempts[name].append(systems[name].run(items, language))
                    for name, runs in attempts.items():
                        for i, ((result, _), run) in enumerate(zip(loaded, median_attempt(runs))):
                            result.runs[name] = run
                            result.repeat_seconds[name] = [attempt[i].seconds for attempt in runs]
                bar.update(len(batch))
                bar.set_postfix_str(Path(batch[-1].clip.path).name)
                if loads is not None:
                    loads.append(machine_load())
    finally:
        for system in systems.values():
            if isinstance(system, FasterWhisperSystem):
                system.process.close()
    if warm_up is not None:  # filled in for the report: our systems' untimed graph work
        warm_up.update({name: asdict(s.warm_up_graphs) for name, s in systems.items() if isinstance(s, OurSystem)})
    if draft_lengths is not None:
        draft_lengths.update({name: summary for name, s in systems.items()
                              if isinstance(s, OurSystem) and (summary := s.draft_length()) is not None})
    return results


def median_attempt(attempts: list[list[Run]]) -> list[Run]:
    """Of a system's repeated runs of one batch, the one whose batch took the median time (the
    lower of the two middle ones); the first where a file failed, should any (a failure in one
    repeat, an out-of-memory error, is not hidden by the others' success)."""
    if failed := next((runs for runs in attempts if any(run.error for run in runs)), None):
        return failed
    return sorted(attempts, key=lambda runs: sum(run.seconds for run in runs))[(len(attempts) - 1) // 2]


def describe_environment(pair: ModelPair, options: EvaluateOptions) -> dict:
    return {
        "device": str(pair.target.device),
        "dtype": pair.target.dtype_label,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "preset": options.preset,
        "target": pair.target.name,
        "draft": pair.draft.name,
        "batch_size": options.batch_size,
        "repeats": options.repeats,
        "cuda_graphs": options.transcribe.cuda_graphs and pair.target.device.type == "cuda",
        "compiled": options.transcribe.compile,
        "lengths_attention": lengths_kernel(options.transcribe.lengths_attention),  # None: masked
        "fused_layers": options.transcribe.fused_layers,
        # With --vad every system decodes the speech that faster-whisper's Silero VAD keeps
        # (transformers is given those samples), timed from the whole recording.
        "vad": options.transcribe.vad_filter,
        "vad_parameters": None if options.transcribe.vad_parameters is None else options.transcribe.vad_parameters.changed(),
        "peers_batch_size": 1,
        "threads": torch.get_num_threads(),
        "normalizer": NORMALIZER,
        "retry_greedy_copies": options.transcribe.retry_greedy_copies,
        "notes": NOTES + ([RULES_NOTE if options.transcribe.retry_greedy_copies else RULES_KEPT_NOTE] if options.peers else [])
        + [note for peer in options.peers for note in PEER_NOTES[peer]]
        + _precision_notes(pair, options),
    }


def _precision_notes(pair: ModelPair, options: EvaluateOptions) -> list[str]:
    """Where faster-whisper cannot compute as ours does: CTranslate2 has no bfloat16 on a CPU,
    where --dtype auto runs our encoder in it (most of a short clip's time)."""
    if "faster-whisper" not in options.peers or pair.target.device.type != "cpu" or pair.target.encoder_dtype == torch.float32:
        return []
    return [f"Ours ran in {pair.target.dtype_label}, faster-whisper in float32 (CTranslate2 has no bfloat16 on a "
            "CPU): part of the speed difference is the precision; --dtype float32 compares like with like."]


def _lengths_label(kernel: bool | str | None) -> str:
    """The header's words for attention by row lengths (environment["lengths_attention"])."""
    if not kernel:
        return ""
    return ", attention by row lengths" + (" (our Triton kernel)" if kernel == "triton" else "")


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def _identical(a: Run, b: Run, with_times: bool) -> bool:
    return a.tokens == b.tokens and (not with_times or a.segment_times == b.segment_times)


def build_report(results: list[FileResult], systems: list[str], environment: dict) -> dict:
    """The report's figures. Files whose audio could not be read, or that failed in our
    target-only or speculative run, are listed in failures and left out of every figure;
    a peer's figures cover the rest of the files it transcribed, and its speed-up, and
    where it transcribed fewer its WER too, are set beside our target-only run's on those
    same files."""
    scored = [r for r in results if r.ok(TARGET) and r.ok(SPECULATIVE)]
    normalized = {
        id(r): {"reference": normalize(r.clip.reference, r.clip.language),
                **{s: normalize(r.runs[s].text, r.clip.language) for s in systems if r.ok(s)}}
        for r in scored
    }
    summary = {}
    for system in systems:
        done = [(r, normalized[id(r)]) for r in scored if r.ok(system)]
        runs = [r.runs[system] for r, _ in done]
        stats = DecodeStats()
        for run in runs:
            stats.add(run.stats)
        seconds = sum(run.seconds for run in runs)
        entry = {
            "files": len(done),
            "wer": normalized_wer([n["reference"] for _, n in done], [n[system] for _, n in done]) if done else None,
            # In WER as insertions; where no reference has a word (a set of silences), the only figure.
            "words_where_none_said": sum(len(n[system].split()) for _, n in done if not n["reference"].split()),
            "seconds": seconds,
            "rtfx": _ratio(sum(r.duration for r, _ in done), seconds),
            "features_seconds": _total(run.features_seconds for run in runs),
            "encoder_seconds": _total(run.encoder_seconds for run in runs),
            "decoder_seconds": _total(run.decoder_seconds for run in runs),
            "speedup_vs_target": _ratio(sum(r.runs[TARGET].seconds for r, _ in done), seconds),
        }
        languages = sorted({r.clip.language for r, _ in done})
        if len(languages) > 1:  # one corpus WER adds words of some with letters of others (SCORED_BY_LETTER)
            entry["wer_by_language"] = {
                language: normalized_wer([n["reference"] for r, n in done if r.clip.language == language],
                                         [n[system] for r, n in done if r.clip.language == language])
                for language in languages}
        if environment.get("repeats", 1) > 1 and runs:
            # Each timed round's seconds over these files: the spread the median hides.
            entry["seconds_by_repeat"] = [sum(r.repeat_seconds[system][k] for r, _ in done)
                                          for k in range(environment["repeats"])]
        if done and len(done) < len(scored):  # its WER is over fewer files: ours on those same files beside it
            entry["target_wer_on_these_files"] = normalized_wer([n["reference"] for _, n in done], [n[TARGET] for _, n in done])
        if system in (TARGET, SPECULATIVE) and environment.get("cuda_graphs"):
            entry["cuda_graphs"] = asdict(sum((run.graphs for run in runs), GraphCounts()))
        if system in SPECULATIVE_SYSTEMS:
            entry["acceptance_rate"] = stats.acceptance_rate
            entry["draft_tokens"] = {"proposed": stats.draft_proposed, "accepted": stats.draft_accepted}
            # Proposed by hints (a retry at a higher temperature checks the failed attempt first):
            # counted in tokens per target pass, not in the draft's acceptance.
            entry["hint_tokens"] = {"proposed": stats.hint_proposed, "accepted": stats.hint_accepted}
            entry["tokens_per_target_pass"] = stats.tokens_per_target_pass
            entry["target_passes"] = stats.target_passes
            # How many draft tokens each target pass that verified some accepted: {accepted: passes}.
            entry["accepted_per_pass_histogram"] = dict(sorted(Counter(stats.accepted_per_pass).items()))
        if system != TARGET:
            same = sum(_identical(r.runs[system], r.runs[TARGET], system == SPECULATIVE) for r, _ in done)
            entry["identical_to_target_fraction"] = _ratio(same, len(done))
        if system == TRANSFORMERS_ASSISTED:
            entry["speedup_vs_transformers_target"] = _ratio(
                sum(r.runs[TRANSFORMERS_TARGET].seconds for r, _ in done if r.ok(TRANSFORMERS_TARGET)),
                sum(r.runs[system].seconds for r, _ in done if r.ok(TRANSFORMERS_TARGET)),
            )
        errors = [r.runs[system].error for r in results if r.error is None and not r.ok(system)]
        if errors and not done:
            entry["error"] = errors[0]  # it failed on every file: most likely a configuration it cannot run
        summary[system] = entry

    failures = []
    for r in results:
        if r.error is not None:
            failures.append({"file": str(r.clip.path), "system": None, "reason": r.error})
        failures += [{"file": str(r.clip.path), "system": s, "reason": r.runs[s].error} for s in systems if s in r.runs and r.runs[s].error]

    per_file = []
    for r in results:
        entry = {"file": str(r.clip.path), "duration": r.duration, "language": r.clip.language, "reference": r.clip.reference}
        if r.error is not None:
            entry["error"] = r.error
        for system, run in r.runs.items():
            if run.error is not None:
                entry[f"{system}_error"] = run.error
                continue
            entry[f"{system}_text"] = run.text
            if id(r) in normalized:  # the file's own word errors and its reference's words
                entry[f"{system}_errors"] = asdict(word_errors(normalized[id(r)]["reference"], normalized[id(r)][system]))
            entry[f"{system}_seconds"] = run.seconds
            entry[f"{system}_features_seconds"] = run.features_seconds
            entry[f"{system}_encoder_seconds"] = run.encoder_seconds
            entry[f"{system}_decoder_seconds"] = run.decoder_seconds
            if system in SPECULATIVE_SYSTEMS:
                entry[f"{system}_acceptance_rate"] = run.stats.acceptance_rate
                entry[f"{system}_tokens_per_target_pass"] = run.stats.tokens_per_target_pass
        if r.ok(TARGET) and r.ok(SPECULATIVE):
            entry["identical"] = _identical(r.runs[SPECULATIVE], r.runs[TARGET], with_times=True)
            entry["same_tokens"] = _identical(r.runs[SPECULATIVE], r.runs[TARGET], with_times=False)
            entry["normalized"] = normalized[id(r)]
            for system in systems:
                if system not in (TARGET, SPECULATIVE) and r.ok(system):
                    entry[f"{system}_identical_to_target"] = _identical(r.runs[system], r.runs[TARGET], with_times=False)
        per_file.append(entry)

    target, speculative = summary[TARGET], summary[SPECULATIVE]
    return {
        "n_files": len(scored),
        "files_without_reference_words": sum(1 for r in scored if not normalized[id(r)]["reference"].split()),
        "audio_seconds": sum(r.duration for r in scored),
        "systems": summary,
        "by_length": _by_length(scored, systems),
        "identical_fraction": speculative["identical_to_target_fraction"],
        "wer_delta": None if target["wer"] is None else speculative["wer"] - target["wer"],  # None: no reference words
        "speedup": _ratio(target["seconds"], speculative["seconds"]),
        "decoder_speedup": _ratio(target["decoder_seconds"], speculative["decoder_seconds"]),
        # Both systems ran in the same round of turns, one after the other: a round's ratio is like with like.
        "speedup_by_repeat": [_ratio(t, s) for t, s in zip(target.get("seconds_by_repeat", []),
                                                          speculative.get("seconds_by_repeat", []))],
        "per_file": per_file,
        "failures": failures,
        # A manifest's duration_seconds far from its file's: a row that names the wrong file?
        "duration_mismatches": [{"file": str(r.clip.path), "manifest_seconds": r.clip.duration, "audio_seconds": r.duration}
                                for r in scored if r.clip.duration is not None
                                and abs(r.clip.duration - r.duration) > max(1.0, 0.1 * r.clip.duration)],
        "environment": environment,
    }


def _by_length(scored: list[FileResult], systems: list[str]) -> dict:
    """Seconds and RTFx per system for files of one window (up to 30 s) and longer ones:
    short files pay a whole window's encoder for little audio, long ones are mostly decoding."""
    groups = {}
    for name, files in (("up to 30 s", [r for r in scored if r.duration <= 30]),
                        ("over 30 s", [r for r in scored if r.duration > 30])):
        done = {system: [r for r in files if r.ok(system)] for system in systems}
        if files:
            groups[name] = {"files": len(files), "audio_seconds": sum(r.duration for r in files), "systems": {
                system: {"files": len(rs), "seconds": sum(r.runs[system].seconds for r in rs),
                         "rtfx": _ratio(sum(r.duration for r in rs), sum(r.runs[system].seconds for r in rs))}
                for system, rs in done.items() if rs}}
    return groups


def _percent(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{100 * value:.{digits}f}%"


def _total(values: Iterable[float | None]) -> float | None:
    """A sum of what every run told (None where one did not, or there was none)."""
    values = list(values)
    return None if None in values or not values else sum(values)


def _rest(times: dict) -> float:
    """A system's seconds outside its features, encoder and decoder (its per-file or summary times)."""
    return times["seconds"] - times["features_seconds"] - times["encoder_seconds"] - times["decoder_seconds"]


def _draft_length_line(rows, entry: dict) -> str:
    """A batch size's rounds by k and, once both kinds of round were measured, the costs fitted and k chosen."""
    rounds = ", ".join(f"k = {k}: {n}" for k, n in entry["rounds_by_k"].items())
    size = "batches of 1 row" if int(rows) == 1 else f"batches of up to {rows} rows"
    line = f"{size}, {sum(entry['rounds_by_k'].values())} rounds measured ({rounds})"
    if "k" in entry:
        line += (f", last fitted a plain round {entry['plain_round_ms']:.2f} ms, a drafting round's overhead "
                 f"{entry['overhead_ms']:.2f} ms and {entry['per_proposal_ms']:.2f} ms a proposal, so "
                 + (f"k = {entry['k']}" if entry["k"] else "no drafting"))
    return line


def _number(value: float | None, unit: str = "", digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def _repeats(repeats: int) -> str:
    middle = "" if repeats % 2 else " (the faster of the middle two)"
    return f", the median of {repeats} timed runs per batch{middle}" if repeats > 1 else ""


def render_markdown(report: dict, title: str) -> str:
    env = report["environment"]
    model = f"preset `{env['preset']}`: " if env["preset"] else ""
    peers = [LABELS[s] for s in report["systems"] if s not in (TARGET, SPECULATIVE)]
    peers = f" ({', '.join(peers)}: one file at a time)" if peers else ""
    lines = [
        f"# Evaluation: {title}",
        "",
        f"{report['n_files']} file{'' if report['n_files'] == 1 else 's'}, {report['audio_seconds']:.1f} s of audio; "
        f"{env['device']}, {env['dtype']}, "
        f"{env['threads']} threads{', CUDA graphs' if env.get('cuda_graphs') else ''}"
        f"{', compiled steps' if env.get('compiled') else ''}{_lengths_label(env.get('lengths_attention'))}"
        f"{', fused layers' if env.get('fused_layers') else ''}"
        f"{', silences cut (VAD)' if env.get('vad') else ''}, "
        f"batch {env['batch_size']}{peers}{_repeats(env.get('repeats', 1))}; {model}target `{env['target']}`, "
        f"draft `{env['draft']}`; torch {env['torch']}, transformers {env['transformers']}"
        + (f"; {load_note(env['load_average'], env['threads'])}." if "load_average" in env else "."),
        "",
        "| system | files | WER | seconds | RTFx | speed-up vs ours target-only | decoder s | acceptance "
        "| tokens / target pass | identical to ours target-only |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for system, s in report["systems"].items():
        if "error" in s:
            lines.append(f"| {LABELS[system]} | 0 | failed on every file: {s['error'][:200]} | | | | | | | |")
            continue
        fewer = f" (ours target-only on these files: {_percent(s['target_wer_on_these_files'])})" if "target_wer_on_these_files" in s else ""
        lines.append(
            f"| {LABELS[system]} | {s['files']} | {_percent(s['wer'])}{fewer} | {_number(s['seconds'])} | {_number(s['rtfx'], digits=1)} "
            f"| {_number(s['speedup_vs_target'], 'x')} | {_number(s['decoder_seconds'])} "
            f"| {_percent(s.get('acceptance_rate'), 0)} | {_number(s.get('tokens_per_target_pass'))} "
            f"| {_percent(s.get('identical_to_target_fraction'), 0)} |"
        )
    by_language = [(system, s["wer_by_language"]) for system, s in report["systems"].items() if "wer_by_language" in s]
    if by_language:
        letters = sorted(set(by_language[0][1]) & SCORED_BY_LETTER)
        lines += ["", "WER by language" + (f" (of letters for {', '.join(letters)}: written without spaces)" if letters
                                           else "") + ": " + "; ".join(
            f"{LABELS[system]}: " + ", ".join(f"{language} {_percent(wer)}" for language, wer in wers.items())
            for system, wers in by_language) + "."]
    if silent := report.get("files_without_reference_words", 0):
        lines += ["", f"Words written for the {silent} clip{'s' * (silent > 1)} whose reference has none (silence, "
                      "noise): " + "; ".join(f"{LABELS[system]} {s['words_where_none_said']}"
                                             for system, s in report["systems"].items() if "error" not in s) + "."]
    if report["n_files"]:
        identical = sum(1 for f in report["per_file"] if f.get("identical"))
        delta = "-" if report["wer_delta"] is None else f"{100 * report['wer_delta']:+.2f} points"
        uncompared = len(report["per_file"]) - report["n_files"]
        lines += [
            "",
            f"Speculative vs target-only: {identical}/{report['n_files']} transcripts identical"
            f"{f' ({uncompared} more not compared, see Failures)' if uncompared else ''}, WER delta {delta}, "
            f"{_pace(report['speedup'])} end to end, {_number(report['decoder_speedup'], 'x')} in the decoder.",
        ]
        if rounds := [r for r in report.get("speedup_by_repeat", []) if r is not None]:
            lines[-1] += (f" Round by round ({len(rounds)} timed rounds, the two systems in turn) the end-to-end speed-up "
                          f"ran from {_number(min(rounds), 'x')} to {_number(max(rounds), 'x')}.")
        if report["systems"][SPECULATIVE]["draft_tokens"]["proposed"] == 0:
            lines[-1] += (" The draft proposed no token (every target pass was the target's own): both did the same "
                          "work, and the difference is run-to-run noise.")
        differing = [f for f in report["per_file"] if f.get("identical") is False]
        if differing:
            lines += ["", f"Files where ours speculative differs from ours target-only ({len(differing)}):", ""]
            lines += [f"- `{f['file']}`: "
                      + (("the same text, other segment times" if f["same_tokens"] else "the same text, other tokens")
                         if f[f"{SPECULATIVE}_text"] == f[f"{TARGET}_text"] else
                         f"target-only \"{f[f'{TARGET}_text']}\" / speculative \"{f[f'{SPECULATIVE}_text']}\"")
                      for f in differing]
    split = [(system, s) for system, s in report["systems"].items() if s.get("features_seconds") is not None]
    if split:
        lines += ["", "Where the seconds went (features, encoder, decoder, and the rest: the host's work around them): "
                  + "; ".join(f"{LABELS[system]}: {_number(s['features_seconds'])}, {_number(s['encoder_seconds'])}, "
                              f"{_number(s['decoder_seconds'])}, {_number(_rest(s))}" for system, s in split) + "."]
    graphed = [(system, s["cuda_graphs"]) for system, s in report["systems"].items() if "cuda_graphs" in s]
    if graphed:
        lines += ["", "CUDA graphs in the timed runs (host seconds): " + "; ".join(
            f"{LABELS[system]}: {g['eager']} steps run eagerly ({g['eager_seconds']:.2f} s), {g['captures']} captured "
            f"({g['capture_seconds']:.2f} s), {g['replays']} replays"
            + (f", {g['compilations']} compilations" if g.get("compilations") else "")
            + (f", {g['failed']} captures failed (run eagerly)" if g.get("failed") else "") for system, g in graphed) + "."]
    warmed = env.get("warm_up_graphs") or {}
    if warmed:
        lines += ["", "Before them, untimed, each engine's warm-up captured every step its batches can meet: " + "; ".join(
            f"{LABELS[system]}: {g['eager']} first uses ({g['eager_seconds']:.2f} s), {g['captures']} captures "
            f"({g['capture_seconds']:.2f} s)" + (f", {g['compilations']} compilations" if g.get("compilations") else "")
            + (f", {g['failed']} captures failed (run eagerly)" if g.get("failed") else "")
            for system, g in warmed.items()) + "."]
    if (length := env.get("draft_length")) and length["fixed"] is None and length["by_rows"]:
        lines += ["", f"{LABELS[SPECULATIVE]}'s adaptive draft length, over every round of the process (warm-ups "
                  "included): " + "; ".join(_draft_length_line(rows, entry) for rows, entry in length["by_rows"].items())
                  # Not the table's accepted over proposed (proposals after a rejection count there): the
                  # rate of speculative decoding's model, on which the length is chosen.
                  + "; its estimate of a proposed token's acceptance (kept over kept and rejected, recent rounds "
                  "weighing most) " + ", ".join(f"{language} {100 * a:.0f}%" for language, a in length["acceptance"].items())
                  + "."]
    if len(report["by_length"]) > 1:
        systems = list(report["systems"])
        lines += ["", "| files | audio s | " + " | ".join(f"{LABELS[s]} s (RTFx)" for s in systems) + " |",
                  "|---|---|" + "---|" * len(systems)]
        for name, group in report["by_length"].items():
            # A system that failed on some files: its seconds are of fewer files than the row's, so say how many.
            cells = [f"{_number(g['seconds'])} ({_number(g['rtfx'], digits=1)})"
                     + (f" on {g['files']} of {group['files']}" if g["files"] < group["files"] else "")
                     if (g := group["systems"].get(s)) else "-" for s in systems]
            lines.append(f"| {group['files']} {name} | {group['audio_seconds']:.1f} | " + " | ".join(cells) + " |")
    assisted = report["systems"].get(TRANSFORMERS_ASSISTED, {})
    if assisted.get("speedup_vs_transformers_target") is not None:
        lines += ["", f"transformers assisted vs transformers generate: "
                      f"{_number(assisted['speedup_vs_transformers_target'], 'x')} end to end."]
    for system in report["systems"]:
        differing = [f for f in report["per_file"] if f.get(f"{system}_identical_to_target") is False]
        if differing:
            lines += ["", f"Files where {LABELS[system]}'s text tokens differ from ours target-only ({len(differing)}):", ""]
            lines += [f"- `{f['file']}`: ours \"{f[f'{TARGET}_text']}\" / {LABELS[system]} \"{f[f'{system}_text']}\""
                      for f in differing]
    if mismatches := report.get("duration_mismatches"):
        lines += ["", f"Files whose audio is not as long as the manifest's duration_seconds says ({len(mismatches)}: "
                      "the wrong file?):", ""]
        lines += [f"- `{m['file']}`: {m['audio_seconds']:.1f} s, the manifest says {m['manifest_seconds']:.1f} s"
                  for m in mismatches]
    if report["failures"]:
        lines += ["", f"Failures ({len(report['failures'])}):", ""]
        lines += [f"- `{f['file']}` ({f['system'] or 'audio'}): {f['reason']}" for f in report["failures"]]
    lines += ["", "Plots: " + ", ".join(f"[{name}]({name})" for name in PLOTS), "", "Notes:", ""]
    lines += [f"- {note}" for note in env["notes"]] + [f"- Text normaliser: {env['normalizer']}.", ""]
    return "\n".join(lines)


def _pace(speedup: float | None) -> str:
    """A speed ratio in words that read right on both sides of 1."""
    if speedup is None:
        return "-"
    if speedup >= 1:
        return f"{_number(speedup, 'x')} faster"
    return f"{_number(speedup, 'x')} the speed (slower)"


def render_plots(report: dict) -> dict[str, bytes]:
    """The plots as PNG files' contents, by name."""
    # The object-oriented API renders with Agg without touching pyplot's global backend.
    from matplotlib.figure import Figure

    systems = [s for s, v in report["systems"].items() if "error" not in v]
    files = [f for f in report["per_file"] if "identical" in f]
    figures = {name: Figure(figsize=(7, 4.5), layout="constrained") for name in PLOTS}

    ax = figures["speedup_vs_duration.png"].subplots()
    for fast, slow, label in [(SPECULATIVE, TARGET, "ours: speculative vs target-only"),
                              (TRANSFORMERS_ASSISTED, TRANSFORMERS_TARGET, "transformers: assisted vs generate")]:
        points = [(f["duration"], f[f"{slow}_seconds"] / f[f"{fast}_seconds"]) for f in files
                  if f.get(f"{fast}_seconds") and f.get(f"{slow}_seconds")]
        if points:
            ax.scatter(*zip(*points), label=label, alpha=0.8)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set(xlabel="clip duration (s)", ylabel="speed-up, end to end (x)", title="Per-clip speed-up vs duration")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()

    ax = figures["acceptance_histogram.png"].subplots()
    histograms = [(s, {int(a): n for a, n in report["systems"][s]["accepted_per_pass_histogram"].items()})
                  for s in SPECULATIVE_SYSTEMS if s in systems and report["systems"][s].get("accepted_per_pass_histogram")]
    width = 0.8 / max(1, len(histograms))
    for i, (s, histogram) in enumerate(histograms):
        passes = sum(histogram.values())
        ax.bar([a + i * width for a in histogram], [100 * n / passes for n in histogram.values()], width,
               label=f"{LABELS[s]} ({passes} of its {report['systems'][s]['target_passes']} target passes)")
    if histograms:
        ax.legend()
    # Passes that verified no draft token (the draft declined, or a retry's hint) are not in it.
    ax.set(xlabel="draft tokens accepted by a target pass", ylabel="target passes that verified draft tokens (%)",
           title="Acceptance: draft tokens accepted per target pass that verified some")

    ax = figures["wer.png"].subplots()
    scored = [(i, s) for i, s in enumerate(systems) if report["systems"][s]["wer"] is not None]  # not 0 % for no file
    wers = [100 * report["systems"][s]["wer"] for _, s in scored]
    bars = ax.bar([LABELS[s] for _, s in scored], wers, color=[f"C{i}" for i, _ in scored])
    ax.bar_label(bars, fmt="%.2f%%")
    ax.set(ylabel="WER (%)", title="Word error rate per system (normalised text)")
    ax.tick_params(axis="x", labelrotation=15)

    ax = figures["time_split.png"].subplots()
    split = [report["systems"][s] for s in systems if report["systems"][s]["features_seconds"] is not None]  # not faster-whisper's
    labels = [LABELS[s] for s in systems if report["systems"][s]["features_seconds"] is not None]
    left = [0.0] * len(split)
    for part, values in [("features", [t["features_seconds"] for t in split]), ("encoder", [t["encoder_seconds"] for t in split]),
                         ("decoder", [t["decoder_seconds"] for t in split]), ("the rest", [max(_rest(t), 0.0) for t in split])]:
        ax.barh(labels, values, left=left, label=part)
        left = [a + b for a, b in zip(left, values)]
    ax.set(xlabel="seconds", title="Where the time goes")
    ax.invert_yaxis()
    ax.legend()

    plots = {}
    for name, figure in figures.items():
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=110)
        plots[name] = buffer.getvalue()
    return plots


def write_report(report: dict, out: Path, title: str) -> str:
    """The plots, report.md and report.json, everything rendered, then written to temporary
    files, before any is renamed into place: a failure leaves a previous report whole.
    Returns report.md's text."""
    markdown = render_markdown(report, title)
    # Texts, not bytes: write_files_atomic escapes a path that is not UTF-8 (a surrogate), where
    # encoding here failed and the whole evaluation was lost.
    files = {**render_plots(report), "report.md": markdown,
             "report.json": json.dumps(report, ensure_ascii=False, indent=2) + "\n"}
    write_files_atomic({out / name: data for name, data in files.items()})
    return markdown
