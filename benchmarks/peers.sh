#!/usr/bin/env bash
# Fetch the peer kernels that benchmarks/indexer.py times beside ours, from the vLLM 0.33.0
# wheel (no vLLM install needed on the GPU host): DeepGEMM's paged MQA logits (vendored by
# vLLM) into .peers/peers.tgz, and vLLM's top-k ops (_C_stable_libtorch) into
# .peers_topk/cstable.xz, its device code for GPUs other than sm_90 zeroed (trim_fatbin.py) and
# its symbol table stripped: 16 MB instead of 64. Both folders are git-ignored and fit one device
# transfer together (about 26 MB).
# Run on a machine with network access, from the repository root.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps "vllm==0.33.0" --dest "$tmp"
wheel=$(ls "$tmp"/vllm-0.33.0-*.whl)
mkdir -p .peers .peers_topk "$tmp/unpacked"
unzip -q -o "$wheel" 'vllm/third_party/deep_gemm/*' 'vllm/_C_stable_libtorch.abi3.so' -d "$tmp/unpacked"
tar -C "$tmp/unpacked" -czf .peers/peers.tgz vllm/third_party
so="$tmp/unpacked/vllm/_C_stable_libtorch.abi3.so"
python3 tools/trim_fatbin.py "$so" "$tmp/trimmed.so" --keep 90
strip --strip-unneeded "$tmp/trimmed.so"
xz -T0 -9 -c "$tmp/trimmed.so" > .peers_topk/cstable.xz
ls -la .peers .peers_topk
