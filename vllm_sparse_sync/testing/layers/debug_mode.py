"""torch's sync debug mode, armed only around the checked region and restored afterwards.

"warn" (the default) records every sync torch's `memcpy_and_sync`/`stream_synchronize` see,
with the user frame at the moment torch warns. "error" makes the first one raise before the
CUDA call (what a capture needs); `record_error` turns that exception into a record.
"""

from __future__ import annotations

import re
import threading
import warnings
from typing import ClassVar

from ..cuda_env import no_cuda_reason
from ..records import STREAM_SYNC, SyncRecord, in_harness_work, user_frame, user_frame_of_traceback
from .protocol import LayerBase

LAYER = "debug_mode"
SYNC_MESSAGE = "called a synchronizing CUDA operation"
PROTOTYPE_MESSAGE = r".*[Ss]ynchronization debug mode is a prototype feature"


def is_sync_error(exc: BaseException) -> bool:
    """Whether `exc` is torch's error-mode rejection of a synchronizing op."""
    return isinstance(exc, RuntimeError) and SYNC_MESSAGE in str(exc)


def set_mode_quietly(mode) -> None:
    """`torch.cuda.set_sync_debug_mode` without its one-time prototype warning."""
    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=PROTOTYPE_MESSAGE)
        torch.cuda.set_sync_debug_mode(mode)


def record_error(exc: BaseException, layer: str = LAYER) -> SyncRecord:
    frame = user_frame_of_traceback(exc.__traceback__)
    return SyncRecord.at(STREAM_SYNC, layer, "torch sync (debug mode error)", frame,
                         detail=str(exc).splitlines()[0][:160])


class DebugModeLayer(LayerBase):
    """Arms `torch.cuda.set_sync_debug_mode` for the region; records what it reports."""

    name: ClassVar[str] = LAYER
    order: ClassVar[int] = 10

    def __init__(self, mode: str = "warn"):
        if mode not in ("warn", "error"):
            raise ValueError("mode must be 'warn' or 'error'")
        self.mode = mode
        self.records: list[SyncRecord] = []
        self._prev = None
        self._catch = None
        self._lock = threading.Lock()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return no_cuda_reason()

    @classmethod
    def record_exception(cls, exc: BaseException) -> SyncRecord | None:
        """torch's error-mode rejection of a sync, as a record; None for any other error."""
        return record_error(exc) if is_sync_error(exc) else None

    def _show(self, message, category, filename, lineno, file=None, line=None):
        if SYNC_MESSAGE in str(message):
            if in_harness_work():
                return
            with self._lock:
                self.records.append(SyncRecord.at(
                    STREAM_SYNC, LAYER, "torch sync (debug mode)", user_frame()))
            return
        self._orig_show(message, category, filename, lineno, file, line)

    def start(self) -> None:
        import torch

        self._prev = torch.cuda.get_sync_debug_mode()
        if self.mode == "warn":
            self._catch = warnings.catch_warnings()
            self._catch.__enter__()
            warnings.filterwarnings("ignore", message=PROTOTYPE_MESSAGE)
            warnings.filterwarnings("always", message=".*" + re.escape(SYNC_MESSAGE))
            self._orig_show = warnings.showwarning
            warnings.showwarning = self._show
        set_mode_quietly(self.mode)

    def stop(self) -> list[SyncRecord]:
        try:
            if self._prev is not None:
                set_mode_quietly(self._prev)
        finally:
            self._prev = None
            if self._catch is not None:
                self._catch.__exit__(None, None, None)
                self._catch = None
        return self.collect()
