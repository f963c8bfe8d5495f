"""Where the step's time goes beyond its two kernels: the step beside its scorer and its top-k
timed alone and together, each as the step launches it.

    python benchmarks/step_parts.py [--shapes 64x65536,32x65536,1x4096] [--rounds 3] [--json FILE]

For each shape (H=64, D=128, k=2048, the serving workspace of ``indexer.py``), CUDA-graph replays
of ``ncalls`` calls over rotated inputs, us a call:

- ``step``: ``indexer_topk`` as ``indexer.py`` times it;
- ``scorer``: the step's scorer launch alone (same splits, same logits buffer);
- ``topk``: the step's top-k launch alone, on the logits the scorer left in that buffer;
- ``pair`` / ``pair_no_pdl``: the two launches in one graph, the top-k a programmatic dependent
  launch (as in the step) or a plain one (the cluster top-k's routes only: the one-CTA kernel
  has no plain form, so ``-`` there);
- ``gap`` = step - scorer - topk: what the step costs beyond its kernels timed alone.

Each time is the median over ``--rounds`` rounds, the parts timed in a rotated order. Prints a
table; ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cold_start import require_cuda, shapes_arg  # noqa: E402  (the same ROWSxWIDTH list and its errors)

PARTS = ("step", "scorer", "topk", "pair", "pair_no_pdl")


def gap_row(B: int, L: int, times: dict[str, float]) -> dict:
    """One shape's row: its times and the step's gap over its scorer plus its top-k."""
    row = dict(B=B, L=L, **{k: round(v, 3) for k, v in times.items()})
    row["gap"] = round(times["step"] - times["scorer"] - times["topk"], 3)
    row["pair_gap"] = round(times["pair"] - times["scorer"] - times["topk"], 3)
    return row


def table(rows: list[dict]) -> str:
    cols = ("B", "L", *PARTS, "gap", "pair_gap")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---:|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "-")) for c in cols) + " |")
    return "\n".join(lines)


def measure(B: int, L: int, rounds: int) -> dict[str, float]:
    """The median time of each part over ``rounds`` rotated rounds (CUDA graphs of rotated inputs)."""
    sys.path.insert(0, HERE)
    import indexer as ix

    from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace

    copies, ncalls = ix.graph_sizes(B, L)
    inp = ix.Inputs(B, L, copies)
    ws = IndexerTopkWorkspace(max(B, ix.SERVING_ROWS), ix.TOPK, ix.WIDE, ix.DEV)
    route = ws.route(B, L, ix.PAGE)
    out = torch.empty(B, ix.TOPK, dtype=torch.int32, device=ix.DEV)
    calls = ix.step_calls(inp, ws, out)
    score, step = calls["scorer"], calls["step"]

    def select(pdl=True):
        if pdl:
            calls["topk"](0)
            return
        from vllm_sparse_sync.kernels.cuda_topk import launch_cuda_topk_cluster

        launch_cuda_topk_cluster(ws.logits, ws.logits.stride(0), inp.lens, None, out, ix.TOPK, L,
                                 nan_low=False, cluster=route.topk_cluster, cap=route.topk_cap, pdl=False)

    makers = {
        "step": lambda i: lambda: step(i),
        "scorer": lambda i: lambda: score(i),
        "topk": lambda i: lambda: select(),
        "pair": lambda i: lambda: (score(i), select()),
        "pair_no_pdl": lambda i: lambda: (score(i), select(pdl=False)),
    }
    parts = PARTS if route.topk_cluster else tuple(p for p in PARTS if p != "pair_no_pdl")
    step(0)  # the logits the top-k reads
    seen: dict[str, list[float]] = {p: [] for p in parts}
    for k in range(rounds):
        for j in range(len(parts)):
            part = parts[(k + j) % len(parts)]
            seen[part].append(ix.timeit(makers[part], ncalls))
    print(f"  {B}x{L}: route {route.kind}, scorer {route.scorer}, cluster {route.topk_cluster}, "
          f"{ncalls} calls a graph", flush=True)
    return {p: statistics.median(v) for p, v in seen.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="64x65536,32x65536,1x4096")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    shapes = shapes_arg(ap, a.shapes)
    if a.rounds < 1:
        ap.error(f"--rounds: must be >= 1, got {a.rounds}")
    require_cuda("step_parts.py")
    rows = []
    for B, L in shapes:
        rows.append(gap_row(B, L, measure(B, L, a.rounds)))
        print(json.dumps(rows[-1]), flush=True)
        if a.json:
            json.dump(rows, open(a.json, "w"), indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
