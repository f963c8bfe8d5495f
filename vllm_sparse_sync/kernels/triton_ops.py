"""Triton versions of the indexer kernels, same signatures and semantics as ``reference``.

Host work here is shape checks and launches only: no device-to-host reads, so every call can be
captured in a CUDA graph once its kernels are compiled (call it once before capture) and its
scratch comes from an ``IndexerTopkWorkspace`` made outside capture.
"""

from __future__ import annotations

import torch

from . import reference as ref
from .config import DEFAULT_CONFIG, KernelConfig
from .route import CUDA, CUDA_RADIX, SAMPLE, Route, score_splits
from .scorer import launch_score, scorer_kind
from .triton_cache import write_k_cache_kernel
from .triton_fused import launch_fused_step
from .triton_topk import launch_radix_topk
from .triton_topk_sample import launch_sample_topk
from .workspace import IndexerTopkWorkspace

_check = ref._check


def write_index_k_cache(
    k_cache: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter quantized keys into the planar page layout, in place.

    Slots ``< 0`` or past the cache are skipped, as in the reference (no host check: the call
    stays capturable; ``VLLM_SPARSE_SYNC_DEVICE_CHECKS=1`` asserts on the device instead).
    """
    page = ref.check_cache_write(k_cache, k_fp8, k_scale, slot_mapping)
    head_dim = k_fp8.shape[1]
    _check(k_cache.stride(1) == 1, "k_cache", "last dimension must be contiguous")
    tokens = k_fp8.shape[0]
    if tokens == 0:
        return
    ref.device_check_slots(slot_mapping, k_cache.shape[0] * page)
    write_k_cache_kernel[(tokens,)](
        k_cache, k_fp8.contiguous().view(torch.uint8), k_scale.contiguous().view(torch.uint8),
        slot_mapping, k_cache.shape[0] * page, k_cache.stride(0),
        D=head_dim, PAGE=page, num_warps=1,
    )


def _check_cache(k_cache: torch.Tensor, head_dim: int) -> int:
    page = ref.page_size_of(k_cache, head_dim)
    _check(k_cache.stride(1) == 1 and k_cache.stride(0) % 4 == 0, "k_cache",
           "needs a contiguous last dimension and a page stride divisible by 4")
    return page


_CHECKED: dict[tuple, int] = {}  # input signatures (shapes, dtypes, strides) already checked


def _signature(*tensors) -> tuple:
    return tuple((t.shape, t.dtype, t.stride(), t.device) if isinstance(t, torch.Tensor) else t
                 for t in tensors)


def _check_scorer(q_fp8, weights, k_cache, block_table, row_lens, active_width) -> int:
    """Page size of the scorer's inputs after checking them; each signature is checked once (the
    checks read tensor metadata only, so a signature seen before passes the same way)."""
    try:
        key = _signature(q_fp8, weights, k_cache, block_table, row_lens, active_width)
    except (AttributeError, TypeError):
        key = None
    page = _CHECKED.get(key) if key is not None else None
    if page is not None:
        return page
    page = _check_scorer_once(q_fp8, weights, k_cache, block_table, row_lens, active_width)
    if key is not None:
        if len(_CHECKED) > 4096:
            _CHECKED.clear()
        _CHECKED[key] = page
    return page


def _check_scorer_once(q_fp8, weights, k_cache, block_table, row_lens, active_width) -> int:
    ref._check_scorer_inputs(q_fp8, weights, k_cache, block_table, row_lens, active_width)
    _check(q_fp8.is_contiguous() and weights.is_contiguous(), "q_fp8/weights", "must be contiguous")
    _check(block_table.stride(1) == 1, "block_table", "last dimension must be contiguous")
    _check(block_table.dtype in (torch.int32, torch.int64), "block_table",
           f"must be int32 or int64, got {block_table.dtype}")
    heads = q_fp8.shape[1]
    _check(heads & (heads - 1) == 0 and heads >= 16, "q_fp8",
           f"heads must be a power of two >= 16, got {heads}")
    return _check_cache(k_cache, q_fp8.shape[2])


def paged_indexer_logits(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    row_lens: torch.Tensor,
    width: int,
    *,
    active_width: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: KernelConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """Indexer scores ``fp32 [rows, width]``; ``-inf`` past each row's live length.

    Dense semantics: the ``-inf`` fill past the live lengths costs in proportion to ``width``.
    """
    page = _check_scorer(q_fp8, weights, k_cache, block_table, row_lens, active_width)
    width = ref.check_width(width)
    _check(isinstance(config, KernelConfig), "config", f"must be a KernelConfig, got {type(config).__name__}")
    rows = q_fp8.shape[0]
    if out is None:
        out = torch.empty(rows, width, dtype=torch.float32, device=q_fp8.device)
    _check(out.shape == (rows, width) and out.dtype == torch.float32 and out.stride(1) == 1, "out",
           f"must be float32 [{rows}, {width}] with contiguous rows")
    if rows == 0 or width == 0:
        return out
    kind = scorer_kind(rows, page, q_fp8.device, config, min(width, block_table.shape[1] * page))
    splits = score_splits(rows, _sms(q_fp8.device), config, kind)
    launch_score(
        q_fp8, weights, k_cache, block_table, row_lens, active_width, out, page_size=page,
        sel_width=min(width, block_table.shape[1] * page), fill_width=width, splits=splits,
        config=config.scorer, kind=kind,
    )
    return out


def _sms(device: torch.device) -> int:
    from .workspace import device_sm_count

    return device_sm_count(str(device))


def _workspace(workspace, rows, k, width, device) -> IndexerTopkWorkspace:
    if workspace is None:
        workspace = IndexerTopkWorkspace(rows, k, width, device)
    workspace.check(rows, k, width)
    return workspace


def _index_out(out: torch.Tensor | None, rows: int, k: int, device: torch.device) -> torch.Tensor:
    """The caller's ``int32 [rows, k]`` output, checked, or a new one."""
    if out is None:
        return torch.empty(rows, k, dtype=torch.int32, device=device)
    _check(out.shape == (rows, k) and out.dtype == torch.int32 and out.stride(1) == 1, "out",
           f"must be int32 [{rows}, {k}] with contiguous rows")
    return out


