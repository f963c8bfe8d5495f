"""Process setup for vLLM on a GPU-less host (`vllm_sparse_sync.testing.vllm_env`, which the
pytest plugin uses before anything imports vLLM)."""

from __future__ import annotations

from ..testing.vllm_env import CPU_ENV, cuda_device_present, prepare_cpu_process

__all__ = ["CPU_ENV", "cuda_device_present", "prepare_cpu_process"]
