"""CUDA graphs of the static decoding step: launch costs paid once per batch size, not per step.

A decoding step of a small model is hundreds of small kernels, and on a GPU launching them from
Python takes longer than running them. A CUDA graph records the launches of one step once and
replays them with one call. That needs a step whose every launch is the same each time: the same
shapes, the same buffers, no host sync and no branch on device values, which is what
`rlcore.rollout.engine.decode_one_token` is. The engine wraps it in a `CapturedStep` per batch it
decodes (a new one after each compaction, at a power-of-two batch size).
RLCORE_CUDA_GRAPHS=0 runs the step eagerly instead (`engine.cuda_graphs_enabled`).
"""

from __future__ import annotations

from typing import Callable

import torch


class CapturedStep:
    """`captured()` does what `step()` does. The first call runs `step` eagerly on a side stream,
    which also warms it up (cuBLAS workspaces, the allocator's blocks), then captures its next
    call into a graph without running it; every later call replays the graph. `step` must read
    and write only tensors that outlive it (the graph keeps their addresses)."""

    def __init__(self, step: Callable[[], None]):
        self.step = step
        self.graph: torch.cuda.CUDAGraph | None = None

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()
