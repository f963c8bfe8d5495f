"""Triton kernels of the DCP step around its all-gather: the send keys, and the merge + remap.

``dcp_send_keys``: one int64 candidate key per local top-k slot, written straight into the
send buffer: the local -> global map (``dcp.local_to_global``), the score (read from the
caller's ``[rows, k]`` scores, or gathered from the scorer's logits row at the local position)
and the key packing (``dcp.candidate_keys``) in one launch.

``dcp_merge``: per row, the ``world * k_local`` gathered keys (padded to a power of two with
``dcp.PAD_KEY``); eight 8-bit radix passes (``tl.histogram``) find the k-th largest key, and the
keys above it, then its first copies in gathered order, are the exact global top-k, written in
the gathered order. Their ids (``dcp.key_ids``), this rank's local positions
(``dcp.global_to_local``) and the mask ``local_idx >= 0`` go to the caller's buffers in the same
launch (``dcp.merge_candidate_keys`` + remap in one kernel). A row's keys live in one program's
registers: rows of more than ``MAX_MERGE_KEYS`` keys (world 4 or more with k 2048) are not
handled here; the caller takes the torch path for them (``merge_fits``).

Both write exactly what the torch ops write, element for element: the same selection rule and
order, and elementwise steps with the torch ops' integer arithmetic (int64 wrap-around, int32
truncation where they cast). One program per row, static shapes, no host reads: capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import sortable_key

MAX_MERGE_KEYS = 4096
"""Most gathered keys per row (``world * k_local``, padded to a power of two) one merge program
holds in registers; above it ``merge_fits`` is False and the torch merge runs instead."""

SEND_BLOCK = 1024


@triton.jit
def _pad_key(like):
    """``dcp.PAD_KEY`` (``-2**63``) broadcast to ``like``'s shape, as int64."""
    return (like.to(tl.int64) * 0 + 1) << 63


@triton.jit
def _low32(like):
    """``0xFFFFFFFF`` as int64, in ``like``'s shape (no unsigned constant in the arithmetic)."""
    return tl.full(like.shape, 0xFFFFFFFF, tl.int64)


