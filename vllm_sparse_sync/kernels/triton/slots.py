"""Triton kernel of the page-table transform: top-k positions to KV-cache slots in place
(``reference.page_table_slots``), for the routes whose top-k does not write slots itself (the
CUDA cluster top-k does). One program per (row, block of columns); no host read. A selected
position without a slot (its page past the table, its entry negative or its slot past
``2**31 - 1``) becomes ``-1`` and adds one to the counter, when one is given.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SLOTS_BLOCK = 1024


@triton.jit(do_not_specialize=["k", "table_stride", "pages", "out_stride"])
def page_slots_kernel(out_ptr, out_stride, table_ptr, table_stride, k, pages, unmapped_ptr,
                      BITS: tl.constexpr, BLOCK: tl.constexpr, COUNT: tl.constexpr):
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < k
    ptr = out_ptr + r.to(tl.int64) * out_stride + cols
    pos = tl.load(ptr, mask=live, other=-1)
    page = tl.where(pos >= 0, pos >> BITS, 0)
    ok = (pos >= 0) & (page < pages)
    base = tl.load(table_ptr + r.to(tl.int64) * table_stride + page, mask=ok, other=0)
    ok = ok & (base >= 0) & (base <= (2147483647 >> BITS))  # an entry without int32 slots: -1
    slot = (base << BITS) | (pos & ((1 << BITS) - 1))
    tl.store(ptr, tl.where(ok, slot, -1), mask=live)
    if COUNT:
        lost = tl.sum(((pos >= 0) & ~ok).to(tl.int32), 0)
        if lost > 0:
            tl.atomic_add(unmapped_ptr, lost)


def launch_page_slots(out: torch.Tensor, page_table: torch.Tensor, page_bits: int,
                      unmapped: torch.Tensor | None = None) -> None:
    """``out`` (int32 ``[rows, k]`` positions, contiguous rows) rewritten as the slots of
    ``page_table``'s first ``rows`` rows, pages of ``2 ** page_bits`` (checked by the caller);
    positions without a slot add to ``unmapped`` (int32 ``[1]``) when given."""
    rows, k = out.shape
    if rows == 0 or k == 0:
        return
    block = min(SLOTS_BLOCK, triton.next_power_of_2(k))
    page_slots_kernel[(rows, triton.cdiv(k, block))](
        out, out.stride(0), page_table, page_table.stride(0), k, page_table.shape[1],
        out if unmapped is None else unmapped,
        BITS=page_bits, BLOCK=block, COUNT=unmapped is not None, num_warps=4,
    )
