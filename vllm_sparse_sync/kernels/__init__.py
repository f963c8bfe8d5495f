"""Indexer kernels: fp8 paged scorer, top-k, K-cache writer; see ``reference`` for semantics."""

from .config import DEFAULT_CONFIG, FusedConfig, KernelConfig, ScorerConfig, TopkConfig
from .dispatch import (
    indexer_topk,
    make_workspace,
    page_table_slots,
    paged_indexer_logits,
    topk_indices,
    write_index_k_cache,
)
from .reference import quantize_index_k
from .route import DeviceInfo, Route, plan_route

__all__ = [
    "DEFAULT_CONFIG",
    "DeviceInfo",
    "FusedConfig",
    "KernelConfig",
    "Route",
    "ScorerConfig",
    "TopkConfig",
    "plan_route",
    "indexer_topk",
    "make_workspace",
    "page_table_slots",
    "paged_indexer_logits",
    "quantize_index_k",
    "topk_indices",
    "write_index_k_cache",
]
