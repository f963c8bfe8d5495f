"""Where one CTA of the cluster-route top-k spends its cycles: the kernel source with clock64 stamps
at its phase boundaries (an experiment copy, compiled here; the library source is unchanged),
read by thread 0 of the first row's first CTA and summed over CUDA-graph replays.

    python tools/cuda_topk_trace.py [--cases 1:1x4096,1:1x4096@1024,1:128x8192]

Cases as in tools/cuda_topk_phases.py (``C:BxL[/W][@T]``). Unlike that tool's cuts, the
kernel runs whole, so nothing the compiler drops changes what is timed; a stamp is thread 0's
view (after a barrier, the CTA's). Prints each phase's mean cycles and microseconds (at the clock
measured against the global timer over the same launches) beside the kernel's graph-replay time.
``--source A.cu --source ''`` traces copies side by side on the same inputs.
"""

from __future__ import annotations

import argparse
import os
import sys
import types

import numpy
import torch

_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_root, os.path.join(_root, "benchmarks"), os.path.join(_root, "tools")]  # package, helpers

from cuda_topk_phases import (  # noqa: E402
    K,
    _compile,
    indexer_logits,
    keep_kernels,
    parse_cases,
    time_cut,
    write_rows,
)

from vllm_sparse_sync.kernels.cuda import topk as cuda_topk  # noqa: E402

SLOTS = 16
COUNT, GT_START, GT_END = 15, 14, 13  # launches; global-timer sums at the entry and at GT_AT
GT_AT = 8  # the stamp whose cycles since the entry calibrate the clock
# (slot, label, anchor, insert before (True) or after the anchor's line)
POINTS = [
    (0, "entry", "    const int row = blockIdx.y;\n", True),
    (1, "cleared + dependency wait", "    __shared__ BodyScratch sc;\n", True),
    (2, "live length", "    // a row of at most REG_MAX keys runs", True),
    (3, "hand-over barrier", "    const int jn = (len + 4 * ACT - 1) / (4 * ACT);", True),
    (4, "pass A counted", "    const u32* totals = hist;", True),
    (5, "pass A found", "    u32 need = sc.res[1];", True),
    (6, "refined", "    // listed: the bin's keys", True),
    (7, "selection closed", "    // collect: per group", True),
    (GT_AT, "scanned", "    const bool any = sel != 0u;", True),
]
PRELUDE = f"""
__device__ unsigned long long vss_trace[{SLOTS}];
__device__ __forceinline__ unsigned long long vss_globaltimer() {{
    unsigned long long g;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g) :: "memory");
    return g;
}}
__device__ __forceinline__ void vss_stamp(int i) {{
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {{
        unsigned long long t;
        asm volatile("mov.u64 %0, %%clock64;" : "=l"(t) :: "memory");
        atomicAdd(&vss_trace[i], t);  // a reduction: no wait on a load
        if (i == 0) {{
            atomicAdd(&vss_trace[{GT_START}], vss_globaltimer());
            atomicAdd(&vss_trace[{COUNT}], 1ull);
        }}
        if (i == {GT_AT}) atomicAdd(&vss_trace[{GT_END}], vss_globaltimer());
    }}
}}
"""


def traced_source(base: str | None, keep) -> str:
    """The source with a stamp at each of POINTS (every occurrence of its anchor)."""
    text = keep_kernels(base or cuda_topk.source(), keep)
    for slot, _, anchor, before in POINTS:
        if anchor not in text:
            raise ValueError(f"anchor not in the source: {anchor!r}")
        stamp = f"vss_stamp({slot});\n"
        text = text.replace(anchor, stamp + anchor if before else anchor + stamp)
    marker = "#define FULL_MASK"
    return text.replace(marker, PRELUDE + marker, 1)


def phase_cycles(t: list[int]) -> dict[str, float]:
    """Each stamped phase's mean cycles a launch, from a trace's sums (``read_trace``): a stamp
    the launches never reached is skipped, its cycles counted in the next reached one."""
    n = t[COUNT]
    out, prev = {}, None
    for slot, label, _, _ in POINTS:
        if t[slot] == 0:
            continue
        if prev is not None:
            out[label] = (t[slot] - t[prev]) / n
        prev = slot
    return out


def read_trace(driver, module, zero: bool = False) -> list[int]:
    """The trace's sums (after the stream's work), or zeroes them (``zero``)."""
    dptr, size = cuda_topk._check(driver.cuModuleGetGlobal(module, b"vss_trace"), "cuModuleGetGlobal")
    host = numpy.zeros(SLOTS, dtype=numpy.uint64)
    torch.cuda.synchronize()
    if zero:
        cuda_topk._check(driver.cuMemcpyHtoD(dptr, host, size), "cuMemcpyHtoD")
    else:
        cuda_topk._check(driver.cuMemcpyDtoH(host, dptr, size), "cuMemcpyDtoH")
    return [int(v) for v in host]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="1:1x4096,1:1x4096@1024,8:1x4096/131072,1:128x8192")
    ap.add_argument("--ncalls", type=int, default=16)
    ap.add_argument("--seeds", default="0,1,2,3")
    ap.add_argument("--source", action="append", default=None, metavar="PATH")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    seeds = [int(s) for s in a.seeds.split(",")]
    sources = [src or None for src in a.source] if a.source else [None]
    mod = cuda_topk.module_for(0)
    driver = mod.driver
    fake = types.SimpleNamespace(driver=driver, ctx=mod.ctx)
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    cases = parse_cases(a.cases, mod.sm_count, mod.smem_optin)
    keep = {(c[0], c[4].threads) for c in cases}
    modules = {}
    for src in sources:
        base = open(src).read() if src else None
        cubin = _compile(arch, traced_source(base, keep))
        modules[src] = cuda_topk._check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
    rows = []
    for C, B, L, W, plan in cases:
        xs = [indexer_logits(B, L, W, seed) for seed in seeds]
        lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        out = torch.empty(B, K, dtype=torch.int32, device="cuda")
        name = cuda_topk.cluster_kernel_name(C, True, plan.threads)
        for src in sources:
            module = modules[src]
            fn = cuda_topk.load_cluster_function(driver, module, name, plan.smem)
            read_trace(driver, module, zero=True)
            us = time_cut(fake, fn, plan, C, xs, lens, out, a.ncalls)
            t = read_trace(driver, module)
            n = t[COUNT]
            ns = (t[GT_END] - t[GT_START]) / n
            mhz = ((t[GT_AT] - t[0]) / n) / ns * 1e3 if ns > 0 else float("nan")
            res = {"C": C, "B": B, "L": L, "W": W, "threads": plan.threads, "source": src, "launches": n,
                   "replay_us": us, "sm_mhz": mhz, "phases": phase_cycles(t)}
            parts = [f"{label} {cyc:.0f} ({cyc / mhz:.2f} us)" for label, cyc in res["phases"].items()]
            rows.append(res)
            print(f"C={C} B={B} L={L} W={W} threads={plan.threads} {src or 'library'}: replay {us:.2f} us, "
                  f"{mhz:.0f} MHz, {n} launches; " + ", ".join(parts), flush=True)
    write_rows(rows, a.out, "cuda_topk_trace.json")


if __name__ == "__main__":
    main()
