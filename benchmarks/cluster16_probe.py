"""Would a 16-CTA cluster (non-portable on sm_90) beat the 8-CTA one on one-row top-k calls?

    python benchmarks/cluster16_probe.py [--shapes 1x32768,1x65536,1x131072,8x65536]
                                          [--rounds 3] [--json FILE]

Builds a variant of ``kernels/cuda_topk.cu`` whose cluster kernels also take C = 16 (the
per-rank scratch arrays sized for 16, ``cl_find_bin``'s range split by 4 bits; only the 1024-thread
cluster kernels of C = 8 and 16 instantiated, to compile fast), loads it beside the library's
module, and times on each shape's scorer logits (rotated copies past L2, CUDA-graph replays): the
library's own launch (C = 8 by its plan), the variant's C = 8, and the variant's C = 16 with the
non-portable cluster size allowed. Each output must equal the library's element for element.
Prints a table; ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import re
import statistics
import sys
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cold_start import parse_shapes  # noqa: E402

PATCHES = (
    ('static_assert(C == 1 || C == 2 || C == 4 || C == 8, "cluster size");',
     'static_assert(C == 1 || C == 2 || C == 4 || C == 8 || C == 16, "cluster size");'),
    ("constexpr int LOG_C = C == 8 ? 3 :", "constexpr int LOG_C = C == 16 ? 4 : C == 8 ? 3 :"),
    ("u32 cnt[2 * 8];", "u32 cnt[2 * 16];"),
    ("u32 rng[2][8];", "u32 rng[2][16];"),
    ("u32 part[2][8];", "u32 part[2][16];"),
    ('static_assert(C >= 1 && C <= 8, "cluster size");', 'static_assert(C >= 1 && C <= 16, "cluster size");'),
)


def variant_source(text: str) -> str:
    """``text`` (cuda_topk.cu) with C = 16 allowed and only the 1024-thread C = 8 / 16 cluster
    kernels instantiated; raises where a patch no longer applies."""
    for old, new in PATCHES:
        if text.count(old) != 1:
            raise ValueError(f"cluster16_probe: the source no longer holds {old!r} once")
        text = text.replace(old, new)
    keep = []
    for line in text.splitlines():
        if re.match(r"(TOPK_KERNEL|DCP_MERGE_KERNEL)\(", line):
            continue
        m = re.match(r"TOPK_CLUSTER_KERNEL\((\d+), (\d+), (\d)\)", line)
        if m and (m.group(1) != "8" or m.group(2) != "1024"):
            continue
        keep.append(line)
        if m:
            keep.append(f"TOPK_CLUSTER_KERNEL(16, 1024, {m.group(3)})")
    return "\n".join(keep) + "\n"


NAMES = ("library", "c8", "c16")


def probe_shape(ix, ct, tk, lib, host, function, B: int, L: int, rounds: int) -> dict:
    """One shape's row: each launch's output check against the library's and its median time."""
    copies = max(2, min(128, math.ceil(ix.L2_BYTES / (B * L * 132))))
    ncalls = max(12, copies)
    inp = ix.Inputs(B, L, copies)
    first = tk.paged_indexer_logits(*inp.args(0), L)
    nl = max(2, min(ncalls, math.ceil(ix.L2_BYTES / (B * L * 4))))
    logits = [first] + [first.clone() for _ in range(nl - 1)]
    out = torch.empty(B, ix.TOPK, dtype=torch.int32, device=ix.DEV)

    def library(i):
        return lambda: ct.launch_cuda_topk_cluster(logits[i % nl], L, inp.lens, None, out, ix.TOPK, L,
                                                   nan_low=False, pdl=False)

    def variant(C):
        cap = min(ct.cluster_chunk_cap(L, C), ct._keys_fitting(lib.smem_optin, C, 1024))
        smem = ct.cluster_smem_bytes(cap, C, 1024)
        fn = function(C, True, smem)
        return lambda i: lambda: ct._launch(host, fn, (C, B, 1), 1024, smem, logits[i % nl], L, inp.lens,
                                            None, out, ix.TOPK, L, False, (ctypes.c_int(cap),), pdl=False)

    makers = {"library": library, "c8": variant(8), "c16": variant(16)}
    library(0)()
    want = out.clone()
    row = dict(B=B, L=L, plan_cluster=ct.plan_cluster(B, L, lib.sm_count, lib.smem_optin).cluster)
    for name, make in makers.items():
        out.fill_(-7)
        try:
            make(0)()
            torch.cuda.synchronize()
        except Exception as exc:
            row[f"{name}_err"] = str(exc).splitlines()[0][:160]
            continue
        row[f"{name}_check"] = "ok" if torch.equal(out, want) else "differs"
    seen: dict[str, list[float]] = {n: [] for n in makers if f"{n}_err" not in row}
    names = list(seen)
    for r in range(rounds):
        for j in range(len(names)):
            name = names[(r + j) % len(names)]
            seen[name].append(ix.timeit(makers[name], ncalls))
    for name, v in seen.items():
        row[f"{name}_us"] = round(statistics.median(v), 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x32768,1x65536,1x131072,8x65536")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    try:
        shapes = parse_shapes(a.shapes)
    except ValueError as exc:
        ap.error(str(exc))
    if not torch.cuda.is_available():
        print("error: benchmarks/cluster16_probe.py times CUDA kernels and needs a CUDA device",
              file=sys.stderr)
        sys.exit(2)
    import indexer as ix

    from vllm_sparse_sync.kernels import cuda_topk as ct
    from vllm_sparse_sync.kernels import triton_ops as tk

    lib = ct.module_for(0)
    drv = lib.driver
    cubin, origin = ct.module_cubin(lib.arch, text=variant_source(ct.source()), name="cuda_topk_c16.cu")
    print(f"variant cubin: {origin}, {len(cubin) // 1024} KiB", flush=True)
    module = ct._check(drv.cuModuleLoadData(cubin), "cuModuleLoadData")
    host = types.SimpleNamespace(driver=drv, ctx=lib.ctx)

    def function(C: int, aligned: bool, smem: int):
        fn = ct._check(drv.cuModuleGetFunction(module, f"topk_cluster_c{C}_t1024_a{int(aligned)}".encode()),
                       "cuModuleGetFunction")
        attr = drv.CUfunction_attribute
        ct._check(drv.cuFuncSetAttribute(fn, attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                  "max dynamic smem")
        if C > 8:
            ct._check(drv.cuFuncSetAttribute(fn, attr.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
                      "non-portable cluster size")
        static = ct._check(drv.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn),
                           "static smem")
        print(f"variant C={C}: static shared memory {int(static)} bytes (reserve {ct.STATIC_SMEM_RESERVE})",
              flush=True)
        return fn

    rows = []
    for B, L in shapes:
        rows.append(probe_shape(ix, ct, tk, lib, host, function, B, L, a.rounds))
        print(json.dumps(rows[-1]), flush=True)
        if a.json:
            json.dump(rows, open(a.json, "w"), indent=1)
    print("| B | L | plan C | library | variant C=8 | variant C=16 | checks |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        checks = ", ".join(f"{n} {r.get(f'{n}_check', r.get(f'{n}_err', '-'))}" for n in NAMES)
        times = " | ".join(str(r.get(f"{n}_us", "-")) for n in NAMES)
        print(f"| {r['B']} | {r['L']} | {r['plan_cluster']} | {times} | {checks} |")


if __name__ == "__main__":
    main()
