"""Pure-torch emulation of ``topk.cu``: the same digit passes, early exit, tie rule and
output order, so the CPU tests pin down what the CUDA kernel must output (element for element,
not only the set). See the comment at the top of ``topk.cu``.

The output of a row of n > k live scores is its selection in ascending position order: every
position whose key is above the k-th largest key, and the lowest positions among the keys equal
to it, as many as k needs. The order depends on the set alone, so every route and every early
exit writes the same row.

The kernel's storage modes (registers, shared-memory candidates, the row again) change where
keys are read from, never the result; ``mode`` reports which one a row would take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..reference import effective_lengths

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
    out[:] = torch.cat([above, ties]).sort().values.to(torch.int32)
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


RANGE_PAD = 4
"""words of shared memory after each thread's range of keys in the cluster route"""


def thread_range(length: int, threads: int) -> int:
    """Keys per thread in the cluster route's collect over a chunk of ``length`` keys: thread t
    owns chunk positions ``[t * per, t * per + per)``; ``per`` is a multiple of 8 (at least 8)."""
    return max(8, (-(-length // threads) + 7) & ~7)


def range_slot(p: int, per: int) -> int:
    """The shared-memory word of chunk position ``p``: ``RANGE_PAD`` words after each thread's
    range, so a warp's 16-byte reads of its ranges fall in distinct banks."""
    return p + RANGE_PAD * (p // per)


REG_GROUPS = 4
"""16-byte groups of keys each thread loads beside the live length (``CLUSTER_UNROLL`` in the
source): a row of at most ``4 * REG_GROUPS * threads`` live keys runs from registers"""


def in_registers(n: int, threads: int) -> bool:
    """Whether a row of ``n`` live keys runs from registers on the first CTA of a launch of
    ``threads`` per CTA. Every thread loads positions ``j * 4 * threads + 4 * t + c``; a row of
    at most ``16 * SHORT_ACT`` keys (512 in the source) runs on the first ``SHORT_ACT`` threads,
    which take the others' keys over shared memory. The output does not depend on either
    layout: each scans its 4-key slices in position order."""
    return n <= 4 * REG_GROUPS * threads


WIDE_SPLIT_KEYS = 8 * 8192
"""a 16-CTA cluster splits only a row of more than this many live keys; a shorter one runs on its
first 8 CTAs as a cluster of 8 would (``WIDE_SPLIT_KEYS`` in the source)"""


def split_ctas(n: int, cluster: int) -> int:
    """The CTAs a cluster of ``cluster`` splits a row of ``n`` live keys over (when it splits)."""
    return 8 if cluster == 16 and n <= WIDE_SPLIT_KEYS else cluster


def chunks_in_registers(n: int, cluster: int, cap: int, threads: int = 1024) -> bool:
    """Whether a row of ``n`` live keys that a cluster splits (not ``runs_solo``) runs from
    registers on every CTA: a 1024-thread launch whose chunks (``cluster_chunks``) hold at most
    ``4 * REG_GROUPS * threads`` keys each. Chunks start at multiples of 4, so their 4-key slices
    are the row's."""
    if threads != 1024 or runs_solo(n, cluster, cap, threads):
        return False
    return max(length for _, length in cluster_chunks(n, split_ctas(n, cluster))) <= 4 * REG_GROUPS * threads


def runs_solo(n: int, cluster: int, cap: int, threads: int = 1024) -> bool:
    """Whether the cluster route runs a row of ``n`` live keys on one CTA's code."""
    return cluster == 1 or in_registers(n, threads) or n <= min(SOLO_MAX, cap)


SOLO_MAX = 16384
"""rows of at most this many live keys (that fit one CTA's keys) run on the cluster's first CTA alone"""
TIE_MAX = 32
"""a level whose bin holds at most this many keys (more than needed) is resolved from a list"""


def cluster_split(n: int, cluster: int, cap: int, threads: int = 1024) -> list[tuple[int, int]]:
    """The cluster route's chunks of a row of ``n`` live keys: one chunk on the first CTA when
    the row is short (``in_registers``, or ``n <= SOLO_MAX`` and ``n <= cap``), else
    ``cluster_chunks`` over ``split_ctas`` CTAs (the rest empty)."""
    if cluster > 1 and runs_solo(n, cluster, cap, threads):
        return [(0, n)] + [(n, 0)] * (cluster - 1)
    split = split_ctas(n, cluster)
    return cluster_chunks(n, split) + [(n, 0)] * (cluster - split)


SOLO_TIE_MAX = 128
"""the same for a row on one CTA (whose pass A has 4096 bins)"""
SOLO_EXP_LO = 113
"""the lowest biased exponent of ``solo_bin``'s window of 32 binary octaves: |x| from 2^-14 to 2^18"""


def solo_bin(u: torch.Tensor) -> torch.Tensor:
    """The one-CTA pass-A bin of order keys ``u`` (int64): 2048 bins per sign, 64 per binary
    octave of |x| from 2^-14 to 2^18; each sign's first and last bins (the edges) also hold the
    magnitudes below and above that window.
    Non-decreasing in ``u``; bin b holds the keys ``solo_bin_keys(b)``."""
    s = u >> 17
    pos = s >= 0x4000
    base = torch.where(pos, 0x4000 + SOLO_EXP_LO * 64, 0x3800 - SOLO_EXP_LO * 64)
    return (s - base).clamp(0, 2047) + pos.long() * 2048


def solo_bin_keys(b: int) -> tuple[int, int]:
    """The order keys ``[lo, hi]`` of ``solo_bin``'s bin ``b``."""
    pos, j = b >= 2048, b & 2047
    base = 0x4000 + SOLO_EXP_LO * 64 if pos else 0x3800 - SOLO_EXP_LO * 64
    s_lo = (0x4000 if pos else 0) if j == 0 else base + j
    s_hi = (0x7FFF if pos else 0x3FFF) if j == 2047 else base + j
    return s_lo << 17, (s_hi << 17) | 0x1FFFF


@dataclass(frozen=True)
class ClusterRowPlan:
    """The cluster route's level for one row of more than k live keys: the keys ``[lo, hi]`` of
    the k-th key's bin (those above ``hi`` are selected)."""

    lo: int
    hi: int
    need: int
    count: int
    """keys in the level's bin"""
    listed: bool
    """the bin's keys are resolved from a list (at most ``TIE_MAX``, or ``SOLO_TIE_MAX`` on one
    CTA, and more than ``need``)"""
    passes: int
    """refine passes after pass A"""

    @property
    def bits(self) -> int:
        """the leading key bits the bin's keys share (32: one key value)"""
        return 32 - (self.lo ^ self.hi).bit_length()


def plan_cluster_row(u: torch.Tensor, k: int, *, solo: bool = False) -> ClusterRowPlan:
    """The kernel's passes on the order keys ``u`` of a row on a cluster (pass A: 2048 bins of
    ``u >> 21``) or on one CTA (``solo``: 4096 bins of ``solo_bin``); then passes of at most 11 of
    the bits that vary in the bin's keys, until the bin is taken whole, holds at most the list's
    size, or one key value."""
    if solo:
        b, need, cnt = _find_bin(torch.bincount(solo_bin(u), minlength=4096), k)
        lo, hi = solo_bin_keys(b)
    else:
        b, need, cnt = _find_bin(torch.bincount(u >> 21, minlength=2048), k)
        lo, hi = b << 21, (b << 21) | 0x1FFFFF
    tie_max = SOLO_TIE_MAX if solo else TIE_MAX
    passes = 0
    while cnt != need and cnt > tie_max and lo != hi:
        sh = (lo ^ hi).bit_length()
        bits = min(11, sh)
        dsh = sh - bits
        sel = u[(u >= lo) & (u <= hi)]
        d, need, cnt = _find_bin(torch.bincount((sel >> dsh) & ((1 << bits) - 1), minlength=1 << bits), need)
        dlo = ((lo >> sh) << sh) | (d << dsh)
        lo, hi = max(lo, dlo), min(hi, dlo | ((1 << dsh) - 1))
        passes += 1
    assert passes <= (3 if solo else 2)
    return ClusterRowPlan(lo, hi, need, cnt, cnt != need and cnt <= tie_max, passes)


def cluster_topk_row(x: torch.Tensor, k: int, cluster: int, *, threads: int = 1024,
                     nan_low: bool = True, cap: int = 1 << 30) -> torch.Tensor:
    """The cluster route's output row for the live scores ``x``, built the way the kernel builds
    it: per-chunk histograms summed (``plan_cluster_row``; one CTA's bins for a row that runs
    solo), passes until the k-th key's bin is taken whole, resolved, or small enough to list; each
    thread counts the keys above the bin (A) and in it (T) in its range; an exclusive scan over
    (CTA, thread) in position order gives the counts before it; a listed bin's keys are ranked by
    (key, position), and ``taken[j]`` says whether
    the bin's j-th key in position order is selected (else the first ``need`` are). A key of A or
    a taken key of T goes to ``ra + tb`` (A keys and taken T keys before it). A row held in
    registers (``in_registers``, or ``chunks_in_registers`` on every CTA) scans its 4-key slices
    in (group, thread) order, chunk by chunk, which is position order, and counts the bin's
    selected keys (listed, or a single value's first ``need``) with A. Equal to ``topk_row``
    (the specification)."""
    n = x.numel()
    out = _short_or_empty_row(n, k)
    if n <= k:
        return out
    u = order_keys(x, nan_low)
    chunks = cluster_split(n, cluster, cap, threads)
    assert sum(length for _, length in chunks) == n
    solo = runs_solo(n, cluster, cap, threads)
    assert chunks[0] == (0, n) or not solo
    plan = plan_cluster_row(u, k, solo=solo)
    above = (u > plan.hi).tolist()
    tie = ((u >= plan.lo) & (u <= plan.hi)).tolist()
    tie_pos = [p for p in range(n) if tie[p]]
    regs = in_registers(n, threads) or chunks_in_registers(n, cluster, cap, threads)
    if plan.listed:  # the ranking: key descending, then position ascending
        ranked = sorted(tie_pos, key=lambda p: (-int(u[p]), p))
        chosen = set(ranked[: plan.need])
        taken = [p in chosen for p in tie_pos]
    else:
        taken = [j < plan.need for j in range(len(tie_pos))]
    if regs:  # the selection closes at the last chosen key: the chosen keys count with A
        chosen = {p for p, t in zip(tie_pos, taken) if t}
        above = [a or p in chosen for p, a in enumerate(above)]
        tie = [False] * n
        tie_pos, taken = [], []
    taken_before = [0]
    for t in taken:
        taken_before.append(taken_before[-1] + int(t))
    out.fill_(-7)
    if regs:  # (group, thread): 4-key slices in position order
        ranges = [(p, min(p + 4, n)) for p in range(0, n, 4)]
    else:
        ranges = []
        for lo, length in chunks:
            per = thread_range(length, threads)
            ranges += [(lo + min(t * per, length), lo + min(t * per + per, length)) for t in range(threads)]
    ra = rt = 0  # the exclusive scan, range by range
    for r_lo, r_hi in ranges:
        a, q, tb = ra, rt, taken_before[rt]
        for p in range(r_lo, r_hi):
            if above[p]:
                out[a + tb] = p
                a += 1
            elif tie[p]:
                if taken[q]:
                    out[a + tb] = p
                    tb += 1
                q += 1
        ra, rt = a, q
    assert ra == k - taken_before[-1] and rt == len(tie_pos)
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
    from ...dcp import global_to_local

    lidx = global_to_local(gidx, world, rank, interleave)
    return gidx, lidx, lidx >= 0
