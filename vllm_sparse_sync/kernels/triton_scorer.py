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
(dense API) and accumulates the first radix histogram of the top-k (fused route).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import lanes_where, live_length, radix_digit, sortable_key


@triton.jit(
    do_not_specialize=[
        "num_pages", "sel_width", "live_width", "fill_width",
    ]
)
def score_kernel(
    q_ptr, w_ptr, kc_ptr, ks_ptr, bt_ptr, bt_stride, lens_ptr, active_ptr, out_ptr, out_stride,
    hist_ptr, num_pages, page_stride, sel_width, live_width, fill_width,
    H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, TILE: tl.constexpr, K: tl.constexpr,
    HAS_ACTIVE: tl.constexpr, FILL_TAIL: tl.constexpr, WITH_HIST: tl.constexpr,
    NUM_STAGES: tl.constexpr, PRECISE: tl.constexpr,
):
    """Scores of row ``program_id(0)``'s live positions ``t < n``; ``-inf`` for holes and past the table."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    n = live_length(lens_ptr, active_ptr, row, sel_width, HAS_ACTIVE)
    n_live = tl.minimum(n, live_width)
    heads = tl.arange(0, H)
    dims = tl.arange(0, D)
    lane = tl.arange(0, TILE)
    q = tl.load(q_ptr + row * (H * D) + heads[:, None] * D + dims[None, :])
    q = q.to(tl.float8e4nv, bitcast=True)
    if PRECISE:  # e4m3 is exact in fp16: exact products, fp32 accumulation
        q_t = tl.trans(q.to(tl.float16))
    else:  # fp8 tensor-core accumulation (Hopper keeps ~14 mantissa bits)
        q_t = tl.trans(q)
    w = tl.load(w_ptr + row * H + heads)
    out_row = out_ptr + row.to(tl.int64) * out_stride
    bt_row = bt_ptr + row.to(tl.int64) * bt_stride
    bins = tl.arange(0, 256)
    hist = tl.zeros([256], dtype=tl.int32)
    n_tiles = tl.cdiv(n, TILE)
    for tile in tl.range(split, n_tiles, splits, num_stages=NUM_STAGES):
        pos = tile * TILE + lane
        inrow = pos < n
        live = pos < n_live
        page = tl.load(bt_row + pos // PAGE, mask=live, other=-1)
        ok = live & (page >= 0) & (page < num_pages)
        base = tl.where(ok, page, 0).to(tl.int64) * page_stride
        slot = pos % PAGE
        kb = tl.load(kc_ptr + base[:, None] + slot[:, None] * D + dims[None, :], mask=ok[:, None], other=0)
        scale = tl.load(ks_ptr + base // 4 + (PAGE * D) // 4 + slot, mask=ok, other=0.0)
        k8 = kb.to(tl.float8e4nv, bitcast=True)
        if PRECISE:
            dots = tl.dot(k8.to(tl.float16), q_t)
        else:
            dots = tl.dot(k8, q_t)
        v = tl.sum(tl.maximum(dots, 0.0) * w[None, :], axis=1) * scale
        v = tl.where(ok, v, float("-inf"))
        tl.store(out_row + pos, v, mask=inrow)
        if WITH_HIST:
            d = tl.where(inrow, radix_digit(sortable_key(v), 0), 0)
            miss = TILE - tl.sum(inrow.to(tl.int32), 0)
            hist += tl.histogram(d, 256) - tl.where(bins == 0, miss, 0)
    if WITH_HIST:
        tl.atomic_add(hist_ptr + row * 256 + bins, hist, mask=(hist != 0) & lanes_where(n > K, bins))
    if FILL_TAIL:
        for tile in range(n // TILE + split, tl.cdiv(fill_width, TILE), splits):
            pos = tile * TILE + lane
            tl.store(out_row + pos, tl.full([TILE], float("-inf"), tl.float32),
                     mask=(pos >= n) & (pos < fill_width))


def launch_score(
    q_fp8, weights, k_cache, block_table, row_lens, active, out, *, page_size, sel_width,
    fill_width, splits, config, hist=None, k=0,
):
    """Launch the scorer; ``out`` is ``fp32 [rows, >= sel_width]`` (written up to each row's length)."""
    rows, heads, head_dim = q_fp8.shape
    has_active = active is not None
    kc = k_cache
    ks = k_cache.view(torch.float32)
    score_kernel[(rows, splits)](
        q_fp8.view(torch.uint8), weights, kc, ks, block_table, block_table.stride(0), row_lens,
        active if has_active else row_lens, out, out.stride(0),
        hist if hist is not None else out, k_cache.shape[0], k_cache.stride(0), sel_width,
        block_table.shape[1] * page_size, fill_width,
        H=heads, D=head_dim, PAGE=page_size, TILE=config.score_tile, K=max(int(k), 1),
        HAS_ACTIVE=has_active, FILL_TAIL=fill_width > 0, WITH_HIST=hist is not None,
        NUM_STAGES=config.score_stages, PRECISE=bool(config.precise), num_warps=config.score_warps,
    )

