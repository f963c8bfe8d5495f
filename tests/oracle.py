"""Independent brute-force twins of the length transforms, for tests only."""

from __future__ import annotations

import numpy as np


def local_count(length: int, world: int, rank: int, interleave: int) -> int:
    """How many of positions ``0..length-1`` rank ``rank`` owns (token g -> rank (g // I) % W)."""
    if length <= 0:
        return 0
    g = np.arange(length)
    return int(((g // interleave) % world == rank).sum())


def kernel_row_len(tokens: int, ratio: int, world: int, rank: int, interleave: int) -> int:
    """Kernel-row length of a decode token whose causal length is ``tokens``."""
    return local_count(max(tokens, 0) // ratio, world, rank, interleave)


def rows_of_batch(seq_lens, query_lens, ratio=1, world=1, rank=0, interleave=1) -> list[int]:
    """Per-decode-token kernel lengths of a batch, one token at a time."""
    rows = []
    for length, q in zip(seq_lens, query_lens):
        for j in range(q):
            rows.append(kernel_row_len(length - q + 1 + j, ratio, world, rank, interleave))
    return rows
