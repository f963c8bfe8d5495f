"""Where the fused step's time goes: the step cut short after each stage, CUDA-graph replays.

    python benchmarks/fused_profile.py [--shapes 1x4096,8x65536] [--config fused_warps=4,...]

Stops (outputs invalid, for timing only): 1 scoring, 2 + the four radix passes and their
barriers; full = counts, the last barrier and the writes too. Prints one JSON line per shape.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from indexer import DEV, L2_BYTES, PAGE, TOPK, WIDE, Inputs, parse_config, timeit  # noqa: E402

from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace  # noqa: E402


def profile_shape(B: int, L: int, config) -> dict:
    """Times of the fused step stopped after each stage, at one shape."""
    from vllm_sparse_sync.kernels.triton_fused import launch_fused_step

    copies = max(2, min(128, math.ceil(L2_BYTES / (B * L * 132))))
    inp = Inputs(B, L, copies)
    ws = IndexerTopkWorkspace(B, TOPK, WIDE, DEV, config=config)
    plan = ws.fused_plan(B, PAGE)
    out = torch.empty(B, TOPK, dtype=torch.int32, device=DEV)
    res = dict(B=B, L=L, plan=plan)
    for stop in (1, 2, 0):
        res[f"stop{stop}_us" if stop else "full_us"] = timeit(
            lambda i, s=stop: lambda: launch_fused_step(
                *inp.args(i), None, out, ws, k=TOPK, page=PAGE, sel_width=L, plan=plan, stop=s),
            max(12, copies))
    res["stalls"] = int(ws.fused_stall.item())
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x4096,1x65536,1x131072,8x65536")
    ap.add_argument("--config", default="")
    a = ap.parse_args()
    config = parse_config(a.config)
    for shape in a.shapes.split(","):
        B, L = (int(x) for x in shape.split("x"))
        res = dict(config=a.config, **profile_shape(B, L, config))
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items()}),
              flush=True)
        torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
