#!/usr/bin/env bash
# One GPU session's validation, logs under $OUT (or ./gpu_logs): GPU tests under xdist with the
# harness report, the audit and the selftest on the GPU, then the indexer benchmark and the DCP
# merge check, and on two GPUs the DCP tests and benchmark. The decode loop
# (benchmarks/decode_loop.py, about 6 minutes) runs on its own.
# Usage: bash scripts/gpu_validate.sh [benchmark-name]   (run from the repository root; copy the
# benchmark JSON from $OUT into benchmarks/results/ afterwards)
set -uo pipefail
out=${OUT:-gpu_logs}; mkdir -p "$out"
name=${1:-h200_validate}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
python3 -m pytest -n 2 -m gpu -p vllm_sparse_sync.testing.plugin -q --ignore=tests/test_dcp_gpu.py --sync-report "$out/sync_report.json" \
  2>&1 | tee "$out/pytest_gpu.log" | tail -25
python3 -m vllm_sparse_sync.cli audit --json "$out/audit.json" 2>&1 | tee "$out/audit.log"
python3 -m vllm_sparse_sync.cli selftest 2>&1 | tee "$out/selftest.log" | tail -40
python3 benchmarks/indexer.py --topk-algos radix,sample,cuda_radix --out "$out/$name.json" \
  2>&1 | tee "$out/bench.log" | tail -30
python3 tools/dcp_merge_check.py --out "$out/dcp_merge_check.json" 2>&1 | tail -9
# two GPUs or more (nvidia-h200-x2): DCP over NCCL (skips with its reason on one GPU)
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  python3 -m pytest -q -p vllm_sparse_sync.testing.plugin tests/test_dcp_gpu.py 2>&1 | tail -5
  python3 benchmarks/dcp.py --world 2 --out "$out/dcp_w2.json" 2>&1 | tail -9
fi
