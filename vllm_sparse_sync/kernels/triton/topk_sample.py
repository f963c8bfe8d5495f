"""Triton top-k by sampled threshold and candidate compaction: exact, deterministic, no atomics.

Four launches per call. ``sample`` (one program per row) picks a key threshold from strided
samples of rows longer than ``SMIN``; ``count`` and ``compact`` (grid ``(rows, chunks)``) count
the keys at or above it per chunk, then write them, in position order at per-chunk prefix
offsets, to the row's candidate buffer when there are between ``k`` and ``CAP`` of them;
``resolve`` (one program per row) finds the exact k-th largest key of the candidates (or of the
whole row when the row is short or the threshold missed) with in-register radix passes and
writes the positions: keys above it, then its ties, lowest positions first. Every buffer read
is written earlier in the same call, so nothing needs resetting between calls.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    chunk_tiles,
    live_length,
    load_tile,
    next_prefix,
    pick_digit,
    radix_hist,
    sortable_key,
)


@triton.jit
def _kth_in_regs(key, valid, need):
    """The ``need``-th largest of the ``valid`` keys of a register tensor."""
    prefix = tl.full((), 0, tl.int32)
    for p in tl.static_range(4):
        d, need = pick_digit(radix_hist(key, valid, prefix, p), need)
        prefix = next_prefix(prefix, d, p)
    return prefix


@triton.jit(do_not_specialize=["sel_width"])
def sample_kernel(
    x_ptr, stride_r, lens_ptr, active_ptr, thr_ptr, sel_width,
    K: tl.constexpr, SMIN: tl.constexpr, S: tl.constexpr, HAS_ACTIVE: tl.constexpr,
    NAN_LOW: tl.constexpr,
):
    """Threshold key of each row longer than ``SMIN``: the m-th largest of ``S`` strided samples."""
    row = tl.program_id(0)
    n = live_length(lens_ptr, active_ptr, row, sel_width, HAS_ACTIVE)
    if n > SMIN:
        n64 = n.to(tl.int64)
        pos = tl.arange(0, S).to(tl.int64) * n64 // S
        key = sortable_key(tl.load(x_ptr + row.to(tl.int64) * stride_r + pos), NAN_LOW)
        # m ~ 1.3x the samples expected above the k-th largest, plus 16
        m = (S * K * 13 + 10 * n64 - 1) // (10 * n64) + 16
        m = tl.minimum(m, S).to(tl.int32)
        tl.store(thr_ptr + row, _kth_in_regs(key, pos >= 0, m))


@triton.jit(do_not_specialize=["sel_width"])
def count_kernel(
    x_ptr, stride_r, lens_ptr, active_ptr, thr_ptr, cnt_ptr, sel_width,
    SMIN: tl.constexpr, HAS_ACTIVE: tl.constexpr, BLK: tl.constexpr, NAN_LOW: tl.constexpr,
):
    """Per chunk: live keys at or above the row's threshold (0 for rows up to ``SMIN``)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)
    n = live_length(lens_ptr, active_ptr, row, sel_width, HAS_ACTIVE)
    t0, t1 = chunk_tiles(n, SMIN, BLK, chunk, chunks)
    thr = tl.load(thr_ptr + row)
    x_row = x_ptr + row.to(tl.int64) * stride_r
    acc = tl.zeros([BLK], dtype=tl.int32)
    for t in range(t0, t1):
        x, pos = load_tile(x_row, t, t1, n, BLK)
        acc += ((pos < n) & (sortable_key(x, NAN_LOW) >= thr)).to(tl.int32)
    tl.store(cnt_ptr + row * chunks + chunk, tl.sum(acc, 0))


@triton.jit
def _row_counts(cnt_ptr, row, chunk, chunks, CHUNKS_P2: tl.constexpr):
    """(candidates of the row, candidates of its chunks before ``chunk``)."""
    cc = tl.arange(0, CHUNKS_P2)
    c = tl.load(cnt_ptr + row * chunks + cc, mask=cc < chunks, other=0)
    return tl.sum(c, 0), tl.sum(tl.where(cc < chunk, c, 0), 0)


