"""Triton kernel of the metadata builder: every decode row's kernel length and block-table row in
one launch, and the active width, from device lengths (no host read).

Program ``t`` (one per decode token): its request ``r`` (from the uniform query length, else a
binary search over ``query_start_loc``), its causal length ``max(L, 0) - q + 1 + j`` (at least 0),
compressed then DCP-localized; then request ``r``'s page row, ``-1`` past the batch's pages. Programs past the
decode tokens zero stale row lengths left by a larger earlier batch. Program 0 also writes the
host bound into the active-width buffer, so the whole build is one launch.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_reqs", "num_rows", "pages", "bound", "uniform_q"])
def decode_rows_kernel(
    seq_ptr, qsl_ptr, bt_ptr, bt_stride, rows_ptr, out_bt_ptr, out_bt_stride, active_ptr,
    num_reqs, num_rows, pages, bound, uniform_q,
    RATIO: tl.constexpr, WORLD: tl.constexpr, RANK: tl.constexpr, INTERLEAVE: tl.constexpr,
    MAX_PAGES: tl.constexpr, BLOCK_P: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):
    t = tl.program_id(0)
    if t == 0:
        tl.store(active_ptr, bound)
    if t < num_rows:
        if uniform_q > 0:
            r = t // uniform_q
        else:  # the last request whose first token is at or before t
            lo = t * 0
            hi = t * 0 + num_reqs
            for _ in tl.static_range(SEARCH_STEPS):
                mid = (lo + hi) // 2
                start = tl.load(qsl_ptr + mid, mask=hi - lo > 1, other=0)
                go_up = (hi - lo > 1) & (start <= t)
                go_down = (hi - lo > 1) & (start > t)
                lo = tl.where(go_up, mid, lo)
                hi = tl.where(go_down, mid, hi)
            r = lo
        first = tl.load(qsl_ptr + r)
        q = tl.load(qsl_ptr + r + 1) - first
        n = tl.maximum(tl.load(seq_ptr + r), 0) - q + 1 + (t - first)  # a negative length reads as 0
        n = tl.maximum(n, 0) // RATIO
        if WORLD > 1:
            span = INTERLEAVE * WORLD
            rem = n % span - RANK * INTERLEAVE
            n = (n // span) * INTERLEAVE + tl.minimum(tl.maximum(rem, 0), INTERLEAVE)
        tl.store(rows_ptr + t, n)
        src = bt_ptr + r.to(tl.int64) * bt_stride
        dst = out_bt_ptr + t.to(tl.int64) * out_bt_stride
        for c in tl.static_range(0, MAX_PAGES, BLOCK_P):
            cols = c + tl.arange(0, BLOCK_P)
            v = tl.load(src + cols, mask=cols < pages, other=-1)
            tl.store(dst + cols, v, mask=cols < MAX_PAGES)
    else:
        tl.store(rows_ptr + t, 0)


def launch_decode_rows(seq_lens, query_start_loc, block_table, rows_out, table_out, active_out, *,
                       num_reqs: int, num_rows: int, clear_to: int, bound: int, uniform_q: int | None,
                       ratio: int, world: int, rank: int, interleave: int, max_reqs: int) -> None:
    """One launch: rows ``[0, num_rows)`` written, ``[num_rows, clear_to)`` zeroed, active width
    set. ``max_reqs`` (a capacity) sizes the binary search, so one compiled kernel serves all."""
    max_pages = table_out.shape[1]
    grid = (max(num_rows, clear_to, 1),)
    search = max_reqs.bit_length() + 1
    decode_rows_kernel[grid](
        seq_lens, query_start_loc, block_table, block_table.stride(0), rows_out, table_out,
        table_out.stride(0), active_out, num_reqs, num_rows, block_table.shape[1], bound,
        uniform_q or 0,
        RATIO=ratio, WORLD=world, RANK=rank, INTERLEAVE=interleave, MAX_PAGES=max_pages,
        BLOCK_P=min(1024, triton.next_power_of_2(max_pages)), SEARCH_STEPS=search, num_warps=1,
    )
