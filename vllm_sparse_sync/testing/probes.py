"""Known-sync and clean operations, the material of the self-test and the GPU layer tests.

Each op takes a device tensor `x` (int32, 8 positive entries) and does one thing.
`expected`: True (it synchronizes the host), False (it must not), None (version-dependent:
measured, not asserted).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Op:
    name: str
    expected: bool | None
    fn: Callable[[torch.Tensor], object]
    tensor_read: bool = True  # a read of x's values (what the sentinel can see)


@functools.lru_cache(maxsize=1)
def _cudart():
    """libcudart through ctypes (torch's lib dir or the nvidia-cuda-runtime wheel)."""
    cands = []
    try:  # the copy torch already loaded, if any
        with open("/proc/self/maps") as f:
            cands += sorted({line.split()[-1] for line in f if "libcudart.so" in line})
    except OSError:
        pass
    tdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    cands += glob.glob(os.path.join(tdir, "libcudart*.so*"))
    try:
        import nvidia.cuda_runtime as ncr

        for base in getattr(ncr, "__path__", []):
            cands += glob.glob(os.path.join(base, "lib", "libcudart.so*"))
    except ImportError:
        pass
    cands += ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    for c in cands:
        try:
            return ctypes.CDLL(c)
        except OSError:
            continue
    raise OSError("libcudart not found")


def ext_stream_sync(x=None) -> None:
    """cudaStreamSynchronize on torch's current stream, called like an extension would."""
    lib = _cudart()
    lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
    rc = lib.cudaStreamSynchronize(ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    if rc != 0:
        raise RuntimeError(f"cudaStreamSynchronize failed with {rc}")


def ext_device_sync(x=None) -> None:
    """cudaDeviceSynchronize through ctypes."""
    rc = _cudart().cudaDeviceSynchronize()
    if rc != 0:
        raise RuntimeError(f"cudaDeviceSynchronize failed with {rc}")


def _event_sync(x):
    ev = torch.cuda.Event()
    ev.record()
    ev.synchronize()


def _pageable_h2d(x):
    x.copy_(torch.arange(8, dtype=torch.int32), non_blocking=True)


OPS: tuple[Op, ...] = (
    Op("x.sum().item()", True, lambda x: x.sum().item()),
    Op("int(x[0])", True, lambda x: int(x[0])),
    Op("bool(x[0] > 0)", True, lambda x: bool(x[0] > 0)),
    Op("x.tolist()", True, lambda x: x.tolist()),
    Op("x.cpu()", True, lambda x: x.cpu()),
    Op("x.nonzero()", True, lambda x: x.nonzero()),
    Op("x[x > 2]", True, lambda x: x[x > 2]),
    Op("masked_select", True, lambda x: torch.masked_select(x, x > 2)),
    Op("unique", True, lambda x: torch.unique(x)),
    Op("bincount", True, lambda x: torch.bincount(x)),
    Op("repeat_interleave(x, x)", True, lambda x: torch.repeat_interleave(x, x)),
    Op("torch.equal(x, y)", True, lambda x: torch.equal(x, x + 1)),
    Op("torch.cuda.synchronize()", True, lambda x: torch.cuda.synchronize(), False),
    Op("Event.synchronize()", True, _event_sync, False),
    Op("Stream.synchronize()", True, lambda x: torch.cuda.current_stream().synchronize(), False),
    Op("ctypes cudaStreamSynchronize", True, ext_stream_sync, False),
    Op("pageable non_blocking H2D", None, _pageable_h2d),
    Op("multinomial(n=1)", None, lambda x: torch.multinomial(x.float(), 1), False),
    Op("arith + cumsum", False, lambda x: torch.cumsum(x * 2 + 1, 0)),
    Op("topk", False, lambda x: torch.topk(x, 3)),
    Op("repeat_interleave sized", False,
       lambda x: torch.repeat_interleave(x, x, output_size=int(8 * 5))),
    Op("nonzero_static", False, lambda x: torch.nonzero_static(x, size=8)),
    Op("copy_ into device buffer", False, lambda x: torch.empty_like(x).copy_(x)),
    Op("x[mask] = 0", False, lambda x: x.clone().__setitem__(x > 2, 0)),
)


def make_input(device) -> torch.Tensor:
    """The probe input: int32 [8] of 5s on `device` (repeat_interleave sized sums to 40)."""
    return torch.full((8,), 5, dtype=torch.int32, device=device)
