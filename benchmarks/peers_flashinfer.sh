#!/usr/bin/env bash
# Fetch FlashInfer's native top-k (include/flashinfer/topk.cuh, the four headers it includes, and
# math.cuh, which it uses without including) from the flashinfer-python wheel into .peers_fi/
# (git-ignored), beside our extern "C" wrapper (benchmarks/flashinfer_topk_peer.cu).
# Where this host has nvcc (NVCC, or on PATH), it also builds the wrapper for sm_$FLASHINFER_ARCH
# (default 90a) into .peers_fi/libfi_topk.sm_<arch>.so (about 3 MB, the CUDA runtime linked
# statically, stamped with the sources' sha256), so the GPU host needs no compile; else
# benchmarks/indexer.py compiles it there on first use (a minute or two). It times FlashInfer's
# ragged top-k (offsets 0: plain indices) beside ours. The wheel itself (about 100 MB,
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
if [ -n "${NVCC:-}" ] || command -v nvcc > /dev/null; then
  python3 benchmarks/indexer.py --build-flashinfer "${FLASHINFER_ARCH:-90a}" \
    || echo "warning: no prebuilt library: benchmarks/indexer.py will compile FlashInfer's top-k on the GPU host" >&2
else
  echo "no nvcc here: benchmarks/indexer.py will compile FlashInfer's top-k on the GPU host"
fi
ls -la .peers_fi
