"""Timing by CUDA-graph replay, shared by the benchmark scripts."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch


def capture(calls: Sequence[Callable[[], object]]) -> torch.cuda.CUDAGraph:
    """The calls warmed up eagerly (the first two also on a side stream, as capture wants), then
    captured in one CUDA graph, replayed once."""
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
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, ncalls: int) -> float:
    """Microseconds per call of one replay of ``graph`` (``ncalls`` calls), between CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / ncalls


def replayed_outputs(graph: torch.cuda.CUDAGraph, out: torch.Tensor, times: int = 3) -> list[torch.Tensor]:
    """Copies of ``out`` after each of ``times`` synchronized replays of ``graph`` (what its last
    call wrote), to compare one graph's selections with another's."""
    outs = []
    for _ in range(times):
        graph.replay()
        torch.cuda.synchronize()
        outs.append(out.clone())
    return outs


def graph_replay_us(calls: Sequence[Callable[[], object]], iters: int) -> float:
    """Median microseconds per call: the calls captured in one CUDA graph (``capture``), the graph
    replayed ``iters`` times between CUDA events."""
    graph = capture(calls)
    times = [replay_us(graph, len(calls)) for _ in range(iters)]
    del graph
    return statistics.median(times)


def rotation(names: Sequence[str], it: int) -> list[str]:
    """The replay order of iteration ``it``: ``names`` rotated by ``it``, reversed on odd
    rotations, so each name runs in every position and after every other name in turn."""
    k = len(names)
    order = [names[(it // 2 + j) % k] for j in range(k)] if k else []
    return order[::-1] if it % 2 else order


def interleaved_replay_us(named: dict[str, Sequence[Callable[[], object]]], iters: int) -> dict[str, float]:
    """Median microseconds per call of each named call list: each captured in its own graph, then
    ``iters`` rounds that replay every graph once in ``rotation`` order, so a drift of the GPU's
    clock (power cap, heat) over the rounds falls on every graph alike."""
    if iters < 1:
        raise ValueError(f"iters: must be >= 1, got {iters}")
    graphs = {name: (capture(calls), len(calls)) for name, calls in named.items()}
    times: dict[str, list[float]] = {name: [] for name in named}
    names = list(named)
    for it in range(iters):
        for name in rotation(names, it):
            graph, n = graphs[name]
            times[name].append(replay_us(graph, n))
    del graphs
    return {name: statistics.median(v) for name, v in times.items()}
