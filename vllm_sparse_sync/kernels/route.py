"""The route planner: which kernels run a call, and their grids, from host facts alone.

One pure function, ``plan_route``, decides from the call's own static shape (its rows, its
width bound, the page size, top-k), the configuration and the device's properties. It never
looks at a capacity larger than the call (a 256-row workspace serving a 1-row call plans the
1-row route) and never at live lengths (those stay on the device), so a captured graph replays
the schedule it was captured with.

Routes: ``fused`` (score and select in one cooperative launch; not taken where the cluster
top-k can run, which is faster after the scorer), ``radix`` and ``sample``
(the scorer into a logits buffer, then that top-k algorithm), ``cuda_radix`` (the same, with
the NVRTC-compiled CUDA top-k where ``DeviceInfo.cuda_topk`` says it can run: on sm_90+ a
thread-block cluster of ``topk_cluster`` CTAs per row, which "auto" takes for every call; before
that one CTA per row, which "auto" takes from ``topk.cuda_min_rows`` rows up). Every route
returns the same set of positions per row; the order inside a row is deterministic per route but
unspecified.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import DEFAULT_CONFIG, KernelConfig

FUSED, RADIX, SAMPLE, CUDA_RADIX = "fused", "radix", "sample", "cuda_radix"
CUDA, TRITON = "cuda", "triton"
"""the unfused route's scorer kernel: the CUDA wgmma kernel (``cuda_scorer``) or Triton's"""


@dataclass(frozen=True)
class DeviceInfo:
    """What a plan needs of the device: SM count, whether all programs of a launch can be made
    resident at once (a cooperative launch, or the interpreter), and the fused programs per SM
    the device accepted (lowered when a cooperative launch was refused)."""

    num_sms: int
    cooperative: bool = True
    fused_ctas_per_sm: int | None = None
    cuda_topk: bool = False
    """Whether the NVRTC-compiled CUDA top-k can run (a CUDA device of compute capability 7.0+,
    cuda-bindings and NVRTC present; ``cuda_topk.status`` gives the reason when not)."""
    cluster_smem: int = 0
    """Shared memory bytes one CTA of the CUDA top-k's cluster route may use (0: no cluster
    route: before sm_90, or no CUDA top-k)."""
    cuda_scorer: bool = False
    """Whether the CUDA wgmma scorer can run (compute capability 9.0, NVRTC present)."""


@dataclass(frozen=True)
class Route:
    """One call's kernels and grids."""

    kind: str
    rows: int
    score_splits: int = 0
    """Unfused: scorer programs per row."""
    topk_chunks: int = 0
    """Unfused: top-k programs per row."""
    fused_parts: int = 0
    """Fused: programs per row."""
    topk_cluster: int = 0
    """``cuda_radix``: CTAs per row of the cluster route (0: one CTA per row, no cluster)."""
    topk_cap: int = 0
    """``cuda_radix`` cluster route: keys per CTA kept in shared memory."""
    fused_tiles: int = 0
    """Fused: most page tiles per program (a power of two, the register tile). A row's programs
    take contiguous chunks of ``cdiv(live tiles, fused_parts)`` tiles, never more than this."""
    scorer: str = TRITON
    """Unfused: the scorer kernel, ``CUDA`` or ``TRITON`` (a call whose tensors the CUDA kernel is
    not built for runs on Triton: ``cuda_scorer.takes``)."""

    @property
    def fused(self) -> bool:
        return self.kind == FUSED


