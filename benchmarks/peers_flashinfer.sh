#!/usr/bin/env bash
# Fetch FlashInfer's native top-k (include/flashinfer/topk.cuh, the four headers it includes, and
# math.cuh, which it uses without including) from the flashinfer-python wheel into .peers_fi/
# (git-ignored), beside our extern "C" wrapper (benchmarks/flashinfer_topk_peer.cu).
# benchmarks/indexer.py compiles the wrapper with the GPU host's nvcc on first use and times
# FlashInfer's ragged top-k (offsets 0: plain indices) beside ours. The wheel itself (about 100 MB,
# with a JIT chain of tvm-ffi and cutlass-dsl) does not fit a device transfer; these headers do
# (about 40 KB compressed). FlashInfer's CUB backend (its bundled CCCL) is not built: the timed
# paths are its filtered and multi-CTA radix kernels, chosen by its own dispatch heuristic.
# Run from the repository root on a machine with network access.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude=$(git rev-parse --git-path info/exclude)  # (a fresh clone may lack .git/info/)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.peers_fi/' "$exclude" 2>/dev/null || echo '/.peers_fi/' >> "$exclude"
version=${FLASHINFER_VERSION:-0.7.4}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps "flashinfer-python==$version" --dest "$tmp"
wheel=$(ls "$tmp"/flashinfer_python-*.whl)
rm -rf .peers_fi && mkdir -p .peers_fi
for h in topk.cuh topk_common.cuh utils.cuh vec_dtypes.cuh exception.h math.cuh; do
  unzip -q -o "$wheel" "flashinfer/data/include/flashinfer/$h" -d "$tmp/x"
done
tar -C "$tmp/x/flashinfer/data/include" -cJf .peers_fi/include.tar.xz flashinfer
echo "flashinfer-python==$version" > .peers_fi/VERSION
ls -la .peers_fi
