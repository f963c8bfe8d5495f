"""One profiled launch per case of the cluster-route top-k, for Nsight Compute's source view:
the library source compiled with ``-lineinfo`` (and any ``--define``), a few warm-up launches
outside the profiler range, then one launch inside it.

    ncu --clock-control none --profile-from-start off --set full --import-source yes -o topk \\
        python tools/cuda_topk_profile.py --cases 1:1x4096,1:128x8192 --mean 8.5 --std 19
    ncu --import topk.ncu-rep --page source --csv --print-source cuda,sass > topk.csv
    python tools/cuda_topk_profile.py --summarize topk.csv

Cases as ``cuda_topk_phases.py``: ``C:BxL`` or ``C:BxL/W``.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import os
import re
import sys

_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_root, os.path.join(_root, "benchmarks"), os.path.join(_root, "tools")]  # package, helpers

K = 2048


def run_cases(cases: str, mean: float, std: float, defines: list[str], warmup: int) -> None:
    import functools
    import types

    import torch

    from vllm_sparse_sync.kernels.cuda import topk as cuda_topk

    if not torch.cuda.is_available():
        print("error: needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    mod = cuda_topk.module_for(0)
    driver = mod.driver
    fake = types.SimpleNamespace(driver=driver, ctx=mod.ctx)
    major, minor = torch.cuda.get_device_capability()
    text = "".join(f"#define {d.replace('=', ' ', 1)}\n" for d in defines) + cuda_topk.source()
    cubin, _ = cuda_topk.compile_source(f"sm_{major}{minor}", text=text, extra_options=("-lineinfo",))
    module = cuda_topk._check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
    for case in cases.split(","):
        C, shape = case.split(":")
        C = int(C)
        shape, _, wide = shape.partition("/")
        B, L = (int(p) for p in shape.split("x"))
        W = int(wide) if wide else L
        plan = cuda_topk.plan_cluster(B, W, mod.sm_count, mod.smem_optin, cluster=C)
        name = cuda_topk.cluster_kernel_name(C, True, plan.threads)
        fn = cuda_topk.load_cluster_function(driver, module, name, plan.smem)
        g = torch.Generator(device="cuda").manual_seed(B + L)
        x = torch.randn(B, W, device="cuda", generator=g) * std + mean
        lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        out = torch.empty(B, K, dtype=torch.int32, device="cuda")

        launch = functools.partial(cuda_topk._launch, fake, fn, (C, B, 1), plan.threads, plan.smem, x, W,
                                   lens, None, out, K, W, True, cuda_topk.cluster_tail(plan.cap))

        for _ in range(warmup):
            launch()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        launch()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        ref = torch.topk(x[:, :L], K, dim=1).values.min(dim=1).values
        got = torch.gather(x, 1, out.long()).min(dim=1).values
        ok = bool(torch.equal(ref, got))
        print(f"case {case}: {name} threads={plan.threads} smem={plan.smem} cap={plan.cap} "
              f"threshold {'ok' if ok else 'WRONG'}", flush=True)


def summarize(path: str, top: int) -> None:
    """Per CUDA source line (from -lineinfo) of each profiled kernel: its share of the warp stall
    samples and of the warp instructions executed, and its three largest stall reasons; the
    lines with the most samples first. ``path``: ncu's ``--page source --csv --print-source
    cuda,sass`` output (gzip accepted)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as fh:
        rows = list(csv.reader(fh))
    starts = [i for i, r in enumerate(rows) if r and r[0] == "Function Name"]
    if not starts:
        sys.exit(f"{path}: no 'Function Name' sections (want --page source --print-source cuda,sass)")
    for n, s in enumerate(starts):
        e = starts[n + 1] - 1 if n + 1 < len(starts) else len(rows)
        head = rows[s + 1]
        idx: dict[str, int] = {}
        for j, c in enumerate(head):
            idx.setdefault(c, j)
        samp, inst = idx["Warp Stall Sampling (All Samples)"], idx["Instructions Executed"]
        stalls = [c for c in head if c.startswith("stall_") and "Not Issued" not in c]
        lines = []
        for r in rows[s + 2:e]:
            if len(r) < len(head) or not r[0]:  # a SASS row under its source line
                continue
            try:
                v, i = float(r[samp]), float(r[inst])
            except ValueError:
                continue
            reasons = sorted(((float(r[idx[c]] or 0), c[len("stall_"):]) for c in stalls), reverse=True)[:3]
            lines.append((v, i, int(r[0]), r[1], reasons))
        tot_s = sum(x[0] for x in lines) or 1.0
        tot_i = sum(x[1] for x in lines) or 1.0
        print(f"== kernel {n} ({rows[s][1]}): {tot_s:.0f} stall samples, {tot_i:.0f} warp instructions")
        for v, i, ln, src, reasons in sorted(lines, key=lambda x: (-x[0], -x[1]))[:top]:
            why = " ".join(f"{c}:{x:.0f}" for x, c in reasons if x > 0)
            print(f"{100 * v / tot_s:5.1f}% {100 * i / tot_i:5.1f}%  L{ln:<5d} {src.strip()[:90]:90s} {why}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="1:1x4096,1:128x8192,1:64x16384,8:1x65536")
    ap.add_argument("--mean", type=float, default=8.5)
    ap.add_argument("--std", type=float, default=19.0)
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--summarize", metavar="CSV",
                    help="summarize ncu's --page source --csv --print-source cuda,sass output instead")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    if a.summarize:
        summarize(a.summarize, a.top)
        return
    bad = [d for d in a.define if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=\w+", d)]
    if bad:
        ap.error(f"--define wants NAME=VALUE, got {bad}")
    run_cases(a.cases, a.mean, a.std, a.define, a.warmup)


if __name__ == "__main__":
    main()
