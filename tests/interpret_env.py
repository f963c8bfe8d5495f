"""Run the Triton kernels in Triton's CPU interpreter when this host has no CUDA device.

Importing this module sets ``TRITON_INTERPRET=1`` (only without CUDA) and reloads the kernel
modules that were imported before, so their ``@triton.jit`` functions become interpreted ones.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

KERNEL_MODULES = [
    "vllm_sparse_sync.kernels.triton.common",
    "vllm_sparse_sync.kernels.triton.k_cache",
    "vllm_sparse_sync.kernels.triton.scorer",
    "vllm_sparse_sync.kernels.triton.topk_radix",
    "vllm_sparse_sync.kernels.triton.topk_sample",
    "vllm_sparse_sync.kernels.triton.fused",
    "vllm_sparse_sync.kernels.triton.dcp_merge",
    "vllm_sparse_sync.kernels.triton.slots",
    "vllm_sparse_sync.kernels.ops",
]
if not CUDA:
    for _name in KERNEL_MODULES:  # re-decorate if something imported them before the variable was set
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])

SKIP_WITH_CUDA = "CUDA present: the GPU tests run the compiled kernels"
