"""Fused decode indexer step for small row counts: score and select in one launch.

Grid ``(rows, parts)``, launched cooperatively (every program resident at once, or the launch
fails and the warm-up call takes fewer programs per SM); ``parts`` comes from the route planner
(``planner.plan_route``: the static row count, the SM count and the width bound). Program ``(r,
p)`` scores the contiguous chunk of page tiles ``[p * c, (p + 1) * c)`` of row ``r``, with ``c =
cdiv(live tiles, parts)`` from the row's device length (at most the route's ``fused_tiles``;
programs past the last tile sit the row out), and keeps their sortable keys in registers:
scores never go to global memory. Chunks keep ``(program, tile, lane)`` order equal to position
order, which the output order and the tie rule rest on. The row's programs then run two 8-bit
radix passes (key bits 31..16): each adds its 256-bin histogram of the keys matching the prefix
so far to the row's histogram and meets the others at a device-side barrier (an atomic
counter, then a spin on a volatile load), after which every program reads the same digit.
A third barrier publishes each program's counts above the 16-bit prefix of the k-th key and in
it; every program then writes its positions above straight to the output (after those of the
programs before it) and its keys in the prefix to the row's candidate buffer (likewise, so the
buffer is in position order). The row's last program (atomic ticket) selects among the
candidates by passes 2 and 3, taking the k-th key's ties in buffer order, i.e. lowest positions
first (the reference's contract), writes them, and zeroes the row's histograms and counters for
the next call (and graph replay). Output order is deterministic: positions of keys above the
prefix in ascending order, then those of the candidates above the k-th key in ascending order,
then its ties, lowest first. Rows of length ``<= k`` get ``0..n-1`` then ``-1``.

Programs of a cooperative launch are all resident, so every barrier completes; as a last
resort a barrier that has polled ``SPIN_LIMIT`` times (about half an hour) gives up and raises
its row's stall flag, and the row's resolve then writes ``-1`` over the whole row: a stalled
row is marked, never silently wrong (``IndexerStep.health()`` reports it).

Under ``TRITON_INTERPRET`` the programs run one after another and cannot wait for each other:
the same kernel then runs as four launches (``PHASE`` 1..4, the interpreter's route; ``PHASE``
0 on the GPU), the barriers falling between them and the keys kept in a scratch buffer.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .common import lanes_where, live_length, next_prefix, pick_digit, radix_hist, sortable_key
from .scorer import load_query, page_keys, tile_scores
from .topk_sample import select_emit
from ..device import interpreting

SPIN_LIMIT = (1 << 31) - 1  # polls before a row barrier gives up and marks its row
STAGES = 6
WARPS = 4
RESOLVE_BLOCK = 1024
"""candidates an iteration of the row's one-program resolve"""


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
def _row_state(hist_row, K: tl.constexpr, PASSES: tl.constexpr):
    """Key prefix and count still needed after the row's first ``PASSES`` radix histograms."""
    bins = tl.arange(0, 256)
    prefix = tl.full((), 0, tl.int32)
    need = tl.full((), K, tl.int32)
    for ps in tl.static_range(PASSES):
        h = tl.load(hist_row + ps * 256 + bins, cache_modifier=".cg")
        d, need = pick_digit(h, need)
        prefix = next_prefix(prefix, d, ps)
    return prefix, need


