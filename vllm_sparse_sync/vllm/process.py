"""Process setup for vLLM on a GPU-less host; importable without vLLM (it never imports it)."""

from __future__ import annotations

import os
import sys

CPU_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",  # CpuPlatform; a CUDA wheel would resolve UnspecifiedPlatform
    "CUDA_VISIBLE_DEVICES": "",  # set and empty: vllm.triton_utils keeps the real Triton
    "TRITON_INTERPRET": "1",  # vLLM's Triton kernels are decorated for Triton's CPU interpreter
}


def cuda_device_present() -> bool:
    """Whether torch sees a CUDA device (vLLM then needs no CPU setup)."""
    import torch

    return torch.cuda.is_available()


def _resolved_platform() -> str | None:
    """Device type of the platform an imported vLLM has resolved; None while it has not."""
    platform = getattr(sys.modules.get("vllm.platforms"), "_current_platform", None)
    return None if platform is None else str(getattr(platform, "device_type", type(platform).__name__))


def prepare_cpu_process() -> None:
    """Set :data:`CPU_ENV` before vLLM is first imported. Idempotent.

    Raises RuntimeError when vLLM is already imported on another platform or without this
    environment (vLLM reads it at import: Triton placeholders, compiled instead of
    interpreted kernels), since the process can no longer be fixed.
    """
    if sys.modules.get("vllm") is None:
        os.environ.update(CPU_ENV)
        return
    platform = _resolved_platform()
    unset = sorted(k for k, v in CPU_ENV.items() if os.environ.get(k) != v)
    if unset or platform not in (None, "cpu"):
        raise RuntimeError(
            f"vllm was imported before prepare_cpu_process() (platform {platform or 'unresolved'}, "
            f"environment not set: {', '.join(unset) or 'none'}); call prepare_cpu_process() "
            "before the first `import vllm`, e.g. in a conftest"
        )
