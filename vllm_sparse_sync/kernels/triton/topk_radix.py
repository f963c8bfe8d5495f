"""Triton top-k over per-row live prefixes of fp32 scores: exact, deterministic radix select.

Grid ``(rows, chunks)`` for every launch; ``chunks`` comes from the static row count, each
program scans a contiguous slice of its row's live tiles (device length), so cost follows live
lengths, never the logits width. Four 8-bit histogram passes (integer atomics: order-free sums)
find the k-th largest key: the last program of a row to finish a pass (an atomic ticket) picks
the digit and stores the row's state for the next launch; pass 3 also stores per-chunk counts
so the emit pass places every selected position without atomics: positions above the
threshold first (in position order), then threshold ties, lowest positions first. The last
emit program of a row zeroes the row's histograms; tickets reset themselves, so the workspace
is ready for the next call (and for graph replay).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    chunk_tiles,
    lanes_where,
    live_length,
    load_tile,
    pick_digit,
    radix_digit,
    sortable_key,
)


@triton.jit(do_not_specialize=["sel_width"])
def radix_pass_kernel(
    x_ptr, stride_r, lens_ptr, active_ptr, hist_ptr, tick_ptr, state_ptr, sfx_ptr, gt_ptr, sel_width,
    K: tl.constexpr, PASS: tl.constexpr, HAS_ACTIVE: tl.constexpr, BLK: tl.constexpr,
    NAN_LOW: tl.constexpr,
):
    """Histogram of radix digit ``PASS`` over keys matching the prefix of earlier passes.

    The row's last program to finish (ticket) picks the digit and stores the row's state
    ``(prefix, ties still needed)`` for the next launch.
    """
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    rows = tl.num_programs(0)
    chunks = tl.num_programs(1)
    n = live_length(lens_ptr, active_ptr, row, sel_width, HAS_ACTIVE)
    if PASS == 0:
        prefix = tl.full((), 0, tl.int32)
        need = tl.full((), K, tl.int32)
    else:
        prefix = tl.load(state_ptr + 2 * row, cache_modifier=".cg")
        need = tl.load(state_ptr + 2 * row + 1, cache_modifier=".cg")
    t0, t1 = chunk_tiles(n, K, BLK, chunk, chunks)
    bins = tl.arange(0, 256)
    acc = tl.zeros([256], dtype=tl.int32)
    above = tl.zeros([BLK], dtype=tl.int32)
    x_row = x_ptr + row.to(tl.int64) * stride_r
    x, pos = load_tile(x_row, t0, t1, n, BLK)
    for t in range(t0, t1):
        x_next, pos_next = load_tile(x_row, t + 1, t1, n, BLK)
        inrow = pos < n
        key = sortable_key(x, NAN_LOW)
        if PASS == 0:
            match = inrow
        else:
            hi = key >> (32 - 8 * PASS)
            match = inrow & (hi == prefix)
            if PASS == 3:
                above += (inrow & (hi > prefix)).to(tl.int32)
        d = tl.where(match, radix_digit(key, PASS), 0)
        miss = BLK - tl.sum(match.to(tl.int32), 0)
        acc += tl.histogram(d, 256) - tl.where(bins == 0, miss, 0)
        x, pos = x_next, pos_next
    hist_row = hist_ptr + (PASS * rows + row) * 256
    tl.atomic_add(hist_row + bins, acc, mask=acc != 0)
    if PASS == 3:
        # per-chunk suffix counts (bins >= b) and count above the 24-bit prefix, for the emit pass
        sfx = tl.sum(acc, 0) - tl.cumsum(acc, 0) + acc
        tl.store(sfx_ptr + (row * chunks + chunk) * 256 + bins, sfx)
        tl.store(gt_ptr + row * chunks + chunk, tl.sum(above, 0))
    ticket = tl.atomic_add(tick_ptr + PASS * rows + row, 1)
    last = ticket == chunks - 1
    h = tl.load(hist_row + bins, mask=lanes_where(last, bins), other=0, cache_modifier=".cg")
    d, need = pick_digit(h, need)
    if PASS == 0:
        prefix = d - 128
    else:
        prefix = prefix * 256 + d
    tl.store(state_ptr + 2 * row, prefix, mask=last)
    tl.store(state_ptr + 2 * row + 1, need, mask=last)
    tl.store(tick_ptr + PASS * rows + row, 0, mask=last)


@triton.jit(do_not_specialize=["sel_width"])
def radix_emit_kernel(
    x_ptr, stride_r, lens_ptr, active_ptr, hist_ptr, tick_ptr, state_ptr, sfx_ptr, gt_ptr, out_ptr,
    stride_o, sel_width,
    K: tl.constexpr, HAS_ACTIVE: tl.constexpr, BLK: tl.constexpr, CHUNKS_P2: tl.constexpr,
    NAN_LOW: tl.constexpr,
):
    """Write each row's top-k positions (``-1`` padded; ``0..n-1`` when n <= K); reset its histograms."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    rows = tl.num_programs(0)
    chunks = tl.num_programs(1)
    n = live_length(lens_ptr, active_ptr, row, sel_width, HAS_ACTIVE)
    out_row = out_ptr + row.to(tl.int64) * stride_o
    lane = tl.arange(0, BLK)
    # short rows: positions 0..n-1 in order, then -1 (written by chunk 0)
    short = (n <= K) & (chunk == 0)
    for j in range(0, K, BLK):
        pos = j + lane
        tl.store(out_row + pos, tl.where(pos < n, pos, -1), mask=(pos < K) & lanes_where(short, pos))
    key_k = tl.load(state_ptr + 2 * row, cache_modifier=".cg")
    need = tl.load(state_ptr + 2 * row + 1, cache_modifier=".cg")
    n_above = K - need
    # chunk offsets from pass-3 stats of the chunks before this one
    cc = tl.arange(0, CHUNKS_P2)
    in_c = cc < chunks
    d3 = key_k & 0xFF
    stats = sfx_ptr + (row * chunks + cc) * 256
    ge_d = tl.load(stats + d3, mask=in_c, other=0)
    gt_d = tl.load(stats + d3 + 1, mask=in_c & lanes_where(d3 < 255, cc), other=0)
    gt_c = tl.load(gt_ptr + row * chunks + cc, mask=in_c, other=0) + gt_d
    eq_c = ge_d - gt_d
    before = cc < chunk
    base_gt = tl.sum(tl.where(before, gt_c, 0), 0)
    base_eq = tl.sum(tl.where(before, eq_c, 0), 0)
    t0, t1 = chunk_tiles(n, K, BLK, chunk, chunks)
    x_row = x_ptr + row.to(tl.int64) * stride_r
    x, pos = load_tile(x_row, t0, t1, n, BLK)
    for t in range(t0, t1):
        x_next, pos_next = load_tile(x_row, t + 1, t1, n, BLK)
        inrow = pos < n
        key = sortable_key(x, NAN_LOW)
        g = (inrow & (key > key_k)).to(tl.int32)
        slot = base_gt + tl.cumsum(g, 0) - g
        tl.store(out_row + slot, pos, mask=g != 0)
        base_gt += tl.sum(g, 0)
        e = (inrow & (key == key_k)).to(tl.int32)
        rank = base_eq + tl.cumsum(e, 0) - e
        tl.store(out_row + n_above + rank, pos, mask=(e != 0) & (rank < need))
        base_eq += tl.sum(e, 0)
        x, pos = x_next, pos_next
    # the last program of the row to finish clears the row's histograms for the next call
    ticket = tl.atomic_add(tick_ptr + 4 * rows + row, 1)
    last = ticket == chunks - 1
    bins = tl.arange(0, 256)
    for p in tl.static_range(4):
        tl.store(hist_ptr + (p * rows + row) * 256 + bins, tl.zeros([256], dtype=tl.int32),
                 mask=lanes_where(last, bins))
    tl.store(tick_ptr + 4 * rows + row, 0, mask=last)