@triton.jit(do_not_specialize=["num_pages", "sel_width", "live_width"])
def fused_step_kernel(
    q_ptr, w_ptr, kc_ptr, ks_ptr, bt_ptr, bt_stride, lens_ptr, active_ptr, out_ptr, out_stride,
    hist_ptr, sync_ptr, cnt_ptr, ckey_ptr, cpos_ptr, cand_stride, stash_ptr, stall_ptr,
    num_pages, page_stride, sel_width, live_width,
    K: tl.constexpr, H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, NSUB: tl.constexpr,
    PARTS_P2: tl.constexpr, HAS_ACTIVE: tl.constexpr, PRECISE: tl.constexpr,
    NUM_STAGES: tl.constexpr, PHASE: tl.constexpr, SPIN: tl.constexpr, RBLK: tl.constexpr,
):
    """One row part's share of the fused step (``PHASE`` 0: all of it; 1..4: interpreter phases)."""
    row = tl.program_id(0)
    p = tl.program_id(1)
    parts = tl.num_programs(1)
    n = live_length(lens_ptr, active_ptr, row, sel_width, HAS_ACTIVE)
    n_tiles = tl.cdiv(n, PAGE)
    # contiguous chunks of `chunk` tiles (the same most tiles per program as any split), so
    # (program, tile, lane) order is position order; live_parts: the programs with a tile
    chunk = tl.maximum(tl.cdiv(n_tiles, parts), 1)
    live_parts = tl.where(n > K, tl.cdiv(n_tiles, chunk), 0)
    out_row = out_ptr + row.to(tl.int64) * out_stride
    if PHASE <= 1:  # a short row: 0..n-1 then -1, from part 0
        short = (n <= K) & (p == 0)
        for j in range(0, K, 1024):
            o = j + tl.arange(0, 1024)
            tl.store(out_row + o, tl.where(o < n, o, -1), mask=(o < K) & lanes_where(short, o))
    if p < live_parts:
        hist_row = hist_ptr + row * 512
        sync_row = sync_ptr + row * 8  # per row: barriers 0, 1 (passes), 2 (counts); 7: ticket
        bins = tl.arange(0, 256)
        jj = tl.arange(0, NSUB)
        lane = tl.arange(0, PAGE)
        t0 = p * chunk
        n_mine = tl.minimum(chunk, n_tiles - t0)  # tiles t0 .. t0 + n_mine - 1 (at most NSUB)
        pos = tl.reshape((t0 + jj[:, None]) * PAGE + lane[None, :], [NSUB * PAGE])
        valid = tl.reshape(jj[:, None] + 0 * lane[None, :] < n_mine, [NSUB * PAGE]) & (pos < n)
        stash = stash_ptr + (row * parts + p).to(tl.int64) * (NSUB * PAGE) + tl.arange(0, NSUB * PAGE)
        if PHASE <= 1:
            q_t, w = load_query(q_ptr, w_ptr, row, H, D, PRECISE)
            bt_row = bt_ptr + row.to(tl.int64) * bt_stride
            k_offs = lane[:, None] * D + tl.arange(0, D)[None, :]
            n_live = tl.minimum(n, live_width)
            keys2 = tl.zeros([NSUB, PAGE], dtype=tl.int32)
            for j in tl.range(0, n_mine, num_stages=NUM_STAGES):
                kb, scale, ok = page_keys(kc_ptr, ks_ptr, bt_row, t0 + j, n_live, num_pages,
                                          page_stride, k_offs, D, PAGE)
                v = sortable_key(tile_scores(kb, scale, ok, q_t, w, PRECISE), False)
                keys2 = tl.where(jj[:, None] == j, v[None, :], keys2)
            keys = tl.reshape(keys2, [NSUB * PAGE])
            if PHASE == 1:
                tl.store(stash, keys)
        else:
            keys = tl.load(stash)
        # radix passes 0 and 1 (key bits 31..16) over every part, a row barrier after each
        stall_row = stall_ptr + row
        for ps in tl.static_range(2):
            if PHASE == 0 or PHASE == ps + 1:
                prefix, need = _row_state(hist_row, K, ps)
                h = radix_hist(keys, valid, prefix, ps)
                tl.atomic_add(hist_row + ps * 256 + bins, h, mask=h != 0, sem="relaxed")
            if PHASE == 0:
                _arrive_and_wait(sync_row + ps, live_parts, stall_row, SPIN)
        prefix, need = _row_state(hist_row, K, 2)
        hi = keys >> 16
        gt = (valid & (hi > prefix)).to(tl.int32)
        eq = (valid & (hi == prefix)).to(tl.int32)
        cnt_row = cnt_ptr + row * parts * 2
        if PHASE == 0 or PHASE == 3:
            tl.store(cnt_row + p * 2, tl.sum(gt, 0))
            tl.store(cnt_row + p * 2 + 1, tl.sum(eq, 0))
        if PHASE == 0:
            _arrive_and_wait(sync_row + 2, live_parts, stall_row, SPIN)
        if PHASE == 0 or PHASE == 4:
            # keys above the 16-bit prefix go straight out; those in it become candidates
            cc = tl.arange(0, PARTS_P2)
            in_c = cc < live_parts
            gt_c = tl.load(cnt_row + cc * 2, mask=in_c, other=0, cache_modifier=".cg")
            eq_c = tl.load(cnt_row + cc * 2 + 1, mask=in_c, other=0, cache_modifier=".cg")
            slot = tl.sum(tl.where(cc < p, gt_c, 0), 0) + tl.cumsum(gt, 0) - gt
            tl.store(out_row + slot, pos, mask=gt != 0)
            slot = tl.sum(tl.where(cc < p, eq_c, 0), 0) + tl.cumsum(eq, 0) - eq
            ckey_row = ckey_ptr + row.to(tl.int64) * cand_stride
            cpos_row = cpos_ptr + row.to(tl.int64) * cand_stride
            tl.store(ckey_row + slot, keys, mask=eq != 0)
            tl.store(cpos_row + slot, pos, mask=eq != 0)
            # the row's last program resolves the candidates, then resets the row's state; every
            # program's writes come before its ticket, so a stalled row's marking is the last word
            if tl.atomic_add(sync_row + 7, 1, sem="acq_rel") == live_parts - 1:
                n_cand = tl.sum(eq_c, 0)
                # passes 2 and 3 over the candidates, then their positions
                select_emit(ckey_row, cpos_row, n_cand, out_row + (K - need), prefix, need, 2, RBLK,
                            False, False)
                stalled = tl.load(stall_row, volatile=True) != 0
                for j in range(0, K, 1024):
                    o = j + tl.arange(0, 1024)
                    tl.store(out_row + o, tl.full([1024], -1, tl.int32),
                             mask=(o < K) & lanes_where(stalled, o))
                tl.store(hist_row + tl.arange(0, 512), tl.zeros([512], dtype=tl.int32))
                tl.store(sync_row + tl.arange(0, 8), tl.zeros([8], dtype=tl.int32))


