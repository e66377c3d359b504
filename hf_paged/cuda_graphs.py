"""CUDA-graph plumbing shared by the decode and prefill graphs and by start-up's timings: the
input buffers a graph reads, capturing a set of graphs in one memory pool, and timing work
the way decode runs it (replayed from a graph)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch


def graph_buffers(size: int, device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A graph's int32 input buffer on ``device`` and the two host twins that fill it (pinned
    on CUDA: a step writes one while the previous step's copy may still read the other)."""
    pin = device.type == "cuda"
    twins = [torch.zeros(size, dtype=torch.int32, pin_memory=pin) for _ in "ab"]
    return torch.zeros(size, dtype=torch.int32, device=device), twins


def capture_graph(step: Callable[[], Any], pool=None,
                  run_first: bool = True) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``step`` captured in memory pool ``pool`` (None: a new one), after one run outside the
    capture for its lazy allocations (unless ``run_first`` is False); the graph and its
    outputs."""
    with torch.inference_mode():
        if run_first:
            step()
            torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs = step()
    return graph, outputs


def capture_graphs(steps: Iterable[tuple[Hashable, Callable[[], tuple]]], pool=None) -> dict:
    """``key -> (graph, *outputs)`` for each ``(key, step)``, all in memory pool ``pool``
    (None: the first one's, so the first should be the largest). Only the first step runs
    once before its capture: the others launch kernels that have run already (start-up's
    warm-up steps run every variant), and their Python launches are most of a capture's time.
    Each graph is replayed once as captured, over the inputs its step ran on: a graph's first
    replay also uploads it to the device (about 2 ms for a prefill graph), which would
    otherwise land on the first request it serves."""
    graphs: dict = {}
    for key, step in steps:
        graph, outputs = capture_graph(step, pool, run_first=not graphs)
        graph.replay()
        pool = graph.pool()
        graphs[key] = (graph, *outputs)
    torch.cuda.synchronize()
    return graphs


def graph_micros(step: Callable[[], object], replays: int = 3) -> float:
    """Microseconds per replay of a CUDA graph of ``step``, timed after one untimed replay."""
    graph, _ = capture_graph(step)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays
