"""Host-side checks of top-k outputs against scores (tests and benchmarks; they synchronize)."""

from __future__ import annotations

import torch


def topk_violations(
    idx: torch.Tensor, logits: torch.Tensor, eff_lens: torch.Tensor, k: int, *, tol: float = 0.0
) -> list[str]:
    """Why ``idx [rows, k]`` is not a valid top-k of ``logits`` over ``eff_lens``; empty when it is.

    Rows of length ``<= k`` must be exactly ``0..n-1`` then ``-1``. Longer rows must hold ``k``
    distinct positions in ``[0, n)`` whose scores, sorted, equal the ``k`` largest scores (ties
    make the positions free); with ``tol > 0`` (scores from another kernel), no selected score
    may fall below the k-th largest minus ``tol``.
    """
    bad: list[str] = []
    idx = idx.detach().cpu().long()
    logits = logits.detach().cpu().float()
    for r, n in enumerate(eff_lens.detach().cpu().long().tolist()):
        row = idx[r]
        if n <= k:
            want = torch.full((k,), -1, dtype=torch.long)
            want[:n] = torch.arange(n)
            if not torch.equal(row, want):
                bad.append(f"row {r} (len {n} <= k): got {row[: min(n + 2, k)].tolist()}...")
            continue
        if bool((row < 0).any()) or bool((row >= n).any()):
            bad.append(f"row {r}: positions out of [0, {n})")
            continue
        if row.unique().numel() != k:
            bad.append(f"row {r}: duplicate positions")
            continue
        sel = logits[r, row].sort().values
        best = torch.topk(logits[r, :n], k).values.sort().values
        if tol == 0.0:
            same = torch.equal(sel.nan_to_num(neginf=-3e38), best.nan_to_num(neginf=-3e38))
            if not same:
                bad.append(f"row {r}: selected scores differ from the top-{k} multiset")
        elif float(sel[0]) < float(best[0]) - tol:
            bad.append(f"row {r}: selected {float(sel[0])} below k-th largest {float(best[0])} - {tol}")
    return bad
