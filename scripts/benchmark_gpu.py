"""GPU speed of our decoders at whisper-large-v3 geometry, and of the real packaged pair on
the dev clips, each next to its physical floor.

    python scripts/benchmark_gpu.py                                   # CUDA, float16, large-v3 geometry
    python scripts/benchmark_gpu.py --measure-bandwidth --profile --batch-sizes 1,4,16 --out out/gpu
    python scripts/benchmark_gpu.py --device cpu --geometry tiny --batch-sizes 1,2   # seconds, on CPU

Section 1, large-v3 geometry (openai/whisper-large-v3's config: d_model 1280, 32 encoder and
32 decoder layers, 20 heads, ffn 5120, 128 mel bins, 51,866 tokens, 448 target and 1,500
source positions) and a 2-layer draft of the same width reading the target's encoder (as
distil-large-v3 does), both with RANDOM weights (nothing is downloaded). Random models say
end-of-text at once or never, so end-of-text is suppressed and every row decodes exactly
--max-new-tokens tokens: per-token figures then mean something, transcripts do not. Methods:
transformers' `generate` (target only), our engine (asr/speculative.py) target-only with its
steps run eagerly and as CUDA graphs (on a GPU; the product's default), and ours speculative
with an ORACLE draft at each --acceptance: its proposals are the target's own greedy tokens
with errors injected at rate 1 - acceptance per token (asr/oracle.py), while the draft model
still runs all its forward passes, so a round costs what it would with a real draft of that size.

Section 2, the real packaged pair (--real-target, --real-draft: the embedded preset) on the
short dev clips (one 30 s window each, greedy with timestamps, natural end-of-text), with
the draft's real acceptance, at fixed k and with the adaptive length.

--compile adds our target-only and speculative rows with the engine's steps compiled whole by
torch.compile (Inductor) inside the CUDA graphs (SpeculativeDecoder.compiled); with
MODES (torch.compile's modes, comma-separated), a set of rows per mode, side by side: e.g.
`--compile default,max-autotune-no-cudagraphs` (Inductor times its own Triton matrix
products against cuBLAS per shape, and can fuse the bias, GELU and residual add into them).

--lengths-attention adds our target-only and speculative rows with the draft's steps and the
verification attending by row lengths (SpeculativeDecoder's lengths_attention: flash-attention's
kernel told each row's length, no mask, no cuDNN), side by side with the masked ones (CUDA,
float16 or bfloat16); with --compile as well, each mode's compiled rows by row lengths too.
`--lengths-attention flash,triton` gives a set of rows per kernel: flash-attention's, and
ours in Triton (asr/triton_ops.py).

--fused-layers adds rows whose steps run each linear map with the layer norm before it and the
GELU or residual add after it in one Triton kernel of ours (SpeculativeDecoder's fused_layers,
asr/triton_ops.fused_linear; CUDA): with masked attention, and with each --lengths-attention
kernel (with --compile, each mode's compiled steps around them too).

--profile runs each method once more under torch.profiler and adds its kernels per token
and their GPU time per token (on a CPU: operators per token and their time), and writes
where that time goes, per row: by kind of kernel (matrix products, attention, layer
norms, indexing such as the KV-cache writes, reductions, elementwise; from the kernels'
names) and the kernels that take the most (DIR/benchmark_gpu_kernels.md).

The floor of each row is the time to read, at --bandwidth-gbs (default: H100 SXM's 3,350
GB/s; --measure-bandwidth times a large device copy instead), the bytes its decoder steps
must read: every weight a step uses, and the cached keys and values it attends to (the
self-attention ones over the mean context, the cross-attention ones over every frame). For
speculative rows: the draft steps run (k a round at fixed k) and one target pass per round,
over the tokens a round keeps.
Each row also gives the time of its two untimed runs (first uses, captures, and for compiled
rows the compilations, where a method before it has not made them already).
Writes DIR/benchmark_gpu.md (the table), DIR/benchmark_gpu.png and DIR/benchmark_gpu.json
(with the command and date); --readme FILE also writes a shorter table into FILE, between
the lines README_BEGIN and README_END, and with --from-json does so from earlier runs'
benchmark_gpu.json alone (a GPU machine's report), measuring nothing:

    python scripts/benchmark_gpu.py --readme README.md --from-json gpu-check/benchmark-b1/benchmark_gpu.json"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import re
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
from transformers import WhisperConfig, WhisperForCausalLM, WhisperForConditionalGeneration

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from anywhere, installed or not

from asr.models import device_problem  # noqa: E402
from asr.cudagraphs import compile_modes as engine_compile_modes  # noqa: E402
from asr.decoder import LENGTHS_KERNELS, DecoderRunner, lengths_attention_unavailable  # noqa: E402
from asr.draft_length import DraftLength  # noqa: E402
from asr.oracle import OracleDraft, acceptance_from_tokens_per_pass, oracle_proposals, oracle_table  # noqa: E402
from asr.rules import DecodingRules  # noqa: E402
from asr.slots import DecodeStats, Sequence  # noqa: E402
from asr.speculative import SpeculativeDecoder  # noqa: E402
from asr import triton_ops  # noqa: E402
from transformers_reference import transformers_generate  # noqa: E402  (beside this script)

DEV = REPO.parent / "shared" / "eval" / "dev"
H100_SXM_GBS = 3350.0
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

# Special tokens of the 51,866-token vocabulary of large-v3.
EOT, SOT, EN, TRANSCRIBE, NO_TIMESTAMPS = 50257, 50258, 50259, 50360, 50364
GENERATE = "transformers generate"
TARGET_ONLY = "ours target-only"  # the product's default: CUDA graphs on a GPU; the reference for "identical"
# In fixed shapes our target-only passes compute as many positions as a speculative
# verification (max_draft_tokens + 1 = 9), so that both give the same logits: this row
# computes one, to show what that costs.
ONE_POSITION = "ours target-only, 1 position per pass"
COMPILED = "compiled"  # --compile: the steps compiled by torch.compile inside the graphs
BY_LENGTHS = "attention by row lengths"  # --lengths-attention
FUSED = "fused layers"  # --fused-layers
# Where --readme writes the table in a README.
README_BEGIN, README_END = "<!-- benchmark_gpu.py --readme: begin -->", "<!-- benchmark_gpu.py --readme: end -->"


@dataclass(frozen=True)
class Geometry:
    name: str
    d_model: int
    encoder_layers: int
    decoder_layers: int
    draft_layers: int
    heads: int
    ffn: int
    mel_bins: int
    vocab: int
    target_positions: int
    source_positions: int


GEOMETRIES = {
    "large-v3": Geometry("large-v3", 1280, 32, 32, 2, 20, 5120, 128, 51866, 448, 1500),
    # The same vocabulary and positions in a model small enough for a CPU test.
    "tiny": Geometry("tiny", 64, 2, 4, 2, 4, 128, 128, 51866, 448, 50),
}


@dataclass
class Row:
    """One method at one batch size."""

    section: str
    batch: int
    method: str
    seconds: float  # decoding the batch, median of the repeats
    steps: int  # tokens of the batch's longest row (what a caller waits for, token by token)
    tokens: int  # tokens kept by all rows (end-of-text included)
    floor_seconds: float
    identical: bool  # tokens equal ours target-only's (the loop of asr/speculative.py)
    warm_up_seconds: float = 0.0  # its two untimed runs: first uses, captures and (compiled rows) compilations
    acceptance: float | None = None  # accepted / proposed
    alpha: float | None = None  # per-token acceptance, from tokens per target pass
    tokens_per_pass: float | None = None
    oracle_alpha: float | None = None
    kernels_per_token: float | None = None  # --profile: kernels (on a CPU, operators) per token
    kernel_ms_per_token: float | None = None  # --profile: their summed time per token
    # --profile: (kind or kernel name, kernels per token, ms per token), by kind, then the costliest kernels
    kernel_kinds: list[tuple[str, float, float]] | None = None
    top_kernels: list[tuple[str, float, float]] | None = None

    @property
    def ms_per_token(self) -> float:
        return 1000 * self.seconds / self.steps

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def floor_ms_per_token(self) -> float:
        return 1000 * self.floor_seconds / self.steps


@dataclass(frozen=True)
class Decoded:
    tokens: list[list[int]]
    stats: DecodeStats | None  # None for transformers
    proposed: list[int] = field(default_factory=list)  # per row: draft tokens proposed to it


# A row of the table to be: its name, a run decoding the batch, and an oracle's acceptance.
Method = tuple[str, Callable[[], Decoded], float | None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: float16 on GPU, float32 on CPU")
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="large-v3")
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens every row decodes (section 1)")
    parser.add_argument("--num-draft-tokens", type=int, default=4, help="k, fixed, for every speculative row")
    parser.add_argument("--acceptance", default="0.6,0.8,0.95", help="the oracle draft's per-token acceptance rates")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row, after two untimed (median)")
    parser.add_argument("--bandwidth-gbs", type=float, default=H100_SXM_GBS)
    parser.add_argument("--measure-bandwidth", action="store_true", help="time a large device copy instead")
    parser.add_argument("--fixed-shapes", action="store_true", help="on a CPU too, decode in the fixed shapes a GPU uses")
    parser.add_argument("--profile", action="store_true", help="count kernels and their time per token (torch.profiler)")
    parser.add_argument("--compile", nargs="?", const="default", metavar="MODES",
                        help="add rows with the engine's steps compiled by torch.compile (SpeculativeDecoder.compiled), "
                             "a set per torch.compile mode in MODES (comma-separated; default: default)")
    parser.add_argument("--lengths-attention", nargs="?", const="flash", metavar="KERNELS",
                        help="add rows whose steps attend by row lengths (SpeculativeDecoder's lengths_attention; CUDA), "
                             "a set per kernel in KERNELS (comma-separated, of flash and triton; default: flash)")
    parser.add_argument("--fused-layers", action="store_true",
                        help="add rows whose linear maps run fused with norms, GELU and residual adds in our Triton "
                             "kernel (SpeculativeDecoder's fused_layers; CUDA), masked and by each --lengths-attention kernel")
    parser.add_argument("--real-target", default="packaged:whisper-base")
    parser.add_argument("--real-draft", default="bundled:whisper-base-2l")
    parser.add_argument("--dev", type=Path, default=DEV, help="folder of manifest.tsv (section 2)")
    parser.add_argument("--real-clips", type=int, help="use only the first N short clips")
    parser.add_argument("--real-max-new-tokens", type=int, default=224, help="a window's token limit (section 2)")
    parser.add_argument("--no-real", action="store_true", help="skip section 2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "out" / "benchmark_gpu")
    parser.add_argument("--readme", type=Path, metavar="FILE",
                        help=f"also write the table into FILE, between its lines {README_BEGIN} and {README_END}")
    parser.add_argument("--from-json", type=Path, nargs="+", metavar="JSON",
                        help="with --readme: write the table of earlier runs (their benchmark_gpu.json, rows in this "
                             "order), measuring nothing")
    args = parser.parse_args()
    if args.readme:
        readme_block(args.readme)  # before measuring: a README it cannot write fails now, not at the end
    if args.from_json:
        if not args.readme:
            parser.error("--from-json writes a README's table: give --readme")
        try:
            reports = [json.loads(path.read_text()) for path in args.from_json]
        except (OSError, ValueError) as error:
            parser.error(f"--from-json: {error}")
        write_readme(args.readme, reports)
        return
    # Its rows time CUDA graphs: a step that could not be captured (asr/cudagraphs.py) ends the run,
    # and so does a compiled step past Dynamo's recompile limit (it would run eagerly in a compiled row).
    warnings.filterwarnings("error", message="a .* step could not be captured")
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    if set(compile_modes(args)) - set(engine_compile_modes()):
        parser.error(f"--compile: modes are from {', '.join(engine_compile_modes())}")

    if problem := device_problem(args.device):  # before anything loads (torch's was an AssertionError)
        parser.error(problem)
    device = torch.device(args.device)
    if device.type == "cpu" and args.profile:  # compiled steps' kernels then show in a CPU profile
        from torch._inductor import config as inductor

        inductor.cpp.enable_kernel_profile = True
    dtype = DTYPES[args.dtype] if args.dtype else (torch.float16 if device.type == "cuda" else torch.float32)
    for kernel in lengths_kernels(args):
        if kernel not in LENGTHS_KERNELS:
            parser.error(f"--lengths-attention: kernels are {', '.join(LENGTHS_KERNELS)}, not {kernel!r}")
        if reason := lengths_attention_unavailable(device, dtype, kernel=kernel):
            parser.error(f"--lengths-attention cannot run here: {reason}")
    if args.fused_layers and (reason := triton_ops.unavailable(device, dtype)):
        parser.error(f"--fused-layers cannot run here: {reason}")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    graphs = device.type == "cuda"
    bandwidth = measure_bandwidth(device) if args.measure_bandwidth else args.bandwidth_gbs * 1e9
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    header = [
        f"{name}, {str(dtype).removeprefix('torch.')}, torch {torch.__version__}, "
        f"bandwidth {bandwidth / 1e9:.0f} GB/s ({'measured' if args.measure_bandwidth else 'given'}), "
        f"CUDA graphs {'on' if graphs else 'off (no GPU)'} for '{TARGET_ONLY}' and the speculative rows, "
        f"k = {args.num_draft_tokens} where fixed.",
        f"Section 1: {args.geometry} geometry with RANDOM weights; end-of-text suppressed, so every row decodes "
        f"exactly {args.max_new_tokens} tokens. 'oracle' rows: the draft model runs all its passes, but its "
        "proposals are replaced by the target's own greedy tokens with errors injected at rate 1 - alpha per token.",
    ]
    print("\n".join(header), flush=True)
    torch.manual_seed(args.seed)
    report = Report(args.out, header, args.profile)
    random_section(args, device, dtype, batch_sizes, bandwidth, report)
    if not args.no_real:
        if (args.dev / "manifest.tsv").is_file():
            header.append(f"Section 2: {args.real_target} + {args.real_draft} on the short clips of {args.dev} "
                          "(greedy, timestamps, natural end-of-text).")
            print(header[-1], flush=True)
            real_section(args, device, dtype, batch_sizes, bandwidth, report)
        else:
            print(f"Section 2 skipped: no {args.dev / 'manifest.tsv'}", flush=True)
    report.save(finished=True)
    rows = report.rows
    if args.readme:
        write_readme(args.readme, [report.json()])
    print("\n" + markdown(rows) + "\n\n" + PER_TOKEN)
    if importlib.util.find_spec("matplotlib") is None:  # the figures are in the table
        print(f"\nwrote {args.out}/benchmark_gpu.md, .json (no plot: matplotlib is not installed)")
    else:
        plot(rows, args.out / "benchmark_gpu.png")
        print(f"\nwrote {args.out}/benchmark_gpu.md, .json, .png")


class Report:
    """benchmark_gpu.md and .json (and with --profile benchmark_gpu_kernels.md) in OUT,
    written again as each batch of rows comes, so that a run stopped from outside (a GPU lent
    for minutes) leaves what it measured; until the run ends their header says so."""

    def __init__(self, out: Path, header: list[str], profiled: bool):
        self.out, self.header, self.profiled = out, header, profiled
        self._groups: list[list[Row]] = []  # measure()'s lists, whose rows it replaces once profiled
        out.mkdir(parents=True, exist_ok=True)

    @property
    def rows(self) -> list[Row]:
        return [row for group in self._groups for row in group]

    def add(self, rows: list[Row]) -> None:
        self._groups.append(rows)
        self.save()

    def json(self, finished: bool = True) -> dict:
        return {"header": self._header(finished), "rows": [asdict(r) for r in self.rows], "command": shown_command(sys.argv[1:]),
                "date": time.strftime("%Y-%m-%d")}

    def save(self, finished: bool = False) -> None:
        header = "\n\n".join(self._header(finished))
        writes = {"benchmark_gpu.md": header + "\n\n" + markdown(self.rows) + "\n\n" + PER_TOKEN + "\n",
                  "benchmark_gpu.json": json.dumps(self.json(finished), indent=1)}
        if self.profiled:
            writes["benchmark_gpu_kernels.md"] = header + "\n\n" + kernel_breakdown(self.rows) + "\n"
        for name, text in writes.items():  # whole or not at all: a run stopped mid-write leaves the last one
            part = self.out / f".{name}.part"
            part.write_text(text)
            part.replace(self.out / name)

    def _header(self, finished: bool) -> list[str]:
        return self.header if finished else [*self.header, "UNFINISHED: the rows measured so far (the run went on, or was stopped)."]


def engines(args: argparse.Namespace, device: torch.device) -> Callable[..., SpeculativeDecoder]:
    """Our engine as the product builds it on this device (fixed shapes and CUDA graphs on a
    GPU), or with graphs=False its steps run eagerly."""
    fixed = device.type == "cuda" or args.fixed_shapes

    def build(target: DecoderRunner, draft=None, graphs: bool = True, max_draft_tokens: int = 8,
              compile: str | None = None, lengths: str | None = None, fused: bool = False) -> SpeculativeDecoder:
        if draft is not None:  # room for the rows' fixed k
            max_draft_tokens = max(args.num_draft_tokens, max_draft_tokens)
        return SpeculativeDecoder(target, draft, max_draft_tokens=max_draft_tokens, fixed_shapes=fixed,
                                  cuda_graphs=graphs, compile=compile, lengths_attention=lengths, fused_layers=fused)
    return build


def variants(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """The engine's variants beside its default, each a set of rows: a label's suffix, and the
    engine's options (compiled steps per --compile mode; attention by lengths; with both, each
    mode's compiled steps by lengths too; fused layers, masked and by each kernel, compiled too)."""
    found = [(f", {compiled(mode)}", dict(compile=mode)) for mode in compile_modes(args)]
    found += [(f", {FUSED}", dict(fused=True))] if args.fused_layers else []
    for kernel in lengths_kernels(args):
        label = BY_LENGTHS + (" (ours, Triton)" if kernel == "triton" else "")
        found += [(f", {label}", dict(lengths=kernel))]
        found += [(f", {compiled(mode)}, {label}", dict(compile=mode, lengths=kernel)) for mode in compile_modes(args)]
        if args.fused_layers:
            found += [(f", {label}, {FUSED}", dict(lengths=kernel, fused=True))]
            found += [(f", {compiled(mode)}, {label}, {FUSED}", dict(compile=mode, lengths=kernel, fused=True))
                      for mode in compile_modes(args)]
    return found


