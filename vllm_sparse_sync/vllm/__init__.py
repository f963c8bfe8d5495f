"""vLLM 0.33's own sparse-indexer metadata builder under this package's harness: real builders
and batches for every decode and prefill path, watch lists, vLLM's top-k bound and the exact one.

Needs vLLM (``pip install "vllm-sparse-sync[vllm]"``). Never imported by the rest of the package.
Without a CUDA device, importing it first prepares the process for vLLM's CPU platform.
"""

from __future__ import annotations

from ..testing.vllm_env import vllm_installed
from .process import CPU_ENV, cuda_device_present, prepare_cpu_process

VLLM_MISSING = (
    'vllm_sparse_sync.vllm needs vLLM, which is not installed: pip install "vllm-sparse-sync[vllm]"'
)

if not vllm_installed():
    raise ModuleNotFoundError(VLLM_MISSING, name="vllm")
if not cuda_device_present():
    prepare_cpu_process()

from .bounds import exact_kernel_max, vllm_bound  # noqa: E402
from .builder import (  # noqa: E402
    DcpGroupStandIn,
    ModelConfigStandIn,
    SpeculativeConfigStandIn,
    dcp_group,
    indexer_spec,
    make_builder,
    make_vllm_config,
)
from .cases import (  # noqa: E402
    UNREACHABLE_PATHS,
    VLLM_PATHS,
    UnreachablePath,
    VllmIndexerCase,
    make_vllm_case,
)
from .watch import vllm_watch  # noqa: E402

__all__ = [
    "CPU_ENV",
    "VLLM_MISSING",
    "UNREACHABLE_PATHS",
    "VLLM_PATHS",
    "DcpGroupStandIn",
    "ModelConfigStandIn",
    "SpeculativeConfigStandIn",
    "UnreachablePath",
    "VllmIndexerCase",
    "cuda_device_present",
    "dcp_group",
    "exact_kernel_max",
    "indexer_spec",
    "make_builder",
    "make_vllm_case",
    "make_vllm_config",
    "prepare_cpu_process",
    "vllm_bound",
    "vllm_watch",
]
