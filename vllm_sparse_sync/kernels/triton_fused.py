"""Fused decode indexer step for small row counts: score and select in one launch.

Grid ``(rows, parts)`` with ``rows * parts`` at most the SM count (``parts`` from the static row
count and the logits capacity), so every program of the launch is resident at once. Program
``(r, p)`` scores tiles ``p, p + parts, ...`` of row ``r`` up to the row's device length and
keeps their sortable keys in registers: scores never go to global memory. The programs of a row
that hold live tiles meet at two device-side barriers (an atomic counter, then a spin on a
volatile load):

1. after adding their 2048-bin histogram of the keys' top 11 bits to the row's histogram;
   every program then knows the bin of the k-th largest key and how many it still needs;
2. after publishing their counts above that bin and in it; every program then writes its
   positions above the bin straight to the output (after those of the programs before it)
   and its keys in the bin to the row's candidate buffer.

The row's last program to finish (atomic ticket) picks the remaining ones among the candidates
by two more radix passes (key bits 20..10, 9..0), writes them, and zeroes the row's histogram
and counters for the next call (and graph replay). Output order, deterministic: positions above
the k-th key's bin by (program, tile, lane), then the bin's keys above the k-th key, then its
ties, both in candidate order. Rows of length ``<= k`` get ``0..n-1`` then ``-1``.

A barrier that has waited ``SPIN_LIMIT`` polls gives up and raises the workspace's stall flag
(only possible when other work keeps SMs busy for seconds). Under ``TRITON_INTERPRET`` the
programs run one after another and cannot wait for each other: the same kernel then runs as
three launches (``PHASE`` 1, 2, 3), the barriers falling between them and the keys kept in a
scratch buffer.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .triton_common import lanes_where, live_length, pick_bin, sortable_key
from .triton_scorer import load_query, page_keys, tile_scores

BINS = 2048  # 11-bit digits: the top one from the scores' histogram, two more in the resolve
SPIN_LIMIT = 1 << 22


@triton.jit
def _top_bin(key):
    """Unsigned-ordered top 11 bits of a sortable key."""
    return ((key >> 21) & 0x7FF) ^ 0x400


@triton.jit
def _masked_hist(d, valid, NB: tl.constexpr):
    """Histogram of ``d`` over ``valid`` lanes (1-D)."""
    d = tl.where(valid, d, 0)
    miss = tl.sum(tl.where(valid, 0, 1), 0)
    return tl.histogram(d, NB) - tl.where(tl.arange(0, NB) == 0, miss, 0)


@triton.jit
def _arrive_and_wait(ctr_ptr, target, stall_ptr, SPIN: tl.constexpr):
    """Row barrier: count this program in, wait until ``target`` programs have arrived."""
    tl.atomic_add(ctr_ptr, 1, sem="release")
    seen = tl.load(ctr_ptr, volatile=True)
    spins = 0
    while (seen < target) & (spins < SPIN):
        seen = tl.load(ctr_ptr, volatile=True)
        spins += 1
    tl.store(stall_ptr, 1, mask=seen < target)
    tl.atomic_add(ctr_ptr, 0, sem="acquire")


@triton.jit
def _resolve(ckey_row, cpos_row, n_cand, need, out_base, NB: tl.constexpr, RBLK: tl.constexpr):
    """Write the ``need`` largest of ``n_cand`` candidate keys (same top 11 bits) to ``out_base``."""
    lane = tl.arange(0, RBLK)
    h = tl.zeros([NB], dtype=tl.int32)
    for t in range(0, n_cand, RBLK):
        m = t + lane < n_cand
        kk = tl.load(ckey_row + t + lane, mask=m, other=0, cache_modifier=".cg")
        h += _masked_hist((kk >> 10) & 0x7FF, m, NB)
    hi, need2 = pick_bin(h, need, NB)
    h = tl.zeros([NB], dtype=tl.int32)
    for t in range(0, n_cand, RBLK):
        m = t + lane < n_cand
        kk = tl.load(ckey_row + t + lane, mask=m, other=0, cache_modifier=".cg")
        h += _masked_hist(kk & 0x3FF, m & (((kk >> 10) & 0x7FF) == hi), NB)
    lo, ties = pick_bin(h, need2, NB)
    kth = hi * 1024 + lo  # the k-th largest key's low 21 bits
    n_gt = need - ties
    base_gt = 0
    base_eq = 0
    for t in range(0, n_cand, RBLK):
        m = t + lane < n_cand
        kk = tl.load(ckey_row + t + lane, mask=m, other=0, cache_modifier=".cg") & 0x1FFFFF
        pos = tl.load(cpos_row + t + lane, mask=m, other=0, cache_modifier=".cg")
        g = (m & (kk > kth)).to(tl.int32)
        slot = base_gt + tl.cumsum(g, 0) - g
        tl.store(out_base + slot, pos, mask=g != 0)
        base_gt += tl.sum(g, 0)
        e = (m & (kk == kth)).to(tl.int32)
        rank = base_eq + tl.cumsum(e, 0) - e
        tl.store(out_base + n_gt + rank, pos, mask=(e != 0) & (rank < ties))
        base_eq += tl.sum(e, 0)


@triton.jit(do_not_specialize=["num_pages", "sel_width", "live_width"])
def fused_step_kernel(
    q_ptr, w_ptr, kc_ptr, ks_ptr, bt_ptr, bt_stride, lens_ptr, active_ptr, out_ptr, out_stride,
    hist_ptr, sync_ptr, cnt_ptr, ckey_ptr, cpos_ptr, cand_stride, stash_ptr, stall_ptr,
    num_pages, page_stride, sel_width, live_width,
    K: tl.constexpr, H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, NSUB: tl.constexpr,
    PARTS_P2: tl.constexpr, HAS_ACTIVE: tl.constexpr, PRECISE: tl.constexpr,
    NUM_STAGES: tl.constexpr, PHASE: tl.constexpr, SPIN: tl.constexpr, RBLK: tl.constexpr,
):
    """One row part's share of the fused step (``PHASE`` 0: all of it; 1, 2, 3: interpreter phases)."""
    NB: tl.constexpr = 2048
    row = tl.program_id(0)
    p = tl.program_id(1)
    parts = tl.num_programs(1)
    n = live_length(lens_ptr, active_ptr, row, sel_width, HAS_ACTIVE)
    n_tiles = tl.cdiv(n, PAGE)
    live_parts = tl.where(n > K, tl.minimum(parts, n_tiles), 0)
    out_row = out_ptr + row.to(tl.int64) * out_stride
    if PHASE <= 1:  # a short row: 0..n-1 then -1, from part 0
        short = (n <= K) & (p == 0)
        for j in range(0, K, RBLK):
            o = j + tl.arange(0, RBLK)
            tl.store(out_row + o, tl.where(o < n, o, -1), mask=(o < K) & lanes_where(short, o))
    if p < live_parts:
        bins = tl.arange(0, NB)
        hist_row = hist_ptr + row * NB
        sync_row = sync_ptr + row * 4
        jj = tl.arange(0, NSUB)
        lane = tl.arange(0, PAGE)
        n_mine = tl.cdiv(n_tiles - p, parts)  # tiles p, p + parts, ... below n_tiles
        pos = tl.reshape((jj[:, None] * parts + p) * PAGE + lane[None, :], [NSUB * PAGE])
        valid = tl.reshape(jj[:, None] + 0 * lane[None, :] < n_mine, [NSUB * PAGE]) & (pos < n)
        stash = stash_ptr + (row * parts + p).to(tl.int64) * (NSUB * PAGE) + tl.arange(0, NSUB * PAGE)
        if PHASE <= 1:
            q_t, w = load_query(q_ptr, w_ptr, row, H, D, PRECISE)
            bt_row = bt_ptr + row.to(tl.int64) * bt_stride
            k_offs = lane[:, None] * D + tl.arange(0, D)[None, :]
            n_live = tl.minimum(n, live_width)
            keys2 = tl.zeros([NSUB, PAGE], dtype=tl.int32)
            for j in tl.range(0, n_mine, num_stages=NUM_STAGES):
                kb, scale, ok = page_keys(kc_ptr, ks_ptr, bt_row, j * parts + p, n_live, num_pages,
                                          page_stride, k_offs, D, PAGE)
                v = sortable_key(tile_scores(kb, scale, ok, q_t, w, PRECISE))
                keys2 = tl.where(jj[:, None] == j, v[None, :], keys2)
            keys = tl.reshape(keys2, [NSUB * PAGE])
            h = _masked_hist(_top_bin(keys), valid, NB)
            tl.atomic_add(hist_row + bins, h, mask=h != 0, sem="relaxed")
            if PHASE == 1:
                tl.store(stash, keys)
        else:
            keys = tl.load(stash)
        if PHASE == 0:
            _arrive_and_wait(sync_row, live_parts, stall_ptr, SPIN)
        top = _top_bin(keys)
        if PHASE == 0 or PHASE == 2:
            b, need = pick_bin(tl.load(hist_row + bins, cache_modifier=".cg"), K, NB)
            cnt = cnt_ptr + (row * parts + p) * 2
            tl.store(cnt, tl.sum((valid & (top > b)).to(tl.int32), 0))
            tl.store(cnt + 1, tl.sum((valid & (top == b)).to(tl.int32), 0))
        if PHASE == 0:
            _arrive_and_wait(sync_row + 1, live_parts, stall_ptr, SPIN)
        if PHASE == 0 or PHASE == 3:
            b, need = pick_bin(tl.load(hist_row + bins, cache_modifier=".cg"), K, NB)
            cc = tl.arange(0, PARTS_P2)
            in_c = cc < live_parts
            cnt_row = cnt_ptr + row * parts * 2
            above_c = tl.load(cnt_row + cc * 2, mask=in_c, other=0, cache_modifier=".cg")
            eq_c = tl.load(cnt_row + cc * 2 + 1, mask=in_c, other=0, cache_modifier=".cg")
            g = (valid & (top > b)).to(tl.int32)
            slot = tl.sum(tl.where(cc < p, above_c, 0), 0) + tl.cumsum(g, 0) - g
            tl.store(out_row + slot, pos, mask=g != 0)
            e = (valid & (top == b)).to(tl.int32)
            slot = tl.sum(tl.where(cc < p, eq_c, 0), 0) + tl.cumsum(e, 0) - e
            ckey_row = ckey_ptr + row.to(tl.int64) * cand_stride
            cpos_row = cpos_ptr + row.to(tl.int64) * cand_stride
            tl.store(ckey_row + slot, keys, mask=e != 0)
            tl.store(cpos_row + slot, pos, mask=e != 0)
            ticket = tl.atomic_add(sync_row + 2, 1, sem="acq_rel")
            if ticket == live_parts - 1:
                n_above = tl.sum(above_c, 0)
                _resolve(ckey_row, cpos_row, tl.sum(eq_c, 0), need, out_row + n_above, NB, RBLK)
                tl.store(hist_row + bins, tl.zeros([NB], dtype=tl.int32))
                tl.store(sync_row + tl.arange(0, 4), tl.zeros([4], dtype=tl.int32))


