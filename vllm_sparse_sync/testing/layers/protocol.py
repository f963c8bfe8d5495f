"""The two shapes a detection layer takes, and what the checked region needs to know of each.

A *region layer* wraps a block of code: `start()` before, `stop()` after, returning the
records it saw. A *step probe* runs a step function itself (the capture probe needs that).
Every layer says whether it can run here and why not (`unavailable_reason`), where it sits
among the others (`order`: region layers start in ascending order and stop in reverse), whether
it takes the watched tensors and cannot run without them (`needs_watch`), and how an exception
raised in the checked block becomes one of its records (`record_exception`, None when the
exception is not a sync it reports).

One instance of a region layer runs at a time, shared by every checked region that uses it
(`shared.py`): per process (`shared_by = "process"`: torch's debug mode, the GPU trace hooks and
the profiler are process-wide) or per thread (`"thread"`: torch modes are per thread). A region
that joins a running layer hands it its watched tensors (`add_watch`); `collect()` returns the
records seen since the last call, so each goes to the region that ran when it was seen. A layer
with `own_thread_only` is joined, collected and stopped only on the thread that started it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from ..records import SyncRecord


class LayerBase:
    """The protocols' defaults: made without the watched tensors, no exception of its own to
    record, one instance per process, records kept in `records`."""

    needs_watch: ClassVar[bool] = False
    shared_by: ClassVar[str] = "process"
    own_thread_only: ClassVar[bool] = False
    records: list[SyncRecord]
    _taken: int = 0

    def add_watch(self, watch: Sequence) -> None:
        """A region joining the running layer watches `watch` too (layers that watch nothing
        ignore it)."""

    def collect(self) -> list[SyncRecord]:
        """The records seen since the last `collect()` (or since `start()`)."""
        new = self.records[self._taken:]
        self._taken += len(new)
        return list(new)

    @classmethod
    def create(cls, watch: Sequence = ()):
        return cls()

    @classmethod
    def record_exception(cls, exc: BaseException) -> SyncRecord | None:
        return None


@runtime_checkable
class RegionLayer(Protocol):
    name: ClassVar[str]
    order: ClassVar[int]
    needs_watch: ClassVar[bool]
    shared_by: ClassVar[str]
    own_thread_only: ClassVar[bool]

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None when the layer can run in this process, else why not."""

    @classmethod
    def create(cls, watch: Sequence) -> RegionLayer: ...

    @classmethod
    def record_exception(cls, exc: BaseException) -> SyncRecord | None: ...

    def start(self) -> None: ...

    def add_watch(self, watch: Sequence) -> None: ...

    def collect(self) -> list[SyncRecord]: ...

    def stop(self) -> list[SyncRecord]:
        """Stop; the records not collected yet."""


@runtime_checkable
class StepProbe(Protocol):
    name: ClassVar[str]
    order: ClassVar[int]
    needs_watch: ClassVar[bool]

    @classmethod
    def unavailable_reason(cls) -> str | None: ...

    def probe(self, step_fn: Callable[[], Any]) -> list[SyncRecord]: ...
