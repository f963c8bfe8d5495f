"""The process environment vLLM needs on a host without a CUDA device, set before vLLM is imported.

vLLM reads it when it is first imported (the platform, the Triton placeholders), so it is set
by the pytest plugin before the initial conftests load (`pytest_load_initial_conftests`), or by
`prepare_cpu_process()` before a script's first ``import vllm``. Never imports vLLM, and never
initializes CUDA (a GPU is found through NVML, so per-worker GPU pinning still works after it).
"""

from __future__ import annotations

import importlib.util
import os
import sys

CPU_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",  # CpuPlatform; a CUDA wheel would resolve UnspecifiedPlatform
    "CUDA_VISIBLE_DEVICES": "",  # set and empty: vllm.triton_utils keeps the real Triton
    "TRITON_INTERPRET": "1",  # vLLM's Triton kernels run in Triton's CPU interpreter
}
EXPORT = " ".join(f"{k}={v}" for k, v in CPU_ENV.items())


def vllm_installed() -> bool:
    """Whether vLLM itself is importable (a package with an ``__init__``, not a folder that happens
    to be named vllm, such as a project's tests/vllm on sys.path)."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin not in (None, "namespace")


def cuda_device_present() -> bool:
    """Whether a CUDA device is usable here, without initializing CUDA (NVML's count, where torch
    has it; else torch's own check)."""
    import torch

    if torch.version.cuda is None:
        return False
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    count = getattr(torch.cuda, "_device_count_nvml", None)
    if count is not None:
        try:
            n = count()
        except Exception:  # noqa: BLE001 - no NVML: no driver
            n = -1
        if n >= 0:
            return n > 0
    return torch.cuda.is_available()


def resolved_platform() -> str | None:
    """Device type of the platform an imported vLLM has resolved; None while it has not."""
    platform = getattr(sys.modules.get("vllm.platforms"), "_current_platform", None)
    return None if platform is None else str(getattr(platform, "device_type", ""))


def _platform_words() -> str:
    platform = getattr(sys.modules.get("vllm.platforms"), "_current_platform", None)
    if platform is None:
        return "not resolved yet"
    return f"{type(platform).__name__} (device type {str(getattr(platform, 'device_type', ''))!r})"


def imported_unprepared() -> str | None:
    """Why an imported vLLM can no longer run on the CPU platform (its platform and the variables
    it was imported without), or None (not imported, or imported as prepared)."""
    if sys.modules.get("vllm") is None:
        return None
    unset = sorted(k for k, v in CPU_ENV.items() if os.environ.get(k) != v)
    if not unset and resolved_platform() in (None, "cpu"):
        return None
    return f"platform {_platform_words()}, environment not set: {', '.join(unset) or 'none'}"


def prepare_cpu_process() -> None:
    """Set :data:`CPU_ENV` before vLLM is first imported. Idempotent.

    Raises RuntimeError when vLLM is already imported on another platform or without this
    environment (vLLM reads it at import: Triton placeholders, compiled instead of interpreted
    kernels), since the process can no longer be fixed; the message says what to do instead.
    """
    if sys.modules.get("vllm") is None:
        os.environ.update(CPU_ENV)
        return
    why = imported_unprepared()
    if why:
        raise RuntimeError(f"vllm was imported before prepare_cpu_process() ({why}); call "
                           f"prepare_cpu_process() before the first `import vllm`, or start the process "
                           f"with {EXPORT}")


def prepare_for_vllm() -> str:
    """Prepare this process for vLLM: the CPU environment where no CUDA device is usable, nothing
    on a GPU host. Returns what was done, in words; RuntimeError (with what to do) when vLLM was
    imported first."""
    if cuda_device_present():
        return "CUDA device present: vLLM's own platform"
    prepare_cpu_process()
    return f"no CUDA device: {EXPORT}"