def lengths_kernels(args: argparse.Namespace) -> list[str]:
    """--lengths-attention's kernels (none without it)."""
    if not args.lengths_attention:
        return []
    return list(dict.fromkeys(k.strip() for k in args.lengths_attention.split(",") if k.strip()))


def compile_modes(args: argparse.Namespace) -> list[str]:
    """--compile's torch.compile modes (none without it)."""
    return list(dict.fromkeys(mode.strip() for mode in args.compile.split(",") if mode.strip())) if args.compile else []


def compiled(mode: str) -> str:
    """A compiled row's label: plain for torch.compile's default mode, else naming the mode."""
    return COMPILED if mode == "default" else f"{COMPILED} {mode}"


def random_section(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, batch_sizes: list[int],
                   bandwidth: float, report: Report) -> None:
    geometry = GEOMETRIES[args.geometry]
    target, draft = random_pair(geometry, device, dtype)
    target_runner = DecoderRunner(target.model.decoder, target.proj_out.weight)
    draft_runner = DecoderRunner(draft.model.decoder, draft.proj_out.weight)
    suppress = [EOT] + list(range(SOT, NO_TIMESTAMPS))  # end-of-text too: fixed-length decoding
    rules = DecodingRules(vocab_size=geometry.vocab, eot=EOT, no_timestamps=NO_TIMESTAMPS, suppress=suppress,
                          begin_suppress=[220], timestamps=False, device=device)
    prompt = [SOT, EN, TRANSCRIBE, NO_TIMESTAMPS]
    max_new = args.max_new_tokens
    k = args.num_draft_tokens
    engine = engines(args, device)
    element = torch.finfo(dtype).bits // 8
    context = len(prompt) + max_new / 2
    for batch in batch_sizes:
        features = torch.randn(batch, geometry.mel_bins, 2 * geometry.source_positions, device=device, dtype=dtype)
        with torch.inference_mode():
            encoded = target.model.encoder(features).last_hidden_state
        frames = encoded.shape[1]
        target_bytes = step_bytes(target_runner, batch, context, frames, element)
        draft_bytes = step_bytes(draft_runner, batch, context, frames, element)

        def ours(decoder: SpeculativeDecoder, **options) -> Callable[[], Decoded]:
            def run() -> Decoded:
                sequences = decoder.decode(encoded, [prompt] * batch, rules, max_new_tokens=max_new, **options)
                return decoded(sequences)
            return run

        target_only = engine(target_runner)  # one engine per batch size: its states go with it
        methods: list[Method] = [
            (GENERATE, lambda: Decoded(transformers_generate(target, encoded, prompt, suppress, [220], None, EOT, max_new), None),
             None),
            (f"{TARGET_ONLY}, eager", ours(engine(target_runner, graphs=False)), None),
            (TARGET_ONLY, ours(target_only), None),
            (ONE_POSITION, ours(engine(target_runner, max_draft_tokens=0)), None),
        ]
        for suffix, options in variants(args):
            methods.append((f"{TARGET_ONLY}{suffix}", ours(engine(target_runner, **options)), None))
        # The oracle's right answers: the target-only tokens, fused layers' own (their kernels round otherwise).
        reference = ours(target_only)().tokens
        references = {suffix: ours(engine(target_runner, **options))().tokens if options.get("fused") else reference
                      for suffix, options in [("", {})] + variants(args)}
        for alpha in [float(a) for a in args.acceptance.split(",")]:
            slots = target_only.states.rows_for(batch)
            for suffix, options in [("", {})] + variants(args):
                proposals = oracle_proposals(references[suffix], alpha, geometry.vocab, seed=args.seed)
                table = oracle_table(proposals, [len(prompt)] * batch, slots, target_only.capacity, device)
                oracle = engine(target_runner, OracleDraft(draft_runner, table), **options)
                methods.append((f"ours speculative{suffix}, oracle alpha={alpha:g}",
                                ours(oracle, draft_length=DraftLength(fixed=k)), alpha))
        measure(f"{geometry.name} geometry, random weights", batch, methods, args, device,
                target_bytes, draft_bytes, k, bandwidth, ends_with_eot=False, report=report)


