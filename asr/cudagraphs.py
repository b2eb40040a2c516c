"""Running the engine's steps as CUDA graphs.

A step (a draft proposal, a verification, a prefill) is a function of fixed shapes over
tensors that live as long as its batch's state, reading nothing back to the host: on a
GPU it is captured once as a CUDA graph and then replayed, one launch instead of
hundreds. A step runs eagerly the first time it is met and is captured the second time,
so that shapes met once (an exploration of k, a rare catch-up width) cost no capture.
GraphCounts says what first uses and captures cost (`asr evaluate` reports it)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, fields
from typing import Callable

import torch
from torch import Tensor


@dataclass
class GraphCounts:
    """What running the steps as graphs cost besides the replays: each step's first use
    runs eagerly, and its capture runs it twice more (a warm-up, then the capture). Counted
    where graphs are on; the seconds are the host's."""

    eager: int = 0  # first uses, and steps never captured (a hinted round's verification)
    captures: int = 0
    replays: int = 0
    eager_seconds: float = 0.0
    capture_seconds: float = 0.0  # warm-up and capture
    compilations: int = 0  # graphs torch.compile made for compiled passes (at first uses)

    def __add__(self, other: GraphCounts) -> GraphCounts:
        return GraphCounts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __sub__(self, other: GraphCounts) -> GraphCounts:
        return GraphCounts(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))


class StepGraphs:
    """Captures and replays steps; disabled (every step eager) off CUDA or when asked.
    All graphs share one memory pool: their intermediates never outlive a replay, and
    replays run one after another on one stream."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.counts = GraphCounts()
        self._pool = None
        self._stream = None

    def run(self, graphs: dict, key: tuple, step: Callable[[], object], state: list[Tensor], capture: bool = True) -> bool:
        """Runs step, as the graph graphs[key] where it has one. Returns whether the run was
        representative of the step's cost (eager mode, or a replay; not a first use or a
        capture). state: the tensors the step changes besides the caches (whose entries
        the step rewrites before reading them), put back after the capture's warm-up."""
        if not self.enabled:
            compiled = compilations()
            step()
            return compilations() == compiled  # a step that compiled says nothing of its cost
        graph = graphs.get(key) if capture else None
        if graph is not None and graph != "seen":
            self.counts.replays += 1
            graph.replay()
            return True
        started, compiled = time.perf_counter(), compilations()
        if graph is None:
            if capture:
                graphs[key] = "seen"
            step()
            self.counts.eager += 1
            self.counts.eager_seconds += time.perf_counter() - started
            self.counts.compilations += compilations() - compiled
            return False
        graph = graphs[key] = self._capture(step, state)
        graph.replay()
        self.counts.captures += 1
        self.counts.capture_seconds += time.perf_counter() - started
        return False

    def _capture(self, step: Callable[[], object], state: list[Tensor]) -> "torch.cuda.CUDAGraph":
        """Warms the step up on a side stream (library handles and workspaces are created
        outside the capture), puts back what the warm-up changed, and captures the step."""
        if self._pool is None:
            self._pool, self._stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        saved = [t.clone() for t in state]
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            step()
        torch.cuda.current_stream().wait_stream(self._stream)
        for tensor, value in zip(state, saved):
            tensor.copy_(value)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
            step()
        return graph


def compilations() -> int:
    """Graphs torch.compile has made in this process so far (DecoderRunner.compiled)."""
    utils = sys.modules.get("torch._dynamo.utils")  # not imported: nothing compiled yet
    return 0 if utils is None else utils.counters["stats"]["unique_graphs"]
