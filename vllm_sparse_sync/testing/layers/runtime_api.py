"""Runtime-API counter: torch.profiler (Kineto/CUPTI) events of synchronizing CUDA calls.

Counts `cudaStreamSynchronize`, `cudaDeviceSynchronize`, `cudaEventSynchronize`, synchronous
`cudaMemcpy*` and pageable memcpys from any library (extensions included), inside a
`record_function` region; the profiler's own closing device sync falls outside that region
and is not counted.

Attribution: the profiler's Python events name functions, not lines, so each torch call in the
region runs inside a profiler range that names its user frame; a sync under such a range gets
the call's own line ("op"). A sync with no torch call above it (an extension's) gets the user
function around it from the Python tracer ("function"), else the line that entered the region
("region").
"""

from __future__ import annotations

import re
import threading
import warnings
from collections.abc import Iterable
from typing import ClassVar

from ..cuda_env import no_cuda_reason
from ..records import (
    ALLOWED_MARK,
    DEVICE_SYNC,
    EVENT_SYNC,
    HARNESS_MARK,
    MEMCPY_SYNC,
    PAGEABLE_MEMCPY,
    STREAM_SYNC,
    UNKNOWN,
    Frame,
    SyncRecord,
    _skipped,
    harness_work,
    user_frame,
)
from ..records import (
    thread_names as known_thread_names,
)
from .protocol import LayerBase

LAYER = "runtime_api"
REGION = "vllm_sparse_sync::checked_region"

SYNC_CALLS = {
    "cudaStreamSynchronize": STREAM_SYNC,
    "cuStreamSynchronize": STREAM_SYNC,
    "cudaDeviceSynchronize": DEVICE_SYNC,
    "cuCtxSynchronize": DEVICE_SYNC,
    "cudaEventSynchronize": EVENT_SYNC,
    "cuEventSynchronize": EVENT_SYNC,
}
_SYNC_MEMCPY = re.compile(r"^(cudaMemcpy(2D|3D|Peer|ToSymbol|FromSymbol)?|cuMemcpy(DtoH|HtoD|DtoD)?(_v2)?)$")
_PROFILER_WARNINGS = r"torch\.(autograd\.)?profiler.*"
_STACK_ENTRY = re.compile(r"^(?P<file>.*)\((?P<line>\d+)\): (?P<func>.*)$")
OP_MARK = "vllm_sparse_sync::op#"


def classify_call(name: str) -> str | None:
    """The sync kind of a CUDA runtime/driver API call name, or None."""
    if name in SYNC_CALLS:
        return SYNC_CALLS[name]
    if _SYNC_MEMCPY.match(name):
        return MEMCPY_SYNC
    return None


def _frame_from_stack(stack: Iterable[str]) -> Frame | None:
    for entry in stack or ():
        m = _STACK_ENTRY.match(entry)
        if not m or _skipped(m["file"]) or "/_pytest/" in m["file"] or "/pluggy/" in m["file"]:
            continue
        import linecache

        code = linecache.getline(m["file"], int(m["line"])).strip()
        return Frame(m["file"], int(m["line"]), m["func"], code)
    return None


def _root(evt):
    """The outermost op above `evt` below the checked region."""
    while getattr(evt, "cpu_parent", None) is not None and evt.cpu_parent.name != REGION:
        evt = evt.cpu_parent
    return evt


def _mark_index(name: str) -> int | None:
    if name.startswith(OP_MARK):
        try:
            return int(name[len(OP_MARK):])
        except ValueError:
            return None
    return None


