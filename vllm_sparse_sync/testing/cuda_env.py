"""CUDA facts without side effects: never initializes CUDA unless asked."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def cuda_available() -> bool:
    """Whether torch can use a CUDA device (initializes CUDA on first call)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def no_cuda_reason() -> str | None:
    """None when CUDA is usable, else a reason fit for a skip message."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    if not cuda_available():
        return "no CUDA device visible"
    return None