def real_section(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, batch_sizes: list[int],
                 bandwidth: float, report: Report) -> None:
    from asr.audio import load_audio
    from asr.features import first_window
    from asr.models import load_pair
    from asr.transcribe import TranscribeOptions, Transcriber

    pair = load_pair(args.real_target, args.real_draft, device=device, dtype=dtype)
    target, draft = pair.target, pair.draft
    rules = Transcriber(pair, TranscribeOptions(language="en")).rules(timestamps=True)
    prompt = target.vocab.sot_sequence("en", "transcribe")
    max_new = min(args.real_max_new_tokens, target.runner.max_positions - 1 - len(prompt))
    clips = short_clips(args.dev / "manifest.tsv")[: args.real_clips]
    windows = [first_window(load_audio(path), target.config.num_mel_bins) for path in clips]
    k = args.num_draft_tokens
    engine = engines(args, device)
    element = torch.finfo(dtype).bits // 8
    section = f"{args.real_target} + {args.real_draft}, {len(clips)} dev clips"
    for batch in batch_sizes:
        chunks = [torch.stack(windows[i : i + batch]).to(device) for i in range(0, len(windows), batch)]
        with torch.inference_mode():
            encoded = [target.encode(chunk) for chunk in chunks]

        def ours(decoder: SpeculativeDecoder, draft_length: Callable[[], DraftLength | None] = lambda: None) -> Callable[[], Decoded]:
            def run() -> Decoded:
                results, length = [], draft_length()  # the adaptive length learns across a run's windows
                for e in encoded:
                    results += decoder.decode(e, [prompt] * len(e), rules, max_new_tokens=max_new,
                                              no_speech_token=target.vocab.no_speech, draft_length=length)
                return decoded(results)
            return run

        def generate() -> Decoded:
            tokens = []
            for e in encoded:
                tokens += transformers_generate(target.model, e, prompt, rules.suppress.tolist(), target.begin_suppress,
                                                target.vocab.no_timestamps, target.vocab.eot, max_new)
            return Decoded(tokens, None)

        speculative = engine(target.runner, draft.runner)
        methods: list[Method] = [
            (GENERATE, generate, None),
            (f"{TARGET_ONLY}, eager", ours(engine(target.runner, graphs=False)), None),
            (TARGET_ONLY, ours(engine(target.runner)), None),
            (f"ours speculative, k = {k}", ours(speculative, lambda: DraftLength(fixed=k)), None),
            ("ours speculative, adaptive k", ours(speculative, lambda: DraftLength()), None),
        ]
        for suffix, options in variants(args):
            methods += [(f"{TARGET_ONLY}{suffix}", ours(engine(target.runner, **options)), None),
                        (f"ours speculative, adaptive k{suffix}",
                         ours(engine(target.runner, draft.runner, **options), lambda: DraftLength()), None)]
        lengths = [len(t) for t in ours(engine(target.runner))().tokens]
        frames = encoded[0].shape[1]
        context = len(prompt) + statistics.mean(lengths) / 2
        # Floors per batch of `batch` rows; every chunk but the last is full.
        target_bytes = step_bytes(target.runner, batch, context, frames, element)
        draft_bytes = step_bytes(draft.runner, batch, context, frames, element)
        measure(section, batch, methods, args, device, target_bytes, draft_bytes, k, bandwidth,
                ends_with_eot=True, report=report, chunks=[len(e) for e in encoded])


