"""Time fixed kernel configurations of the scorer and the top-k at a few shapes; pick defaults.

    python benchmarks/variants.py [--shapes 64x65536,1x131072] [--best best.json]

Each variant also checks its step output (rows 0..1) against its own dense logits. ``--best``
writes the fastest precise scorer and top-k (summed over shapes) as a config
that ``indexer.py --config-file`` reads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from indexer import DEV, L2_BYTES, PAGE, TOPK, Inputs, timeit, unfused_splits  # noqa: E402

from vllm_sparse_sync.kernels.config import DEFAULT_CONFIG  # noqa: E402
from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace  # noqa: E402

# variants as "family.field" -> value over the defaults
SCORER = [{}, {"scorer.precise": False}, {"scorer.stages": 2}, {"scorer.stages": 3}, {"scorer.stages": 6},
          {"scorer.ctas_per_sm": 2}, {"scorer.ctas_per_sm": 8}, {"scorer.warps": 8}, {"scorer.tile": 128}]
TOPKS = [{}, {"topk.algo": "radix"}, {"topk.algo": "sample"},
         {"topk.algo": "sample", "topk.resolve_warps": 16},
         {"topk.algo": "sample", "topk.resolve_block": 4096, "topk.resolve_warps": 16},
         {"topk.algo": "sample", "topk.sample_above": 4096}, {"topk.algo": "sample", "topk.ctas_per_sm": 8}]


def run_variant(inp, kind: str, v: dict, ncalls: int) -> dict:
    """Time one configuration on one shape; check its step output."""
    from vllm_sparse_sync.kernels import triton_ops as tk
    from vllm_sparse_sync.kernels.triton_scorer import launch_score
    from vllm_sparse_sync.kernels.verify import topk_violations

    B, L = inp.B, inp.L
    cfg = DEFAULT_CONFIG.with_values(**v)
    ws = IndexerTopkWorkspace(B, TOPK, L, DEV, config=cfg)
    out = torch.empty(B, TOPK, dtype=torch.int32, device=DEV)
    res = dict(B=B, L=L, kind=kind, variant=v)
    try:
        dense = tk.paged_indexer_logits(*inp.args(0), L, config=cfg)
        if kind == "scorer":
            res["us"] = timeit(lambda i: lambda: launch_score(
                *inp.args(i), None, ws.logits, page_size=PAGE, sel_width=L, fill_width=0,
                splits=unfused_splits(B, L, cfg), config=cfg.scorer), ncalls)
            res["tbs"] = B * L * 132 / (res["us"] * 1e-6) / 1e12
        else:
            copies = [dense] + [dense.clone() for _ in range(max(1, min(ncalls, 8)) - 1)]
            tws = IndexerTopkWorkspace(B, TOPK, 0, DEV, config=cfg)
            res["topk_us"] = timeit(lambda i: lambda: tk.topk_indices(
                copies[i % len(copies)], inp.lens, TOPK, workspace=tws, out=out), ncalls)
        res["step_us"] = timeit(lambda i: lambda: tk.indexer_topk(
            *inp.args(i), TOPK, width=L, workspace=ws, out=out), ncalls)
        got = tk.indexer_topk(*inp.args(0), TOPK, width=L, workspace=ws)
        bad = topk_violations(got[:2], dense[:2], inp.lens[:2], TOPK, tol=1e-3)
        res["check"] = "ok" if not bad else bad[0]
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return res


def pick_best(results: list[dict]) -> dict:
    """Fastest precise scorer and fastest top-k (times summed over shapes)."""
    def total(kind, key, v):
        rs = [r for r in results if r["kind"] == kind and r["variant"] == v]
        if any(key not in r or r.get("check") != "ok" for r in rs):
            return float("inf")
        return sum(r[key] for r in rs)

    scorer = min((v for v in SCORER if v.get("scorer.precise", True)), key=lambda v: total("scorer", "us", v))
    topk = min(TOPKS, key=lambda v: total("topk", "topk_us", v))
    return DEFAULT_CONFIG.with_values(**scorer, **topk).to_dict()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="64x65536,8x65536,1x131072,1x4096")
    ap.add_argument("--best", default="")
    ap.add_argument("--scorer", default="", help="JSON list of scorer variants (replaces the built-in list)")
    ap.add_argument("--topk", default="", help="JSON list of top-k variants (replaces the built-in list)")
    a = ap.parse_args()
    scorer_variants = json.loads(a.scorer) if a.scorer else SCORER
    topk_variants = json.loads(a.topk) if a.topk else TOPKS
    results = []
    for shape in a.shapes.split(","):
        B, L = (int(x) for x in shape.split("x"))
        copies = max(2, min(128, math.ceil(L2_BYTES / (B * L * 132))))
        inp = Inputs(B, L, copies)
        for kind, variants in (("scorer", scorer_variants), ("topk", topk_variants)):
            for v in variants:
                res = run_variant(inp, kind, v, max(12, copies))
                results.append(res)
                print(json.dumps({k: (round(x, 2) if isinstance(x, float) else x) for k, x in res.items()}),
                      flush=True)
        del inp
        torch.cuda.empty_cache()
    if a.best:
        best = pick_best(results)
        print("best:", json.dumps(best), flush=True)
        json.dump(best, open(a.best, "w"))


if __name__ == "__main__":
    main()
