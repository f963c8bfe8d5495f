"""Pure-torch emulation of ``cuda_topk.cu``: the same digit passes, early exit, tie rule and
collection order, so the CPU tests pin down what the CUDA kernel must output (element for
element, not only the set). See the comment at the top of ``cuda_topk.cu``.

The kernel's storage modes (registers, shared-memory candidates, the row again) change where
keys are read from, never the result; ``mode`` reports which one a row would take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .reference import effective_lengths

PASSES = ((21, 11), (10, 11), (0, 10))
"""(shift, bits) of the digit of each pass: bits 31..21, 20..10, 9..0."""


def order_keys(x: torch.Tensor, nan_low: bool = True) -> torch.Tensor:
    """uint32 order keys as int64: ``bits | 2^31`` for positive floats, ``~bits`` for negative ones;
    NaN -> 0 when ``nan_low``."""
    bits = x.float().contiguous().view(torch.int32).long() & 0xFFFFFFFF
    neg = (bits & 0x80000000) != 0
    u = torch.where(neg, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    if nan_low:
        u = torch.where((bits & 0x7FFFFFFF) > 0x7F800000, torch.zeros_like(u), u)
    return u


def _find_bin(hist: torch.Tensor, need: int) -> tuple[int, int, int]:
    """(bin, need left in it, its count) of the need-th largest, counting from the top bin."""
    rev = hist.flip(0)
    incl = rev.cumsum(0)
    i = int(torch.searchsorted(incl, torch.tensor(need, dtype=incl.dtype)))  # first incl >= need
    before = int(incl[i - 1]) if i > 0 else 0
    b = hist.numel() - 1 - i
    return b, need - before, int(hist[b])


@dataclass(frozen=True)
class RowPlan:
    """How the kernel resolves one row of more than k live keys."""

    prefix: int
    bits: int
    """resolved top bits: 11, 22 or 32"""
    need: int
    """ties taken, lowest positions first"""
    mode: str
    """"registers", "candidates" or "global" (where the refinement reads keys), or "none" (early exit)"""


def plan_row(u: torch.Tensor, k: int, *, tile: int = 16384, cap: int = 8192) -> RowPlan:
    """The kernel's passes on the order keys ``u`` (int64, length n > k)."""
    n = u.numel()
    assert n > k >= 1
    b, need, cnt = _find_bin(torch.bincount(u >> 21, minlength=2048), k)
    prefix, bits = b, 11
    if cnt == need:
        return RowPlan(prefix, bits, need, "none")
    mode = "registers" if n <= tile else ("candidates" if cnt <= cap else "global")
    for shift, width in PASSES[1:]:
        if cnt == need:
            break
        pshift = shift + width
        sel = u[(u >> pshift) == prefix]
        hist = torch.bincount((sel >> shift) & ((1 << width) - 1), minlength=1 << width)
        d, need, cnt = _find_bin(hist, need)
        prefix = (prefix << width) | d
        bits += width
    return RowPlan(prefix, bits, need, mode)


def _short_or_empty_row(n: int, k: int) -> torch.Tensor:
    """An int32 [k] row: 0..n-1 then -1 when ``n <= k`` (a short row's output), else all -1."""
    out = torch.full((k,), -1, dtype=torch.int32)
    if n <= k:
        out[:n] = torch.arange(n, dtype=torch.int32)
    return out


def topk_row(x: torch.Tensor, k: int, *, nan_low: bool = True, tile: int = 16384,
             cap: int = 8192) -> torch.Tensor:
    """The kernel's output row (int32 [k]) for the live scores ``x`` (length n)."""
    n = x.numel()
    out = _short_or_empty_row(n, k)
    if n <= k:
        return out
    u = order_keys(x, nan_low)
    plan = plan_row(u, k, tile=tile, cap=cap)
    hi = u >> (32 - plan.bits)
    above = torch.nonzero(hi > plan.prefix).flatten()
    ties = torch.nonzero(hi == plan.prefix).flatten()[: plan.need]
    assert above.numel() == k - plan.need and ties.numel() == plan.need
    out[:] = torch.cat([above, ties]).to(torch.int32)
    return out


def topk_indices(logits: torch.Tensor, row_lens: torch.Tensor, k: int, *,
                 active_width: torch.Tensor | None = None, nan_low: bool = True,
                 tile: int = 16384, cap: int = 8192) -> torch.Tensor:
    """``int32 [rows, k]`` exactly as the CUDA kernel writes it (CPU tensors)."""
    rows, width = logits.shape
    eff = effective_lengths(row_lens, width, active_width)
    out = torch.empty(rows, k, dtype=torch.int32)
    for r, n in enumerate(eff.tolist()):
        out[r] = topk_row(logits[r, :n].cpu(), k, nan_low=nan_low, tile=tile, cap=cap)
    return out