@triton.jit(do_not_specialize=["k", "idx_stride", "score_stride"])
def dcp_send_keys_kernel(idx_ptr, idx_stride, score_ptr, score_stride, send_ptr, k,
                         W: tl.constexpr, IL: tl.constexpr, RANK: tl.constexpr,
                         GATHER: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``program_id(0)``, slots ``program_id(1) * BLOCK ...``: ``send[row * k + j]``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < k
    lp_raw = tl.load(idx_ptr + row * idx_stride + cols, mask=m, other=-1)
    lp = lp_raw.to(tl.int64)
    # dcp.local_to_global: int64 arithmetic, then the input's dtype (int32 truncates)
    g = (lp // IL) * (W * IL) + RANK * IL + lp % IL
    g = tl.where(lp >= 0, g, -1).to(lp_raw.dtype).to(tl.int64)
    if GATHER:  # the scorer's logits row, at the local position
        s = tl.load(score_ptr + row * score_stride + tl.maximum(lp, 0), mask=m & (lp >= 0),
                    other=float("-inf"))
    else:
        s = tl.load(score_ptr + row * score_stride + cols, mask=m, other=float("-inf"))
    # dcp.candidate_keys
    key = (sortable_key(s, True).to(tl.int64) << 32) + (_low32(g) - tl.maximum(g, 0))
    key = tl.where(g >= 0, key, _pad_key(key))
    tl.store(send_ptr + row * k + cols, key, mask=m)


@triton.jit(do_not_specialize=["world_stride", "row_stride", "out_stride"])
def dcp_merge_kernel(keys_ptr, world_stride, row_stride, gidx_ptr, lidx_ptr, mask_ptr, out_stride,
                     K: tl.constexpr, K_LOCAL: tl.constexpr, W: tl.constexpr, IL: tl.constexpr,
                     RANK: tl.constexpr, N: tl.constexpr):
    """Row ``program_id(0)``: select the ``K`` largest of its ``W * K_LOCAL`` keys (``N``: a power
    of two) by eight 8-bit radix passes, then write them in the gathered order."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, N)
    valid = offs < W * K_LOCAL
    src = (offs // K_LOCAL).to(tl.int64) * world_stride + row * row_stride + offs % K_LOCAL
    key = tl.load(keys_ptr + tl.where(valid, src, 0), mask=valid, other=0)
    pad = _pad_key(key)
    key = tl.where(valid, key, pad)
    # the take-th largest key (take = min(K, W * K_LOCAL)), its digits from the top: unsigned order
    # of key ^ 2**63 is the signed order of key
    u = key ^ pad
    bins = tl.arange(0, 512)
    take = min(K, W * K_LOCAL)
    need = tl.full((), take, tl.int32)
    alive = valid
    for p in tl.static_range(8):
        digit = ((u >> (56 - 8 * p)) & 255).to(tl.int32)
        hist = tl.histogram(tl.where(alive, digit, 256), 512)  # bin 256 collects the others
        hist = tl.where(bins < 256, hist, 0)
        at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # alive keys with digit >= bin
        d = tl.max(tl.where((at_least >= need) & (bins < 256), bins, -1), axis=0)
        above_d = tl.sum(tl.where(bins == d, at_least - hist, 0), axis=0)
        need = need - above_d
        alive = alive & (digit == d)
    kth = tl.max(tl.where(alive, key, pad), axis=0)
    above = valid & (key > kth)
    tie = valid & (key == kth)
    tie_rank = tl.cumsum(tie.to(tl.int32), axis=0)
    sel = (above | (tie & (tie_rank <= need))) & (key != pad)
    pos = tl.cumsum(sel.to(tl.int32), axis=0) - 1
    count = tl.sum(sel.to(tl.int32), axis=0)
    # dcp.key_ids
    ids = (_low32(key) - (key & _low32(key))).to(tl.int32)
    # dcp.global_to_local on the int32 ids
    g = ids.to(tl.int64)
    owned = (g >= 0) & ((g // IL) % W == RANK)
    lp = (g // (IL * W)) * IL + g % IL
    local = tl.where(owned, lp, -1).to(tl.int32)
    out = row * out_stride + pos
    tl.store(gidx_ptr + out, ids, mask=sel)
    tl.store(lidx_ptr + out, local, mask=sel)
    tl.store(mask_ptr + out, (local >= 0).to(tl.uint8), mask=sel)
    rest = (offs >= count) & (offs < K)  # -1 padding after the selected ids
    tail = row * out_stride + offs
    tl.store(gidx_ptr + tail, tl.full((N,), -1, tl.int32), mask=rest)
    tl.store(lidx_ptr + tail, tl.full((N,), -1, tl.int32), mask=rest)
    tl.store(mask_ptr + tail, tl.zeros((N,), tl.uint8), mask=rest)


def merge_width(world: int, k_local: int, k: int) -> int:
    """Keys one merge program holds: ``max(world * k_local, k)`` up to a power of two."""
    return triton.next_power_of_2(max(world * k_local, k))


def merge_fits(world: int, k_local: int, k: int) -> bool:
    """Whether ``dcp_merge`` takes rows of ``world * k_local`` keys (at most ``MAX_MERGE_KEYS``)."""
    return merge_width(world, k_local, k) <= MAX_MERGE_KEYS


def _warps(n: int) -> int:
    return 4 if n <= 1024 else 8 if n <= 4096 else 16


def dcp_send_keys(local_idx: torch.Tensor, scores: torch.Tensor, send: torch.Tensor, *, world: int,
                  rank: int, interleave: int, gather: bool) -> torch.Tensor:
    """Candidate keys of ``local_idx`` (int32/int64 ``[rows, k]``, ``-1`` padding) into ``send``
    (int64, ``rows * k`` contiguous); equal to ``dcp.candidate_keys(scores_of_slots,
    dcp.local_to_global(local_idx, ...))``. Scores: ``[rows, k]`` per slot, or with ``gather``
    a ``[rows, >= width]`` logits buffer read at each slot's local position (slots with
    ``-1`` read nothing). Row strides are taken as given; columns must be contiguous."""
    rows, k = local_idx.shape
    if rows == 0:
        return send
    if local_idx.stride(1) != 1 or scores.stride(1) != 1 or not send.is_contiguous():
        raise ValueError("dcp_send_keys: local_idx/scores columns and send must be contiguous")
    if send.numel() != rows * k or send.dtype != torch.int64:
        raise ValueError(f"dcp_send_keys: send must be int64 of {rows * k} keys, got "
                         f"{send.dtype} {tuple(send.shape)}")
    block = min(SEND_BLOCK, triton.next_power_of_2(k))
    grid = (rows, triton.cdiv(k, block))
    dcp_send_keys_kernel[grid](local_idx, local_idx.stride(0), scores, scores.stride(0), send, k,
                               W=world, IL=interleave, RANK=rank, GATHER=bool(gather), BLOCK=block,
                               num_warps=4)
    return send


def dcp_merge(gathered: torch.Tensor, k: int, global_idx: torch.Tensor, local_idx: torch.Tensor,
              local_mask: torch.Tensor, *, world: int, rank: int, interleave: int) -> None:
    """Merge + remap of gathered keys ``int64 [world, rows, k_local]`` into the caller's
    ``[rows, k]`` buffers (``global_idx`` / ``local_idx`` int32, ``local_mask`` bool), equal to
    ``dcp.merge_candidate_keys`` then ``dcp.global_to_local`` then ``>= 0``. Requires
    ``merge_fits(world, k_local, k)``."""
    from ...dcp import check_merge_buffers

    rows, k_local = check_merge_buffers("dcp_merge", gathered, world, k, global_idx, local_idx, local_mask)
    if not merge_fits(world, k_local, k):
        raise ValueError(f"dcp_merge: {world} x {k_local} keys per row exceed MAX_MERGE_KEYS="
                         f"{MAX_MERGE_KEYS} (take the torch merge)")
    if rows == 0:
        return
    n = merge_width(world, k_local, k)
    dcp_merge_kernel[(rows,)](gathered, gathered.stride(0), gathered.stride(1), global_idx,
                              local_idx, local_mask.view(torch.uint8), global_idx.stride(0),
                              K=k, K_LOCAL=k_local, W=world, IL=interleave, RANK=rank, N=n,
                              num_warps=_warps(n))
