"""Triton top-k over per-row live prefixes of fp32 scores: exact, deterministic radix select.

Grid ``(rows, chunks)`` for every launch; ``chunks`` comes from the static row count, each
program scans a contiguous slice of its row's live tiles (device length), so cost follows live
lengths, never the logits width. Four 8-bit histogram passes (integer atomics: order-free sums)
find the k-th largest key; pass 3 also stores per-chunk counts so the emit pass places every
selected position without atomics: positions above the threshold first (in position order),
then threshold ties, lowest positions first. The last emit program of a row zeroes the row's
histograms, so the workspace is ready for the next call (and for CUDA-graph replay).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import derive_prefix, lanes_where, live_length, radix_digit, sortable_key


@triton.jit
def _chunk_tiles(n, K: tl.constexpr, BLK: tl.constexpr, chunk, chunks):
    """Tile range ``[t0, t1)`` of this chunk over a row of ``n`` live scores (empty when n <= K)."""
    n_tiles = tl.where(n > K, tl.cdiv(n, BLK), 0)
    per = tl.cdiv(n_tiles, chunks)
    t0 = chunk * per
    t1 = tl.minimum(t0 + per, n_tiles)
    return t0, t1


@triton.jit(do_not_specialize=["sel_width"])
def radix_pass_kernel(
    x_ptr, stride_r, lens_ptr, active_ptr, hist_ptr, sfx_ptr, gt_ptr, sel_width,
    K: tl.constexpr, PASS: tl.constexpr, HAS_ACTIVE: tl.constexpr, BLK: tl.constexpr,
):
    """Histogram of radix digit ``PASS`` over keys matching the prefix of earlier passes."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    rows = tl.num_programs(0)
    chunks = tl.num_programs(1)
    n = live_length(lens_ptr, active_ptr, row, sel_width, HAS_ACTIVE)
    hist_row = hist_ptr + row * 256
    prefix, need = derive_prefix(hist_row, rows * 256, K, PASS)
    t0, t1 = _chunk_tiles(n, K, BLK, chunk, chunks)
    bins = tl.arange(0, 256)
    lane = tl.arange(0, BLK)
    acc = tl.zeros([256], dtype=tl.int32)
    above = tl.zeros([BLK], dtype=tl.int32)
    x_row = x_ptr + row.to(tl.int64) * stride_r
    for t in range(t0, t1):
        pos = t * BLK + lane
        inrow = pos < n
        x = tl.load(x_row + pos, mask=inrow, other=float("-inf"))
        key = sortable_key(x)
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
    tl.atomic_add(hist_row + PASS * rows * 256 + bins, acc, mask=acc != 0)
    if PASS == 3:
        # per-chunk suffix counts (bins >= b) and count above the 24-bit prefix, for the emit pass
        sfx = tl.sum(acc, 0) - tl.cumsum(acc, 0) + acc
        tl.store(sfx_ptr + (row * chunks + chunk) * 256 + bins, sfx)
        tl.store(gt_ptr + row * chunks + chunk, tl.sum(above, 0))


@triton.jit(do_not_specialize=["sel_width"])
def radix_emit_kernel(
    x_ptr, stride_r, lens_ptr, active_ptr, hist_ptr, sfx_ptr, gt_ptr, done_ptr, out_ptr, stride_o,
    sel_width,
    K: tl.constexpr, HAS_ACTIVE: tl.constexpr, BLK: tl.constexpr, CHUNKS_P2: tl.constexpr,
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
    hist_row = hist_ptr + row * 256
    key_k, need = derive_prefix(hist_row, rows * 256, K, 4)
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
    t0, t1 = _chunk_tiles(n, K, BLK, chunk, chunks)
    x_row = x_ptr + row.to(tl.int64) * stride_r
    for t in range(t0, t1):
        pos = t * BLK + lane
        inrow = pos < n
        x = tl.load(x_row + pos, mask=inrow, other=float("-inf"))
        key = sortable_key(x)
        g = (inrow & (key > key_k)).to(tl.int32)
        slot = base_gt + tl.cumsum(g, 0) - g
        tl.store(out_row + slot, pos, mask=g != 0)
        base_gt += tl.sum(g, 0)
        e = (inrow & (key == key_k)).to(tl.int32)
        rank = base_eq + tl.cumsum(e, 0) - e
        tl.store(out_row + n_above + rank, pos, mask=(e != 0) & (rank < need))
        base_eq += tl.sum(e, 0)
    # the last program of the row to finish clears the row's histograms for the next call
    ticket = tl.atomic_add(done_ptr + row, 1)
    last = ticket == chunks - 1
    bins = tl.arange(0, 256)
    for p in tl.static_range(4):
        tl.store(hist_row + p * rows * 256 + bins, tl.zeros([256], dtype=tl.int32),
                 mask=lanes_where(last, bins))
    tl.store(done_ptr + row, 0, mask=last)


def launch_radix_topk(x, stride_r, row_lens, active, ws, out, k, sel_width, *, first_pass: bool = True):
    """Launch passes ``(0 if first_pass) .. 3`` and the emit pass for ``x`` rows on ``ws`` buffers."""
    rows = out.shape[0]
    chunks = ws.topk_chunks(rows)
    has_active = active is not None
    act = active if has_active else row_lens
    grid = (rows, chunks)
    cfg = dict(num_warps=ws.topk_warps)
    for p in range(0 if first_pass else 1, 4):
        radix_pass_kernel[grid](
            x, stride_r, row_lens, act, ws.hist, ws.chunk_sfx, ws.chunk_gt, sel_width,
            K=k, PASS=p, HAS_ACTIVE=has_active, BLK=ws.topk_block, **cfg,
        )
    radix_emit_kernel[grid](
        x, stride_r, row_lens, act, ws.hist, ws.chunk_sfx, ws.chunk_gt, ws.done, out, out.stride(0),
        sel_width,
        K=k, HAS_ACTIVE=has_active, BLK=ws.topk_block,
        CHUNKS_P2=triton.next_power_of_2(chunks), **cfg,
    )