def measure(section: str, batch: int, methods: list[Method], args: argparse.Namespace, device: torch.device,
            target_bytes: int, draft_bytes: int, k: int, bandwidth: float, ends_with_eot: bool, report: Report,
            chunks: list[int] | None = None) -> list[Row]:
    """Times every method (one untimed run first: warm-up; two for graph capture, which
    happens on a step's second use), taking turns so that the machine's drift is shared,
    and returns their rows, written into the report as they come (the rows' timings, then
    each one's profile with --profile). ends_with_eot: every row kept an end-of-text (not in its tokens)
    besides its tokens; chunks: rows per decode call."""
    runs: dict[str, list[float]] = {name: [] for name, _, _ in methods}
    warm_up: dict[str, float] = dict.fromkeys(runs, 0.0)  # the untimed runs: first uses, captures, compilations
    results: dict[str, Decoded] = {}
    warm_ups = 2
    for repeat in range(args.repeats + warm_ups):
        shift = repeat % len(methods)  # one further each repeat: no method always runs first
        for name, run, _ in methods[shift:] + methods[:shift]:
            synchronize(device)
            began = time.perf_counter()
            try:
                results[name] = run()
            except Exception as error:  # noqa: BLE001
                if BY_LENGTHS not in name and FUSED not in name:
                    raise
                # Not yet run on a GPU when written: where its kernel refuses, its rows go, not the run.
                methods = [method for method in methods if method[0] != name]
                report.header.append(f"FAILED, left out: {section}, batch {batch}, {name}: {type(error).__name__}: {error}")
                print(f"    {section} | batch {batch} | {name}: FAILED, left out: {error}", flush=True)
                continue
            synchronize(device)
            seconds = time.perf_counter() - began
            if repeat >= warm_ups:
                runs[name].append(seconds)
            else:
                warm_up[name] += seconds
            # As it goes: a run stopped from outside (a machine lent for minutes) still tells this much.
            longest = max(len(t) for t in results[name].tokens)
            print(f"    {section} | batch {batch} | {name}: {'timed' if repeat >= warm_ups else 'untimed'} run {seconds:.2f} s, "
                  f"{1000 * seconds / longest:.2f} ms per token of the longest row", flush=True)
    chunks = chunks or [batch]
    # A caller waits, per chunk, for its longest row; a step reads the weights once per chunk.
    starts = [sum(chunks[:i]) for i in range(len(chunks))]
    eot = int(ends_with_eot)
    reference = results[TARGET_ONLY].tokens
    rows = []
    for name, _, oracle_alpha in methods:
        out = results[name]
        steps = sum(max(len(t) + eot for t in out.tokens[s : s + n]) for s, n in zip(starts, chunks))
        tokens = sum(len(t) + eot for t in out.tokens)
        stats = out.stats
        if stats is not None and stats.draft_proposed:
            per_pass = stats.tokens_per_target_pass
            rounds = steps / per_pass
            # The draft's steps: in each chunk those of its longest-drafting row's proposals (k a
            # round only where k is fixed; steps past every row's end or limit are not counted).
            draft_steps = sum(max(out.proposed[s : s + n]) for s, n in zip(starts, chunks))
            floor = (draft_steps * draft_bytes + rounds * target_bytes) / bandwidth
            adaptive = "adaptive" in name
            extra = dict(acceptance=stats.acceptance_rate, tokens_per_pass=per_pass, oracle_alpha=oracle_alpha,
                         alpha=None if adaptive else acceptance_from_tokens_per_pass(per_pass, k))
        else:
            floor, extra = steps * target_bytes / bandwidth, {}
        rows.append(Row(section, batch, name, statistics.median(runs[name]), steps, tokens, floor,
                        out.tokens == reference, warm_up_seconds=warm_up[name], **extra))
        print(f"  {section} | batch {batch} | {name}: {rows[-1].ms_per_token:.2f} ms/token "
              f"(floor {rows[-1].floor_ms_per_token:.3f})", flush=True)
    report.add(rows)  # the timings are kept before the profiles, which take long
    for i, (name, run, _) in enumerate(methods if args.profile else []):
        kernels, steps = profile(run, device), rows[i].steps
        rows[i] = replace(rows[i], kernels_per_token=len(kernels.events) / steps,
                          kernel_ms_per_token=1000 * kernels.seconds / steps,
                          kernel_kinds=[(kind, n / steps, 1000 * seconds / steps) for kind, n, seconds in kernels.by_kind()],
                          top_kernels=[(kernel, n / steps, 1000 * seconds / steps) for kernel, n, seconds in kernels.top()])
        report.save()
        print(f"  {section} | batch {batch} | {name}: {rows[i].kernels_per_token:.0f} kernels / token, "
              f"{rows[i].kernel_ms_per_token:.2f} ms of kernel time / token", flush=True)
    return rows


