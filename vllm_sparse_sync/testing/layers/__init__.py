"""Detection layers, one module each, behind the protocols in `protocol.py`."""

from __future__ import annotations

from .capture_probe import CaptureProbe
from .debug_mode import DebugModeLayer
from .protocol import RegionLayer, StepProbe
from .runtime_api import RuntimeApiLayer
from .sentinel import SentinelLayer
from .trace import TraceLayer

REGION_LAYERS = {
    cls.name: cls for cls in (SentinelLayer, DebugModeLayer, TraceLayer, RuntimeApiLayer)
}
STEP_PROBES = {CaptureProbe.name: CaptureProbe}
ALL_LAYERS = (*REGION_LAYERS, *STEP_PROBES)


def unavailable_reason(name: str) -> str | None:
    """None when layer `name` can run in this process, else why not."""
    cls = REGION_LAYERS.get(name) or STEP_PROBES.get(name)
    if cls is None:
        raise ValueError(f"unknown sync layer {name!r}; known: {', '.join(ALL_LAYERS)}")
    return cls.unavailable_reason()


def parse_layers(spec) -> tuple[str, ...] | None:
    """`"sentinel,debug_mode"` or a sequence -> names; None/"auto" -> None."""
    if spec is None:
        return None
    if isinstance(spec, str):
        if spec.strip() in ("", "auto"):
            return None
        spec = [s.strip() for s in spec.split(",") if s.strip()]
    names = tuple(spec)
    for n in names:
        if n not in ALL_LAYERS:
            raise ValueError(f"unknown sync layer {n!r}; known: {', '.join(ALL_LAYERS)}")
    return names


def default_layers(*, watch: bool) -> tuple[str, ...]:
    """The layers `layers=None` means here: every layer that can run in this process;
    the sentinel only when something is watched."""
    out = []
    for name, cls in {**REGION_LAYERS, **STEP_PROBES}.items():
        if name == "sentinel" and not watch:
            continue
        if cls.unavailable_reason() is None:
            out.append(name)
    return tuple(out)


__all__ = [
    "ALL_LAYERS",
    "CaptureProbe",
    "DebugModeLayer",
    "REGION_LAYERS",
    "RegionLayer",
    "RuntimeApiLayer",
    "STEP_PROBES",
    "SentinelLayer",
    "StepProbe",
    "TraceLayer",
    "default_layers",
    "parse_layers",
    "unavailable_reason",
]
