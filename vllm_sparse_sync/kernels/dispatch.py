"""Kernel dispatch: Triton on CUDA tensors, the torch reference elsewhere."""

from __future__ import annotations

from . import reference

paged_indexer_logits = reference.paged_indexer_logits
topk_indices = reference.topk_indices
write_index_k_cache = reference.write_index_k_cache
indexer_topk = reference.indexer_topk
