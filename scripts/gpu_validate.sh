#!/usr/bin/env bash
# One GPU session's validation, logs under $OUT (or ./gpu_logs):
#   1. prebuild (the NVRTC cubin cache), then the GPU suite under xdist with the harness report
#      (GPU_WORKERS, default 12: 444 tests in about 6.5 minutes on one H100);
#   2. compute-sanitizer (memcheck, racecheck, synccheck) over the CUDA top-k, scorer and DCP merge
#      tests (HYPOTHESIS_PROFILE=quick: 3 examples a property); API errors are not reported:
#      cuda-bindings probes driver entry points this driver lacks (cuGetProcAddress, "invalid
#      argument"), which is no kernel's fault;
#   3. the audit and the selftest on the GPU;
#   4. the indexer benchmark of record, and with BEFORE=DIR (a checkout of an earlier commit, e.g.
#      `git worktree add /tmp/before <commit>`) the same benchmark and host_overhead.py run there
#      first and again after, in one process group: before / after / before, each --rounds 3;
#   5. on two GPUs, the DCP tests and benchmark.
# The whole script takes longer than one 10-minute device call: split it there (suite; sanitizers,
# audit, selftest; benchmarks). The decode loop (benchmarks/decode_loop.py, about 6 minutes) runs on its own.
# Usage: [BEFORE=/tmp/before] bash scripts/gpu_validate.sh [benchmark-name]   (from the repository root;
# copy the benchmark JSON from $OUT into benchmarks/results/ afterwards)
set -uo pipefail
out=${OUT:-gpu_logs}; mkdir -p "$out"
name=${1:-h200_validate}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
python3 -m vllm_sparse_sync.cli prebuild 2>&1 | tail -4
python3 -m pytest -n ${GPU_WORKERS:-12} -m gpu -p vllm_sparse_sync.testing.plugin -q --ignore=tests/test_dcp_gpu.py \
  --sync-report "$out/sync_report.json" 2>&1 | tee "$out/pytest_gpu.log" | tail -25
for tool in memcheck racecheck synccheck; do
  HYPOTHESIS_PROFILE=quick compute-sanitizer --tool $tool --report-api-errors no --target-processes all --error-exitcode 9 \
    python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/test_cuda_topk_gpu.py tests/test_cuda_scorer_gpu.py \
    tests/test_cuda_dcp_merge_gpu.py tests/test_topk_adversarial_gpu.py -k "not device_side_assertions" \
    > "$out/sanitizer_$tool.log" 2>&1
  echo "compute-sanitizer $tool: exit $?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$out/sanitizer_$tool.log" | tail -3
done
python3 -m vllm_sparse_sync.cli audit --json "$out/audit.json" 2>&1 | tee "$out/audit.log" | tail -3
python3 -m vllm_sparse_sync.cli selftest 2>&1 | tee "$out/selftest.log" | tail -20
if [ -n "${BEFORE:-}" ]; then
  for side in before after before2; do
    dir=$PWD; [ "$side" = after ] || dir=$BEFORE
    (cd "$dir" && PYTHONPATH=$dir python3 benchmarks/indexer.py --topk-algos '' --rounds 3 \
      --out "$out/${name}_$side.json" > "$out/bench_$side.log" 2>&1) && echo "indexer $side: ok"
    (cd "$dir" && PYTHONPATH=$dir python3 benchmarks/host_overhead.py --device cuda \
      --out "$out/host_$side.json" > "$out/host_$side.log" 2>&1) && echo "host overhead $side: ok"
  done
  python3 -c "import json, sys; sys.path.insert(0, 'benchmarks'); import indexer
print(indexer.compare(json.load(open(sys.argv[1]))['shapes'], sys.argv[2]))" \
    "$out/${name}_after.json" "$out/${name}_before.json"
else
  python3 benchmarks/indexer.py --topk-algos '' --rounds 3 --out "$out/$name.json" 2>&1 | tee "$out/bench.log" | tail -30
fi
python3 tools/dcp_merge_check.py --out "$out/dcp_merge_check.json" 2>&1 | tail -9
# two GPUs or more: DCP over NCCL (skips with its reason on one GPU)
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  python3 -m pytest -q -p vllm_sparse_sync.testing.plugin tests/test_dcp_gpu.py 2>&1 | tail -5
  python3 benchmarks/dcp.py --world 2 --out "$out/dcp_w2.json" 2>&1 | tail -9
fi
