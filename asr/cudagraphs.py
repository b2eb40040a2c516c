"""Running the engine's steps as CUDA graphs.

A step (a draft proposal, a verification, a prefill) is a function of fixed shapes over
tensors that live as long as its batch's state, reading nothing back to the host: on a
GPU it is captured once as a CUDA graph and then replayed, one launch instead of
hundreds. A step runs eagerly the first time it is met and is captured the second time,
so that shapes met once (an exploration of k, a rare catch-up width) cost no capture."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


class StepGraphs:
    """Captures and replays steps; disabled (every step eager) off CUDA or when asked.
    All graphs share one memory pool: their intermediates never outlive a replay, and
    replays run one after another on one stream."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._pool = None
        self._stream = None

    def run(self, graphs: dict, key: tuple, step: Callable[[], object], state: list[Tensor], capture: bool = True) -> bool:
        """Runs step, as the graph graphs[key] where it has one. Returns whether the run was
        representative of the step's cost (eager mode, or a replay; not a first use or a
        capture). state: the tensors the step changes besides the caches (whose entries
        the step rewrites before reading them), put back after the capture's warm-up."""
        if not self.enabled:
            step()
            return True
        if not capture:
            step()
            return False
        graph = graphs.get(key)
        if graph is None:
            graphs[key] = "seen"
            step()
            return False
        if graph == "seen":
            graph = graphs[key] = self._capture(step, state)
            graph.replay()
            return False
        graph.replay()
        return True

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
