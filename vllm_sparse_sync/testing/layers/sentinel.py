"""CPU sentinel: flags host reads of watched tensors and of everything computed from them.

Runs on any machine. Tensors in `watch` stand for device-resident tensors. Taint lives on
storages (`taint.py`): every view of a tainted storage is tainted. Two torch modes follow the
data while the layer runs:

* a dispatch mode sees every ATen op: when an input is tainted, its outputs and every
  argument its schema marks as written (`out=`, in-place targets, `copy_`, `index_put_`, ...)
  become tainted; a custom op (outside `aten`/`prims`) counts as writing all its tensor
  arguments;
* a function mode sees the Python-level call and flags the host reads of tainted data
  (`.item()`, `int()`, `.tolist()`, `.cpu()`, `nonzero`, mask indexing, sizing from data, ...),
  and `non_blocking` copies from pageable host memory into device-standing tensors.

Triton launches with a tainted argument taint all their tensor arguments (`launch_hooks.py`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import ClassVar

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..records import (
    D2H_COPY,
    DATA_DEPENDENT_SHAPE,
    PAGEABLE_MEMCPY,
    SCALAR_READ,
    SyncRecord,
    in_harness_work,
    user_frame,
)
from . import launch_hooks
from .protocol import LayerBase
from .taint import TaintSet, storage_objects_are_preserved, tensors_in

LAYER = "sentinel"

_SCALAR_READS = {
    "item", "__int__", "__float__", "__bool__", "__index__", "__complex__", "__format__",
    "equal", "allclose", "is_nonzero", "__contains__",
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
_METHOD_FACTORIES = {"new_empty", "new_zeros", "new_ones", "new_full", "narrow", "expand",
                     "reshape", "view", "repeat", "tile"}
# attribute-like calls that never read data and need no taint bookkeeping
_PASS_THROUGH = {
    "__get__", "untyped_storage", "data_ptr", "dim", "size", "stride", "numel", "storage_offset",
    "is_contiguous", "is_pinned", "element_size", "__len__", "get_device", "nelement",
}
# schema namespaces whose write annotations are trusted; any other op may write every argument
_ANNOTATED_NAMESPACES = {"aten", "prims", "prim"}


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


def _to_device(args, kwargs) -> bool:
    """Whether a `Tensor.to(...)` call targets a non-CPU device."""
    cands = list(args[1:]) + [kwargs.get("device")]
    for c in cands:
        if isinstance(c, str) and c.split(":")[0] not in ("cpu", "meta") and _is_device_str(c):
            return True
        if isinstance(c, torch.device) and c.type not in ("cpu", "meta"):
            return True
    return False


def _is_device_str(s: str) -> bool:
    try:
        torch.device(s)
    except (RuntimeError, TypeError):
        return False
    return True


def _arg(args, kwargs, pos: int, name: str, default=None):
    if len(args) > pos:
        return args[pos]
    return kwargs.get(name, default)


def _pageable_host(t, taint: TaintSet) -> bool:
    """A host tensor in pageable memory (not standing for device data)."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t in taint:
        return False
    try:
        return not t.is_pinned()
    except RuntimeError:  # no accelerator to ask: nothing can be pinned
        return True


def _device_standing(t, taint: TaintSet) -> bool:
    return isinstance(t, torch.Tensor) and (t in taint or t.device.type not in ("cpu", "meta"))


def _classify(name, args, kwargs, taint: TaintSet) -> str | None:
    if name in _SCALAR_READS:
        return SCALAR_READ if taint.any(args) else None
    if name in _D2H:
        return D2H_COPY if args and taint.any(args[0]) else None
    if name == "to":
        if args and args[0] in taint and _to_host(args, kwargs):
            return D2H_COPY
        if (kwargs.get("non_blocking") and args and _pageable_host(args[0], taint)
                and _to_device(args, kwargs)):
            return PAGEABLE_MEMCPY
        return None
    if name == "cuda":
        nb = _arg(args, kwargs, 2, "non_blocking", False)
        return PAGEABLE_MEMCPY if nb and args and _pageable_host(args[0], taint) else None
    if name == "copy_":
        dst, src = args[0] if args else None, _arg(args, kwargs, 1, "src")
        if _arg(args, kwargs, 2, "non_blocking", False):
            if _device_standing(dst, taint) and _pageable_host(src, taint):
                return PAGEABLE_MEMCPY
            if (isinstance(src, torch.Tensor) and src.device.type not in ("cpu", "meta")
                    and _pageable_host(dst, taint)):
                return PAGEABLE_MEMCPY
        return None
    if name in _SHAPE_FROM_DATA:
        return DATA_DEPENDENT_SHAPE if taint.any(args) or taint.any(kwargs) else None
    if name == "tensor_split":
        sections = _arg(args, kwargs, 1, "indices_or_sections")
        return DATA_DEPENDENT_SHAPE if isinstance(sections, torch.Tensor) and sections in taint else None
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
        host_args = list(args[1:] if name in _METHOD_FACTORIES else args) + list(kwargs.values())
        if any(t.dim() == 0 and t in taint for t in tensors_in(host_args)):
            return SCALAR_READ  # a device scalar turned into a host size or value
        return None
    return None


def _host_copy(out, taint: TaintSet):
    """The result of a device-to-host copy as a copy of its own: a CPU stand-in's `.cpu()`,
    `.to("cpu")` or `.numpy()` can return the watched storage itself, which a CUDA tensor's never
    does; later host reads of it read host data and are no sync."""
    if isinstance(out, torch.Tensor) and out in taint:
        return out.clone()
    if isinstance(out, np.ndarray):
        return out.copy()
    return out


class _ReadMode(TorchFunctionMode):
    """Python-level calls: flags host reads, follows taint into results."""

    def __init__(self, layer: SentinelLayer):
        super().__init__()
        self.layer = layer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        layer = self.layer
        name = getattr(func, "__name__", "")
        if layer.paused or name in _PASS_THROUGH:
            return func(*args, **kwargs)
        if not launch_hooks.installed():
            launch_hooks.install()
        taint = layer.taint
        kind = _classify(name, args, kwargs, taint)
        if kind is not None:
            layer.flag(kind, func)
        if kind == D2H_COPY:  # the copy is the sync; what it returns is host data
            layer.touched += 1
            layer.pause()
            try:
                return _host_copy(func(*args, **kwargs), taint)
            finally:
                layer.resume()
        tainted_in = taint.any(args) or taint.any(kwargs)
        out = func(*args, **kwargs)
        if tainted_in:
            layer.touched += 1
            taint.add_all(out)
        return out


_WRITES: dict = {}  # op -> what `_written_args` found


def _written_args(func) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
    """(positional indices, keyword names) an ATen op writes; None: treat all as written."""
    cached = _WRITES.get(func)
    if cached is not None or func in _WRITES:
        return cached
    namespace = getattr(func, "namespace", None)
    schema = getattr(func, "_schema", None)
    if namespace not in _ANNOTATED_NAMESPACES or schema is None:
        result = None
    else:
        pos, kw = [], []
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                kw.append(a.name)
                if not a.kwarg_only:
                    pos.append(i)
        result = (tuple(pos), tuple(kw))
    _WRITES[func] = result
    return result


class _WriteMode(TorchDispatchMode):
    """ATen ops: taint flows from tainted inputs into outputs and written arguments."""

    def __init__(self, layer: SentinelLayer):
        super().__init__()
        self.layer = layer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        layer = self.layer
        if layer.paused:
            return out
        taint = layer.taint
        if taint.any(args) or taint.any(kwargs):
            taint.add_all(out)
            written = _written_args(func)
            if written is None:
                taint.add_all(args)
                taint.add_all(kwargs)
            else:
                pos, kw = written
                for i in pos:
                    if i < len(args):
                        taint.add_all(args[i])
                for k in kw:
                    if k in kwargs:
                        taint.add_all(kwargs[k])
        return out


def watch_list(watch) -> list[torch.Tensor]:
    """`watch` as a flat list of tensors: a tensor, or lists/tuples of them (nested).

    Anything else (None, numbers, dicts, strings) is a usage error naming the entry.
    """
    if isinstance(watch, torch.Tensor):
        return [watch]
    if isinstance(watch, (str, bytes, dict)) or not isinstance(watch, Iterable):
        raise TypeError(f"watch: expected a tensor or a sequence of tensors, got {type(watch).__name__}")
    out: list[torch.Tensor] = []
    stack = [(list(watch), "watch")]
    while stack:  # iterative: a recursive closure would keep the tensors alive in a cycle
        obj, path = stack.pop()
        for i, entry in enumerate(obj):
            where = f"{path}[{i}]"
            if isinstance(entry, torch.Tensor):
                out.append(entry)
            elif isinstance(entry, (list, tuple)):
                stack.append((list(entry), where))
            else:
                raise TypeError(
                    f"{where}: expected a torch.Tensor (a tensor that stands for device data), "
                    f"got {type(entry).__name__}"
                )
    return out


class SentinelLayer(LayerBase):
    """Flags host reads of watched (device-standing) tensors and their descendants.

    Torch modes are per thread: the sentinel sees the thread that started it.
    ``touched`` counts the ops and launches that consumed tainted data (0 after a region means
    the watched tensors were never used there).
    """

    name: ClassVar[str] = LAYER
    order: ClassVar[int] = 30  # innermost: closest to the user code
    needs_watch: ClassVar[bool] = True
    shared_by: ClassVar[str] = "thread"  # torch modes are per thread

    def __init__(self, watch=()):
        self.watch = watch_list(watch)
        self.taint = TaintSet()
        self.records: list[SyncRecord] = []
        self.touched = 0
        self.paused = 0
        self._modes: list = []
        self._lock = threading.Lock()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not storage_objects_are_preserved():
            return f"torch {torch.__version__} does not keep one Python object per storage"
        return None

    @classmethod
    def create(cls, watch=()):
        return cls(watch)

    def mark(self, *tensors) -> None:
        """Watch more tensors while the layer runs."""
        for t in watch_list(list(tensors)):
            self.taint.add(t)

    def add_watch(self, watch) -> None:
        self.mark(*watch)

    def flag(self, kind: str, func) -> None:
        if in_harness_work():
            return
        op = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
        if "<locals>" in op:
            op = getattr(func, "__name__", op)
        op = op.replace("TensorBase.", "Tensor.").replace("_VariableFunctionsClass.", "torch.")
        with self._lock:
            self.records.append(SyncRecord.at(kind, LAYER, op, user_frame()))

    # launch_hooks.LaunchWatcher
    def on_launch(self, tensors: list) -> None:
        if self.paused:
            return
        if any(t in self.taint for t in tensors):
            self.touched += 1
            for t in tensors:
                self.taint.add(t)

    def pause(self) -> None:
        self.paused += 1

    def resume(self) -> None:
        self.paused -= 1

    def start(self) -> None:
        for t in self.watch:
            self.taint.add(t)
        modes = [_WriteMode(self), _ReadMode(self)]
        try:
            for m in modes:
                m.__enter__()
                self._modes.append(m)
        except BaseException:
            self._exit_modes()
            raise
        launch_hooks.watch_launches(self)

    def _exit_modes(self) -> None:
        while self._modes:
            self._modes.pop().__exit__(None, None, None)

    def stop(self) -> list[SyncRecord]:
        launch_hooks.unwatch_launches(self)
        self._exit_modes()
        return self.collect()
