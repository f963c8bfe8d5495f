"""Indexer kernels: fp8 paged scorer, top-k, K-cache writer; see ``reference`` for semantics."""

from .dispatch import (
    indexer_topk,
    make_workspace,
    paged_indexer_logits,
    topk_indices,
    write_index_k_cache,
)
from .reference import quantize_index_k

__all__ = [
    "indexer_topk",
    "make_workspace",
    "paged_indexer_logits",
    "quantize_index_k",
    "topk_indices",
    "write_index_k_cache",
]
