"""Timing work the way decode runs it: replayed from a CUDA graph (start-up's measured choices
of kernels and collectives use it)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_micros(step: Callable[[], object], replays: int = 3) -> float:
    """Microseconds per replay of a CUDA graph of ``step``, which runs once outside the graph
    first (its lazy set-up) and once more as a replay before the timed ones."""
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays
