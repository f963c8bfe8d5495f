"""Sync records, budgets and the error raised when a checked region synchronizes."""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import threading
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

from .known import find_known

# Kinds shared by every layer.
SCALAR_READ = "scalar_read"  # .item(), int(), bool(), torch.equal, sizing from a device value
D2H_COPY = "d2h_copy"  # .cpu(), .tolist(), .numpy(), .to("cpu")
DATA_DEPENDENT_SHAPE = "data_dependent_shape"  # nonzero, mask indexing, unique, bincount ...
STREAM_SYNC = "stream_sync"
DEVICE_SYNC = "device_sync"
EVENT_SYNC = "event_sync"
MEMCPY_SYNC = "memcpy_sync"
PAGEABLE_MEMCPY = "pageable_memcpy"
CAPTURE_FAILURE = "capture_failure"

KINDS = (
    SCALAR_READ,
    D2H_COPY,
    DATA_DEPENDENT_SHAPE,
    STREAM_SYNC,
    DEVICE_SYNC,
    EVENT_SYNC,
    MEMCPY_SYNC,
    PAGEABLE_MEMCPY,
    CAPTURE_FAILURE,
)


def check_kind(kind: object) -> str:
    """`kind` if it names a sync kind (one of `KINDS`), else a ValueError listing them."""
    if kind not in KINDS:
        raise ValueError(f"unknown sync kind {kind!r}; known: {', '.join(KINDS)}")
    return kind  # type: ignore[return-value]


_TESTING_DIR = os.path.dirname(os.path.abspath(__file__))
_SKIP_DIRS: tuple[str, ...] = (_TESTING_DIR,)
# stdlib modules that sit between user code and a callback (warnings hooks, with-blocks)
_SKIP_FILES = frozenset(os.path.abspath(m.__file__) for m in (contextlib, threading, warnings))


def _torch_dir() -> str | None:
    mod = sys.modules.get("torch")
    if mod is None or not getattr(mod, "__file__", None):
        return None
    return os.path.dirname(os.path.abspath(mod.__file__))


def _skipped(filename: str) -> bool:
    path = os.path.abspath(filename)
    if path.startswith(_SKIP_DIRS):
        return True
    tdir = _torch_dir()
    if tdir and path.startswith(tdir + os.sep):
        return True
    return filename.startswith("<frozen") or path in _SKIP_FILES


def _display(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


@dataclass(frozen=True)
class Frame:
    """A user-code location: file, line, function and the source line."""

    filename: str
    lineno: int
    function: str
    code: str

    @property
    def location(self) -> str:
        return f"{_display(self.filename)}:{self.lineno}"


UNKNOWN = Frame("?", 0, "?", "")


def frame_from(frame) -> Frame:
    code = frame.f_code
    src = linecache.getline(code.co_filename, frame.f_lineno).strip()
    return Frame(code.co_filename, frame.f_lineno, code.co_name, src)


def user_frame(start=None) -> Frame:
    """The innermost stack frame outside torch and outside this testing package."""
    frame = start if start is not None else sys._getframe(1)
    while frame is not None:
        if not _skipped(frame.f_code.co_filename):
            return frame_from(frame)
        frame = frame.f_back
    return UNKNOWN


def user_frame_of_traceback(tb) -> Frame:
    """The innermost user frame of a traceback (where a sync raised)."""
    found = UNKNOWN
    while tb is not None:
        if not _skipped(tb.tb_frame.f_code.co_filename):
            src = linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno).strip()
            found = Frame(tb.tb_frame.f_code.co_filename, tb.tb_lineno,
                          tb.tb_frame.f_code.co_name, src)
        tb = tb.tb_next
    return found


_harness = threading.local()
HARNESS_MARK = "vllm_sparse_sync::harness"  # the profiler range of the harness's own work


@contextlib.contextmanager
def harness_work(mark: bool = True):
    """A block of the harness's own work on this thread (a profiler's restart, a probe's warm-up
    and capture): the region layers running around it record nothing from this thread inside.
    `mark`: also a profiler range, so a profiler running around it leaves it out (not for the
    block that stops or starts that profiler)."""
    _harness.depth = getattr(_harness, "depth", 0) + 1
    try:
        torch = sys.modules.get("torch") if mark else None
        if torch is not None:
            with torch.autograd.profiler.record_function(HARNESS_MARK):
                yield
        else:
            yield
    finally:
        _harness.depth -= 1


