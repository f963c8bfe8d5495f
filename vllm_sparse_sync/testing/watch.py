"""Watch lists without hand-built lists: every device-standing tensor an object holds.

Convention (this project's and vLLM's): a host twin's name has the word ``cpu`` (or ``np``);
everything else a builder, a batch or a metadata object holds is device data. A CPU stand-in
for a device tensor that shares storage with its host twin cannot be told apart from the twin,
so it is refused here rather than silently unwatched.
"""

from __future__ import annotations

import dataclasses

import torch

from .layers.taint import storage_of

HOST_NAMES = ("cpu", "np", "numpy")


def is_host_name(name: str) -> bool:
    """Whether an attribute name marks host data: one of its ``_``-separated words is ``cpu``,
    ``np`` or ``numpy`` (``seq_lens_cpu``, ``seq_lens_cpu_upper_bound``, ``cpu``, ``x_np``)."""
    return any(word in HOST_NAMES for word in name.lower().split("_"))


def _children(obj, depth: int):
    """(name, value) pairs below `obj` worth walking: dataclass fields, then plain attributes."""
    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        return [(str(k), v) for k, v in obj.items()]
    if depth <= 0 or isinstance(obj, type):
        return []
    if dataclasses.is_dataclass(obj):
        return [(f.name, getattr(obj, f.name, None)) for f in dataclasses.fields(obj)]
    if hasattr(obj, "__dict__"):
        return list(vars(obj).items())
    return []


def device_tensors(*objs, depth: int = 3) -> list[torch.Tensor]:
    """Every device-standing tensor in `objs`: tensors themselves, and the tensors their fields
    and attributes hold (through lists, tuples and dicts, and dataclasses and plain objects up
    to `depth` levels down), except under host-named attributes (``*_cpu``).

    Raises ValueError when a collected tensor shares storage with a host twin (a CPU stand-in
    that is the host tensor itself would hide every read of it).
    """
    found: list[tuple[str, torch.Tensor]] = []
    host: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    stack = [(f"objs[{i}]", o, depth, False) for i, o in enumerate(objs)]
    while stack:
        path, obj, left, under_host = stack.pop()
        if isinstance(obj, torch.Tensor):
            (host if under_host else found).append((path, obj))
            continue
        if obj is None or isinstance(obj, (str, bytes, int, float, bool, type)) or id(obj) in seen:
            continue
        seen.add(id(obj))
        container = isinstance(obj, (list, tuple, dict))
        for name, value in _children(obj, left):
            child_host = under_host or is_host_name(name)
            stack.append((f"{path}.{name}", value, left if container else left - 1, child_host))
    host_storages = {id(s): p for p, t in host if (s := storage_of(t)) is not None}
    out, kept = [], set()
    for path, t in reversed(found):
        s = storage_of(t)
        if s is not None and id(s) in host_storages:
            raise ValueError(
                f"{path} shares storage with its host twin {host_storages[id(s)]}: a CPU stand-in "
                "for a device tensor must be its own copy (clone it), or reads of it go unseen"
            )
        if id(t) not in kept:
            kept.add(id(t))
            out.append(t)
    return out
