"""Timing by CUDA-graph replay, shared by the benchmark scripts."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch


def graph_replay_us(calls: Sequence[Callable[[], object]], iters: int) -> float:
    """Median microseconds per call: the calls warmed up eagerly (the first two also on a side
    stream, as capture wants), captured in one CUDA graph, the graph replayed ``iters`` times
    between CUDA events."""
    for c in calls[:3]:
        c()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / len(calls))
    del graph
    return statistics.median(times)