BLOCK = 1024
"""scores a program reads an iteration"""
WARPS = 4


def launch_radix_topk(x, stride_r, row_lens, active, ws, out, k, sel_width, chunks, nan_low=True):
    """Launch radix passes 0..3 and the emit pass for ``x`` rows on ``ws`` buffers, ``chunks``
    programs per row (the route's); ``nan_low=False`` for scores from the scorer (NaN already
    negative)."""
    rows = out.shape[0]
    has_active = active is not None
    act = active if has_active else row_lens
    grid = (rows, chunks)
    for p in range(4):
        radix_pass_kernel[grid](
            x, stride_r, row_lens, act, ws.hist, ws.ticks, ws.state, ws.chunk_sfx, ws.chunk_gt,
            sel_width, K=k, PASS=p, HAS_ACTIVE=has_active, BLK=BLOCK, NAN_LOW=nan_low,
            num_warps=WARPS,
        )
    radix_emit_kernel[grid](
        x, stride_r, row_lens, act, ws.hist, ws.ticks, ws.state, ws.chunk_sfx, ws.chunk_gt, out,
        out.stride(0), sel_width,
        K=k, HAS_ACTIVE=has_active, BLK=BLOCK, CHUNKS_P2=triton.next_power_of_2(chunks),
        NAN_LOW=nan_low, num_warps=WARPS,
    )
