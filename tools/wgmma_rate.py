"""The tensor pipe's rate for the scorer's wgmma forms on one GPU, with no memory traffic.

    python tools/wgmma_rate.py [--iters 2000] [--out benchmarks/results/NAME.json]

Every SM runs one CTA whose first 1, 2 or 4 warpgroups each issue a 64-token tile's MMAs over and
over against a query image in shared memory (A from registers, as ``kernels/cuda/scorer.cu``):
f16 8 x m64n64k16 (the exact path), f16 16 x m64n32k16 (heads split in two), e4m3 4 x m64n64k32
(the fp8 path) and f16 4 x m64n64k16 (half the exact path's steps), each alone and with the
scorer's relu-and-weight epilogue after the wait. Prints an SM's cycles per tile (all its
warpgroups together) and one warpgroup's, from ``clock64``, and writes JSON. Needs compute
capability 9.0 (sm_90a) and NVRTC.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_root, os.path.join(_root, "benchmarks"), os.path.join(_root, "tools")]  # package, helpers

# (kernel, N, PRECISE, k-steps): the forms timed, each one tile's MMAs
FORMS = [("f16_n64x8", 64, True, 8), ("f16_n32x16", 32, True, 16), ("e4m3_n64x4", 64, False, 4),
         ("f16_n64x4", 64, True, 4)]

MICRO = r'''
template <int N, bool P, int STEPS>
__device__ __forceinline__ void micro(int iters, int wgs, long long* out, int epi) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const int warp = threadIdx.x >> 5, wg = warp >> 2;
    for (int i = threadIdx.x; i < 16384 / 4; i += blockDim.x)
        reinterpret_cast<u32*>(smem)[i] = 0x3c003c00u * (i & 1);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (wg >= wgs) return;
    u32 a0 = threadIdx.x * 0x00010001u, a1 = a0 ^ 0x1111u, a2 = a0 ^ 0x2222u, a3 = a0 ^ 0x4444u;
    float d[N / 2];
    for (int i = 0; i < N / 2; ++i) d[i] = 0.f;
    const u32 qbase = smem_addr(smem);
    float acc = 0.f;
    long long t0 = clock64();
    for (int it = 0; it < iters; ++it) {
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < STEPS; ++j)
            Mma<N, P>::run(d, a0, a1, a2, a3, b_desc(qbase + (j % 8) * 2048), j > 0);
        wgmma_commit();
        wgmma_wait();
        fence_operands(d);
        if (epi) {
#pragma unroll
            for (int i = 0; i < N / 2; ++i) acc = fmaf(fmaxf(d[i], 0.f), 0.5f, acc);
        }
        a0 += 0x00010001u;
    }
    long long t1 = clock64();
    if ((threadIdx.x & 127) == 0) out[blockIdx.x * 4 + wg] = t1 - t0;
    if (acc == 1234.5f || d[0] == 1234.5f) out[0] = -1;
}
'''


def source() -> str:
    """The scorer's source (its wgmma wrappers) with one kernel per form appended."""
    from vllm_sparse_sync.kernels.cuda import scorer as cuda_scorer

    kernels = "".join(
        f'extern "C" __global__ void __launch_bounds__(544, 1) rate_{name}(int iters, int wgs, '
        f"long long* out, int epi) {{ micro<{n}, {'true' if p else 'false'}, {steps}>"
        f"(iters, wgs, out, epi); }}\n"
        for name, n, p, steps in FORMS)
    return cuda_scorer.source() + MICRO + kernels


def per_tile(cycles: float, iters: int, wgs: int) -> tuple[float, float]:
    """(an SM's cycles per tile, one warpgroup's) from a warpgroup's mean cycles over ``iters``."""
    return cycles / (iters * wgs), cycles / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.iters < 1:
        ap.error(f"--iters: must be >= 1, got {a.iters}")
    import torch

    if not torch.cuda.is_available():
        print("error: needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    from vllm_sparse_sync.kernels.cuda import scorer as cuda_scorer
    from vllm_sparse_sync.kernels.cuda import topk as cuda_topk

    mod = cuda_scorer.module_for(0)
    drv = mod.driver
    cubin, _ = cuda_topk.compile_source(cuda_scorer.ARCH, text=source(), name="wgmma_rate.cu")
    module = cuda_topk._check(drv.cuModuleLoadData(cubin), "cuModuleLoadData")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.zeros(sms * 4, dtype=torch.int64, device="cuda")
    rows = []
    for name, *_ in FORMS:
        fn = cuda_topk._check(drv.cuModuleGetFunction(module, f"rate_{name}".encode()), "cuModuleGetFunction")
        for epi in (0, 1):
            for wgs in (1, 2, 4):
                for _ in range(2):  # the first launch warms up; the second is read
                    out.zero_()
                    values = (ctypes.c_int(a.iters), ctypes.c_int(wgs), ctypes.c_void_p(out.data_ptr()),
                              ctypes.c_int(epi))
                    cuda_topk.launch_values(mod, fn, (sms, 1, 1), 544, 16384, values, out.device)
                    torch.cuda.synchronize()
                cycles = out.view(sms, 4)[:, :wgs].double().mean().item()
                sm, wg = per_tile(cycles, a.iters, wgs)
                rows.append(dict(form=name, warpgroups=wgs, epilogue=bool(epi),
                                 sm_cycles_per_tile=round(sm, 1), wg_cycles_per_tile=round(wg, 1)))
    print("| form | epilogue | warpgroups | SM cycles a tile | warpgroup cycles a tile |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['form']} | {'yes' if r['epilogue'] else 'no'} | {r['warpgroups']} |"
              f" {r['sm_cycles_per_tile']} | {r['wg_cycles_per_tile']} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(iters=a.iters, sms=sms, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
