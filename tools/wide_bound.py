"""Where one row's step goes under a wide host bound, on one GPU: the whole step at the row's own
bound, at the 128K bound and with an active width (each twice, interleaved), and each part alone:
the CUDA and Triton scorers at each bound, the top-k's exact plan and the wide bound's cluster.

    python tools/wide_bound.py [--lengths 4096,16384] [--out PATH]

Inputs as ``indexer.py``'s, ``--copies`` of them rotated (16 by default: L2-resident at these
sizes; ``indexer.py`` rotates past L2, so its times read higher). Medians of CUDA-graph replays,
us. Prints a table and writes JSON (default ``$OUT/wide_bound.json``, else ``/tmp``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_root, os.path.join(_root, "benchmarks"), os.path.join(_root, "tools")]  # package, helpers

COLUMNS = ("step_exact", "step_wide_host", "step_wide_active", "scorer_cuda_exact", "scorer_cuda_wide_active",
           "scorer_triton_exact", "topk_exact", "topk_wide_c8_host", "topk_wide_c8_active")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="one row's step under a wide host bound, part by part")
    ap.add_argument("--lengths", default="4096,16384", help="the row's live lengths, comma-separated")
    ap.add_argument("--copies", type=int, default=16, help="input copies rotated (one per graph call)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    try:
        a.lengths = [int(x) for x in a.lengths.split(",")]
    except ValueError:
        ap.error(f"--lengths: comma-separated ints, got {a.lengths!r}")
    if any(n < 1 or n > 131072 for n in a.lengths) or a.copies < 1:
        ap.error("--lengths: each in [1, 131072]; --copies: at least 1")
    return a


def table(rows: list[dict]) -> str:
    """One line per length: each column's fastest repeat (``NAME`` or ``NAME_0``, ``NAME_1``)."""
    def best(r, c):
        v = [r[k] for k in (c, f"{c}_0", f"{c}_1") if k in r]
        return f"{min(v):.2f}" if v else "-"
    lines = ["| L | " + " | ".join(COLUMNS) + " |", "|---:|" + "---:|" * len(COLUMNS)]
    lines += [f"| {r['L']} | " + " | ".join(best(r, c) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def measure(L: int, copies: int) -> dict:
    import indexer as ix
    import torch

    from vllm_sparse_sync.kernels import ops as tk
    from vllm_sparse_sync.kernels.config import DEFAULT_CONFIG
    from vllm_sparse_sync.kernels.cuda.topk import launch_cuda_topk_cluster
    from vllm_sparse_sync.kernels.launch import launch_scorer
    from vllm_sparse_sync.kernels.planner import Route
    from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace

    B, n = 1, copies
    inp = ix.Inputs(B, L, n)
    cfg = DEFAULT_CONFIG
    ws = IndexerTopkWorkspace(ix.SERVING_ROWS, ix.TOPK, ix.WIDE, "cuda", config=cfg)
    out = torch.empty(B, ix.TOPK, dtype=torch.int32, device="cuda")
    act = torch.tensor([L], dtype=torch.int32, device="cuda")
    r = {"L": L, "copies": copies, "route_exact": str(ws.plan_call(B, L, ix.PAGE)),
         "route_wide": str(ws.plan_call(B, ix.WIDE, ix.PAGE))}

    def T(f):
        return ix.timeit(f, n)

    def step(width, a):
        wide = width == ix.WIDE
        return lambda i: lambda: tk.indexer_topk(*inp.args(i, wide), ix.TOPK, active_width=a, width=width,
                                                 workspace=ws, out=out)

    logits = ws.logits

    def scorer(width, a, kind):
        wide, splits = width == ix.WIDE, ix.unfused_splits(B, width, kind)
        route = Route("scorer", B, score_splits=splits, scorer=kind)
        return lambda i: lambda: launch_scorer(route, *inp.args(i, wide), a, logits, page=ix.PAGE, width=width,
                                               precise=cfg.precise, pdl=cfg.pdl)

    tk.indexer_topk(*inp.args(0, True), ix.TOPK, width=ix.WIDE, workspace=ws, out=out)  # row 0's logits

    def topk(width, a, cluster, threads=None):
        return lambda i: lambda: launch_cuda_topk_cluster(logits, logits.stride(0), inp.lens, a, out,
                                                          ix.TOPK, width, nan_low=False, cluster=cluster,
                                                          threads=threads)

    for rep in range(2):  # interleaved repeats
        r[f"step_exact_{rep}"] = T(step(L, None))
        r[f"step_wide_host_{rep}"] = T(step(ix.WIDE, None))
        r[f"step_wide_active_{rep}"] = T(step(ix.WIDE, act))
        r[f"step_exact_active_{rep}"] = T(step(L, act))
    for kind in ("cuda", "triton"):
        r[f"scorer_{kind}_exact"] = T(scorer(L, None, kind))
        r[f"scorer_{kind}_wide_host"] = T(scorer(ix.WIDE, None, kind))
        r[f"scorer_{kind}_wide_active"] = T(scorer(ix.WIDE, act, kind))
    r["topk_exact"] = T(topk(L, None, None))
    r["topk_exact_active"] = T(topk(L, act, None))
    r["topk_wide_c8_host"] = T(topk(ix.WIDE, None, 8))
    r["topk_wide_c8_active"] = T(topk(ix.WIDE, act, 8))
    r["topk_wide_c1_1024"] = T(topk(ix.WIDE, None, 1, 1024))
    return r


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("error: tools/wide_bound.py times CUDA kernels and needs a CUDA device")
    rows = []
    for L in a.lengths:
        rows.append(measure(L, a.copies))
        print(f"L={L} done", file=sys.stderr, flush=True)
    print(table(rows))
    path = a.out or os.path.join(os.environ.get("OUT", "/tmp"), "wide_bound.json")
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
