"""Triton fp8 paged indexer scorer: ``logit[r, t] = k_scale[t] * sum_h w[r, h] * relu(q[r, h] . k[t])``.

Grid ``(rows, splits)`` with ``splits`` from the static row count and SM count. Program
``(r, s)`` takes tiles ``s, s + splits, ...`` of row ``r`` up to the row's device length, so
work follows live lengths whatever the width. Per tile: gather ``TILE`` tokens of fp8 K through
the page table, ``[TILE, D] x [D, H]`` fp8 dot, ReLU, weighted head sum, times the token scale.
Strides stay specialized (Triton's divisibility hints keep the K loads 16-byte wide), so an
eager call with a new stride compiles once: warm each captured shape first. ``PRECISE``
(default) converts e4m3 to fp16 for the dot (exact products, fp32 accumulation, matching the
reference to fp32 rounding); without it the dot runs on fp8 tensor cores, whose accumulation
keeps ~14 mantissa bits (as DeepGEMM). Optionally it also fills ``-inf`` past the live length
(dense API). Triton's software pipeliner overlaps the K loads (``NUM_STAGES``). A tile of
exactly one page loads its K from one scalar page id; other tile sizes gather per token.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .common import live_length
from ..device import interpreting

try:  # Triton >= 3.3 on CUDA; a no-op for a next kernel not launched as a programmatic dependent
    from triton.language.extra.cuda import gdc_launch_dependents
except ImportError:  # pragma: no cover - older Triton
    gdc_launch_dependents = None


@triton.jit
def _tile_pages(bt_row, tile, n_live, num_pages, PAGE: tl.constexpr, TILE: tl.constexpr):
    """Physical page (int64, 0 where invalid) and validity of each token of ``tile``."""
    pos = tile * TILE + tl.arange(0, TILE)
    live = pos < n_live
    page = tl.load(bt_row + pos // PAGE, mask=live, other=-1)
    ok = live & (page >= 0) & (page < num_pages)
    return tl.where(ok, page, 0).to(tl.int64), ok


@triton.jit
def _tile_keys(kc_ptr, ks_ptr, page, ok, tile, page_stride,
               D: tl.constexpr, PAGE: tl.constexpr, TILE: tl.constexpr):
    """fp8 K bytes ``[TILE, D]`` and fp32 scales ``[TILE]`` of ``tile``'s tokens (0 where invalid)."""
    slot = (tile * TILE + tl.arange(0, TILE)) % PAGE
    base = page * page_stride
    dims = tl.arange(0, D)
    kb = tl.load(kc_ptr + base[:, None] + slot[:, None] * D + dims[None, :], mask=ok[:, None], other=0)
    scale = tl.load(ks_ptr + base // 4 + (PAGE * D) // 4 + slot, mask=ok, other=0.0)
    return kb, scale


@triton.jit
def page_keys(kc_ptr, ks_ptr, bt_row, tile, n_live, num_pages, page_stride, k_offs,
               D: tl.constexpr, PAGE: tl.constexpr):
    """A tile that is exactly one page: fp8 K ``[PAGE, D]``, scales ``[PAGE]``, validity ``[PAGE]``.

    One scalar page id per tile, so the K load is a scalar base plus constant offsets (16-byte
    vector loads, no per-element address math or masks); an invalid page reads page 0 and
    scores ``-inf``.
    """
    first = tile * PAGE
    page = tl.load(bt_row + tile, mask=first < n_live, other=-1)
    page_ok = (first < n_live) & (page >= 0) & (page < num_pages)
    base = tl.where(page_ok, page, 0).to(tl.int64) * page_stride
    kb = tl.load(kc_ptr + base + k_offs)
    lane = tl.arange(0, PAGE)
    scale = tl.load(ks_ptr + base // 4 + (PAGE * D) // 4 + lane)
    ok = page_ok & (first + lane < n_live)
    return kb, scale, ok


@triton.jit
def load_query(q_ptr, w_ptr, row, H: tl.constexpr, D: tl.constexpr, PRECISE: tl.constexpr):
    """Row ``row``'s query as the dot's right operand ``[D, H]`` and its head weights ``[H]``."""
    heads = tl.arange(0, H)
    dims = tl.arange(0, D)
    q = tl.load(q_ptr + row.to(tl.int64) * (H * D) + heads[:, None] * D + dims[None, :])
    q = q.to(tl.float8e4nv, bitcast=True)
    if PRECISE:  # e4m3 is exact in fp16: exact products, fp32 accumulation
        q_t = tl.trans(q.to(tl.float16))
    else:  # fp8 tensor-core accumulation (Hopper keeps ~14 mantissa bits)
        q_t = tl.trans(q)
    w = tl.load(w_ptr + row.to(tl.int64) * H + heads)
    return q_t, w


@triton.jit
def tile_scores(kb, scale, ok, q_t, w, PRECISE: tl.constexpr):
    """``scale * sum_h w_h relu(k . q_h)`` per token, ``-inf`` where invalid."""
    k8 = kb.to(tl.float8e4nv, bitcast=True)
    if PRECISE:
        dots = tl.dot(k8.to(tl.float16), q_t)
    else:
        dots = tl.dot(k8, q_t)
    v = tl.sum(tl.maximum(dots, 0.0) * w[None, :], axis=1) * scale  # maxNum relu: a NaN dot is 0
    neg = (v.to(tl.int32, bitcast=True) | -2147483648).to(tl.float32, bitcast=True)
    v = tl.where(v != v, neg, v)  # a negative NaN: its sortable key lies below -inf's
    return tl.where(ok, v, float("-inf"))


@triton.jit(do_not_specialize=["num_pages", "sel_width", "live_width", "fill_width"])
def score_kernel(
    q_ptr, w_ptr, kc_ptr, ks_ptr, bt_ptr, bt_stride, lens_ptr, active_ptr, out_ptr, out_stride,
    num_pages, page_stride, sel_width, live_width, fill_width,
    H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, TILE: tl.constexpr,
    HAS_ACTIVE: tl.constexpr, FILL_TAIL: tl.constexpr, NUM_STAGES: tl.constexpr,
    PRECISE: tl.constexpr, SCALAR_PAGE: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr,
):
    """Scores of row ``program_id(0)``'s live positions ``t < n``; ``-inf`` for holes and past the table."""
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
    row = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    n = live_length(lens_ptr, active_ptr, row, sel_width, HAS_ACTIVE)
    n_live = tl.minimum(n, live_width)
    dims = tl.arange(0, D)
    lane = tl.arange(0, TILE)
    q_t, w = load_query(q_ptr, w_ptr, row, H, D, PRECISE)
    out_row = out_ptr + row.to(tl.int64) * out_stride
    bt_row = bt_ptr + row.to(tl.int64) * bt_stride
    n_tiles = tl.cdiv(n, TILE)
    if SCALAR_PAGE:
        k_offs = lane[:, None] * D + dims[None, :]
        for tile in tl.range(split, n_tiles, splits, num_stages=NUM_STAGES):
            kb, scale, ok = page_keys(kc_ptr, ks_ptr, bt_row, tile, n_live, num_pages, page_stride,
                                       k_offs, D, PAGE)
            v = tile_scores(kb, scale, ok, q_t, w, PRECISE)
            pos = tile * TILE + lane
            tl.store(out_row + pos, v, mask=pos < n)
    else:
        for tile in tl.range(split, n_tiles, splits, num_stages=NUM_STAGES):
            page, ok = _tile_pages(bt_row, tile, n_live, num_pages, PAGE, TILE)
            kb, scale = _tile_keys(kc_ptr, ks_ptr, page, ok, tile, page_stride, D, PAGE, TILE)
            v = tile_scores(kb, scale, ok, q_t, w, PRECISE)
            pos = tile * TILE + lane
            tl.store(out_row + pos, v, mask=pos < n)
    if FILL_TAIL:
        for tile in range(n // TILE + split, tl.cdiv(fill_width, TILE), splits):
            pos = tile * TILE + lane
            tl.store(out_row + pos, tl.full([TILE], float("-inf"), tl.float32),
                     mask=(pos >= n) & (pos < fill_width))


TILE = 64
"""tokens a loop iteration; a tile of exactly one page loads its K from one page id"""
WARPS = 4
STAGES = 6
"""software-pipeline depth of the K loads"""


def launch_score(
    q_fp8, weights, k_cache, block_table, row_lens, active, out, *, page_size, sel_width,
    fill_width, splits, precise: bool = True, launch_dependents: bool = True,
):
    """Launch the scorer; ``out`` is ``fp32 [rows, >= sel_width]`` (written up to each row's length).
    ``precise``: exact or e4m3 scores; ``launch_dependents``: let the next kernel launch early."""
    rows, heads, head_dim = q_fp8.shape
    has_active = active is not None
    kc = k_cache
    ks = k_cache.view(torch.float32)
    score_kernel[(rows, splits)](
        q_fp8.view(torch.uint8), weights, kc, ks, block_table, block_table.stride(0), row_lens,
        active if has_active else row_lens, out, out.stride(0),
        k_cache.shape[0], k_cache.stride(0), sel_width,
        block_table.shape[1] * page_size, fill_width,
        H=heads, D=head_dim, PAGE=page_size, TILE=TILE,
        HAS_ACTIVE=has_active, FILL_TAIL=fill_width > 0, NUM_STAGES=STAGES,
        PRECISE=precise, SCALAR_PAGE=TILE == page_size and k_cache.shape[0] > 0,
        LAUNCH_DEPENDENTS=launch_dependents and can_launch_dependents(out.device),
        num_warps=WARPS,
    )


def can_launch_dependents(device: torch.device) -> bool:
    """Whether a scorer launch on ``device`` can trigger its dependents: sm_90+ with a Triton that
    has ``gdc_launch_dependents``, not in the interpreter."""
    if gdc_launch_dependents is None or device.type != "cuda" or interpreting():
        return False
    return _sm90_or_later(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm90_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9