# Kinds of kernel (on a CPU, of operator) by name, the first that matches: attention's
# (flash, memory-efficient "fmha_cutlass", cuDNN's), then cuBLAS's (nvjet, xmma, cutlass,
# split-K reductions) and Inductor's GEMM templates as matrix products.
KERNEL_KINDS = [
    ("attention", r"flash|fmha|attention|cudnn|sdpa"),
    ("matrix products", r"gemm|nvjet|xmma|cutlass|cublas|s16816|linear|addmm|\bmm\b|matmul|triton_tem"),
    ("layer norm", r"layer_norm"),
    ("indexing (KV writes, gathers)", r"index|scatter|gather|embedding"),
    ("reductions", r"reduce|softmax|sum|max|min|cum|logsumexp"),
    ("elementwise", r"elementwise|triton|add|mul|sub|div|where|fill|copy|masked|gelu|clamp|eq|ge|lt"),
]


# Kernel names listed per profiled row: nearly all of a decoder step's, so that one profile on a
# lent GPU says what each step launches (and what Inductor fused) without a second run.
TOP_KERNELS = 40


@dataclass
class Kernels:
    """The kernels (on a CPU, top-level operators) of one profiled run: (name, seconds) each."""

    events: list[tuple[str, float]]

    @property
    def seconds(self) -> float:
        return sum(seconds for _, seconds in self.events)

    def by_kind(self) -> list[tuple[str, int, float]]:
        """(kind, kernels, seconds) per kind of KERNEL_KINDS that occurs, then "other"."""
        def kind(name: str) -> str:
            return next((kind for kind, pattern in KERNEL_KINDS if re.search(pattern, name.lower())), "other")

        totals = self._totals(kind)
        return [(k, *totals[k]) for k in [k for k, _ in KERNEL_KINDS] + ["other"] if k in totals]

    def top(self, n: int = TOP_KERNELS) -> list[tuple[str, int, float]]:
        """The n kernel names that take the most time: (name, kernels, seconds)."""
        totals = self._totals(lambda name: name.removeprefix("void ")[:100])
        return sorted(((name, *total) for name, total in totals.items()), key=lambda item: -item[2])[:n]

    def _totals(self, key: Callable[[str], str]) -> dict[str, tuple[int, float]]:
        """(kernels, seconds) per key of the kernels' names."""
        totals: dict[str, tuple[int, float]] = {}
        for name, seconds in self.events:
            count, total = totals.get(key(name), (0, 0.0))
            totals[key(name)] = (count + 1, total + seconds)
        return totals


