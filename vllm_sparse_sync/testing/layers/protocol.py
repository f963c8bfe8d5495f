"""The two shapes a detection layer takes.

A *region layer* wraps a block of code: `start()` before, `stop()` after, returning the
records it saw. A *step probe* runs a step function itself (the capture probe needs that).
Both say whether they can run here and why not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Protocol, runtime_checkable

from ..records import SyncRecord


@runtime_checkable
class RegionLayer(Protocol):
    name: ClassVar[str]

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None when the layer can run in this process, else why not."""

    def start(self) -> None: ...

    def stop(self) -> list[SyncRecord]: ...


@runtime_checkable
class StepProbe(Protocol):
    name: ClassVar[str]

    @classmethod
    def unavailable_reason(cls) -> str | None: ...

    def probe(self, step_fn: Callable[[], Any]) -> list[SyncRecord]: ...
