"""Synthetic decode-indexer inputs (paged fp8 K cache, page table, q, weights, lengths).

Used by tests and benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .reference import FP8_DTYPE, page_bytes


@dataclass
class IndexerCase:
    """One decode indexer step's inputs; ``block_table`` is ``[rows, table_pages]`` int32."""

    q_fp8: torch.Tensor
    weights: torch.Tensor
    k_cache: torch.Tensor
    block_table: torch.Tensor
    row_lens: torch.Tensor

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        return self.q_fp8, self.weights, self.k_cache, self.block_table, self.row_lens


def random_k_cache(num_pages: int, page: int = 64, head_dim: int = 128, *, ties: bool = False,
                   device="cpu", generator: torch.Generator | None = None) -> torch.Tensor:
    """``uint8 [num_pages, page * (head_dim + 4)]``: random e4m3 values, positive fp32 scales.

    ``ties``: values from {-0.5, 0, 0.5} and unit scales, so many scores are equal.
    """
    cache = torch.empty(num_pages, page_bytes(page, head_dim), dtype=torch.uint8, device=device)
    shape = (num_pages, page * head_dim)
    if ties:
        vals = (torch.randint(-1, 2, shape, device=device, generator=generator).float() * 0.5)
        scales = torch.ones(num_pages, page, device=device)
    else:
        vals = torch.randn(shape, device=device, generator=generator) * 0.5
        scales = torch.rand(num_pages, page, device=device, generator=generator) + 0.5
    cache[:, : page * head_dim] = vals.to(FP8_DTYPE).view(torch.uint8)
    cache[:, page * head_dim :] = scales.contiguous().view(torch.uint8).view(num_pages, page * 4)
    return cache


def make_case(
    lens: list[int],
    *,
    heads: int = 64,
    head_dim: int = 128,
    page: int = 64,
    table_pages: int | None = None,
    spare_pages: int = 3,
    num_pages: int | None = None,
    holes: bool = True,
    ties: bool = False,
    device="cpu",
    seed: int = 0,
) -> IndexerCase:
    """Rows with lengths ``lens``; each row's live pages are distinct random physical pages.

    Table entries past a row's live pages are ``-1`` (``holes``) or stale valid pages;
    ``num_pages`` fixes the cache size (default: live pages plus ``spare_pages``).
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    rows = len(lens)
    need = [(n + page - 1) // page for n in lens]
    table_pages = table_pages if table_pages is not None else max([1, *need])
    if num_pages is None:
        num_pages = max(1, sum(need)) + spare_pages
    gdev = torch.Generator(device=device).manual_seed(seed)
    k_cache = random_k_cache(num_pages, page, head_dim, ties=ties, device=device, generator=gdev)
    perm = torch.randperm(num_pages, generator=g)
    table = torch.randint(0, num_pages, (rows, table_pages), generator=g, dtype=torch.int32)
    at = 0
    for r, p in enumerate(need):
        p = min(p, table_pages)  # a row longer than the table keeps only the table's pages
        table[r, :p] = perm[at : at + p].int()
        if holes:
            table[r, p:] = -1
        at += p
    q = (torch.randn(rows, heads, head_dim, generator=g) * 0.7).to(FP8_DTYPE)
    if ties:
        q = torch.randint(-1, 2, (rows, heads, head_dim), generator=g).float().to(FP8_DTYPE)
    w = torch.randn(rows, heads, generator=g)
    return IndexerCase(
        q.to(device), w.to(device), k_cache, table.to(device),
        torch.tensor(lens, dtype=torch.int32).to(device),
    )


def shard_k_cache(k_cache: torch.Tensor, block_table: torch.Tensor, world_size: int, rank: int,
                  interleave: int = 1, *, head_dim: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """One DCP rank's share of a global paged K cache: ``(local_cache, local_block_table)``.

    ``block_table`` ``int32 [n, pages]`` maps each request's global kernel rows to pages of
    ``k_cache``; the rank keeps the rows ``g`` it owns (``(g // I) % W == rank``), in order, at
    their local positions, in fresh pages: request ``i`` gets pages ``i * P .. i * P + P - 1``.
    Rows on a page ``< 0`` (holes) are left zero. Test and benchmark data, not a hot path.
    """
    from ..dcp import local_to_global
    from ..lengths import dcp_localize
    from .reference import SCALE_BYTES, page_size_of, split_index_k_cache, write_index_k_cache

    page = page_size_of(k_cache, head_dim)
    n, pages_g = block_table.shape
    rows_g = pages_g * page
    pages_l = max(1, -(-dcp_localize(rows_g, world_size, rank, interleave) // page))
    dev = k_cache.device
    values, scales = split_index_k_cache(k_cache, head_dim)
    num_pages = k_cache.shape[0]
    g = local_to_global(torch.arange(pages_l * page, device=dev), world_size, rank, interleave)
    gsafe = g.clamp(0, rows_g - 1)
    src = block_table.to(dev).long()[:, gsafe // page]  # [n, local rows]
    ok = (g < rows_g)[None, :] & (src >= 0) & (src < num_pages)
    src = src.clamp(0, num_pages - 1)
    v = values.view(torch.uint8)[src, gsafe % page].reshape(-1, head_dim).view(FP8_DTYPE)
    s = scales[src, gsafe % page].reshape(-1)
    slots = torch.arange(n * pages_l * page, device=dev)
    slots = torch.where(ok.reshape(-1), slots, torch.full_like(slots, -1))
    local = torch.zeros(n * pages_l, page * (head_dim + SCALE_BYTES), dtype=torch.uint8, device=dev)
    write_index_k_cache(local, v.contiguous(), s.contiguous(), slots)
    table = torch.arange(n * pages_l, dtype=torch.int32, device=dev).view(n, pages_l)
    return local, table
