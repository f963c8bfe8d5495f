"""Run 192 (benchmarks/NOTES.md, session 33): one plain launch of the library's cluster top-k on
64x64K indexer logits, after two warm-ups, for ncu. From the repository root:

    ncu --clock-control none -k regex:topk_cluster --launch-skip 2 --launch-count 1 \
        --page source --csv --print-source sass --section SourceCounters \
        python3 benchmarks/results/run192_ncu_topk.py
"""
import os
import sys

import torch

sys.path.insert(0, "benchmarks")
from cuda_topk_phases import indexer_logits  # noqa: E402

from vllm_sparse_sync.kernels.cuda_topk import launch_cuda_topk_cluster  # noqa: E402

B, L = int(os.environ.get("B", "64")), int(os.environ.get("L", "65536"))
x = indexer_logits(B, L, L, 0)
lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
out = torch.empty(B, 2048, dtype=torch.int32, device="cuda")
for _ in range(3):
    launch_cuda_topk_cluster(x, x.stride(0), lens, None, out, 2048, L, pdl=False)
torch.cuda.synchronize()
print("ok", out[0, :4].tolist())