@functools.cache
def _launch_kwargs(ctas_per_sm: int, warps: int) -> dict:
    """Cooperative launch (all programs resident, or an error) and a register cap that lets
    ``ctas_per_sm`` programs share an SM's 64K registers, where this Triton has the options."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - not an NVIDIA build
        return {}
    fields = CUDAOptions.__dataclass_fields__
    kw = {}
    if "launch_cooperative_grid" in fields:
        kw["launch_cooperative_grid"] = True
    if "maxnreg" in fields:
        kw["maxnreg"] = min(255, 65536 // (ctas_per_sm * warps * 32) // 8 * 8)
    return kw


def launch_fused_step(q_fp8, weights, k_cache, block_table, row_lens, active, out, ws, *, k, page,
                      sel_width, route) -> None:
    """Launch the fused step of ``route`` over ``out``'s rows with ``ws``'s fused buffers."""
    rows, heads, head_dim = q_fp8.shape
    parts, nsub = route.fused_parts, route.fused_tiles
    has_active = active is not None
    interp = interpreting()
    phases = (1, 2, 3, 4) if interp else (0,)
    stash = ws.fused_stash(rows * parts * nsub * page) if interp else ws.fused_hist
    extra = {} if interp else _launch_kwargs(ws.fused_ctas_per_sm, WARPS)
    for phase in phases:
        fused_step_kernel[(rows, parts)](
            q_fp8.view(torch.uint8), weights, k_cache, k_cache.view(torch.float32), block_table,
            block_table.stride(0), row_lens, active if has_active else row_lens, out, out.stride(0),
            ws.fused_hist, ws.fused_sync, ws.fused_cnt, ws.fused_cand_key, ws.fused_cand_pos,
            ws.fused_cand_key.stride(0), stash, ws.fused_stall,
            k_cache.shape[0], k_cache.stride(0), sel_width, block_table.shape[1] * page,
            K=k, H=heads, D=head_dim, PAGE=page, NSUB=nsub, PARTS_P2=triton.next_power_of_2(parts),
            HAS_ACTIVE=has_active, PRECISE=ws.config.precise, NUM_STAGES=STAGES,
            PHASE=phase, SPIN=SPIN_LIMIT, RBLK=RESOLVE_BLOCK, num_warps=WARPS, **extra,
        )
