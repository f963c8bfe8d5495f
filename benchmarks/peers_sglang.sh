#!/usr/bin/env bash
# Fetch SGLang's decode top-k (`fast_topk`, sgl-kernel's csrc/elementwise/topk.cu) as a compiled
# sm_90a cubin into .peers_sgl/ (git-ignored). The sgl-kernel wheel (about 540 MB, a torch
# extension built for one torch version) does not fit a device transfer and its extension would
# not load on the GPU host's torch; the one cubin that holds the top-k kernels (about 240 KB)
# does. benchmarks/indexer.py loads it with the CUDA driver and times `topk_kernel` (one CTA per
# row, k 2048) on the buffers vLLM's top-k gets. Needs pip, unzip and a cuobjdump (CUOBJDUMP, or
# the one Triton's wheel carries). Run from the repository root on a machine with network access.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude=$(git rev-parse --git-path info/exclude)  # (a fresh clone may lack .git/info/)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.peers_sgl/' "$exclude" 2>/dev/null || echo '/.peers_sgl/' >> "$exclude"
version=${SGL_KERNEL_VERSION:-0.3.21}
cuobjdump=${CUOBJDUMP:-$(python3 -c 'import os, triton; print(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"))')}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "downloading sgl-kernel==$version (about 540 MB) ..."
python3 -m pip download --quiet --no-deps "sgl-kernel==$version" --dest "$tmp"
wheel=$(ls "$tmp"/sgl_kernel-*.whl)
unzip -q -o "$wheel" 'sgl_kernel/sm90/common_ops.abi3.so' -d "$tmp/x"
mkdir -p "$tmp/cubins"
(cd "$tmp/cubins" && "$cuobjdump" -xelf all "$tmp/x/sgl_kernel/sm90/common_ops.abi3.so" > /dev/null)
symbol=""
for f in "$tmp"/cubins/*sm_90a.cubin; do
  s=$("$cuobjdump" -symbols "$f" 2>/dev/null | grep -o '_Z[A-Za-z0-9_]*11topk_kernelENS_14FastTopKParamsE' | head -1 || true)
  if [ -n "$s" ]; then symbol=$s; cubin=$f; break; fi
done
[ -n "$symbol" ] || { echo "no sm_90a cubin with SGLang's topk_kernel in sgl-kernel $version" >&2; exit 1; }
rm -rf .peers_sgl && mkdir -p .peers_sgl
cp "$cubin" .peers_sgl/fast_topk.sm_90a.cubin
echo "$symbol" > .peers_sgl/SYMBOL
echo "sgl-kernel==$version" > .peers_sgl/VERSION
ls -la .peers_sgl