def profile(run: Callable[[], Decoded], device: torch.device) -> Kernels:
    """The kernels launched by one run (on a CPU: its top-level operators)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as profiler:
        run()
        synchronize(device)
    events = profiler.events()
    if device.type == "cuda":
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    else:
        kernels = [e for e in events if cpu_operator(e.name) and not any(cpu_operator(a) for a in ancestors(e))]
    return Kernels([(e.name, e.time_range.elapsed_us() / 1e6) for e in kernels])


def cpu_operator(name: str) -> bool:
    """A CPU profile's operators: aten's, and oneDNN's and fbgemm's (our CPU matrix products,
    asr/decoder.py), and Inductor's generated kernels in compiled steps (enable_kernel_profile)."""
    if name.startswith("aten::empty"):  # an allocation, not a kernel (compiled code makes its own at the top level)
        return False
    return name.startswith(("aten::", "mkldnn::", "quantized::")) or "cpp_fused" in name


def ancestors(event) -> list[str]:
    """The names of the events an event runs inside (a compiled region's wrappers are not operators)."""
    names, parent = [], event.cpu_parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return names


def random_pair(geometry: Geometry, device: torch.device, dtype: torch.dtype) -> tuple[WhisperForConditionalGeneration, WhisperForCausalLM]:
    """A target of the geometry and a draft of draft_layers decoder layers (its own
    embeddings and head, as distil-large-v3 has), built on the device. The output heads
    get unit-variance weights so logits are well apart: fewer near-ties between our
    methods and transformers' (they differ in float rounding)."""
    g = geometry
    config = WhisperConfig(
        vocab_size=g.vocab, num_mel_bins=g.mel_bins, d_model=g.d_model, encoder_layers=g.encoder_layers,
        decoder_layers=g.decoder_layers, encoder_attention_heads=g.heads, decoder_attention_heads=g.heads,
        encoder_ffn_dim=g.ffn, decoder_ffn_dim=g.ffn, max_source_positions=g.source_positions,
        max_target_positions=g.target_positions, tie_word_embeddings=False,
        decoder_start_token_id=SOT, eos_token_id=EOT, pad_token_id=EOT, bos_token_id=EOT,
    )
    draft_config = WhisperConfig.from_dict({**config.to_dict(), "decoder_layers": g.draft_layers})
    with torch.device(device):
        target = WhisperForConditionalGeneration(config)
        draft = WhisperForCausalLM(draft_config)
    with torch.no_grad():
        for model in (target, draft):
            model.proj_out.weight.normal_(0, 1)
    return target.to(dtype).eval(), draft.to(dtype).eval()


