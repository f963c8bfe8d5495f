"""Indexer kernels: fp8 paged scorer, top-k, K-cache writer; see ``reference`` for semantics.

``dispatch`` (the public functions: the device kernels on CUDA tensors, the torch reference
elsewhere), ``ops`` (their device entry points), ``planner`` (which kernels a call takes),
``launch`` (running a planned route), ``workspace`` (scratch), ``device`` (host queries),
``cuda/`` (NVRTC-compiled kernels), ``triton/`` (Triton kernels), ``reference`` (the torch oracle).
"""

from .config import DEFAULT_CONFIG, KernelConfig, parse_config
from .dispatch import (
    indexer_topk,
    make_workspace,
    page_table_slots,
    paged_indexer_logits,
    topk_indices,
    write_index_k_cache,
)
from .planner import DeviceInfo, Route, StepPlan, plan_route, plan_step
from .reference import quantize_index_k

__all__ = [
    "DEFAULT_CONFIG",
    "DeviceInfo",
    "KernelConfig",
    "Route",
    "StepPlan",
    "indexer_topk",
    "make_workspace",
    "page_table_slots",
    "paged_indexer_logits",
    "parse_config",
    "plan_route",
    "plan_step",
    "quantize_index_k",
    "topk_indices",
    "write_index_k_cache",
]
