"""Pin each pytest-xdist worker to its own GPU before CUDA initializes.

GPUs are counted without touching CUDA: `CUDA_VISIBLE_DEVICES` if set, else NVML through
ctypes, else `nvidia-smi -L`.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys

ENV = "CUDA_VISIBLE_DEVICES"


def _nvml_count() -> int | None:
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    try:
        if lib.nvmlInit_v2() != 0:
            return None
        count = ctypes.c_uint(0)
        ok = lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0
        lib.nvmlShutdown()
        return int(count.value) if ok else None
    except AttributeError:
        return None


def _smi_count() -> int | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def visible_devices(environ=None) -> list[str] | None:
    """The device ids this process may use, or None when unknown; never initializes CUDA."""
    environ = os.environ if environ is None else environ
    spec = environ.get(ENV)
    if spec is not None:
        return [d.strip() for d in spec.split(",") if d.strip() and d.strip() != "-1"]
    count = _nvml_count()
    if count is None:
        count = _smi_count()
    return None if count is None else [str(i) for i in range(count)]


def worker_index(worker_id: str | None) -> int | None:
    """`gw3` -> 3; None when not an xdist worker."""
    if not worker_id:
        return None
    m = re.fullmatch(r"gw(\d+)", worker_id)
    return int(m.group(1)) if m else None


def devices_for_worker(index: int, devices: list[str], per_worker: int = 1) -> list[str]:
    """The devices worker `index` gets: a round-robin slice of `per_worker` devices."""
    if not devices:
        return []
    per_worker = max(1, min(per_worker, len(devices)))
    groups = max(1, len(devices) // per_worker)
    start = (index % groups) * per_worker
    return devices[start:start + per_worker]


def cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:
        return False


def pin_worker(environ=None, *, per_worker: int = 1) -> str:
    """Set `CUDA_VISIBLE_DEVICES` for this xdist worker; return what was done, in words."""
    environ = os.environ if environ is None else environ
    idx = worker_index(environ.get("PYTEST_XDIST_WORKER"))
    if idx is None:
        return "not an xdist worker"
    if cuda_initialized():
        return "CUDA already initialized in this worker: not pinned"
    devices = visible_devices(environ)
    if not devices:
        return "no GPUs counted: not pinned"
    chosen = devices_for_worker(idx, devices, per_worker)
    environ[ENV] = ",".join(chosen)
    return f"worker gw{idx} pinned to {ENV}={environ[ENV]}"
