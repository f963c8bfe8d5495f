"""CPU sentinel: flags host reads of watched tensors and of everything computed from them.

Runs on any machine. Tensors in `watch` stand for device-resident tensors; taint follows
them through every torch op seen by a TorchFunctionMode (results, in-place targets and `out=`
tensors of an op with a tainted input become tainted; views share taint through their storage).
"""

from __future__ import annotations

import threading
import weakref
from typing import ClassVar

import torch
from torch.overrides import TorchFunctionMode

from ..records import (
    D2H_COPY,
    DATA_DEPENDENT_SHAPE,
    SCALAR_READ,
    SyncRecord,
    user_frame,
)

LAYER = "sentinel"

_SCALAR_READS = {
    "item", "__int__", "__float__", "__bool__", "__index__", "__complex__", "__format__",
    "equal", "allclose", "is_nonzero",
}
_D2H = {"tolist", "numpy", "cpu", "__array__", "__repr__", "__str__"}
_SHAPE_FROM_DATA = {
    "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount",
    "_unique", "_unique2", "masked_scatter",
}
_FACTORIES = {
    "empty", "zeros", "ones", "full", "arange", "range", "linspace", "logspace", "rand",
    "randn", "randint", "randperm", "new_empty", "new_zeros", "new_ones", "new_full",
    "empty_strided", "narrow", "expand", "reshape", "view", "repeat", "tile",
}


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)
    elif isinstance(obj, slice):
        for o in (obj.start, obj.stop, obj.step):
            yield from _tensors(o)


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        ptr = t.untyped_storage().data_ptr()
    except Exception:
        return None
    return ptr or None


class TaintSet:
    """Storage addresses of tainted tensors, alive only while a tainted tensor holds them."""

    def __init__(self):
        # storage address -> {id(tensor): weakref}; an address with no live holder is clean
        self._by_ptr: dict[int, dict[int, weakref.ref]] = {}

    def add(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key is None:
            return
        holders = self._by_ptr.setdefault(key, {})
        ref = holders.get(id(t))
        if ref is None or ref() is not t:  # ids of dead tensors are reused: replace stale refs
            holders[id(t)] = weakref.ref(t)

    def __contains__(self, t: torch.Tensor) -> bool:
        key = _storage_key(t)
        if key is None:
            return False
        holders = self._by_ptr.get(key)
        if not holders:
            return False
        for k, ref in list(holders.items()):
            if ref() is None:
                del holders[k]
        if not holders:
            del self._by_ptr[key]
            return False
        return True

    def any(self, obj) -> bool:
        return any(t in self for t in _tensors(obj))


def _is_mask(idx) -> bool:
    return isinstance(idx, torch.Tensor) and idx.dtype in (torch.bool, torch.uint8)


def _index_parts(idx):
    return idx if isinstance(idx, tuple) else (idx,)


def _to_host(args, kwargs) -> bool:
    """Whether a `Tensor.to(...)` call targets the host."""
    cands = list(args[1:]) + [kwargs.get("device")]
    for c in cands:
        if isinstance(c, str) and c.split(":")[0] == "cpu":
            return True
        if isinstance(c, torch.device) and c.type == "cpu":
            return True
    return False


class _TaintMode(TorchFunctionMode):
    def __init__(self, layer: SentinelLayer):
        super().__init__()
        self.layer = layer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        layer = self.layer
        if name == "__get__":  # attribute reads (dtype, shape, ...)
            return func(*args, **kwargs)
        taint = layer.taint
        kind = _classify(name, args, kwargs, taint)
        if kind is not None:
            layer.flag(kind, func)
        out = func(*args, **kwargs)
        if taint.any(args) or taint.any(kwargs):
            for t in _tensors(out):
                taint.add(t)
        return out


def _classify(name, args, kwargs, taint: TaintSet) -> str | None:
    if name in _SCALAR_READS:
        return SCALAR_READ if taint.any(args) else None
    if name in _D2H:
        return D2H_COPY if args and taint.any(args[0]) else None
    if name == "to":
        return D2H_COPY if args and args[0] in taint and _to_host(args, kwargs) else None
    if name in _SHAPE_FROM_DATA:
        return DATA_DEPENDENT_SHAPE if taint.any(args) or taint.any(kwargs) else None
    if name == "where":
        one_arg = len(args) == 1 and "input" not in kwargs and "other" not in kwargs
        return DATA_DEPENDENT_SHAPE if one_arg and taint.any(args) else None
    if name == "repeat_interleave":
        sized = kwargs.get("output_size") is not None or len(args) >= 4
        data_repeats = any(isinstance(a, torch.Tensor) for a in args[1:2]) or \
            isinstance(kwargs.get("repeats"), torch.Tensor) or len(args) == 1
        if not sized and data_repeats and (taint.any(args) or taint.any(kwargs)):
            return DATA_DEPENDENT_SHAPE
        return None
    if name == "one_hot":
        num_classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
        return DATA_DEPENDENT_SHAPE if num_classes == -1 and taint.any(args[:1]) else None
    if name in ("__getitem__", "__setitem__"):
        if len(args) < 2:
            return None
        parts = _index_parts(args[1])
        if any(_is_mask(p) for p in parts):
            involved = args[0] in taint or any(_is_mask(p) and p in taint for p in parts)
            if name == "__setitem__":
                value_is_tensor = len(args) > 2 and isinstance(args[2], torch.Tensor)
                return DATA_DEPENDENT_SHAPE if involved and value_is_tensor else None
            return DATA_DEPENDENT_SHAPE if involved else None
        slices = [p for p in parts if isinstance(p, slice)]
        if any(taint.any(s) for s in slices):
            return SCALAR_READ
        return None
    if name in _FACTORIES:
        sizes = args[1:] if name in ("new_empty", "new_zeros", "new_ones", "new_full", "narrow",
                                     "expand", "reshape", "view", "repeat", "tile") else args
        if any(isinstance(t, torch.Tensor) and t.dim() == 0 and t in taint
               for t in _tensors(list(sizes))):
            return SCALAR_READ
        return None
    return None


class SentinelLayer:
    """Flags host reads of watched (device-standing) tensors and their descendants.

    Torch function modes are per thread: the sentinel sees the thread that started it.
    """

    name: ClassVar[str] = LAYER

    def __init__(self, watch=()):
        self.watch = list(_tensors(list(watch)))
        self.taint = TaintSet()
        self.records: list[SyncRecord] = []
        self._mode: _TaintMode | None = None
        self._lock = threading.Lock()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None

    def mark(self, *tensors) -> None:
        """Watch more tensors while the layer runs."""
        for t in _tensors(list(tensors)):
            self.taint.add(t)

    def flag(self, kind: str, func) -> None:
        op = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
        if "<locals>" in op:
            op = getattr(func, "__name__", op)
        op = op.replace("TensorBase.", "Tensor.").replace("_VariableFunctionsClass.", "torch.")
        with self._lock:
            self.records.append(SyncRecord.at(kind, LAYER, op, user_frame()))

    def start(self) -> None:
        for t in self.watch:
            self.taint.add(t)
        self._mode = _TaintMode(self)
        self._mode.__enter__()

    def stop(self) -> list[SyncRecord]:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        return list(self.records)
