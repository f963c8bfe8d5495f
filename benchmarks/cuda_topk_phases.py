"""Where the cluster-route top-k spends its time: the kernel source cut short at
each phase (an experiment copy, compiled here; the library source is unchanged), timed by
CUDA-graph replay. Phase times are differences of cumulative times.

    python benchmarks/cuda_topk_phases.py [--cases 1:1x4096,8:1x65536,2:64x65536]

A case is ``C:BxL`` (C CTAs per row, B rows of L live keys, host width L) or ``C:BxL/W`` (host
width W: the plan a wider bound gets, e.g. a short row on a cluster's first CTA). ``--define
SHORT_ACT=256`` compiles a variant of the source (a macro it leaves open); ``--stops 99`` times
the whole kernel only (one compile).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graph_timer import graph_replay_us  # noqa: E402

from vllm_sparse_sync.kernels import cuda_topk  # noqa: E402

K = 2048
# (stop, anchor in cuda_topk.cu, code inserted before it): each stop ends the kernel there
CUTS = [
    (1, "    if (n <= k) {  // cluster-uniform",
     "if (STOP_AT == 1) { if (tid == 0) o[0] = n; return; }\n"),
    (2, "    // refine on the next",
     "if (STOP_AT == 2) { if (tid == 0) o[0] = (int)(klo ^ need); return; }\n"),
    (3, "    // listed: the bin's keys",
     "if (STOP_AT == 3) { if (tid == 0) o[0] = (int)(klo ^ khi ^ need); return; }\n"),
    (4, "    if (!any) return;",
     "if (STOP_AT == 4) { if (tid == 0) o[0] = (int)(ra ^ rt); return; }\n"),
]
STOPS = (0, 1, 2, 3, 4, 99)
NAMES = {0: "launch (empty)", 1: "live length", 2: "load + pass A", 3: "refine", 4: "count + scan",
         99: "write"}


def cut_source(stop: int, defines: tuple[str, ...] = (), base: str | None = None) -> str:
    text = "".join(f"#define {d.replace('=', ' ', 1)}\n" for d in defines) + (base or cuda_topk.source())
    for _, anchor, code in CUTS:  # in each body that has the phase (registers, shared memory)
        assert text.count(anchor) >= 1, anchor
        text = text.replace(anchor, code + anchor)
    head = "    const int row = blockIdx.y;\n    const u32 rank"
    assert text.count(head) == 1
    empty = "    if (STOP_AT == 0) { if (threadIdx.x == 0) out[blockIdx.y] = 0; return; }\n"
    text = text.replace(head, empty + head)
    return f"#define STOP_AT {stop}\n" + text


def time_cut(mod, fn, plan, cluster: int, xs: list, lens, out, ncalls: int) -> float:
    """us per launch of one cut kernel over rotating inputs (CUDA-graph replays)."""
    rows, width = xs[0].shape

    def call(x):
        return lambda: cuda_topk._launch(mod, fn, (cluster, rows, 1), plan.threads, plan.smem, x, width, lens,
                                         None, out, K, width, True, (ctypes.c_int(plan.cap),))

    return graph_replay_us([call(xs[i % len(xs)]) for i in range(ncalls)], 20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="1:1x4096,8:1x65536,8:1x131072,8:8x65536,2:64x65536,1:128x8192")
    ap.add_argument("--ncalls", type=int, default=16)
    ap.add_argument("--mean", type=float, default=0.0, help="the logits' mean (normal)")
    ap.add_argument("--std", type=float, default=1.0,
                    help="the logits' standard deviation (the indexer benchmark's: about mean 8.5, std 19)")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                    help="a macro for the source (repeatable), e.g. SHORT_ACT=256")
    ap.add_argument("--stops", default=",".join(str(s) for s in STOPS),
                    help=f"the cuts to time, of {STOPS} (99: the whole kernel)")
    ap.add_argument("--source", default=None, metavar="PATH",
                    help="time this copy of cuda_topk.cu instead of the library's (e.g. an earlier commit's)")
    ap.add_argument("--out", default=None, help="JSON path (default: $OUT/cuda_topk_phases.json if $OUT is set)")
    a = ap.parse_args()
    stops = tuple(int(s) for s in a.stops.split(","))
    if not set(stops) <= set(STOPS) or not stops:
        ap.error(f"--stops: a comma list of {STOPS}")
    bad = [d for d in a.define if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=\w+", d)]
    if bad:
        ap.error(f"--define wants NAME=VALUE, got {bad}")
    if not torch.cuda.is_available():
        print("error: needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    base = None
    if a.source:
        with open(a.source) as fh:
            base = fh.read()
    mod = cuda_topk.module_for(0)
    driver = mod.driver
    fake = types.SimpleNamespace(driver=driver, ctx=mod.ctx)
    major, minor = torch.cuda.get_device_capability()
    modules = {}
    for stop in stops:
        cubin, _ = cuda_topk.compile_source(f"sm_{major}{minor}", text=cut_source(stop, tuple(a.define), base))
        modules[stop] = cuda_topk._check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    rows_out = []
    for case in a.cases.split(","):
        C, shape = case.split(":")
        C = int(C)
        shape, _, wide = shape.partition("/")
        B, L = (int(p) for p in shape.split("x"))
        W = int(wide) if wide else L
        plan = cuda_topk.plan_cluster(B, W, mod.sm_count, mod.smem_optin, cluster=C)
        name = cuda_topk.cluster_kernel_name(C, True, plan.threads).encode()
        functions = {stop: cuda_topk._check(driver.cuModuleGetFunction(m, name), "get")
                     for stop, m in modules.items()}
        g = torch.Generator(device="cuda").manual_seed(B + L)
        xs = [torch.randn(B, W, device="cuda", generator=g) * a.std + a.mean for _ in range(4)]
        lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        out = torch.empty(B, K, dtype=torch.int32, device="cuda")
        res = {"C": C, "B": B, "L": L, "W": W, "cap": plan.cap, "threads": plan.threads, "mean": a.mean,
               "std": a.std, "defines": a.define, "source": a.source}
        for stop, fn in functions.items():
            cuda_topk._check(driver.cuFuncSetAttribute(fn, attr, plan.smem), "smem")
            res[NAMES[stop]] = time_cut(fake, fn, plan, C, xs, lens, out, a.ncalls)
        rows_out.append(res)
        prev = 0.0
        parts = []
        for stop in stops:
            t = res[NAMES[stop]]
            parts.append(f"{NAMES[stop]} {t - prev:+.2f}")
            prev = t
        print(f"C={C} B={B} L={L} W={W} cap={plan.cap} threads={plan.threads} {' '.join(a.define)} "
              f"{a.source or ''} "
              f"total {res[NAMES[stops[-1]]]:.2f} us: " + ", ".join(parts),
              flush=True)
    path = a.out or (os.path.join(os.environ["OUT"], "cuda_topk_phases.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as fh:
            json.dump(rows_out, fh, indent=1)


if __name__ == "__main__":
    main()
