"""Adversarial top-k scores and lengths, shared by the CPU and GPU top-k tests: every kind of
score the kernels order by their bits (ties, NaN of both signs, infinities, signed zeros,
denormals, the largest floats, sorted runs, one outlier), and the row lengths at a top-k's
edges (0, 1, k - 1, k, k + 1, the whole width, past it, negative)."""

from __future__ import annotations

import torch

F32_MAX = torch.finfo(torch.float32).max
TINY = torch.finfo(torch.float32).smallest_normal

KINDS = ("equal", "few", "nan", "all_nan", "inf", "signed_zero", "denormal", "huge", "ascending", "descending",
         "outlier", "random")


def _bits(ints: list[int]) -> torch.Tensor:
    return torch.tensor(ints, dtype=torch.int64).to(torch.int32).view(torch.float32)


def scores(kind: str, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` float32 scores (CPU) of one adversarial ``kind``."""
    if n == 0:
        return torch.empty(0)
    u = torch.rand(n, generator=gen)
    pick = torch.randint(0, 1 << 30, (n,), generator=gen)
    if kind == "equal":
        return torch.full((n,), 1.5)
    if kind == "few":
        return torch.tensor([-1.0, 0.0, 2.5])[pick % 3]
    if kind == "nan":  # NaNs of both signs and payloads among numbers
        x = torch.randn(n, generator=gen)
        nans = _bits([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF])[pick % 4]
        return torch.where(u < 0.3, nans, x)
    if kind == "all_nan":
        return _bits([0x7FC00000, 0xFFC00000])[pick % 2]
    if kind == "inf":
        return torch.tensor([float("inf"), float("-inf"), 0.0, 1.0, -1.0])[pick % 5]
    if kind == "signed_zero":
        return torch.tensor([0.0, -0.0])[pick % 2]
    if kind == "denormal":  # the smallest magnitudes, both signs, and zeros
        mags = _bits([1, 2, 3, 0x007FFFFF, 0x00400000, 0x80000001, 0x807FFFFF, 0, 0x80000000])
        return mags[pick % mags.numel()]
    if kind == "huge":
        return torch.tensor([F32_MAX, -F32_MAX, F32_MAX / 2, 3e38, -3e38, TINY])[pick % 6]
    if kind == "ascending":
        return torch.arange(n, dtype=torch.float32)
    if kind == "descending":
        return -torch.arange(n, dtype=torch.float32)
    if kind == "outlier":
        x = torch.zeros(n)
        x[int(pick[0]) % n] = 1e30
        return x
    if kind == "random":
        return torch.randn(n, generator=gen)
    raise ValueError(f"kind: unknown {kind!r}")


def edge_lengths(k: int, width: int) -> list[int]:
    """The lengths at a top-k's edges, the longest first: the width, k + 1, past the width, k,
    k - 1, 1, 0, negative."""
    return [width, k + 1, width + 100, k, max(k - 1, 0), 1, 0, -3]


ALL_ROWS = len(KINDS) * 8
"""Rows of ``adversarial_rows`` that meet every kind at every edge length."""


def adversarial_rows(rows: int, width: int, k: int, gen: torch.Generator, *, offset: int = 0,
                     pad: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(buffer, logits, row_lens)`` on the CPU: ``logits`` is the view ``buffer[:, offset:offset +
    width]`` of a wider buffer (``offset + width + pad`` columns, the rest NaN); row ``r`` holds
    kind ``r % len(KINDS)`` and the edge length ``r // len(KINDS)`` (in ``edge_lengths``' order,
    cycling), so the first ``len(KINDS)`` rows are every kind at the full width and
    ``ALL_ROWS`` rows meet every kind at every length."""
    buf = torch.full((rows, offset + width + pad), float("nan"))
    lens = edge_lengths(k, width)
    row_lens = torch.empty(rows, dtype=torch.int32)
    for r in range(rows):
        kind = KINDS[r % len(KINDS)]
        n = lens[(r // len(KINDS)) % len(lens)]
        buf[r, offset:offset + width] = scores(kind, width, gen)
        row_lens[r] = n
    return buf, buf[:, offset:offset + width], row_lens


def sets(t: torch.Tensor) -> torch.Tensor:
    """Each row's selection as a sorted row (the contract is the set)."""
    return t.sort(dim=1).values
