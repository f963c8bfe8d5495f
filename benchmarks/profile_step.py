"""One eager decode step (B=64, L=64K, k=2048) between cudaProfilerStart/Stop, for Nsight Compute.

    ncu --profile-from-start off --section SpeedOfLight ... python benchmarks/profile_step.py

Runs the exact (fp16-dot) scorer, the fp8-dot scorer, then the five top-k launches.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from indexer import DEV, TOPK, Inputs  # noqa: E402

from vllm_sparse_sync.kernels import triton_ops as tk  # noqa: E402
from vllm_sparse_sync.kernels.config import DEFAULT_CONFIG  # noqa: E402
from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace  # noqa: E402


def main() -> None:
    B, L = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "64x65536").split("x"))
    inp = Inputs(B, L, 1)
    cfg8 = DEFAULT_CONFIG.with_values(**{"scorer.precise": False})
    ws = IndexerTopkWorkspace(B, TOPK, L, DEV)
    logits = tk.paged_indexer_logits(*inp.args(0), L)
    logits8 = tk.paged_indexer_logits(*inp.args(0), L, config=cfg8)
    tk.topk_indices(logits, inp.lens, TOPK, workspace=ws)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    tk.paged_indexer_logits(*inp.args(0), L, out=logits)
    tk.paged_indexer_logits(*inp.args(0), L, out=logits8, config=cfg8)
    tk.topk_indices(logits, inp.lens, TOPK, workspace=ws)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
