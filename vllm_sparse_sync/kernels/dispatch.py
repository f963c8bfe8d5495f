"""Kernel dispatch: Triton on CUDA tensors, the torch reference elsewhere.

Triton is imported on the first CUDA call only, so the package imports (and runs on the CPU)
without it. Triton-only keywords (``workspace=``, ``out=``) are accepted on both routes; the
reference ignores ``workspace`` and copies into ``out``.
"""

from __future__ import annotations

import torch

from . import reference


def _triton():
    from . import triton_ops

    return triton_ops


def _uses_triton(t: torch.Tensor) -> bool:
    """Whether a call on `t` takes the Triton route (CUDA tensors; anything else meets the
    reference's checks)."""
    return isinstance(t, torch.Tensor) and t.is_cuda


def _finish(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return result
    out.copy_(result)
    return out


def paged_indexer_logits(q_fp8, weights, k_cache, block_table, row_lens, width, *,
                         active_width=None, out=None):
    """See ``reference.paged_indexer_logits``."""
    if _uses_triton(q_fp8):
        return _triton().paged_indexer_logits(q_fp8, weights, k_cache, block_table, row_lens, width,
                                              active_width=active_width, out=out)
    res = reference.paged_indexer_logits(q_fp8, weights, k_cache, block_table, row_lens, width,
                                         active_width=active_width)
    return _finish(res, out)


def topk_indices(logits, row_lens, k, *, active_width=None, workspace=None, out=None, page_table=None,
                 page_size=None):
    """See ``reference.topk_indices``."""
    if _uses_triton(logits):
        return _triton().topk_indices(logits, row_lens, k, active_width=active_width,
                                      workspace=workspace, out=out, page_table=page_table,
                                      page_size=page_size)
    return _finish(reference.topk_indices(logits, row_lens, k, active_width=active_width,
                                          page_table=page_table, page_size=page_size), out)


def page_table_slots(indices, page_table, page_size):
    """See ``reference.page_table_slots`` (on CUDA: one Triton launch, then ``indices`` unchanged)."""
    if _uses_triton(indices):
        bits = reference.check_slot_inputs(indices, page_table, page_size)
        from .triton_slots import launch_page_slots

        out = indices.clone(memory_format=torch.contiguous_format)
        launch_page_slots(out, page_table, bits)
        return out
    return reference.page_table_slots(indices, page_table, page_size)


def write_index_k_cache(k_cache, k_fp8, k_scale, slot_mapping) -> None:
    """See ``reference.write_index_k_cache``."""
    if _uses_triton(k_cache):
        return _triton().write_index_k_cache(k_cache, k_fp8, k_scale, slot_mapping)
    return reference.write_index_k_cache(k_cache, k_fp8, k_scale, slot_mapping)


def indexer_topk(q_fp8, weights, k_cache, block_table, row_lens, k, *, active_width=None,
                 width=None, workspace=None, out=None, page_table=None, page_size=None):
    """See ``reference.indexer_topk``."""
    if _uses_triton(q_fp8):
        return _triton().indexer_topk(q_fp8, weights, k_cache, block_table, row_lens, k,
                                      active_width=active_width, width=width,
                                      workspace=workspace, out=out, page_table=page_table,
                                      page_size=page_size)
    res = reference.indexer_topk(q_fp8, weights, k_cache, block_table, row_lens, k,
                                 active_width=active_width, width=width, page_table=page_table,
                                 page_size=page_size)
    return _finish(res, out)


def make_workspace(rows: int, k: int, width: int = 0, device="cuda", config=None):
    """An ``IndexerTopkWorkspace`` for CUDA devices; ``None`` elsewhere (the reference needs none)."""
    if torch.device(device).type != "cuda":
        return None
    from .config import DEFAULT_CONFIG
    from .workspace import IndexerTopkWorkspace

    return IndexerTopkWorkspace(rows, k, width, device, config=config or DEFAULT_CONFIG)