def _slots(out: torch.Tensor, pages: tuple | None, unmapped: torch.Tensor | None = None) -> None:
    """``out``'s positions rewritten as KV-cache slots where ``pages`` (table, log2 page size) is
    given, by its own launch; positions without a slot add to ``unmapped``."""
    if pages is not None:
        from .triton_slots import launch_page_slots

        launch_page_slots(out, *pages, unmapped)


def _launch_topk(route: Route, logits, row_lens, active_width, ws, out, k, width, *,
                 nan_low: bool, after_scorer: bool = False, pages: tuple | None = None,
                 counts: torch.Tensor | None = None, unmapped: torch.Tensor | None = None) -> None:
    """The route's top-k launches; ``nan_low=False`` for scores from the scorer (NaN negative).
    ``after_scorer``: the stream's previous kernel is this step's scorer (which does not write
    ``row_lens`` or ``active_width``). ``pages``: (page table, log2 page size), the output as
    KV-cache slots: written by the cluster top-k itself, by a transform launch after the others;
    positions without a slot add to ``unmapped``. ``counts``: the pass-A counts that scorer wrote
    (``scorer_counts_for``)."""
    if route.kind == CUDA_RADIX and route.topk_cluster:
        from .cuda_topk import launch_cuda_topk_cluster

        launch_cuda_topk_cluster(logits, logits.stride(0), row_lens, active_width, out, k, width,
                                 nan_low=nan_low, cluster=route.topk_cluster, cap=route.topk_cap,
                                 lens_early=after_scorer and ws.config.topk.cuda_lens_early,
                                 page_table=None if pages is None else pages[0],
                                 page_bits=0 if pages is None else pages[1], counts=counts,
                                 unmapped=None if pages is None else unmapped)
        return
    _launch_positions(route, logits, row_lens, active_width, ws, out, k, width, nan_low=nan_low)
    _slots(out, pages, unmapped)


def _launch_positions(route: Route, logits, row_lens, active_width, ws, out, k, width, *,
                      nan_low: bool) -> None:
    """The top-k launches of a route other than the cluster top-k (positions)."""
    if route.kind == CUDA_RADIX:
        from .cuda_topk import launch_cuda_topk

        tc = ws.config.topk
        launch_cuda_topk(logits, logits.stride(0), row_lens, active_width, out, k, width, nan_low=nan_low,
                         threads=tc.cuda_threads, vec=tc.cuda_vec, cap=tc.cuda_cap)
        return
    launch = launch_sample_topk if route.kind == SAMPLE else launch_radix_topk
    launch(logits, logits.stride(0), row_lens, active_width, ws, out, k, width, route.topk_chunks,
           nan_low)