def decoded(sequences: list[Sequence]) -> Decoded:
    stats = DecodeStats()
    for s in sequences:
        stats.add(s.stats)
    return Decoded([s.tokens for s in sequences], stats, [s.stats.draft_proposed for s in sequences])


def step_bytes(runner: DecoderRunner, batch: int, context: float, frames: int, element: int) -> int:
    """Bytes one decoder step must read: the weights it uses (not the cross-attention key
    and value maps, applied once per window; of the embedding only a few rows) and, per row,
    the self-attention keys and values over `context` positions and the cross-attention
    ones over every frame."""
    weights = 0
    for layer in runner.layers:
        once_per_window = {id(p) for m in (layer.encoder_attn.k_proj, layer.encoder_attn.v_proj) for p in m.parameters()}
        weights += sum(p.numel() for p in layer.parameters() if id(p) not in once_per_window)
    weights += sum(p.numel() for p in runner.decoder.layer_norm.parameters())
    head_rows = runner.vocab_size if runner.head_token_ids is None else runner.head_token_ids.numel()
    weights += head_rows * runner.decoder.embed_tokens.embedding_dim
    width = runner.num_heads * runner.head_dim
    cache = batch * len(runner.layers) * 2 * width * (context + frames)
    return int((weights + cache) * element)