def cluster_chunks(n: int, cluster: int) -> list[tuple[int, int]]:
    """``(first position, length)`` of each CTA's chunk of a row of ``n`` live keys in the cluster
    route: ``ceil(n / cluster)`` rounded up to 4 per CTA, the last ones shorter or empty."""
    chunk = (-(-n // cluster) + 3) & ~3
    return [(r * chunk, max(0, min(chunk, n - r * chunk))) for r in range(cluster)]


def warp_segments(length: int, warps: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each warp's segment of a chunk in the cluster route's collect: a multiple of
    128 positions per warp, the last ones shorter or empty."""
    seg = (-(-length // warps) + 127) & ~127
    return [(w * seg, min(w * seg + seg, length)) for w in range(warps)]


def cluster_topk_row(x: torch.Tensor, k: int, cluster: int, *, warps: int = 32,
                     nan_low: bool = True) -> torch.Tensor:
    """The cluster route's output row for the live scores ``x``, built the way the kernel builds
    it: per-chunk histograms summed, then each (CTA, warp) segment writing its above and tie
    keys at the counts of every earlier segment. Equal to ``topk_row`` (the specification)."""
    n = x.numel()
    out = _short_or_empty_row(n, k)
    if n <= k:
        return out
    u = order_keys(x, nan_low)
    chunks = cluster_chunks(n, cluster)
    assert sum(length for _, length in chunks) == n
    hist = sum(torch.bincount(u[lo:lo + length] >> 21, minlength=2048) for lo, length in chunks)
    assert torch.equal(hist, torch.bincount(u >> 21, minlength=2048))
    plan = plan_row(u, k)
    shift = 32 - plan.bits
    n_above = k - plan.need
    ra = rt = 0
    for lo, length in chunks:
        for s_lo, s_hi in warp_segments(length, warps):
            if s_hi <= s_lo:
                continue
            hi = u[lo + s_lo:lo + s_hi] >> shift
            above = torch.nonzero(hi > plan.prefix).flatten() + lo + s_lo
            ties = torch.nonzero(hi == plan.prefix).flatten() + lo + s_lo
            out[ra:ra + above.numel()] = above.to(torch.int32)
            take = ties[: max(0, plan.need - rt)]
            out[n_above + rt:n_above + rt + take.numel()] = take.to(torch.int32)
            ra += above.numel()
            rt += ties.numel()
    assert ra == n_above and rt >= plan.need
    return out


MERGE_DIGIT_BITS = 11
"""bits per radix pass of the DCP merge (``dcp_merge_p*``): 11 x 5, then the last 9"""


def dcp_merge_row(keys_row: torch.Tensor, k: int, *, world: int, rank: int,
                  interleave: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CUDA DCP merge of one row, built the way ``dcp_merge_p*`` builds it: ``keys_row`` is
    the row's ``int64 [world * k_local]`` gathered keys in gathered order; returns ``(global ids,
    local positions, mask)``, ``[k]`` each. Radix passes over ``key ^ 2^63`` (unsigned) that stop
    once the bin of the ``min(k, n)``-th largest holds exactly the keys still needed; then the
    keys above the prefix and the first ``need`` equal to it in gathered order, padding excluded."""
    u = [int(v) + 2**63 for v in keys_row.tolist()]  # key ^ 2^63, as an unsigned value
    n = len(u)
    take = min(k, n)
    prefix, rbits, need, cnt = 0, 0, take, -1
    while take > 0 and rbits < 64 and cnt != need:
        width = MERGE_DIGIT_BITS if rbits + MERGE_DIGIT_BITS <= 64 else 64 - rbits
        shift = 64 - rbits - width
        hist = torch.zeros(2048, dtype=torch.int64)
        for x in u:
            if rbits == 0 or x >> (64 - rbits) == prefix:
                hist[(x >> shift) & ((1 << width) - 1)] += 1
        b, need, cnt = _find_bin(hist, need)
        prefix, rbits = (prefix << width) | b, rbits + width
    ids: list[int] = []
    tie_rank = 0
    for x in u if take > 0 else []:
        hi = x >> (64 - rbits)
        taken = hi > prefix
        if hi == prefix:
            taken = tie_rank < need
            tie_rank += 1
        if taken and x != 0:  # padding (dcp.PAD_KEY) is never an id
            low = 0xFFFFFFFF - (x & 0xFFFFFFFF)
            ids.append(low - 2**32 if low >= 2**31 else low)  # int32, as the kernel casts
    gidx = torch.full((k,), -1, dtype=torch.int32)
    gidx[:len(ids)] = torch.tensor(ids, dtype=torch.int32)
    from ..dcp import global_to_local

    lidx = global_to_local(gidx, world, rank, interleave)
    return gidx, lidx, lidx >= 0