@triton.jit(do_not_specialize=["sel_width"])
def compact_kernel(
    x_ptr, stride_r, lens_ptr, active_ptr, thr_ptr, cnt_ptr, ckey_ptr, cpos_ptr, sel_width,
    K: tl.constexpr, CAP: tl.constexpr, SMIN: tl.constexpr, HAS_ACTIVE: tl.constexpr,
    BLK: tl.constexpr, CHUNKS_P2: tl.constexpr, NAN_LOW: tl.constexpr,
):
    """Write the chunk's keys at or above the threshold, and their positions, in position order."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)
    n = live_length(lens_ptr, active_ptr, row, sel_width, HAS_ACTIVE)
    c, base = _row_counts(cnt_ptr, row, chunk, chunks, CHUNKS_P2)
    t0, t1 = chunk_tiles(n, SMIN, BLK, chunk, chunks)
    t1 = tl.where((c >= K) & (c <= CAP), t1, t0)
    thr = tl.load(thr_ptr + row)
    x_row = x_ptr + row.to(tl.int64) * stride_r
    ck = ckey_ptr + row.to(tl.int64) * CAP
    cp = cpos_ptr + row.to(tl.int64) * CAP
    for t in range(t0, t1):
        x, pos = load_tile(x_row, t, t1, n, BLK)
        key = sortable_key(x, NAN_LOW)
        g = ((pos < n) & (key >= thr)).to(tl.int32)
        slot = base + tl.cumsum(g, 0) - g
        tl.store(ck + slot, key, mask=g != 0)
        tl.store(cp + slot, pos, mask=g != 0)
        base += tl.sum(g, 0)


@triton.jit
def _src_tile(src, src_pos, t, cnt, RB: tl.constexpr, FROM_ROW: tl.constexpr,
              NAN_LOW: tl.constexpr):
    """Keys, positions and validity of tile ``t`` of the row's scores or of its candidates."""
    i = t * RB + tl.arange(0, RB)
    valid = i < cnt
    if FROM_ROW:
        key = sortable_key(tl.load(src + i, mask=valid, other=float("-inf")), NAN_LOW)
        pos = i
    else:
        # candidates may come from other programs of the same launch: read them from L2
        key = tl.load(src + i, mask=valid, other=0, cache_modifier=".cg")
        pos = tl.load(src_pos + i, mask=valid, other=-1, cache_modifier=".cg")
    return key, pos, valid


@triton.jit
def select_emit(src, src_pos, cnt, out_row, prefix, want, FIRST: tl.constexpr, RB: tl.constexpr,
                FROM_ROW: tl.constexpr, NAN_LOW: tl.constexpr):
    """The ``want`` largest of ``cnt`` keys that share radix ``prefix`` (passes before ``FIRST``),
    in source order: above the k-th largest, then its ties."""
    n_t = tl.cdiv(cnt, RB)
    need = want
    for p in tl.static_range(FIRST, 4):
        acc = tl.zeros([256], dtype=tl.int32)
        for t in range(0, n_t):
            key, pos, valid = _src_tile(src, src_pos, t, cnt, RB, FROM_ROW, NAN_LOW)
            acc += radix_hist(key, valid, prefix, p)
        d, need = pick_digit(acc, need)
        prefix = next_prefix(prefix, d, p)
    n_above = want - need
    base_gt = tl.full((), 0, tl.int32)
    base_eq = tl.full((), 0, tl.int32)
    for t in range(0, n_t):
        key, pos, valid = _src_tile(src, src_pos, t, cnt, RB, FROM_ROW, NAN_LOW)
        g = (valid & (key > prefix)).to(tl.int32)
        tl.store(out_row + base_gt + tl.cumsum(g, 0) - g, pos, mask=g != 0)
        base_gt += tl.sum(g, 0)
        e = (valid & (key == prefix)).to(tl.int32)
        rank = base_eq + tl.cumsum(e, 0) - e
        tl.store(out_row + n_above + rank, pos, mask=(e != 0) & (rank < need))
        base_eq += tl.sum(e, 0)


