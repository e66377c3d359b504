"""Kernel timings on a CUDA device: between CUDA events, or replayed from a CUDA graph so that
launches cost what they cost inside the engine's graphs."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_seconds(run: Callable[[], torch.Tensor], repeats: int) -> float:
    """Mean time of ``run()``, ``repeats`` of them captured in one CUDA graph and replayed."""
    for _ in range(3):  # compile and warm up outside the graph
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            run()
    graph.replay()
    return event_seconds(graph.replay, 1) / repeats


def event_seconds(run: Callable[[], object], repeats: int) -> float:
    """Mean time of ``run()`` between CUDA events: host work and syncs inside included."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats
