"""Host argument checks shared by the public API: host ints, flags, devices, and the kernels'
length limits. Each failure is a ``TypeError`` or ``ValueError`` that names the argument."""

from __future__ import annotations

import operator

import numpy as np
import torch

INT32_MAX = 2**31 - 1
"""Largest value an int32 device length (``seq_lens``, ``query_start_loc``) holds."""

MAX_KERNEL_ROWS = 2**30
"""Most kernel rows (positions) one row of the kernels may have: positions, widths and top-k are
int32 inside the kernels, and a position plus any tile or block of a kernel stays below
``2**31`` when positions are below ``2**30``."""

MAX_ROWS = 2**20
"""Most rows (decode tokens) one call of the kernels may have: per-row offsets are int64, and each
row's scratch words (histograms, counters) stay int32-addressable."""


def host_int(name: str, value: object, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as a Python int in ``[low, high]``: ints and ``numpy.integer`` are taken; bools,
    floats, strings and tensors are a ``TypeError``, values out of range a ``ValueError``."""
    if type(value) is int:  # the common case, on every build
        v = value
    elif isinstance(value, (bool, np.bool_, torch.Tensor)):
        raise TypeError(f"{name}: must be a host int, got {type(value).__name__}")
    else:
        try:
            v = operator.index(value)
        except TypeError:
            raise TypeError(f"{name}: must be a host int, got {type(value).__name__} {value!r}") from None
    if low is not None and v < low:
        raise ValueError(f"{name}: must be >= {low}, got {v}")
    if high is not None and v > high:
        raise ValueError(f"{name}: must be <= {high}, got {v}")
    return v


def flag(name: str, value: object) -> bool:
    """``value`` as a bool: only ``True``/``False`` (or a ``numpy.bool_``); anything else, even a
    truthy string, is a ``TypeError``."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name}: must be a bool, got {type(value).__name__} {value!r}")


def device(name: str, value: object, *, allow_meta: bool = False) -> torch.device:
    """``value`` as a torch device that can hold this package's buffers here: a ``ValueError``
    for a string torch cannot parse, the meta device (no data; ``allow_meta`` where only tensor
    metadata is used, as a builder's proof that it reads no device data), or a CUDA device this
    torch or host does not have."""
    if not isinstance(value, (str, torch.device)):
        raise TypeError(f"{name}: must be a torch.device or a string, got {type(value).__name__}")
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"{name}: {value!r} is not a torch device ({str(exc).splitlines()[0]})") from None
    if dev.type == "meta" and not allow_meta:
        raise ValueError(f"{name}: the meta device holds no data; use cpu or cuda")
    if dev.type == "cuda":
        if torch.version.cuda is None and torch.version.hip is None:
            raise ValueError(f"{name}: {dev} asked for, but this torch ({torch.__version__}) has no CUDA")
        if not torch.cuda.is_available():
            raise ValueError(f"{name}: {dev} asked for, but no CUDA device is visible here")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{name}: {dev} asked for, but only {torch.cuda.device_count()} CUDA "
                             "device(s) are visible")
    return dev


def same_device(name: str, t: torch.Tensor, want: torch.device) -> None:
    """A ``ValueError`` unless ``t`` lives on ``want`` (an index-less ``want`` takes any index)."""
    if t.device != want and not (t.device.type == want.type and want.index is None):
        raise ValueError(f"{name}: must live on {want}, got a tensor on {t.device}")


def tensor(name: str, value: object, *, allow_meta: bool = False) -> torch.Tensor:
    """``value`` if it is a tensor, else a ``TypeError`` naming it (lists and arrays included); a
    meta tensor is a ``ValueError`` unless ``allow_meta`` (device ops that read no data)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: must be a torch.Tensor, got {type(value).__name__}")
    if value.device.type == "meta" and not allow_meta:
        raise ValueError(f"{name}: a meta tensor holds no data")
    return value


INT_DTYPES = (torch.int32, torch.int64)


def int_tensor(name: str, value: object, dtypes: tuple = INT_DTYPES, *, allow_meta: bool = False) -> torch.Tensor:
    """``value`` as a tensor of one of ``dtypes`` (int32 or int64 by default): floats, bools and
    other integer widths are refused, never cast."""
    t = tensor(name, value, allow_meta=allow_meta)
    if t.dtype not in dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name}: must be {names}, got {t.dtype}")
    return t
