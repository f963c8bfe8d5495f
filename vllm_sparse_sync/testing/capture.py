"""`decode_graph`: capture a decode step once, replay it, check replay against eager runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .cuda_env import no_cuda_reason
from .layers.capture_probe import (
    CaptureProbe,
    clear_cuda_error,
    end_failed_capture,
    reset_cuda_rng,
)
from .layers.debug_mode import DebugModeLayer
from .records import HostSyncError


def flatten_tensors(obj) -> list:
    """Tensors inside `obj` (tensor, sequence, mapping, dataclass), in a stable order."""
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in flatten_tensors(o)]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in flatten_tensors(obj[k])]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in flatten_tensors(getattr(obj, f.name))]
    return []


def _assert_same(name: str, got: Sequence, want: Sequence, atol: float, rtol: float) -> None:
    import torch

    if len(got) != len(want):
        raise AssertionError(f"{name}: {len(got)} output tensors vs {len(want)}")
    for i, (g, w) in enumerate(zip(got, want)):
        w = w.to(g.device)
        if g.shape != w.shape:
            raise AssertionError(f"{name}: output {i} shape {tuple(g.shape)} vs {tuple(w.shape)}")
        if g.dtype.is_floating_point:
            torch.testing.assert_close(g, w.to(g.dtype), atol=atol, rtol=rtol, equal_nan=True,
                                       msg=lambda m, i=i: f"{name}: output {i}: {m}")
        elif not torch.equal(g, w.to(g.dtype)):
            bad = int((g != w.to(g.dtype)).sum())
            raise AssertionError(f"{name}: output {i} differs in {bad} of {g.numel()} entries")


def _alloc_count() -> int:
    import torch

    return int(torch.cuda.memory_stats().get("allocation.all.allocated", 0))


class DecodeGraph:
    """A decode step captured into a CUDA graph (or run eagerly where CUDA is absent)."""

    def __init__(self, step_fn: Callable[[], Any], *, inputs: Iterable = (), warmup: int = 2,
                 capture_error_mode: str = "global"):
        self.step_fn = step_fn
        self.inputs = flatten_tensors(list(inputs))
        self.warmup = warmup
        self.capture_error_mode = capture_error_mode
        self.captured = no_cuda_reason() is None
        self.graph = None
        self.outputs: Any = None
        self._input_ptrs = [t.data_ptr() for t in self.inputs]
        if self.captured:
            self._capture()
        else:
            self.outputs = step_fn()
        self._output_ptrs = [t.data_ptr() for t in flatten_tensors(self.outputs)]

    def _capture(self) -> None:
        import torch

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.step_fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        device = torch.cuda.current_device()
        error = None
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode=self.capture_error_mode)
            debug = DebugModeLayer("error")
            try:
                debug.start()
                try:
                    self.outputs = self.step_fn()
                finally:
                    debug.stop()
            except Exception as exc:
                error = exc
            finally:
                errors = end_failed_capture(graph, device)
        error = error or (errors[0] if errors else None)
        if error is not None:
            clear_cuda_error()
            reset_cuda_rng(device)
            graph.reset()
            record = CaptureProbe._record(error)
            raise HostSyncError([record], 0, "decode_graph capture") from error
        torch.cuda.synchronize()
        self.graph = graph

    def replay(self):
        """Replay the graph (or run the step eagerly without CUDA); return the outputs."""
        if self.graph is None:
            self.outputs = self.step_fn()
        else:
            self.graph.replay()
        return self.outputs

    def check_against_eager(self, mutate, *, cases: int | None = None,
                            reference: Callable[[], Any] | None = None,
                            compare: Callable[[Any, Any], None] | None = None,
                            atol: float = 0.0, rtol: float = 0.0,
                            expect_change: bool = False) -> list[dict]:
        """For each case: mutate the inputs in place, replay, compare with an eager run and
        with `reference()`; assert input/output addresses stable and no replay allocations.

        `mutate`: a callable taking the case index (with `cases`) or an iterable of no-argument
        callables. `compare(graph_out, ref_out)` replaces the default reference comparison.
        """
        import torch

        steps = ([lambda i=i: mutate(i) for i in range(cases)] if cases is not None
                 else list(mutate))
        results, previous = [], None
        for i, step in enumerate(steps):
            step()
            ptrs = [t.data_ptr() for t in self.inputs]
            if ptrs != self._input_ptrs:
                raise AssertionError(f"case {i}: an input moved; mutate must write in place")
            before = _alloc_count() if self.graph is not None else 0
            out = self.replay()
            if self.graph is not None:
                torch.cuda.synchronize()
                allocs = _alloc_count() - before
                if allocs:
                    raise AssertionError(f"case {i}: {allocs} allocation(s) during replay")
            got = [t.clone() for t in flatten_tensors(out)]
            if [t.data_ptr() for t in flatten_tensors(out)] != self._output_ptrs:
                raise AssertionError(f"case {i}: output addresses changed")
            eager = [t.clone() for t in flatten_tensors(self.step_fn())]
            _assert_same(f"case {i} replay vs eager", got, eager, atol, rtol)
            if reference is not None:
                ref = reference()
                if compare is not None:
                    compare(out, ref)
                else:
                    _assert_same(f"case {i} replay vs reference", got, flatten_tensors(ref),
                                 atol, rtol)
            changed = previous is None or any(
                g.shape != p.shape or not torch.equal(g, p) for g, p in zip(got, previous))
            results.append({"case": i, "changed": changed})
            previous = got
        if expect_change and len(results) > 1 and not all(r["changed"] for r in results[1:]):
            same = [r["case"] for r in results[1:] if not r["changed"]]
            raise AssertionError(f"replay outputs did not change in cases {same}: "
                                 "values baked at capture?")
        return results


def decode_graph(step_fn: Callable[[], Any], *, inputs: Iterable = (), warmup: int = 2,
                 capture_error_mode: str = "global") -> DecodeGraph:
    """Capture `step_fn` into a CUDA graph with the debug mode armed inside the capture.

    `inputs`: the tensors `check_against_eager` mutates (their addresses must not change).
    Raises `HostSyncError` (with the failing line) if the capture sees a sync.
    """
    return DecodeGraph(step_fn, inputs=inputs, warmup=warmup,
                       capture_error_mode=capture_error_mode)
