"""The indexer kernels' entry points on a device: same signatures and semantics as ``reference``.

Each call checks its host arguments, plans its route (``IndexerTopkWorkspace.plan_call``; a step
brings its own ``StepPlan``) and launches it (``launch``). No device-to-host reads, so every call
can be captured in a CUDA graph once its kernels are compiled (call it once before capture) and
its scratch comes from an ``IndexerTopkWorkspace`` made outside capture.
"""

from __future__ import annotations

import torch

from . import reference as ref
from .config import DEFAULT_CONFIG, KernelConfig
from .launch import CooperativeLaunchRefused, launch_scorer, launch_topk, run_step
from .planner import DeviceInfo, Route, score_splits, scorer_for
from .workspace import IndexerTopkWorkspace

_check = ref._check


def write_index_k_cache(
    k_cache: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter quantized keys into the planar page layout, in place.

    Slots ``< 0`` or past the cache are skipped, as in the reference (no host check: the call
    stays capturable; ``VLLM_SPARSE_SYNC_DEVICE_CHECKS=1`` asserts on the device instead).
    """
    from .triton.k_cache import write_k_cache_kernel

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
    sel_width = min(width, block_table.shape[1] * page)
    device = _scorer_device(q_fp8.device, config)
    kind = scorer_for(rows, page, device, config, sel_width, scorer_fits(q_fp8, k_cache, block_table, page))
    route = Route("scorer", rows, score_splits=score_splits(rows, device.num_sms, kind), scorer=kind)
    _launch_dense_scores(route, q_fp8, weights, k_cache, block_table, row_lens, active_width, out,
                         page=page, sel_width=sel_width, fill_width=width, config=config)
    return out


def _scorer_device(device: torch.device, config: KernelConfig) -> DeviceInfo:
    """What the scorer's plan needs of ``device``: its SMs and whether the CUDA scorer runs."""
    from .device import cuda_scorer_ok, device_sm_count

    return DeviceInfo(device_sm_count(str(device)), cuda_scorer=config.cuda and cuda_scorer_ok(device))


def _launch_dense_scores(route: Route, q_fp8, weights, k_cache, block_table, row_lens, active, out, *,
                         page: int, sel_width: int, fill_width: int, config: KernelConfig) -> None:
    """The route's scorer, with ``-inf`` written past each row's length up to ``fill_width``."""
    if route.scorer == "cuda":
        from .cuda.scorer import launch_cuda_score

        launch_cuda_score(q_fp8, weights, k_cache, block_table, row_lens, active, out, page_size=page,
                          sel_width=sel_width, fill_width=fill_width, splits=route.score_splits,
                          precise=config.precise, pdl=config.pdl)
        return
    from .triton.scorer import launch_score

    launch_score(q_fp8, weights, k_cache, block_table, row_lens, active, out, page_size=page,
                 sel_width=sel_width, fill_width=fill_width, splits=route.score_splits,
                 precise=config.precise, launch_dependents=config.pdl)


def scorer_fits(q_fp8, k_cache, block_table, page: int) -> bool:
    """Whether the CUDA scorer is built for a call of these tensors (host metadata only)."""
    from .cuda.scorer import takes

    return takes(q_fp8, k_cache, block_table, page, 1)


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
    route = ws.plan_call(rows, width, 1, score=False)
    counter = ws.unmapped if counter is None else counter
    launch_topk(route, logits, row_lens, active_width, ws, out, k, width, nan_low=True, pages=pages,
                unmapped=counter)
    if pages is not None:
        ref.assert_mapped(counter)
    return out


def _pages(page_table, page_size, rows: int, device: torch.device) -> tuple | None:
    """(page table, log2 page size) once checked, or None without a table."""
    if page_table is None:
        return None
    return page_table, ref.check_page_table(page_table, page_size, rows, device)


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
    route: Route | None = None,
) -> torch.Tensor:
    """The whole decode indexer step, score then select (``int32 [rows, k]``; with ``page_table``
    KV-cache slots, ``page_size`` defaulting to the K cache's, positions without a slot counted
    into ``unmapped``, else into the workspace's counter). ``route``: a step's planned route for
    this call (its ``StepPlan`` fits ``workspace``), launched as is.

    The route is this call's (``planner.plan_route`` on its rows and width, ``workspace.plan_call``):
    up to ``planner.FUSED_MAX_ROWS`` rows where the cluster top-k cannot run it is one fused launch
    whose scores stay in registers; otherwise scores go to the workspace's buffer for live columns
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
    if route is not None:  # a step's: planned for its workspace
        counter = workspace.unmapped if counter is None else counter
        run_step(route, workspace, q_fp8, weights, k_cache, block_table, row_lens, active_width, out, k=k,
                 page=page, width=width, pages=pages, unmapped=counter)
        if pages is not None:
            ref.assert_mapped(counter)
        return out
    ws = _workspace(workspace, rows, k, width, q_fp8.device)
    counter = ws.unmapped if counter is None else counter
    fits = scorer_fits(q_fp8, k_cache, block_table, page)
    while True:
        route = ws.plan_call(rows, width, page, scorer_fits=fits)
        try:
            run_step(route, ws, q_fp8, weights, k_cache, block_table, row_lens, active_width, out, k=k,
                     page=page, width=width, pages=pages, unmapped=counter)
            break
        except CooperativeLaunchRefused:
            ws.fused_ctas_per_sm //= 2  # the warm-up call settles the fused grid
    if pages is not None:
        ref.assert_mapped(counter)
    return out
