"""Triton K-cache writer: scatter per-token fp8 keys and fp32 scales into the planar page layout."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import lanes_where


@triton.jit(do_not_specialize=["num_slots", "page_stride"])
def write_k_cache_kernel(
    kc_ptr, val_ptr, scale_ptr, slot_ptr, num_slots, page_stride,
    D: tl.constexpr, PAGE: tl.constexpr,
):
    """Token ``program_id(0)``: 128 value bytes to its slot row, 4 scale bytes to the page's scale plane."""
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    ok = (slot >= 0) & (slot < num_slots)
    slot = tl.where(ok, slot, 0)
    base = (slot // PAGE) * page_stride
    off = slot % PAGE
    dims = tl.arange(0, D)
    vals = tl.load(val_ptr + tok.to(tl.int64) * D + dims)
    tl.store(kc_ptr + base + off * D + dims, vals, mask=lanes_where(ok, dims))
    b = tl.arange(0, 4)
    sb = tl.load(scale_ptr + tok.to(tl.int64) * 4 + b)
    tl.store(kc_ptr + base + PAGE * D + off * 4 + b, sb, mask=lanes_where(ok, b))