@triton.jit(do_not_specialize=["sel_width"])
def resolve_kernel(
    x_ptr, stride_r, lens_ptr, active_ptr, cnt_ptr, ckey_ptr, cpos_ptr, out_ptr, stride_o, sel_width,
    chunks, K: tl.constexpr, CAP: tl.constexpr, SMIN: tl.constexpr, HAS_ACTIVE: tl.constexpr,
    RB: tl.constexpr, CHUNKS_P2: tl.constexpr, NAN_LOW: tl.constexpr,
):
    """Each row's top-k positions (``0..n-1`` then ``-1`` when n <= K).

    Rows longer than SMIN select from their candidates when the threshold kept between K and
    CAP of them, else (shorter rows, or a threshold that missed) from the whole row.
    """
    row = tl.program_id(0)
    n = live_length(lens_ptr, active_ptr, row, sel_width, HAS_ACTIVE)
    out_row = out_ptr + row.to(tl.int64) * stride_o
    c, _ = _row_counts(cnt_ptr, row, 0, chunks, CHUNKS_P2)
    if n <= K:
        lane = tl.arange(0, RB)
        for j in range(0, K, RB):
            pos = j + lane
            tl.store(out_row + pos, tl.where(pos < n, pos, -1), mask=pos < K)
    elif (n > SMIN) & (c >= K) & (c <= CAP):
        off = row.to(tl.int64) * CAP
        select_emit(ckey_ptr + off, cpos_ptr + off, c, out_row, 0, K, 0, RB, False, NAN_LOW)
    else:
        select_emit(x_ptr + row.to(tl.int64) * stride_r, x_ptr, n, out_row, 0, K, 0, RB, True,
                    NAN_LOW)


BLOCK = 1024
"""scores a program reads an iteration"""
WARPS = 4
CAP = 8192
"""most candidates a row (the workspace's candidate buffers)"""
SAMPLE_ABOVE = 4096
"""rows longer than this are sampled; shorter ones are read whole by the resolve"""
SAMPLES = 2048
"""strided samples a row that set the candidate threshold"""
RESOLVE_BLOCK = 2048
RESOLVE_WARPS = 8


def launch_sample_topk(x, stride_r, row_lens, active, ws, out, k, sel_width, chunks, nan_low=True):
    """Launch sample, count, compact and resolve for ``x`` rows on ``ws`` buffers, ``chunks``
    programs per row (the route's); ``nan_low=False`` for scores from the scorer."""
    rows = out.shape[0]
    has_active = active is not None
    act = active if has_active else row_lens
    grid = (rows, chunks)
    cap, smin, p2 = CAP, SAMPLE_ABOVE, triton.next_power_of_2(chunks)
    sample_kernel[(rows,)](
        x, stride_r, row_lens, act, ws.thresh, sel_width,
        K=k, SMIN=smin, S=SAMPLES, HAS_ACTIVE=has_active, NAN_LOW=nan_low,
        num_warps=WARPS,
    )
    count_kernel[grid](
        x, stride_r, row_lens, act, ws.thresh, ws.chunk_cnt, sel_width,
        SMIN=smin, HAS_ACTIVE=has_active, BLK=BLOCK, NAN_LOW=nan_low, num_warps=WARPS,
    )
    compact_kernel[grid](
        x, stride_r, row_lens, act, ws.thresh, ws.chunk_cnt, ws.cand_key, ws.cand_pos, sel_width,
        K=k, CAP=cap, SMIN=smin, HAS_ACTIVE=has_active, BLK=BLOCK, CHUNKS_P2=p2,
        NAN_LOW=nan_low, num_warps=WARPS,
    )
    resolve_kernel[(rows,)](
        x, stride_r, row_lens, act, ws.chunk_cnt, ws.cand_key, ws.cand_pos, out, out.stride(0),
        sel_width, chunks,
        K=k, CAP=cap, SMIN=smin, HAS_ACTIVE=has_active, RB=RESOLVE_BLOCK, CHUNKS_P2=p2,
        NAN_LOW=nan_low, num_warps=RESOLVE_WARPS,
    )