def _count(name: str, v: object) -> int:
    """``v`` as a host int ``>= 0`` (``numpy.integer`` too, never a bool), else a ``ValueError``."""
    if isinstance(v, np.integer) and not isinstance(v, np.bool_):
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{name}: must be an int >= 0, got {v!r}")
    return v


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def fused_grid(rows: int, width: int, page: int, slots: int, max_keys: int,
               max_parts: int) -> tuple[int, int] | None:
    """``(programs per row, tiles per program)`` of the fused step, or None when it does not fit.

    ``slots``: programs that can be resident at once on the device. ``programs * tiles`` covers
    the width's tiles, so a row of any live length up to the width splits into contiguous chunks
    of ``cdiv(live tiles, programs) <= tiles`` tiles, one per program.
    """
    if rows <= 0 or width <= 0 or page <= 0 or page & (page - 1) or rows > slots:
        return None
    tiles = _cdiv(width, page)
    per_part = _next_pow2(_cdiv(tiles, max(1, min(max_parts, slots // rows))))
    if per_part * page > max_keys:
        return None
    return _cdiv(tiles, per_part), per_part


def score_splits(rows: int, num_sms: int, config: KernelConfig = DEFAULT_CONFIG, scorer: str = TRITON) -> int:
    """Programs per row of the ``scorer`` kernel for a call of ``rows`` rows."""
    per_sm = config.scorer.cuda_ctas_per_sm if scorer == CUDA else config.scorer.ctas_per_sm
    return max(1, num_sms * per_sm // max(rows, 1))


def scorer_for(rows: int, page: int, device: DeviceInfo, config: KernelConfig = DEFAULT_CONFIG,
               width: int = 0) -> str:
    """The unfused scorer kernel of a call of ``rows`` rows and width bound ``width``: ``CUDA``
    for the exact path (``scorer.precise``) from ``scorer.cuda_min_rows`` rows, a bound of
    ``scorer.cuda_min_width`` or one row of ``scorer.cuda_one_row_min_width`` up, where the device
    can run it, ``scorer.cuda`` asks for it and pages are 64 tokens (the kernel's tile); else
    ``TRITON``. The e4m3 path (``scorer.precise`` off) takes ``CUDA`` only from
    ``scorer.cuda_fp8_min_tokens`` rows x width tokens or one row of a bound of
    ``scorer.cuda_fp8_one_row_min_width`` up (benchmarks/NOTES.md, runs 63-65, 138-139, 156-157
    and 165-166)."""
    sc = config.scorer
    if sc.precise:
        big = (rows >= sc.cuda_min_rows or (0 < sc.cuda_min_width <= width)
               or (rows == 1 and 0 < sc.cuda_one_row_min_width <= width))
    else:
        big = ((0 < sc.cuda_fp8_min_tokens <= rows * width)
               or (rows == 1 and 0 < sc.cuda_fp8_one_row_min_width <= width))
    ok = device.cuda_scorer and sc.cuda and page == 64 and big
    return CUDA if ok else TRITON


def topk_algo_for(rows: int, config: KernelConfig = DEFAULT_CONFIG, device: DeviceInfo | None = None) -> str:
    """The unfused top-k algorithm for a call of ``rows`` rows ("cuda_radix" only where
    ``device.cuda_topk``; otherwise the Triton choice of "auto")."""
    algo = config.topk.algo
    tc = config.topk
    cuda_ok = device is not None and device.cuda_topk
    cluster = cuda_ok and tc.cuda_cluster and device.cluster_smem > 0
    if cuda_ok and (algo == CUDA_RADIX or (algo == "auto" and (cluster or 0 < tc.cuda_min_rows <= rows))):
        return CUDA_RADIX
    if algo not in ("auto", CUDA_RADIX):
        return algo
    return SAMPLE if rows >= config.topk.sample_min_rows else RADIX


def plan_route(rows: int, width: int, page: int, device: DeviceInfo,
               config: KernelConfig = DEFAULT_CONFIG, *, score: bool = True) -> Route:
    """The route of one call: ``rows`` rows, logits width bound ``width`` (kernel rows), K-cache
    pages of ``page`` rows. ``score=False``: a top-k of given logits (never fused)."""
    rows, width, page = _count("rows", rows), _count("width", width), _count("page", page)
    if page < 1 or page & (page - 1):
        raise ValueError(f"page: must be a power of two, got {page!r}")
    sms = device.num_sms
    fc = config.fused
    # on sm_90+ the scorer then the cluster top-k beats the fused step on every fused shape
    # measured (benchmarks/NOTES.md, run 23): the fused route serves the other devices
    cluster_topk = (device.cuda_topk and device.cluster_smem > 0 and config.topk.cuda_cluster
                    and config.topk.algo in ("auto", CUDA_RADIX))
    if score and fc.enabled and device.cooperative and 0 < rows <= fc.max_rows and not cluster_topk:
        grid = fused_grid(rows, width, page, sms * (device.fused_ctas_per_sm or fc.ctas_per_sm),
                          fc.max_keys, fc.max_parts)
        if grid is not None:
            return Route(FUSED, rows, fused_parts=grid[0], fused_tiles=grid[1])
    r = max(rows, 1)
    scorer = scorer_for(rows, page, device, config, width) if score else TRITON
    splits = score_splits(rows, sms, config, scorer) if score else 0
    algo = topk_algo_for(rows, config, device)
    if algo == CUDA_RADIX:
        plan = None
        if config.topk.cuda_cluster and device.cluster_smem > 0:
            from .cuda_topk import plan_cluster  # pure host logic

            plan = plan_cluster(rows, width, sms, device.cluster_smem)
        if plan is None:  # one CTA per row
            return Route(CUDA_RADIX, rows, score_splits=splits, topk_chunks=1, scorer=scorer)
        return Route(CUDA_RADIX, rows, score_splits=splits, topk_chunks=plan.cluster,
                     topk_cluster=plan.cluster, topk_cap=plan.cap, scorer=scorer)
    chunks = max(1, min(config.topk.max_chunks, sms * config.topk.ctas_per_sm // r))
    return Route(algo, rows, score_splits=splits, topk_chunks=chunks, scorer=scorer)
