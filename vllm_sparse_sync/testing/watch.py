"""Watch lists without hand-built lists: every device-standing tensor an object holds.

Convention (this project's and vLLM's): a host twin's name has the word ``cpu`` (or ``np``);
everything else a builder, a batch or a metadata object holds is device data. A CPU stand-in
for a device tensor that shares storage with a host twin cannot be told apart from the twin
(reads of the twin are host reads), so it is left out of the watch and named in the list's
`unwatched`, which checked regions report.
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


class WatchList(list):
    """Tensors to watch; `unwatched` names the device-standing tensors left out because they share
    storage with a host twin (``Batch.seq_lens (storage of Batch.seq_lens_cpu)``)."""

    unwatched: tuple[str, ...] = ()


def _label(obj, i: int, n: int) -> str:
    name = type(obj).__name__
    return name if n == 1 or not isinstance(obj, (list, tuple, dict)) else f"objs[{i}]"


def device_tensors(*objs, depth: int = 3, strict: bool = False) -> WatchList:
    """Every device-standing tensor in `objs`: tensors themselves, and the tensors their fields
    and attributes hold (through lists, tuples and dicts, and dataclasses and plain objects up
    to `depth` levels down), except under host-named attributes (``*_cpu``).

    A collected tensor that shares storage with a host twin is left out and named in the
    result's `unwatched`; with `strict`, that is a ValueError naming it (for stand-ins this
    project builds, which are always their own copies).
    """
    found: list[tuple[str, torch.Tensor]] = []
    host: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    stack = [(_label(o, i, len(objs)), o, depth, False) for i, o in enumerate(objs)]
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
            sep = "" if name.startswith("[") else "."
            stack.append((f"{path}{sep}{name}", value, left if container else left - 1, child_host))
    host_storages = {}
    for p, t in host:
        s = storage_of(t)
        if s is not None:
            host_storages.setdefault(id(s), p)
    out, kept, unwatched = WatchList(), set(), []
    for path, t in reversed(found):
        s = storage_of(t)
        if s is not None and id(s) in host_storages:
            unwatched.append(f"{path} (storage of {host_storages[id(s)]})")
            continue
        if id(t) not in kept:
            kept.add(id(t))
            out.append(t)
    out.unwatched = tuple(dict.fromkeys(unwatched))
    if strict and out.unwatched:
        raise ValueError(f"{out.unwatched[0]} shares storage with its host twin: a CPU stand-in for a "
                         "device tensor must be its own copy (clone it), or reads of it go unseen")
    return out
