"""Decode context parallelism: local/global position maps and the exact top-k candidate merge.

Token ``g`` lives on rank ``(g // I) % W`` at local position ``(g // (I*W)) * I + g % I``
(world ``W``, interleave ``I``). Each rank selects a local top-k with scores; the global top-k
is the top-k of the ``W * k`` gathered candidates, exact because every global winner is in its
owner's local top-k. All functions are device-side tensor ops with no host reads.
"""

from __future__ import annotations

import torch

from . import checks
from .lengths import check_dcp


def local_to_global(local_pos: torch.Tensor, world_size: int, rank: int,
                    interleave: int = 1) -> torch.Tensor:
    """Rank-local positions -> global positions; ``-1`` (padding) stays ``-1``."""
    checks.int_tensor("local_pos", local_pos, allow_meta=True)
    check_dcp(world_size, rank, interleave)
    lp = local_pos.long()
    g = (lp // interleave) * (world_size * interleave) + rank * interleave + lp % interleave
    return torch.where(lp >= 0, g, torch.full_like(g, -1)).to(local_pos.dtype)


def global_to_local(global_pos: torch.Tensor, world_size: int, rank: int,
                    interleave: int = 1) -> torch.Tensor:
    """Global positions -> this rank's local positions; ``-1`` where the rank does not own them."""
    checks.int_tensor("global_pos", global_pos, allow_meta=True)
    check_dcp(world_size, rank, interleave)
    gp = global_pos.long()
    owned = (gp >= 0) & ((gp // interleave) % world_size == rank)
    lp = (gp // (interleave * world_size)) * interleave + gp % interleave
    return torch.where(owned, lp, torch.full_like(lp, -1)).to(global_pos.dtype)


PAD_KEY = -(2**63)
"""Candidate key of a padding slot (``-1`` id): below the key of every real candidate."""

_LOW32 = 0xFFFFFFFF


def candidate_keys(scores: torch.Tensor, global_ids: torch.Tensor) -> torch.Tensor:
    """One int64 key per candidate that orders as (score descending, global id ascending).

    High 32 bits: the score's sortable int32 key (``reference.sortable_keys``: NaN below every
    number, ``-0.0`` below ``+0.0``, as the top-k kernels order scores); low 32 bits:
    ``2**32 - 1 - id``, so among equal scores the lowest global id has the largest key. Ids
    ``< 0`` are padding and get ``PAD_KEY``, below every real key (ids must be ``< 2**31``).
    The key carries the id, so one int64 tensor is all the all-gather moves. Device ops only.
    """
    from .kernels.reference import sortable_keys

    checks.tensor("scores", scores, allow_meta=True)
    checks.int_tensor("global_ids", global_ids, allow_meta=True)
    if scores.dtype != torch.float32:
        raise ValueError(f"scores: must be float32, got {scores.dtype}")
    if scores.shape != global_ids.shape:
        raise ValueError(f"scores/global_ids: shapes differ, {tuple(scores.shape)} vs "
                         f"{tuple(global_ids.shape)}")
    ids = global_ids.long()
    key = (sortable_keys(scores).long() << 32) + (_LOW32 - ids.clamp_min(0))
    return torch.where(ids >= 0, key, torch.full_like(key, PAD_KEY))


def key_ids(keys: torch.Tensor) -> torch.Tensor:
    """Global ids of candidate keys (int32; ``-1`` for padding)."""
    checks.int_tensor("keys", keys, (torch.int64,), allow_meta=True)
    ids = _LOW32 - (keys & _LOW32)
    return torch.where(keys != PAD_KEY, ids, torch.full_like(ids, -1)).to(torch.int32)


def check_merge_buffers(who: str, gathered: torch.Tensor, world: int, k: int, global_idx: torch.Tensor,
                        local_idx: torch.Tensor, local_mask: torch.Tensor) -> tuple[int, int]:
    """The merge kernels' argument checks: ``gathered`` int64 ``[world, rows, k_local]`` with
    contiguous columns; the outputs ``[rows, k]`` int32 / int32 / bool on its device, with
    contiguous columns and one row stride. Returns ``(rows, k_local)``; raises ``ValueError``
    naming ``who`` and the field."""
    if not isinstance(gathered, torch.Tensor) or gathered.dim() != 3:
        raise ValueError(f"{who}: gathered must be a 3-D tensor [world, rows, k_local]")
    w, rows, k_local = gathered.shape
    if w != world or gathered.dtype != torch.int64 or gathered.stride(2) != 1:
        raise ValueError(f"{who}: gathered must be int64 [world={world}, rows, k_local] with "
                         f"contiguous columns, got {gathered.dtype} {tuple(gathered.shape)}")
    for name, t, dt in (("global_idx", global_idx, torch.int32), ("local_idx", local_idx, torch.int32),
                        ("local_mask", local_mask, torch.bool)):
        if t.shape != (rows, k) or t.dtype != dt or t.stride(1) != 1 or t.device != gathered.device:
            raise ValueError(f"{who}: {name} must be {dt} [{rows}, {k}] with contiguous columns on "
                             f"{gathered.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if not (global_idx.stride(0) == local_idx.stride(0) == local_mask.stride(0)):
        raise ValueError(f"{who}: the output buffers' row strides differ")
    return rows, k_local


def merge_candidate_keys(keys: torch.Tensor, k: int) -> torch.Tensor:
    """Exact global top-``k`` of gathered candidate keys ``int64 [world, rows, k_local]``.

    Returns ``int32 [rows, k]`` global ids of the ``k`` largest keys of each row (a key equal to
    the k-th largest taken first where it comes first in the gathered order), in the gathered
    order (rank, then slot), then ``-1`` padding (padding keys are never ids). Static shapes, no
    host reads: capturable. Exact because every winner of the global top-k is in the local
    top-k of the rank that owns it, and the keys of real candidates are unique per row.
    """
    checks.tensor("keys", keys, allow_meta=True)
    if keys.dim() != 3 or keys.dtype != torch.int64:
        raise ValueError(f"keys: must be int64 [world, rows, k_local], got {keys.dtype} "
                         f"{tuple(keys.shape)}")
    k = checks.host_int("k", k, low=1)
    world, rows, k_local = keys.shape
    n = world * k_local
    flat = keys.permute(1, 0, 2).reshape(rows, n)
    take = min(k, n)
    if take == 0:
        return torch.full((rows, k), -1, dtype=torch.int32, device=keys.device)
    kth = torch.topk(flat, take, dim=1, largest=True, sorted=False).values.min(dim=1, keepdim=True).values
    above = flat > kth
    tie = flat == kth
    need = take - above.sum(dim=1, keepdim=True)
    sel = (above | (tie & (tie.cumsum(dim=1) <= need))) & (flat != PAD_KEY)
    # output slot j takes the (j + 1)-th selected key in gathered order
    rank = sel.cumsum(dim=1)
    slots = torch.arange(1, k + 1, device=keys.device).expand(rows, k).contiguous()
    src = torch.searchsorted(rank, slots).clamp_max(n - 1)
    ids = key_ids(flat).gather(1, src)
    return torch.where(slots <= rank[:, -1:], ids, torch.full_like(ids, -1))


def merge_topk_candidates(scores: torch.Tensor, global_ids: torch.Tensor, k: int) -> torch.Tensor:
    """Exact global top-``k`` from gathered per-rank candidates.

    ``scores`` fp32 and ``global_ids`` int ``[world, rows, k_local]`` (``-1`` ids are padding).
    Returns ``int32 [rows, k]``: the global ids of the ``k`` best candidates (scores in the
    kernels' order: NaN lowest; ties to the lowest global id) in the gathered order (rank, then
    slot), ``-1`` padded.
    """
    checks.tensor("scores", scores, allow_meta=True)
    checks.tensor("global_ids", global_ids, allow_meta=True)
    if scores.shape != global_ids.shape or scores.dim() != 3:
        raise ValueError(
            f"scores/global_ids: must both be [world, rows, k_local], got {tuple(scores.shape)} "
            f"and {tuple(global_ids.shape)}"
        )
    k = checks.host_int("k", k, low=1)
    return merge_candidate_keys(candidate_keys(scores, global_ids), k)
