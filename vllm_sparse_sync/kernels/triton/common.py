"""Triton device helpers shared by the indexer kernels: live lengths, sortable keys, radix digits.

Keys: a float32 score maps to an int32 whose signed order is the float order
(``b`` if ``b >= 0`` else ``b ^ 0x7FFFFFFF`` on the float's bits; NaN maps below every
number). Radix passes read 8-bit digits from the top: pass 0 uses bits 31..24 with the sign
flipped, passes 1..3 the next bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def live_length(lens_ptr, active_ptr, row, sel_width, HAS_ACTIVE: tl.constexpr):
    """Device length of ``row``: ``min(row_len, sel_width, active[0])``, at least 0, as int32
    (clamped in the lengths' own dtype first, so an int64 length past ``2**31`` is not wrapped)."""
    n = tl.load(lens_ptr + row)
    n = tl.minimum(tl.maximum(n, 0), sel_width)
    if HAS_ACTIVE:
        a = tl.load(active_ptr)
        n = tl.minimum(n, tl.maximum(a, 0))
    return n.to(tl.int32)


@triton.jit
def sortable_key(x, NAN_LOW: tl.constexpr):
    """int32 key of a float32 tensor, ordered as the floats (signed compare). A negative NaN's key
    lies below ``-inf``'s; ``NAN_LOW`` also sends positive NaNs (any caller's scores) there, at the
    cost of a compare per key. The scorer writes NaN scores as negative NaNs, so keys of its
    scores need no check."""
    b = x.to(tl.int32, bitcast=True)
    key = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    if NAN_LOW:
        key = tl.where(x != x, -2147483648, key)
    return key


@triton.jit
def radix_digit(key, PASS: tl.constexpr):
    """8-bit digit of ``key`` for radix pass ``PASS`` (0 = most significant), unsigned order."""
    if PASS == 0:
        d = ((key >> 24) & 0xFF) ^ 0x80
    else:
        d = (key >> (24 - 8 * PASS)) & 0xFF
    return d


@triton.jit
def pick_digit(h, need):
    """Digit ``d`` of a 256-bin histogram where the ``need``-th largest falls; returns (d, need left in d)."""
    return pick_bin(h, need, 256)


@triton.jit
def pick_bin(h, need, NBINS: tl.constexpr):
    """Bin ``d`` of an ``NBINS`` histogram holding the ``need``-th largest; returns (d, need left in d)."""
    idx = tl.arange(0, NBINS)
    incl = tl.cumsum(h, 0)
    total = tl.sum(h, 0)
    ge = total - incl + h
    d = tl.max(tl.where(ge >= need, idx, -1), 0)
    gt = tl.sum(tl.where(idx > d, h, 0), 0)
    return d, need - gt


@triton.jit
def lanes_where(flag, lanes):
    """Scalar ``flag`` broadcast to the shape of ``lanes`` (int1): masks that mix both (interpreter-safe)."""
    return (lanes * 0 + flag.to(tl.int32)) != 0


@triton.jit
def chunk_tiles(n, K: tl.constexpr, BLK: tl.constexpr, chunk, chunks):
    """Tile range ``[t0, t1)`` of this chunk over a row of ``n`` live scores (empty when n <= K)."""
    n_tiles = tl.where(n > K, tl.cdiv(n, BLK), 0)
    per = tl.cdiv(n_tiles, chunks)
    t0 = chunk * per
    t1 = tl.minimum(t0 + per, n_tiles)
    return t0, t1


@triton.jit
def load_tile(x_row, t, t1, n, BLK: tl.constexpr):
    """Scores of tile ``t`` (``-inf`` past ``n``; nothing read when ``t >= t1``) and their positions."""
    pos = t * BLK + tl.arange(0, BLK)
    x = tl.load(x_row + pos, mask=(pos < n) & lanes_where(t < t1, pos), other=float("-inf"))
    return x, pos


@triton.jit
def radix_hist(key, valid, prefix, PASS: tl.constexpr):
    """256-bin histogram of digit ``PASS`` over ``valid`` keys whose higher digits equal ``prefix``."""
    if PASS == 0:
        match = valid
    else:
        match = valid & ((key >> (32 - 8 * PASS)) == prefix)
    d = tl.where(match, radix_digit(key, PASS), 0)
    miss = tl.sum(tl.where(match, 0, 1), 0)
    return tl.histogram(d, 256) - tl.where(tl.arange(0, 256) == 0, miss, 0)


@triton.jit
def next_prefix(prefix, d, PASS: tl.constexpr):
    """Signed key prefix after digit ``d`` of pass ``PASS`` (the full key after pass 3)."""
    if PASS == 0:
        return d - 128
    else:
        return prefix * 256 + d