def in_harness_work() -> bool:
    """Whether this thread is inside `harness_work()`."""
    return getattr(_harness, "depth", 0) > 0


_thread_names: dict[int, str] = {}


def note_thread() -> None:
    """Remember this thread's name by its native id (a profiler names threads by that id, after
    the thread may have ended)."""
    _thread_names[threading.get_native_id()] = threading.current_thread().name


def thread_names() -> dict[int, str]:
    """Native thread id -> name, for the threads running now and those that ran a region."""
    names = dict(_thread_names)
    names.update({t.native_id: t.name for t in threading.enumerate() if t.native_id is not None})
    return names


_allowed = threading.local()
ALLOWED_MARK = "vllm_sparse_sync::allowed"  # the profiler range of an allowed region


def allowed_reason() -> str | None:
    """Why syncs on this thread are allowed right now (inside `allowed_syncs`), else None."""
    stack = getattr(_allowed, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def allowed_syncs(reason: str):
    """Syncs on this thread inside the block are recorded as allowed (shown, never counted
    against a budget): for a library's deliberate syncs, such as vLLM's `gpu_sync_allowed()`."""
    stack = getattr(_allowed, "stack", None)
    if stack is None:
        stack = _allowed.stack = []
    stack.append(reason)
    try:
        torch = sys.modules.get("torch")
        if torch is not None:
            with torch.autograd.profiler.record_function(ALLOWED_MARK):
                yield
        else:
            yield
    finally:
        stack.pop()


@dataclass(frozen=True)
class SyncRecord:
    """One synchronization (or host read) seen by one layer."""

    kind: str
    layer: str
    op: str
    location: str
    function: str = "?"
    code: str = ""
    thread: str = ""
    detail: str = ""
    attribution: str = "op"
    """Whose line `location` is: "op" (the syncing call's own line), "function" (the start of
    the user function around a call the layer saw without its line, e.g. an extension's), or
    "region" (the line that entered the checked region, when the layer saw no Python frame)."""
    allowed: str = ""
    """Why this sync is allowed (a deliberate one, e.g. inside vLLM's `gpu_sync_allowed()`, or a
    known upstream read); empty for a sync that counts."""
    known: bool = False
    """Whether it is allowed as a known read (`known.py`) rather than by an allowed region."""

    @classmethod
    def at(cls, kind: str, layer: str, op: str, frame: Frame, detail: str = "",
           thread: str | None = None, attribution: str = "op", allowed: str = "") -> SyncRecord:
        """A record at `frame`; `allowed` (why the layer saw it as allowed) falls back to the
        thread's allowed region, then to the known reads."""
        allowed = allowed or allowed_reason() or ""
        known = False
        if not allowed:
            read = find_known(frame.filename, frame.function, frame.code, op)
            if read is not None:
                allowed, known = read.why or f"known read in {read.function}", True
        return cls(kind=kind, layer=layer, op=op, location=frame.location,
                   function=frame.function, code=frame.code,
                   thread=thread if thread is not None else threading.current_thread().name,
                   detail=detail, attribution=attribution, allowed=allowed, known=known)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> SyncRecord:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    def format(self) -> str:
        code = f": {self.code}" if self.code else ""
        detail = f" ({self.detail})" if self.detail else ""
        where = {"region": " (line of the checked region)",
                 "function": " (start of the function around it)"}.get(self.attribution, "")
        allowed = f" [allowed: {self.allowed}]" if self.allowed else ""
        return (f"[{self.layer}] {self.kind} {self.op} at {self.location}{where} in {self.function}"
                f"{code}  [thread {self.thread}]{detail}{allowed}")


def count_by_kind(records: Iterable[SyncRecord]) -> dict[str, int]:
    return dict(Counter(r.kind for r in records))


def count_by_layer(records: Iterable[SyncRecord]) -> dict[str, int]:
    return dict(Counter(r.layer for r in records))


@dataclass(frozen=True)
class Budget:
    """Allowed syncs per checked region.

    `kinds=None`: at most `n` syncs of any kind. A sequence: at most `n` of those kinds together,
    none of any other kind. A mapping: per-kind limits, none of any other kind. Each layer is
    checked on its own (layers see the same syncs; a budget counts syncs, not sightings).
    """

    n: int = 0
    kinds: tuple[str, ...] | Mapping[str, int] | None = None

    @classmethod
    def of(cls, value) -> Budget:
        if isinstance(value, Budget):
            return value
        if value is None:
            return cls()
        if isinstance(value, int):
            return cls(n=value)
        if isinstance(value, Mapping):
            return cls(n=0, kinds=dict(value))
        raise TypeError(f"budget must be an int, a Budget or a kind->count mapping, got {value!r}")

    def __post_init__(self):
        if isinstance(self.n, bool) or not isinstance(self.n, int):
            raise TypeError(f"budget n must be an int, got {self.n!r}")
        if self.n < 0:
            raise ValueError("budget n must be >= 0")
        if self.kinds is not None and not isinstance(self.kinds, Mapping):
            kinds = (self.kinds,) if isinstance(self.kinds, str) else tuple(self.kinds)
            object.__setattr__(self, "kinds", kinds)
        if self.kinds is not None:
            for kind in self.kinds:
                check_kind(kind)

    def violations(self, records: Sequence[SyncRecord]) -> list[str]:
        """Human-readable budget overruns, one per (layer, group); empty when within budget.
        Allowed records (`SyncRecord.allowed`) never count."""
        out = []
        by_layer: dict[str, list[SyncRecord]] = {}
        for r in records:
            if r.allowed:
                continue
            by_layer.setdefault(r.layer, []).append(r)
        for layer, recs in sorted(by_layer.items()):
            counts = Counter(r.kind for r in recs)
            if self.kinds is None:
                total = sum(counts.values())
                if total > self.n:
                    out.append(f"{layer}: {total} syncs > budget {self.n}")
                continue
            if isinstance(self.kinds, Mapping):
                limits = dict(self.kinds)
                for kind, c in sorted(counts.items()):
                    if c > limits.get(kind, 0):
                        out.append(f"{layer}: {c} {kind} > budget {limits.get(kind, 0)}")
                continue
            allowed = sum(c for k, c in counts.items() if k in self.kinds)
            if allowed > self.n:
                out.append(f"{layer}: {allowed} of {'/'.join(self.kinds)} > budget {self.n}")
            for kind, c in sorted(counts.items()):
                if kind not in self.kinds:
                    out.append(f"{layer}: {c} {kind} > budget 0 (kind not allowed)")
        return out

    def describe(self) -> str:
        if self.kinds is None:
            return str(self.n)
        if isinstance(self.kinds, Mapping):
            return ", ".join(f"{k}={v}" for k, v in self.kinds.items())
        return f"{self.n} of {'/'.join(self.kinds)}"


class HostSyncError(AssertionError):
    """A checked region synchronized the host more than its budget allows."""

    def __init__(self, records: Sequence[SyncRecord], budget: Budget | int = 0,
                 where: str = "", violations: Sequence[str] | None = None,
                 unavailable: Sequence[str] = ()):
        self.records = list(records)
        self.budget = Budget.of(budget)
        self.where = where
        self.violations = list(violations if violations is not None
                               else self.budget.violations(self.records))
        self.unavailable = list(unavailable)
        super().__init__(self._message())

    def _message(self) -> str:
        head = (f"{len(self.records)} host sync record(s) in checked region"
                f"{' ' + self.where if self.where else ''} (budget {self.budget.describe()})")
        lines = [head]
        lines += [f"  over budget: {v}" for v in self.violations]
        lines += [f"  {r.format()}" for r in self.records]
        if self.unavailable:
            lines.append(f"  layers not run: {', '.join(self.unavailable)}")
        return "\n".join(lines)

    def __reduce__(self):
        return (HostSyncError, (self.records, self.budget, self.where, self.violations,
                                self.unavailable))
