"""Coordinate transforms of sequence lengths, on Python ints, CPU tensors and device tensors.

Host values may be Python ints or numpy arrays (computed in int64 whatever their dtype, so no
length near ``2**31`` wraps), device values tensors (their dtype kept; the formulas never form a
value past the largest length, so int32 lengths up to ``2**31 - 1`` are exact).

Coordinates: *tokens* (uncompressed, what the scheduler counts) vs *compressed rows*
(``tokens // ratio``); *per request* vs *per decode token* (MTP / spec decode); *global* vs
*DCP-local* (this rank's share). A decode row's kernel length is
``localize(compress(expand(request_len)))``. Every transform is monotone non-decreasing, so a
host bound on request lengths maps to a bound on every kernel row. No function here reads a
device tensor on the host.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

from . import checks
from .checks import host_int

Lengths = TypeVar("Lengths", int, np.ndarray, torch.Tensor)


def _host64(lengths: Lengths) -> Lengths:
    """Host lengths in int64 (Python ints and tensors as they are); anything but integer lengths
    is a ``TypeError`` naming ``lengths``."""
    if isinstance(lengths, np.ndarray):
        if lengths.dtype.kind not in "iu":
            raise TypeError(f"lengths: must hold integers, got a numpy array of {lengths.dtype}")
        return lengths.astype(np.int64, copy=False)
    if isinstance(lengths, torch.Tensor):
        return checks.int_tensor("lengths", lengths, allow_meta=True)
    return host_int("lengths", lengths)


def _compress(lengths: Lengths, ratio: int) -> Lengths:
    return lengths if ratio == 1 else lengths // ratio


def _compress_ceil(lengths: Lengths, ratio: int) -> Lengths:
    return lengths if ratio == 1 else lengths // ratio + (lengths % ratio != 0)


def _localize(lengths: Lengths, world_size: int, rank: int, interleave: int) -> Lengths:
    if world_size == 1:
        return lengths
    if interleave == 1:  # tokens g < L with g % W == rank: L // W, plus one when L % W > rank
        return lengths // world_size + (lengths % world_size > rank)  # a bool adds in L's dtype
    span = interleave * world_size
    base = (lengths // span) * interleave
    rem = lengths % span - rank * interleave
    if isinstance(rem, torch.Tensor):
        return base + rem.clamp(0, interleave)
    if isinstance(rem, np.ndarray):
        return base + np.clip(rem, 0, interleave)
    return base + min(max(rem, 0), interleave)


def compress(lengths: Lengths, ratio: int) -> Lengths:
    """Tokens -> compressed rows: ``floor(len / ratio)``."""
    return _compress(_host64(lengths), host_int("ratio", ratio, low=1))


def compress_ceil(lengths: Lengths, ratio: int) -> Lengths:
    """Tokens -> compressed rows, rounded up: ``ceil(len / ratio)`` (a bound, not a row length)."""
    return _compress_ceil(_host64(lengths), host_int("ratio", ratio, low=1))


def check_dcp(world_size: int, rank: int, interleave: int) -> None:
    """Refuse a DCP world, rank or interleave that cannot exist."""
    world_size = host_int("world_size", world_size)
    rank = host_int("rank", rank)
    interleave = host_int("interleave", interleave)
    if world_size < 1 or not 0 <= rank < world_size or interleave < 1:
        raise ValueError(
            f"dcp: need world_size >= 1, 0 <= rank < world_size, interleave >= 1; "
            f"got world_size={world_size}, rank={rank}, interleave={interleave}"
        )


def dcp_localize(lengths: Lengths, world_size: int, rank: int, interleave: int = 1) -> Lengths:
    """Global lengths -> this rank's local lengths under DCP.

    Token ``g`` lives on rank ``(g // I) % W``; the local length is
    ``(L // (I*W)) * I + clamp(L % (I*W) - rank*I, 0, I)``. Lengths are ``>= 0``.
    """
    check_dcp(world_size, rank, interleave)
    return _localize(_host64(lengths), int(world_size), int(rank), int(interleave))


def kernel_lengths(lengths: Lengths, ratio: int, world_size: int = 1, rank: int = 0,
                   interleave: int = 1) -> Lengths:
    """Per-token lengths in tokens -> kernel rows (compress, then localize)."""
    return dcp_localize(compress(lengths, ratio), world_size, rank, interleave)


def layout_kernel_lengths(layout, lengths: Lengths) -> Lengths:
    """``kernel_lengths`` with the ratio and DCP placement of an ``IndexerLayout`` (checked when the
    layout was made), on int64 host lengths, a Python int or an integer tensor."""
    return _localize(_compress(lengths, layout.compress_ratio), layout.dcp_world_size,
                     layout.dcp_rank, layout.cp_interleave)


def layout_localize(layout, rows: Lengths) -> Lengths:
    """``dcp_localize`` with an ``IndexerLayout``'s DCP placement, on checked rows."""
    return _localize(rows, layout.dcp_world_size, layout.dcp_rank, layout.cp_interleave)


def token_request_index(query_start_loc: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Request index of each of ``num_rows`` flattened decode tokens (int64, on the input's device).

    Tokens at or past ``query_start_loc[-1]`` get the index ``len(query_start_loc) - 1``
    (one past the last request), which callers treat as padding.
    """
    checks.int_tensor("query_start_loc", query_start_loc, allow_meta=True)
    num_rows = host_int("num_rows", num_rows, low=0)
    tokens = torch.arange(num_rows, device=query_start_loc.device, dtype=query_start_loc.dtype)
    return torch.searchsorted(query_start_loc[1:].contiguous(), tokens, right=True)


def expand_per_token(seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Per-request lengths (tokens) -> per-decode-token causal lengths ``L - q + 1 + j``.

    ``seq_lens`` counts this step's query tokens; ``query_start_loc`` is the prefix sum of the
    query lengths (``n + 1`` entries). Returns ``num_rows`` int32 lengths; rows past the last
    token, and negative lengths, are 0. Sync-free on device tensors.
    """
    checks.int_tensor("seq_lens", seq_lens, allow_meta=True)
    checks.int_tensor("query_start_loc", query_start_loc, allow_meta=True)
    num_rows = host_int("num_rows", num_rows, low=0)
    num_reqs = query_start_loc.shape[0] - 1
    if num_reqs <= 0 or seq_lens.shape[0] == 0:
        return torch.zeros(num_rows, dtype=torch.int32, device=seq_lens.device)
    qsl = query_start_loc.long()
    req = token_request_index(qsl, num_rows)
    live = req < num_reqs
    req_safe = req.clamp_max(num_reqs - 1)
    start = qsl[req_safe]
    q_len = qsl[req_safe + 1] - start
    j = torch.arange(num_rows, device=seq_lens.device) - start
    lens = seq_lens.long()[req_safe] - q_len + 1 + j
    lens = torch.where(live, lens.clamp_min(0), torch.zeros_like(lens))
    return lens.to(torch.int32)


def per_token_lengths_host(seq_lens: list[int], query_lens: list[int]) -> list[int]:
    """Host twin of :func:`expand_per_token` over Python lists (for bounds and tests)."""
    out: list[int] = []
    for length, q in zip(seq_lens, query_lens):
        out.extend(max(length - q + 1 + j, 0) for j in range(q))
    return out
