"""Capture probe: capture the step in a throwaway CUDA graph; any sync fails the capture.

The debug mode is armed in "error" mode inside the capture (never around it), so torch-visible
syncs are rejected before reaching CUDA and the capture stays valid; anything else that syncs
invalidates the capture. Either way the capture is ended, the graph discarded and the CUDA RNG
state replaced, so the process stays usable.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, ClassVar

from ..cuda_env import no_cuda_reason
from ..records import CAPTURE_FAILURE, SyncRecord, harness_work, user_frame_of_traceback
from .debug_mode import DebugModeLayer, is_sync_error, record_error

LAYER = "capture"
EMPTY_GRAPH_MESSAGE = r".*The CUDA Graph is empty"


def reset_cuda_rng(device=None) -> None:
    """Give the default CUDA generator a fresh state object (not marked as capturing)."""
    import torch

    idx = torch.cuda.current_device() if device is None else torch.device(device).index or 0
    gen = torch.cuda.default_generators[idx]
    if hasattr(gen, "graphsafe_set_state") and hasattr(gen, "clone_state"):
        gen.graphsafe_set_state(gen.clone_state())


def end_failed_capture(graph, device: int) -> list[BaseException]:
    """End a capture that may have been invalidated; return the errors met on the way."""
    import torch

    errors: list[BaseException] = []
    try:
        with warnings.catch_warnings():  # a step rejected before any work captures nothing
            warnings.filterwarnings("ignore", message=EMPTY_GRAPH_MESSAGE)
            graph.capture_end()
        return errors
    except BaseException as exc:  # invalidated capture: the stream has left capture mode
        errors.append(exc)
    end_pool = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end_pool is not None:
        try:
            end_pool(device, graph.pool())
        except BaseException as exc:
            errors.append(exc)
    return errors


def clear_cuda_error() -> None:
    """Drop a pending CUDA runtime error left by a rejected call (e.g. an extension's sync)."""
    try:
        from ..probes import _cudart

        _cudart().cudaGetLastError()
    except Exception:
        pass


class CaptureProbe:
    """Captures `step_fn` once (after an eager warm-up), reports whatever made it fail."""

    name: ClassVar[str] = LAYER
    order: ClassVar[int] = 100  # a step probe: runs after the region layers
    needs_watch: ClassVar[bool] = False

    def __init__(self, *, warmup: int = 1, capture_error_mode: str = "global",
                 arm_debug_mode: bool = True):
        self.warmup = warmup
        self.capture_error_mode = capture_error_mode
        self.arm_debug_mode = arm_debug_mode

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return no_cuda_reason()

    def probe(self, step_fn: Callable[[], Any]) -> list[SyncRecord]:
        with harness_work():  # its warm-up, capture and clean-up: not syncs of a region around it
            return self._probe(step_fn)

    def _probe(self, step_fn: Callable[[], Any]) -> list[SyncRecord]:
        import torch

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                step_fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

        records: list[SyncRecord] = []
        graph = torch.cuda.CUDAGraph()
        device = torch.cuda.current_device()
        failed = False
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode=self.capture_error_mode)
            debug = DebugModeLayer("error") if self.arm_debug_mode else None
            try:
                if debug is not None:
                    debug.start()
                try:
                    step_fn()
                finally:
                    if debug is not None:
                        debug.stop()
            except Exception as exc:
                failed = True
                records.append(self._record(exc))
            finally:
                errors = end_failed_capture(graph, device)
        if errors and not failed:
            failed = True
            records.append(self._record(errors[0]))
        if failed:
            clear_cuda_error()
            reset_cuda_rng(device)
        try:
            graph.reset()
        except Exception:
            pass
        del graph
        torch.cuda.synchronize()
        return records

    @staticmethod
    def _record(exc: BaseException) -> SyncRecord:
        if is_sync_error(exc):
            return record_error(exc, layer=LAYER)
        frame = user_frame_of_traceback(exc.__traceback__)
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        return SyncRecord.at(CAPTURE_FAILURE, LAYER, type(exc).__name__, frame, detail=first)
