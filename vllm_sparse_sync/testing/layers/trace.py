"""GPU trace recorder: torch's sanitizer hooks for stream, device and event synchronizations.

Sees `torch.cuda.synchronize()`, `Event.synchronize()` and Triton autotuning, which the debug
mode misses. The hooks cannot be removed once activated, so the layer only runs in a process
that opted in (`VLLM_SPARSE_SYNC_TRACE=1`, as `run_isolated` sets for its subprocess).
"""

from __future__ import annotations

import os
import threading
from typing import ClassVar

from ..cuda_env import no_cuda_reason
from ..records import DEVICE_SYNC, EVENT_SYNC, STREAM_SYNC, SyncRecord, in_harness_work, user_frame
from .protocol import LayerBase

LAYER = "trace"
ENV = "VLLM_SPARSE_SYNC_TRACE"

_lock = threading.Lock()
_active: list[TraceLayer] = []
_installed = False


def trace_allowed() -> bool:
    return os.environ.get(ENV, "") == "1"


def _fire(kind: str, op: str) -> None:
    if in_harness_work():
        return
    with _lock:
        targets = list(_active)
    if not targets:
        return
    rec = SyncRecord.at(kind, LAYER, op, user_frame())
    for layer in targets:
        layer.records.append(rec)


def _install() -> None:
    global _installed
    if _installed:
        return
    import torch
    from torch.cuda import _gpu_trace

    _gpu_trace.register_callback_for_device_synchronization(
        lambda: _fire(DEVICE_SYNC, "device synchronize"))
    _gpu_trace.register_callback_for_stream_synchronization(
        lambda stream: _fire(STREAM_SYNC, "stream synchronize"))
    _gpu_trace.register_callback_for_event_synchronization(
        lambda event: _fire(EVENT_SYNC, "event synchronize"))
    torch._C._activate_gpu_trace()
    _installed = True


class TraceLayer(LayerBase):
    """Records every synchronization torch's GPU trace hooks report during the region."""

    name: ClassVar[str] = LAYER
    order: ClassVar[int] = 20

    def __init__(self):
        self.records: list[SyncRecord] = []

    @classmethod
    def unavailable_reason(cls) -> str | None:
        reason = no_cuda_reason()
        if reason:
            return reason
        if not trace_allowed():
            return (f"GPU trace hooks are irreversible: runs only in a subprocess "
                    f"({ENV}=1, see vllm_sparse_sync.testing.run_isolated)")
        return None

    def start(self) -> None:
        _install()
        with _lock:
            _active.append(self)

    def stop(self) -> list[SyncRecord]:
        with _lock:
            if self in _active:
                _active.remove(self)
        return self.collect()
