"""Time variants of the CUDA exact scorer beside the library's, in one run, on the indexer's shapes.

    python tools/cuda_scorer_variants.py [--shapes 64x65536,128x8192] [--out results/NAME.json]
        --variant deep=@24 --variant short=@12 --variant rt=@24/384 --variant v3=.dev/scorer_v3.cu
        [--fp8] [--triton] [--rounds 3]

A variant is ``NAME=PATH[@STAGES[/DEEP_TILES]][:MACRO=VALUE,...]``: a source file (empty: the
library's ``scorer.cu``) compiled by NVRTC with those macros defined first. Its launch
follows its source: a source with a producer warp (``PRODUCER_WARP``) runs ``128 * CONSUMERS +
32`` threads, one CTA an SM, the kernel of ring ``STAGES`` (one the source instantiates) with
``deep_tiles`` DEEP_TILES (a program of that many live tiles runs every slot, else the short
ring's; ``@STAGES`` alone: 0, every slot; no ``@``: the source's ``STAGES_SHORT`` ring; the
pseudo-macro ``SMEM_PAD=N`` launches with N more bytes of dynamic shared memory than it uses,
``CTAS_PER_SM=N`` sizes its grid for N CTAs an SM: ``N * SMs // B`` programs a row);
an older one-warpgroup source runs 128 threads, ``CTAS_PER_SM`` CTAs an SM. ``--fp8``: the e4m3
tensor-core path instead of the exact one; ``--triton``: the Triton scorer of the same path
beside them, at the planner's Triton split count. Every variant's scores are compared with the
first variant's on the same inputs (the largest relative difference is printed), then timed by
CUDA-graph replays with inputs rotated past L2, as ``indexer.py`` times ``scorer_us``;
``--rounds N`` times every variant N times a shape, round k starting at the k-th variant (a
variant timed first or last each round alike; the median is reported, every time kept). Prints
a table (us) and writes JSON. ``--eager``: one launch of each, nothing timed (for Nsight Compute).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_root, os.path.join(_root, "benchmarks"), os.path.join(_root, "tools")]  # package, helpers

HEADS, SHAPES = 64, "8x65536,32x16384,32x65536,64x16384,64x65536,128x8192,1x65536,1x131072"
TRITON = "triton"


@dataclass(frozen=True)
class Variant:
    name: str
    path: str
    defines: dict[str, int] = field(default_factory=dict)
    stages: int | None = None
    deep_tiles: int | None = None


def parse_macros(spec: str, defs: str) -> dict[str, int]:
    """``"MACRO=VALUE,..."`` (of variant ``spec``) as a dict; a clear error naming a malformed item."""
    defines = {}
    for item in filter(None, defs.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"[A-Z_][A-Z0-9_]*", key) or not re.fullmatch(r"-?\d+", value):
            raise ValueError(f"variant {spec!r}: macro {item!r} is not MACRO=INTEGER")
        defines[key] = int(value)
    return defines


def parse_variant(spec: str) -> Variant:
    """``NAME=PATH[@STAGES[/DEEP_TILES]][:MACRO=VALUE,...]`` (a clear error naming a malformed spec)."""
    name, eq, rest = spec.partition("=")
    if not eq or not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name == TRITON:
        raise ValueError(f"variant {spec!r}: expected NAME=PATH[@STAGES[/DEEP_TILES]][:MACRO=VALUE,...]"
                         f" (NAME not {TRITON!r})")
    path, _, defs = rest.partition(":")
    path, at, stages = path.partition("@")
    stages, slash, deep = stages.partition("/")
    if at and not stages.isdigit():
        raise ValueError(f"variant {spec!r}: @{stages} is not a stage count")
    if slash and not deep.isdigit():
        raise ValueError(f"variant {spec!r}: /{deep} is not a tile count")
    defines = parse_macros(spec, defs)
    deep_tiles = int(deep) if slash else (0 if at else None)
    return Variant(name, path, defines, int(stages) if at else None, deep_tiles)


def round_orders(count: int, rounds: int) -> list[list[int]]:
    """The order variants are timed in, each round: round k starts at variant k % count."""
    if count < 1 or rounds < 1:
        raise ValueError(f"round_orders: needs variants and rounds >= 1, got {count}, {rounds}")
    return [[(k + i) % count for i in range(count)] for k in range(rounds)]


def launch_ring(v: Variant) -> tuple[int | None, int]:
    """(slots, ``deep_tiles``) variant ``v`` launches with (None slots: its source's default)."""
    from vllm_sparse_sync.kernels.cuda import scorer as cuda_scorer

    return (v.stages, v.deep_tiles) if v.stages is not None else (None, cuda_scorer.NEVER_DEEP)


def source_macro(text: str, name: str, defines: dict[str, int]) -> int | None:
    """The value of ``#define NAME N`` in ``text`` unless ``defines`` overrides it."""
    if name in defines:
        return defines[name]
    m = re.search(rf"^#define {name} (\d+)\b", text, re.M)
    return int(m.group(1)) if m else None


def geometry(text: str, v: Variant, heads: int, precise: bool = True) -> tuple[str, int, int, int]:
    """(kernel name, threads, dynamic shared memory, CTAs an SM) of variant ``v`` of ``text``."""
    from vllm_sparse_sync.kernels.cuda import scorer as cuda_scorer

    qbytes = heads * cuda_scorer.HEAD_DIM * (2 if precise else 1)
    base = f"score_h{heads}_p{int(precise)}"
    if "PRODUCER_WARP" in text:
        stages = launch_ring(v)[0] or source_macro(text, "STAGES_SHORT", v.defines)
        consumers = source_macro(text, "CONSUMERS", v.defines)
        smem = cuda_scorer.smem_bytes(heads, precise, stages) + v.defines.get("SMEM_PAD", 0)
        return f"{base}_s{stages}", 128 * consumers + 32, smem, v.defines.get("CTAS_PER_SM", 1)
    stages = source_macro(text, "STAGES", v.defines)
    if stages is None or v.stages not in (None, stages):
        raise ValueError(f"variant {v.name}: a one-warpgroup source runs its STAGES ring only")
    smem = qbytes + stages * cuda_scorer.SLOT_BYTES + stages * 12
    return base, 128, smem, source_macro(text, "CTAS_PER_SM", v.defines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", default=[], help="NAME=PATH[:MACRO=VALUE,...]")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--out", default="")
    ap.add_argument("--eager", action="store_true",
                    help="one launch per variant and shape, nothing timed (for ncu: -k regex:score_)")
    ap.add_argument("--fp8", action="store_true", help="the e4m3 tensor-core path (default: the exact one)")
    ap.add_argument("--triton", action="store_true", help="the Triton scorer of the same path beside them")
    ap.add_argument("--rounds", type=int, default=1,
                    help="times each variant is timed a shape, in rotated orders")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error(f"--rounds: must be >= 1, got {a.rounds}")
    variants = [parse_variant(v) for v in (a.variant or ["lib="])]

    import torch
    from indexer import L2_BYTES, PAGE, Inputs, timeit

    from vllm_sparse_sync.kernels.cuda import scorer as cuda_scorer
    from vllm_sparse_sync.kernels.cuda import topk as cuda_topk
    from vllm_sparse_sync.kernels.planner import TRITON as TRITON_KIND
    from vllm_sparse_sync.kernels.planner import score_splits
    from vllm_sparse_sync.kernels.triton.scorer import launch_score as launch_triton_score

    precise = not a.fp8

    if not torch.cuda.is_available():
        print("error: needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    mod = cuda_scorer.module_for(0)
    driver = mod.driver
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    kernels = []
    for v in variants:
        text = open(v.path).read() if v.path else cuda_scorer.source()
        name, threads, smem, per_sm = geometry(text, v, HEADS, precise)
        full = "".join(f"#define {k} {val}\n" for k, val in v.defines.items()) + text
        cubin, log = cuda_topk.compile_source(cuda_scorer.ARCH, text=full, name=f"{v.name}.cu",
                                              extra_options=("--ptxas-options=-v",))
        pattern = rf"entry function '{name}'.*?(\d+) bytes spill stores.*?Used (\d+) registers"
        regs = re.search(pattern, log, re.S)
        module = cuda_topk._check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        fn = cuda_topk._check(driver.cuModuleGetFunction(module, name.encode()), "cuModuleGetFunction")
        cuda_topk._check(driver.cuFuncSetAttribute(fn, attr, smem), "cuFuncSetAttribute")
        spills, used = (int(regs.group(1)), int(regs.group(2))) if regs else (None, None)
        info = dict(kernel=name, threads=threads, smem=smem, ctas_per_sm=per_sm, spill_bytes=spills,
                    registers=used, deep_tiles=launch_ring(v)[1])
        print(f"{v.name}: {v.path or 'library'} {v.defines} {info}", flush=True)
        kernels.append((v, fn, info))
    if a.triton:
        kernels.append((Variant(TRITON, ""), None, dict(kernel="triton_scorer", ctas_per_sm=0)))

    rows = []
    for shape in a.shapes.split(","):
        B, L = (int(x) for x in shape.split("x"))
        copies = max(2, min(128, math.ceil(L2_BYTES / (B * L * 132))))
        ncalls = max(12, copies)
        inp = Inputs(B, L, copies)
        row = dict(B=B, L=L)
        first, calls = None, []
        for v, fn, info in kernels:
            out = torch.empty(B, L, device="cuda")
            if fn is None:  # the Triton scorer
                splits = score_splits(B, sms, TRITON_KIND)

                def call(i, splits=splits, out=out, inp=inp, L=L):
                    return lambda: launch_triton_score(*inp.args(i), None, out, page_size=PAGE, sel_width=L,
                                                       fill_width=0, splits=splits, precise=precise)
            else:
                splits = max(1, sms * info["ctas_per_sm"] // B)

                def call(i, fn=fn, info=info, splits=splits, out=out, inp=inp, B=B, L=L):
                    q, w, cache, table, lens = inp.args(i)
                    values = cuda_scorer.score_values(q, w, cache, table, lens, None, out, page_size=PAGE,
                                                      sel_width=L, fill_width=0, deep_tiles=info["deep_tiles"])
                    return lambda: cuda_topk.launch_values(mod, fn, (B, splits, 1), info["threads"],
                                                           info["smem"], values, q.device)

            call(0)()
            torch.cuda.synchronize()
            if first is None:
                first = out.clone()
                diff = 0.0
            else:
                diff = float(((out - first).abs() / first.abs().clamp_min(1e-6)).max())
            row[f"{v.name}_rel_diff"] = diff
            calls.append((v, call, splits, diff))
        if a.eager:
            continue
        times = {v.name: [] for v, _, _ in kernels}
        for order in round_orders(len(calls), a.rounds):
            for i in order:
                v, call, splits, diff = calls[i]
                times[v.name].append(round(timeit(call, ncalls), 2))
                print(f"  {B}x{L} {v.name}: {times[v.name][-1]} us (splits {splits}, rel diff {diff:.2e})",
                      flush=True)
        for name, ts in times.items():
            row[f"{name}_us"] = sorted(ts)[len(ts) // 2]
            row[f"{name}_us_all"] = ts
        rows.append(row)
    if a.eager:
        return

    names = [v.name for v, _, _ in kernels]
    print("| B | L | " + " | ".join(f"{n} us" for n in names) + " | "
          + " | ".join(f"{n}/{names[0]}" for n in names[1:]) + " |")
    print("|---:|---:|" + "---:|" * (2 * len(names) - 1))
    for r in rows:
        times = [r[f"{n}_us"] for n in names]
        print(f"| {r['B']} | {r['L']} | " + " | ".join(f"{t:.2f}" for t in times) + " | "
              + " | ".join(f"{t / times[0]:.3f}" for t in times[1:]) + " |")
    if a.out:
        with open(a.out, "w") as f:
            variants = [dict(name=v.name, path=v.path, defines=v.defines, stages=v.stages, **info)
                        for v, _, info in kernels]
            json.dump(dict(path="e4m3" if a.fp8 else "exact", variants=variants, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
