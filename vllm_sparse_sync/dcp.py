"""Decode context parallelism: local/global position maps and the exact top-k candidate merge.

Token ``g`` lives on rank ``(g // I) % W`` at local position ``(g // (I*W)) * I + g % I``
(world ``W``, interleave ``I``). Each rank selects a local top-k with scores; the global top-k
is the top-k of the ``W * k`` gathered candidates, exact because every global winner is in its
owner's local top-k. All functions are device-side tensor ops with no host reads.
"""

from __future__ import annotations

import torch

from .lengths import check_dcp


def local_to_global(local_pos: torch.Tensor, world_size: int, rank: int,
                    interleave: int = 1) -> torch.Tensor:
    """Rank-local positions -> global positions; ``-1`` (padding) stays ``-1``."""
    check_dcp(world_size, rank, interleave)
    lp = local_pos.long()
    g = (lp // interleave) * (world_size * interleave) + rank * interleave + lp % interleave
    return torch.where(lp >= 0, g, torch.full_like(g, -1)).to(local_pos.dtype)


def global_to_local(global_pos: torch.Tensor, world_size: int, rank: int,
                    interleave: int = 1) -> torch.Tensor:
    """Global positions -> this rank's local positions; ``-1`` where the rank does not own them."""
    check_dcp(world_size, rank, interleave)
    gp = global_pos.long()
    owned = (gp >= 0) & ((gp // interleave) % world_size == rank)
    lp = (gp // (interleave * world_size)) * interleave + gp % interleave
    return torch.where(owned, lp, torch.full_like(lp, -1)).to(global_pos.dtype)


def merge_topk_candidates(scores: torch.Tensor, global_ids: torch.Tensor, k: int) -> torch.Tensor:
    """Exact global top-``k`` from gathered per-rank candidates.

    ``scores`` fp32 and ``global_ids`` int ``[world, rows, k_local]`` (``-1`` ids are padding).
    Returns ``int32 [rows, k]``: score descending, ties to the lowest global id, ``-1`` padded.
    """
    if scores.shape != global_ids.shape or scores.dim() != 3:
        raise ValueError(
            f"scores/global_ids: must both be [world, rows, k_local], got {tuple(scores.shape)} "
            f"and {tuple(global_ids.shape)}"
        )
    if k <= 0:
        raise ValueError(f"k: must be > 0, got {k}")
    world, rows, k_local = scores.shape
    ids = global_ids.permute(1, 0, 2).reshape(rows, world * k_local).long()
    vals = scores.permute(1, 0, 2).reshape(rows, world * k_local).float()
    valid = ids >= 0
    vals = torch.where(valid, vals, torch.full_like(vals, float("-inf")))
    # Two stable sorts: by id ascending, then by score descending (ties keep the id order);
    # padding goes last because its id sorts past every real id.
    big = torch.iinfo(torch.int64).max
    order = torch.sort(torch.where(valid, ids, torch.full_like(ids, big)), dim=1, stable=True).indices
    vals, ids, valid = vals.gather(1, order), ids.gather(1, order), valid.gather(1, order)
    rank_key = torch.where(valid, vals, torch.full_like(vals, float("-inf")))
    order = torch.sort(rank_key, dim=1, descending=True, stable=True).indices
    ids, valid = ids.gather(1, order), valid.gather(1, order)
    # Valid candidates with -inf scores must still precede padding: move padding last.
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    ids, valid = ids.gather(1, order), valid.gather(1, order)
    out = torch.where(valid, ids, torch.full_like(ids, -1))[:, :k]
    if out.shape[1] < k:
        pad = torch.full((rows, k - out.shape[1]), -1, dtype=out.dtype, device=out.device)
        out = torch.cat([out, pad], dim=1)
    return out.to(torch.int32)