def fused_plan(rows: int, width: int, page: int, num_sms: int, ctas_per_sm: int, max_keys: int):
    """``(parts, tiles per part)`` of the fused step for a static shape, or ``None`` when it does not fit."""
    if rows <= 0 or width <= 0 or page <= 0 or page & (page - 1):
        return None
    slots = num_sms * ctas_per_sm
    if rows > slots:
        return None
    tiles = triton.cdiv(width, page)
    nsub = triton.next_power_of_2(triton.cdiv(tiles, max(1, slots // rows)))
    if nsub * page > max_keys:
        return None
    return triton.cdiv(tiles, nsub), nsub


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (programs one after another)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def launch_fused_step(q_fp8, weights, k_cache, block_table, row_lens, active, out, ws, *, k, page,
                      sel_width, plan) -> None:
    """Launch the fused step over ``out``'s rows with ``ws``'s fused buffers."""
    rows, heads, head_dim = q_fp8.shape
    parts, nsub = plan
    has_active = active is not None
    cfg = ws.config
    phases = (1, 2, 3) if interpreting() else (0,)
    stash = ws.fused_stash(rows * parts * nsub * page) if phases != (0,) else ws.fused_hist
    for phase in phases:
        fused_step_kernel[(rows, parts)](
            q_fp8.view(torch.uint8), weights, k_cache, k_cache.view(torch.float32), block_table,
            block_table.stride(0), row_lens, active if has_active else row_lens, out, out.stride(0),
            ws.fused_hist, ws.fused_sync, ws.fused_cnt, ws.fused_cand_key, ws.fused_cand_pos,
            ws.fused_cand_key.stride(0), stash, ws.fused_stall,
            k_cache.shape[0], k_cache.stride(0), sel_width, block_table.shape[1] * page,
            K=k, H=heads, D=head_dim, PAGE=page, NSUB=nsub, PARTS_P2=triton.next_power_of_2(parts),
            HAS_ACTIVE=has_active, PRECISE=bool(cfg.precise), NUM_STAGES=cfg.fused_stages,
            PHASE=phase, SPIN=SPIN_LIMIT, RBLK=cfg.fused_resolve_block, num_warps=cfg.fused_warps,
        )