def measure_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device copy, counting bytes read and written."""
    size = (1 << 30) if device.type == "cuda" else (64 << 20)
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    synchronize(device)
    began = time.perf_counter()
    repeats = 10
    for _ in range(repeats):
        target.copy_(source)
    synchronize(device)
    return 2 * size * repeats / (time.perf_counter() - began)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def short_clips(manifest: Path) -> list[Path]:
    """The clips of at most 30 s (one window each), as scripts/benchmark.py takes them."""
    with open(manifest, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [manifest.parent / r["file"] for r in rows if float(r.get("duration_seconds") or 0) <= 30]


# What the per-token columns count, said under every table: at batch 16, 6.5 ms per token beside
# batch 1's 3.7 read as batching nearly doubling a token's cost, where it makes 9x the tokens a second.
PER_TOKEN = ("Per token (ms, floor, kernels): per decoding step of the batch, the time each row waits for its next "
             "token (the longest row's tokens, every row's at once); the batch's throughput is tokens / s.")


def markdown(rows: list[Row], compact: bool = False) -> str:
    """The table of every column, or (compact: the README's) the speeds, floors and kernels."""
    def fmt(value: float | None, pattern: str) -> str:
        return "-" if value is None else format(value, pattern)

    def alpha(row: Row) -> str:
        return fmt(row.alpha, ".2f") + (f" (oracle {row.oracle_alpha:g})" if row.oracle_alpha is not None else "")

    # (header, cell of a row given its group's transformers and ours target-only rows, in the compact table)
    columns = [
        ("section", lambda r, gen, ours: r.section, True),
        ("batch", lambda r, gen, ours: str(r.batch), True),
        ("method", lambda r, gen, ours: r.method, True),
        ("ms / token", lambda r, gen, ours: f"{r.ms_per_token:.2f}", True),
        ("tokens / s", lambda r, gen, ours: f"{r.tokens_per_second:.0f}", True),
        ("floor ms / token", lambda r, gen, ours: f"{r.floor_ms_per_token:.3f}", True),
        ("floor / measured", lambda r, gen, ours: f"{r.floor_seconds / r.seconds:.0%}", True),
        ("kernels / token", lambda r, gen, ours: fmt(r.kernels_per_token, ".0f"), True),
        ("kernel ms / token", lambda r, gen, ours: fmt(r.kernel_ms_per_token, ".3f"), False),
        ("vs transformers", lambda r, gen, ours: f"{gen.seconds / r.seconds:.2f}x", True),
        ("vs ours target-only", lambda r, gen, ours: f"{ours.seconds / r.seconds:.2f}x", True),
        ("accepted / proposed", lambda r, gen, ours: fmt(r.acceptance, ".0%"), False),
        ("alpha", lambda r, gen, ours: alpha(r), False),
        ("tokens / target pass", lambda r, gen, ours: fmt(r.tokens_per_pass, ".2f"), True),
        ("same tokens as ours target-only", lambda r, gen, ours: "yes" if r.identical else "NO", True),
        ("2 untimed runs s", lambda r, gen, ours: f"{r.warm_up_seconds:.1f}", True),
    ]
    columns = [(header, cell) for header, cell, in_compact in columns if in_compact or not compact]
    lines = ["| " + " | ".join(header for header, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        group = [r for r in rows if r.section == row.section and r.batch == row.batch]
        generate = next(r for r in group if r.method == GENERATE)
        ours = next(r for r in group if r.method == TARGET_ONLY)
        lines.append("| " + " | ".join(cell(row, generate, ours) for _, cell in columns) + " |")
    return "\n".join(lines)


def shown_command(arguments: list[str]) -> str:
    """This run's command as a README names it: its output and dev-set folders as DIR and DEV."""
    shown, placeholders = [], {"--out": "DIR", "--dev": "DEV"}
    for i, argument in enumerate(arguments):
        shown.append(placeholders.get(arguments[i - 1], argument) if i else argument)
    return " ".join(["python scripts/benchmark_gpu.py", *shown])


def readme_block(path: Path) -> tuple[str, int, int]:
    """path's text, and where its table's block starts and its end line starts."""
    try:
        text = path.read_text()
    except OSError as error:
        sys.exit(f"{path}: {error.strerror or error}")
    start, end = text.find(README_BEGIN), text.find(README_END)
    if start < 0 or end < start:
        sys.exit(f"{path}: no lines {README_BEGIN} ... {README_END} to write the table between")
    return text, start, end


def write_readme(path: Path, reports: list[dict]) -> None:
    """Replaces the lines between README_BEGIN and README_END in path with the runs' rows in
    one table (compact), the commands and machines that printed them above it: the README's
    GPU table is regenerated, never copied by hand. The file is replaced whole, never left
    half-written."""
    text, start, end = readme_block(path)
    # One table: each run's rows compared within that run (its transformers and target-only rows).
    tables = [markdown([Row(**row) for row in report["rows"]], compact=True).split("\n") for report in reports]
    table = "\n".join(tables[0][:2] + [line for lines in tables for line in lines[2:]])
    printed = [f"- `{r['command']}`, {r['date']}: {r['header'][0]}" if "command" in r else
               f"- benchmark_gpu.py (an earlier version: command and date not recorded): {r['header'][0]}" for r in reports]
    block = f"{README_BEGIN}\n\nPrinted by:\n\n" + "\n".join(printed) + f"\n\n{table}\n\n{PER_TOKEN}\n\n"
    written = path.with_name(path.name + ".partial")
    written.write_text(text[:start] + block + text[end:])
    written.replace(path)
    print(f"wrote the table of {len(reports)} runs into {path}")


def kernel_breakdown(rows: list[Row]) -> str:
    """Per profiled row: its kernels per token and their ms per token by kind, then the costliest kernels."""
    parts = []
    for row in rows:
        if row.kernel_kinds is None:
            continue
        lines = [f"### {row.section}, batch {row.batch}, {row.method}: {row.kernels_per_token:.0f} kernels, "
                 f"{row.kernel_ms_per_token:.3f} ms per token (measured {row.ms_per_token:.3f})",
                 "", "| kind / kernel | kernels / token | ms / token | share |", "|---|---|---|---|"]
        heading = (f"**kernels by name, costliest first (up to {TOP_KERNELS}):**", None, None)
        for name, count, ms in row.kernel_kinds + [heading] + row.top_kernels:
            if count is None:
                lines.append(f"| {name} | | | |")
                continue
            name = name.replace("|", "\\|")
            lines.append(f"| {name} | {count:.1f} | {ms:.3f} | {ms / (row.kernel_ms_per_token or 1):.0%} |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sections = list(dict.fromkeys(r.section for r in rows))
    figure, axes = plt.subplots(1, len(sections), figsize=(7 * len(sections), 5), squeeze=False)
    for axis, section in zip(axes[0], sections):
        group = [r for r in rows if r.section == section]
        for method in dict.fromkeys(r.method for r in group):
            points = [r for r in group if r.method == method]
            line, = axis.plot([r.batch for r in points], [r.ms_per_token for r in points], marker="o", label=method)
            axis.plot([r.batch for r in points], [r.floor_ms_per_token for r in points], linestyle=":",
                      color=line.get_color())
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("batch size")
        axis.set_ylabel("ms per token of a row (dotted: bandwidth floor)")
        axis.set_title(section, fontsize=9)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
