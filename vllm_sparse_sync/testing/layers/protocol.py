"""The two shapes a detection layer takes, and what the checked region needs to know of each.

A *region layer* wraps a block of code: `start()` before, `stop()` after, returning the
records it saw. A *step probe* runs a step function itself (the capture probe needs that).
Every layer says whether it can run here and why not (`unavailable_reason`), where it sits
among the others (`order`: region layers start in ascending order and stop in reverse), whether
it takes the watched tensors and cannot run without them (`needs_watch`), and how an exception
raised in the checked block becomes one of its records (`record_exception`, None when the
exception is not a sync it reports).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from ..records import SyncRecord


class LayerBase:
    """The protocols' defaults: made without the watched tensors, no exception of its own to
    record."""

    needs_watch: ClassVar[bool] = False

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

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None when the layer can run in this process, else why not."""

    @classmethod
    def create(cls, watch: Sequence) -> RegionLayer: ...

    @classmethod
    def record_exception(cls, exc: BaseException) -> SyncRecord | None: ...

    def start(self) -> None: ...

    def stop(self) -> list[SyncRecord]: ...


@runtime_checkable
class StepProbe(Protocol):
    name: ClassVar[str]
    order: ClassVar[int]
    needs_watch: ClassVar[bool]

    @classmethod
    def unavailable_reason(cls) -> str | None: ...

    def probe(self, step_fn: Callable[[], Any]) -> list[SyncRecord]: ...