def _attribution(evt, op_frames: dict[int, Frame], marks: list) -> tuple[Frame | None, str, str]:
    """(user frame, name of the nearest op above `evt`, "op" | "function" | "region").

    The nearest op-mark range or Python stack above `evt` (by parent links, else an op-mark
    range around it in time on the same thread) names the torch call's own line; else a
    Python-tracer event names the function around it.
    """
    node = evt
    op = ""
    function = None
    while node is not None:
        name = node.name
        i = _mark_index(name)
        if i is not None and i in op_frames:
            return op_frames[i], op, "op"
        if (node is not evt and not op and not name.startswith(("cuda", "cu")) and name != REGION
                and i is None and not getattr(node, "is_python_function", False)):
            op = name
        stacked = _frame_from_stack(getattr(node, "stack", None))  # real lines (legacy profiler)
        if stacked is not None:
            return stacked, op, "op"
        if function is None and getattr(node, "is_python_function", False):
            function = _frame_from_stack([name])  # a Python-tracer event: "file(def line): func"
        node = getattr(node, "cpu_parent", None)
    start = evt.time_range.start
    around = [m for m in marks if m.thread == evt.thread
              and m.time_range.start <= start <= m.time_range.end]
    if around:
        inner = max(around, key=lambda m: m.time_range.start)
        frame = op_frames.get(_mark_index(inner.name))
        if frame is not None:
            return frame, op, "op"
    if function is not None:
        return function, op, "function"
    return None, op, "region"


def _within(evt, ranges: list) -> bool:
    """Whether `evt` started inside one of `ranges` on its own thread."""
    start = evt.time_range.start
    return any(a.thread == evt.thread and a.time_range.start <= start <= a.time_range.end for a in ranges)


def _allowed_by(evt, allowed: list) -> str:
    """"allowed region" when `evt` ran inside an `allowed_syncs` range (same thread), else ""."""
    return "inside an allowed region" if _within(evt, allowed) else ""


def _is_device_event(evt) -> bool:
    return "CUDA" in str(getattr(evt, "device_type", ""))


def records_from_events(events, *, fallback: Frame = UNKNOWN, thread_names: dict | None = None,
                        op_frames: dict[int, Frame] | None = None,
                        region_thread: str | None = None) -> list[SyncRecord]:
    """Sync records from profiler FunctionEvents, counting only calls inside the region.

    `op_frames`: the user frame of each op-mark range (`OP_MARK` + index). `thread_names`: native
    thread id -> name; `region_thread`: the name of the thread that opened the region, for the
    profiler's own id of that thread (some torch builds number threads from 1, not by native id).
    """
    events = list(events)
    op_frames = op_frames or {}
    marks = [e for e in events if e.name.startswith(OP_MARK) and not _is_device_event(e)]
    allowed = [e for e in events if e.name == ALLOWED_MARK and not _is_device_event(e)]
    harness = [e for e in events if e.name == HARNESS_MARK and not _is_device_event(e)]
    regions = [e for e in events if e.name == REGION and not _is_device_event(e)]
    if not regions:
        return []
    spans = [(r.time_range.start, r.time_range.end) for r in regions]

    def inside(e) -> bool:  # the region's, not the harness's own work inside it
        s = e.time_range.start
        return any(a <= s <= b for a, b in spans) and not _within(e, harness)

    out: list[SyncRecord] = []
    synced_roots = set()
    names = dict(thread_names or {})
    if region_thread is not None:
        names.update({r.thread: region_thread for r in regions})
    for e in events:
        if _is_device_event(e) or not inside(e):
            continue
        kind = classify_call(e.name)
        if kind is None:
            continue
        frame, op, how = _attribution(e, op_frames, marks)
        detail = "" if frame else "no Python frame for this call (an extension's?)"
        synced_roots.add(id(_root(e)))
        out.append(SyncRecord.at(kind, LAYER, f"{e.name}" + (f" via {op}" if op else ""),
                                 frame or fallback, detail=detail,
                                 thread=names.get(e.thread, str(e.thread)), attribution=how,
                                 allowed=_allowed_by(e, allowed)))
    for e in events:
        if _is_device_event(e) or not inside(e) or e.name == REGION:
            continue
        pageable = [k for k in getattr(e, "kernels", ()) or () if "Pageable" in k.name]
        if not pageable or id(_root(e)) in synced_roots:
            continue
        frame, _, how = _attribution(e, op_frames, marks)
        for k in pageable:
            out.append(SyncRecord.at(PAGEABLE_MEMCPY, LAYER, f"{k.name} via {e.name}",
                                     frame or fallback, thread=names.get(e.thread, str(e.thread)),
                                     detail="" if frame else "no Python frame for this copy",
                                     attribution=how, allowed=_allowed_by(e, allowed)))
    return out


