"""Kernel dispatch: the device kernels (``ops``) on CUDA tensors, the torch reference elsewhere.

Triton and cuda-bindings are imported on the first CUDA call only, so the package imports (and
runs on the CPU) without them. Triton-only keywords (``workspace=``, ``out=``) are accepted on both routes; the
reference ignores ``workspace`` and copies into ``out``, which must have the result's shape,
dtype and device on both. ``unmapped`` (int32 ``[1]``): the counter that each selected position
without a KV-cache slot adds one to (``reference.page_table_slots``).
"""

from __future__ import annotations

import torch

from . import reference


def _device():
    from . import ops

    return ops


def _on_device(t: torch.Tensor) -> bool:
    """Whether a call on `t` takes the device kernels (CUDA tensors; anything else meets the
    reference's checks)."""
    return isinstance(t, torch.Tensor) and t.is_cuda


def _check_out(out, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    """The reference route's ``out=``: None, or a tensor of the result's shape, dtype and device."""
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out: must be a tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        raise ValueError(f"out: must be {dtype} {list(shape)} on {device}, got {out.dtype} "
                         f"{list(out.shape)} on {out.device}")


def _finish(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return result
    _check_out(out, result.shape, result.dtype, result.device)
    out.copy_(result)
    return out


def paged_indexer_logits(q_fp8, weights, k_cache, block_table, row_lens, width, *,
                         active_width=None, out=None, config=None):
    """See ``reference.paged_indexer_logits`` (``config``: a ``KernelConfig`` for the device
    kernels, e.g. ``precise=False``; the reference is exact)."""
    if _on_device(q_fp8):
        from .config import DEFAULT_CONFIG

        return _device().paged_indexer_logits(q_fp8, weights, k_cache, block_table, row_lens, width,
                                              active_width=active_width, out=out,
                                              config=DEFAULT_CONFIG if config is None else config)
    reference._check_scorer_inputs(q_fp8, weights, k_cache, block_table, row_lens, active_width)
    _check_out(out, (q_fp8.shape[0], reference.check_width(width)), torch.float32, q_fp8.device)
    res = reference.paged_indexer_logits(q_fp8, weights, k_cache, block_table, row_lens, width,
                                         active_width=active_width)
    return _finish(res, out)


def topk_indices(logits, row_lens, k, *, active_width=None, workspace=None, out=None, page_table=None,
                 page_size=None, unmapped=None):
    """See ``reference.topk_indices``."""
    if _on_device(logits):
        return _device().topk_indices(logits, row_lens, k, active_width=active_width,
                                      workspace=workspace, out=out, page_table=page_table,
                                      page_size=page_size, unmapped=unmapped)
    reference.check_topk_inputs(logits, row_lens, k, active_width)
    _check_out(out, (logits.shape[0], reference.check_k(k)), torch.int32, logits.device)
    return _finish(reference.topk_indices(logits, row_lens, k, active_width=active_width,
                                          page_table=page_table, page_size=page_size,
                                          unmapped=unmapped), out)


def page_table_slots(indices, page_table, page_size, *, unmapped=None):
    """See ``reference.page_table_slots`` (on CUDA: one Triton launch, then ``indices`` unchanged)."""
    if _on_device(indices):
        bits = reference.check_slot_inputs(indices, page_table, page_size)
        counter = reference.check_unmapped(unmapped, indices.device)
        if counter is None and reference.device_checks_enabled():  # this call's count, to assert on
            counter = torch.zeros(1, dtype=torch.int32, device=indices.device)
        from .triton.slots import launch_page_slots

        out = indices.clone(memory_format=torch.contiguous_format)
        launch_page_slots(out, page_table, bits, counter)
        reference.assert_mapped(counter)
        return out
    return reference.page_table_slots(indices, page_table, page_size, unmapped=unmapped)


def write_index_k_cache(k_cache, k_fp8, k_scale, slot_mapping) -> None:
    """See ``reference.write_index_k_cache``."""
    if _on_device(k_cache):
        return _device().write_index_k_cache(k_cache, k_fp8, k_scale, slot_mapping)
    return reference.write_index_k_cache(k_cache, k_fp8, k_scale, slot_mapping)


def indexer_topk(q_fp8, weights, k_cache, block_table, row_lens, k, *, active_width=None,
                 width=None, workspace=None, out=None, page_table=None, page_size=None, unmapped=None):
    """See ``reference.indexer_topk``."""
    if _on_device(q_fp8):
        return _device().indexer_topk(q_fp8, weights, k_cache, block_table, row_lens, k,
                                      active_width=active_width, width=width,
                                      workspace=workspace, out=out, page_table=page_table,
                                      page_size=page_size, unmapped=unmapped)
    reference._check_scorer_inputs(q_fp8, weights, k_cache, block_table, row_lens, active_width)
    _check_out(out, (q_fp8.shape[0], reference.check_k(k)), torch.int32, q_fp8.device)
    res = reference.indexer_topk(q_fp8, weights, k_cache, block_table, row_lens, k,
                                 active_width=active_width, width=width, page_table=page_table,
                                 page_size=page_size, unmapped=unmapped)
    return _finish(res, out)


def make_workspace(rows: int, k: int, width: int = 0, device="cuda", config=None):
    """An ``IndexerTopkWorkspace`` for CUDA devices; ``None`` elsewhere (the reference needs none)."""
    from .. import checks

    if checks.device("device", device).type != "cuda":
        return None
    from .config import DEFAULT_CONFIG
    from .workspace import IndexerTopkWorkspace

    return IndexerTopkWorkspace(rows, k, width, device, config=config or DEFAULT_CONFIG)