def topk_indices(
    logits: torch.Tensor,
    row_lens: torch.Tensor,
    k: int,
    *,
    active_width: torch.Tensor | None = None,
    workspace: IndexerTopkWorkspace | None = None,
    out: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    page_size: int | None = None,
    unmapped: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top-``k`` positions per row ``int32 [rows, k]`` among the row's live positions, ``-1`` padded
    (with ``page_table``: their KV-cache slots, ``reference.page_table_slots``; positions without a
    slot add to ``unmapped``, else to the workspace's counter)."""
    ref.check_topk_inputs(logits, row_lens, k, active_width)
    _check(logits.stride(1) == 1, "logits", "must be float32 with contiguous rows")
    k = ref.check_k(k)
    rows, width = logits.shape
    pages = _pages(page_table, page_size, rows, logits.device)
    counter = ref.check_unmapped(unmapped, logits.device)
    out = _index_out(out, rows, k, logits.device)
    if rows == 0:
        return out
    ws = _workspace(workspace, rows, k, 0, logits.device)
    route = ws.route(rows, width, 1, score=False)
    counter = ws.unmapped if counter is None else counter
    _launch_topk(route, logits, row_lens, active_width, ws, out, k, width, nan_low=True, pages=pages,
                 unmapped=counter)
    if pages is not None:
        ref.assert_mapped(counter)
    return out


def _pages(page_table, page_size, rows: int, device: torch.device) -> tuple | None:
    """(page table, log2 page size) once checked, or None without a table."""
    if page_table is None:
        return None
    return page_table, ref.check_page_table(page_table, page_size, rows, device)


def _run_fused(q_fp8, weights, k_cache, block_table, row_lens, active, out, ws, k, page, width,
               route: Route) -> Route:
    """Run the fused step of ``route``; returns the route actually taken (unfused: not run).

    A cooperative launch the device refuses (its programs would not all be resident) lowers the
    workspace's programs per SM and plans again, so the first (warm-up) call settles the plan.
    """
    while route.fused:
        try:
            launch_fused_step(q_fp8, weights, k_cache, block_table, row_lens, active, out, ws,
                              k=k, page=page, sel_width=width, route=route)
            return route
        except RuntimeError as exc:
            if ws.fused_ctas_per_sm == 1 or "cooperative" not in str(exc).lower():
                raise
            ws.fused_ctas_per_sm //= 2
            route = ws.route(out.shape[0], width, page)
    return route


def indexer_topk(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    row_lens: torch.Tensor,
    k: int,
    *,
    active_width: torch.Tensor | None = None,
    width: int | None = None,
    workspace: IndexerTopkWorkspace | None = None,
    out: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    page_size: int | None = None,
    unmapped: torch.Tensor | None = None,
) -> torch.Tensor:
    """The whole decode indexer step, score then select (``int32 [rows, k]``; with ``page_table``
    KV-cache slots, ``page_size`` defaulting to the K cache's, positions without a slot counted
    into ``unmapped``, else into the workspace's counter).

    The route comes from ``route.plan_route`` (the call's rows and width): up to
    ``config.fused.max_rows`` rows it is one fused launch whose scores stay in registers
    (``triton_fused``); otherwise scores go to the workspace's internal buffer for live columns
    only (nothing is filled past a row's length), then the top-k launches run. Every route is
    bounded by the live lengths, whatever the width, and selects the same positions.
    """
    page = _check_scorer(q_fp8, weights, k_cache, block_table, row_lens, active_width)
    rows = q_fp8.shape[0]
    k = ref.check_k(k)
    width = ref.check_width(block_table.shape[1] * page if width is None else width)
    pages = _pages(page_table, page if page_size is None else page_size, rows, q_fp8.device)
    counter = ref.check_unmapped(unmapped, q_fp8.device)
    out = _index_out(out, rows, k, q_fp8.device)
    if rows == 0:
        return out
    ws = _workspace(workspace, rows, k, width, q_fp8.device)
    counter = ws.unmapped if counter is None else counter
    route = _run_fused(q_fp8, weights, k_cache, block_table, row_lens, active_width, out, ws, k, page,
                       width, ws.route(rows, width, page))
    if route.fused:
        _slots(out, pages, counter)
        if pages is not None:
            ref.assert_mapped(counter)
        return out
    logits = ws.logits
    counts = scorer_counts_for(route, ws, pages)
    ran = launch_score(
        q_fp8, weights, k_cache, block_table, row_lens, active_width, logits, page_size=page,
        sel_width=width, fill_width=0, splits=route.score_splits, config=ws.config.scorer,
        kind=route.scorer, counts=counts,
    )
    _launch_topk(route, logits, row_lens, active_width, ws, out, k, width, nan_low=False, after_scorer=True,
                 pages=pages, counts=counts if ran == CUDA else None, unmapped=counter)
    if pages is not None:
        ref.assert_mapped(counter)
    return out


def scorer_counts_for(route: Route, ws: IndexerTopkWorkspace, pages: tuple | None) -> torch.Tensor | None:
    """The workspace's pass-A counts where a step of ``route`` has the scorer count them for the top-k
    (``topk.scorer_counts``: the CUDA scorer, then the CUDA top-k at one CTA a row, positions), else
    None."""
    take = (ws.config.topk.scorer_counts and route.scorer == CUDA and route.kind == CUDA_RADIX
            and route.topk_cluster == 1 and pages is None)
    return ws.counts if take else None