def _op_mark_mode(frames: dict[int, Frame]):
    """A torch function mode that runs each torch call inside a range named after its frame."""
    from torch.autograd.profiler import record_function
    from torch.overrides import TorchFunctionMode

    class _OpMarks(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if getattr(func, "__name__", "") == "__get__":
                return func(*args, **kwargs)
            i = len(frames)
            frames[i] = user_frame()
            with record_function(f"{OP_MARK}{i}"):
                return func(*args, **kwargs)

    return _OpMarks()


class RuntimeApiLayer(LayerBase):
    """Profiles the region and reports synchronizing CUDA API calls from any library.

    Torch's profiler is stopped only on the thread that started it and cannot nest, so regions
    of that thread share one instance; `collect()` ends the profiling session, turns its events
    into records and starts the next one.
    """

    name: ClassVar[str] = LAYER
    order: ClassVar[int] = 0  # outermost: the profiler's own syncs stay outside the others
    own_thread_only: ClassVar[bool] = True

    def __init__(self, *, with_stack: bool = True):
        self.with_stack = with_stack
        self.records: list[SyncRecord] = []
        self._prof = None
        self._region = None
        self._marks = None
        self._op_frames: dict[int, Frame] = {}
        self._entry = UNKNOWN
        self._thread: str | None = None

    @classmethod
    def unavailable_reason(cls) -> str | None:
        reason = no_cuda_reason()
        if reason is None and _foreign_profiler_running():
            return "another torch profiler is running in this process (CUPTI takes one)"
        return reason

    def start(self) -> None:
        import torch

        self._entry = user_frame()
        self._thread = threading.current_thread().name  # the profiler's owner
        with harness_work(mark=False):
            torch.cuda.synchronize()  # outside the region: earlier work is not ours
        self._begin()
        self._marks = _op_mark_mode(self._op_frames)
        self._marks.__enter__()

    def _begin(self) -> None:
        from torch.profiler import ProfilerActivity, profile, record_function

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=UserWarning, module=_PROFILER_WARNINGS)
            self._prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                                 with_stack=self.with_stack)
            self._prof.__enter__()
        _ours.add(id(self._prof))
        self._region = record_function(REGION)
        self._region.__enter__()

    def _end(self) -> list[SyncRecord]:
        if self._prof is None:
            return []
        prof, self._prof = self._prof, None
        try:
            self._region.__exit__(None, None, None)
        finally:
            _ours.discard(id(prof))
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", category=UserWarning,
                                        module=_PROFILER_WARNINGS)
                prof.__exit__(None, None, None)
                events = prof.events()
        return records_from_events(events, fallback=self._entry, thread_names=known_thread_names(),
                                   op_frames=self._op_frames, region_thread=self._thread)

    def collect(self) -> list[SyncRecord]:
        if self._prof is None:
            return []
        with harness_work(mark=False):
            found = self._end()
            self._begin()
        return found

    def stop(self) -> list[SyncRecord]:
        if self._prof is None:
            return []
        try:
            if self._marks is not None:
                self._marks.__exit__(None, None, None)
                self._marks = None
        finally:
            with harness_work(mark=False):
                found = self._end()
        return found


_ours: set[int] = set()


def _foreign_profiler_running() -> bool:
    """Whether a torch profiler that is not this layer's runs (a user's `torch.profiler`)."""
    import torch

    enabled = getattr(torch.autograd.profiler, "_is_profiler_enabled", False)
    return bool(enabled) and not _ours
