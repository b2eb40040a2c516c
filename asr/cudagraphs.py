"""Running the engine's steps as CUDA graphs, and compiled (CompiledSteps, `--compile`).

A step (a draft proposal, a verification, a prefill) is a function of fixed shapes over
tensors that live as long as its batch's state, reading nothing back to the host: on a
GPU it is captured once as a CUDA graph and then replayed, one launch instead of
hundreds. A step runs eagerly the first time it is met and is captured the second time,
so that shapes met once (a rare catch-up width) cost no capture.
A step whose capture fails (something in it that capture forbids) runs eagerly from then
on, with a warning. GraphCounts says what first uses and captures cost (`asr evaluate`
reports it)."""

from __future__ import annotations

import sys
import time
import warnings
from dataclasses import dataclass, fields
from typing import Callable

import torch
from torch import Tensor


@dataclass
class GraphCounts:
    """What running the steps as graphs cost besides the replays: each step's first use
    runs eagerly, and its capture runs it twice more (a warm-up, then the capture). Counted
    where graphs are on; the seconds are the host's."""

    eager: int = 0  # first uses
    captures: int = 0
    replays: int = 0
    eager_seconds: float = 0.0
    capture_seconds: float = 0.0  # warm-up and capture
    compilations: int = 0  # graphs torch.compile made for compiled steps (at first uses)
    failed: int = 0  # captures that failed: those steps run eagerly

    def __add__(self, other: GraphCounts) -> GraphCounts:
        return GraphCounts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __sub__(self, other: GraphCounts) -> GraphCounts:
        return GraphCounts(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))


SEEN, EAGER = "seen", "eager"  # graphs[key] after a first use; after a capture that failed


class StepGraphs:
    """Captures and replays steps; disabled (every step eager) off CUDA or when asked.
    All graphs share one memory pool: their intermediates never outlive a replay, and
    replays run one after another on one stream."""

    def __init__(self, enabled: bool, device: torch.device | None = None):
        self.enabled = enabled
        self.device = device  # the GPU the steps run on (streams are per device)
        self.counts = GraphCounts()
        self._pool = None
        self._stream = None

    def run(self, graphs: dict, key: tuple, step: Callable[[], object], state: list[Tensor]) -> bool:
        """Runs step, as the graph graphs[key] where it has one. Returns whether the run was
        representative of the step's cost (not a first use, a capture, or a compilation).
        state: the tensors the step changes besides the caches (whose entries the step
        rewrites before reading them), put back after the capture's warm-up."""
        graph = graphs.get(key) if self.enabled else None
        if graph not in (None, SEEN, EAGER):
            self.counts.replays += 1
            graph.replay()
            return True
        started, compiled = time.perf_counter(), compilations()
        if graph == SEEN:
            try:
                graphs[key] = graph = self._capture(step, state)
            except RuntimeError as error:
                graphs[key] = EAGER
                self.counts.failed += 1
                cause = error.__context__ or error  # capture_end's error hides the step's
                warnings.warn(f"a {key[0]} step could not be captured as a CUDA graph and runs eagerly: {cause}",
                              stacklevel=2)
            else:
                graph.replay()
                self.counts.captures += 1
                self.counts.capture_seconds += time.perf_counter() - started
                return False
        elif graph is None and self.enabled:
            graphs[key] = SEEN
        step()
        if self.enabled:
            self.counts.eager += 1
            self.counts.eager_seconds += time.perf_counter() - started
            self.counts.compilations += compilations() - compiled
        # A first use (or a capture that failed) says nothing of the step's cost.
        first = self.enabled and graph is not EAGER
        return not first and compilations() == compiled

    def _capture(self, step: Callable[[], object], state: list[Tensor]) -> "torch.cuda.CUDAGraph":
        """Warms the step up on a side stream (library handles and workspaces are created
        outside the capture), puts back what the warm-up changed, and captures the step."""
        with torch.cuda.device(self.device):  # streams are the step's device's (cuda:1 while cuda:0 is current)
            if self._pool is None:
                self._pool, self._stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
            saved = [t.clone() for t in state]
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                step()
            torch.cuda.current_stream().wait_stream(self._stream)
            for tensor, value in zip(state, saved):
                tensor.copy_(value)
            # Not the torch.cuda.graph context: it synchronises and empties the allocator's cache
            # at every capture (so every allocation after it pays a cudaMalloc again), and leaves
            # the side stream current when a capture fails.
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(self._stream):
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    step()
                finally:
                    graph.capture_end()
            return graph


class CompiledSteps:
    """Steps (unbound methods of a batch: a draft step, a verification) compiled
    whole by torch.compile in one mode: the decoder's pass and all around it (the rules, the
    choice of tokens, the state's bookkeeping: dozens of small operators a step, each a kernel
    of its own on a GPU), so that Inductor fuses them; mode None: the steps as they are. A
    step's first use, eager under graphs, compiles it, so nothing compiles in a capture."""

    def __init__(self, mode: str | None):
        if mode is not None and mode not in compile_modes():
            raise ValueError(f"no torch.compile mode {mode!r} for the engine's steps: use one of {', '.join(compile_modes())}")
        self.mode = mode
        self._steps: dict[Callable, Callable] = {}

    def __call__(self, step: Callable) -> Callable:
        if self.mode is None:
            return step
        if step not in self._steps:
            # Dynamo keeps its graphs per function, shared by every engine: one per step, rules and
            # mode, each made shape-generic once a second shape is met.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self._steps[step] = torch.compile(step, mode=self.mode)
        return self._steps[step]


def device_clock(device: torch.device) -> float:
    """time.perf_counter() once the work queued on the device (on this thread's stream) is
    done. On CUDA the host runs ahead of the GPU, so a clock read at once would charge work
    queued before it (a batch's encoder pass, its windows' prefills) to whatever is timed
    next: the next round, in the adaptive draft length's costs (docs/gpu-check-2026-11-26.md).
    Where the device is idle, as after a round's one read, waiting costs microseconds. The
    stream's, not the whole device's: a device-wide synchronize from a visitor's thread
    (timing its features) could invalidate a capture under way on the scheduler's side
    stream. (Its stream is the scheduler's default one, so it waits for the rounds queued
    there, as the features' own copy to the GPU does.)"""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return time.perf_counter()


def compile_modes() -> list[str]:
    """torch.compile's modes the steps can be compiled in: not those with Inductor's own CUDA
    graphs ("reduce-overhead", "max-autotune"), which cannot run inside ours, nor those that
    leave most operators uncompiled ("lite")."""
    return [mode for mode, options in torch._inductor.list_mode_options().items()
            if not options.get("triton.cudagraphs") and not options.get("fallback_by_default")]


def compilations() -> int:
    """Graphs torch.compile has made in this process so far (SpeculativeDecoder.compiled)."""
    utils = sys.modules.get("torch._dynamo.utils")  # not imported: nothing compiled yet
    return 0 if utils is None else utils.counters["stats"]["unique_graphs"]
