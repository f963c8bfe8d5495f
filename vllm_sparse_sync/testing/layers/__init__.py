"""Detection layers, one module each, behind the protocols in `protocol.py`."""

from __future__ import annotations

from .capture_probe import CaptureProbe
from .debug_mode import DebugModeLayer
from .protocol import RegionLayer, StepProbe
from .runtime_api import RuntimeApiLayer
from .sentinel import SentinelLayer
from .trace import TraceLayer

REGION_LAYERS = {
    cls.name: cls
    for cls in sorted((SentinelLayer, DebugModeLayer, TraceLayer, RuntimeApiLayer), key=lambda c: c.order)
}
STEP_PROBES = {CaptureProbe.name: CaptureProbe}
ALL_LAYERS = (*REGION_LAYERS, *STEP_PROBES)


def layer_class(name: str):
    """The class of layer `name`; a ValueError naming the known layers otherwise."""
    cls = REGION_LAYERS.get(name) or STEP_PROBES.get(name)
    if cls is None:
        raise ValueError(f"unknown sync layer {name!r}; known: {', '.join(ALL_LAYERS)}")
    return cls


def unavailable_reason(name: str, *, watch: bool = True) -> str | None:
    """None when layer `name` can run in this process (given whether anything is watched),
    else why not."""
    cls = layer_class(name)
    reason = cls.unavailable_reason()
    if reason is None and cls.needs_watch and not watch:
        reason = "nothing watched (pass watch=[...]: the tensors that stand for device data)"
    return reason


def parse_layers(spec) -> tuple[str, ...] | None:
    """`"sentinel,debug_mode"` or a sequence -> names; None/"auto" -> None."""
    if spec is None:
        return None
    if isinstance(spec, str):
        if spec.strip() in ("", "auto"):
            return None
        spec = [s.strip() for s in spec.split(",") if s.strip()]
    elif not isinstance(spec, (list, tuple)) or not all(isinstance(s, str) for s in spec):
        raise TypeError(f"layers: expected 'auto', a comma-separated string or a list of names, "
                        f"got {spec!r}")
    names = tuple(spec)
    for n in names:
        layer_class(n)
    return names


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
    "layer_class",
    "parse_layers",
    "unavailable_reason",
]
