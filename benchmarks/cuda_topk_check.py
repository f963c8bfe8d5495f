"""First-run check of the CUDA top-k (``topk.algo="cuda_radix"``): compile, exactness, capture,
bound-insensitivity, timing against the default route's top-k and torch.topk. One script, never
aborts on one failing case (prints the error and goes on); JSON to $OUT/cuda_topk_check.json when
$OUT is set.

    python benchmarks/cuda_topk_check.py [--variants 1024x4,1024x2,512x4,512x8,c1,c2,c4,c8,cauto] [--quick]

A variant is ``THREADSxVEC`` (one CTA per row) or ``cN`` / ``cauto`` (the cluster route, sm_90+:
N CTAs per row, or the planner's choice).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graph_timer import graph_replay_us  # noqa: E402

from vllm_sparse_sync.kernels import cuda_topk  # noqa: E402
from vllm_sparse_sync.kernels import cuda_topk_emu as emu  # noqa: E402
from vllm_sparse_sync.kernels import reference as ref  # noqa: E402

DEV = "cuda"
K = 2048
SHAPES = [
    (1, 4096),
    (1, 65536),
    (1, 131072),
    (8, 65536),
    (32, 16384),
    (32, 65536),
    (64, 16384),
    (64, 65536),
    (128, 8192),
]
PEERS = {  # H200, us, CUDA-graph replays (the task's table): vLLM cooperative / persistent
    (1, 4096): (3.5, 7.5),
    (1, 65536): (11.5, 23.4),
    (1, 131072): (13.3, 23.1),
    (8, 65536): (11.8, 24.9),
    (32, 16384): (10.5, 14.1),
    (32, 65536): (24.1, 46.8),
    (64, 16384): (10.7, 10.9),
    (64, 65536): (20.9, 31.1),
    (128, 8192): (None, 8.4),
}
WIDE = 131072
RESULTS: dict = {"errors": []}


def log(msg: str) -> None:
    print(msg, flush=True)


def guarded(name):
    def wrap(fn):
        def run(*a, **kw):
            try:
                return fn(*a, **kw)
            except Exception as exc:  # keep going: one failure must not hide the rest
                tb = traceback.format_exc(limit=4)
                log(f"ERROR in {name} {a}: {type(exc).__name__}: {exc}\n{tb}")
                RESULTS["errors"].append(f"{name} {a}: {type(exc).__name__}: {str(exc)[:300]}")
                return None

        return run

    return wrap


def tag(variant) -> str:
    return variant if isinstance(variant, str) else f"{variant[0]}x{variant[1]}"


def parse_variant(text: str):
    if text.startswith("c"):
        return text
    return tuple(int(p) for p in text.split("x"))


def cluster_args(variant: str) -> dict:
    """``cN``, ``cNtT`` (T threads per CTA), ``cauto``, each with an optional ``-nopdl`` (a plain
    launch instead of a programmatic dependent one): the cluster route's size and threads."""
    m = re.fullmatch(r"c(\d+|auto)(?:t(\d+))?(-nopdl)?", variant)
    if not m:
        raise ValueError(f"variant {variant!r}: THREADSxVEC, cN, cNtT or cauto (optionally -nopdl)")
    return dict(cluster=None if m[1] == "auto" else int(m[1]), threads=int(m[2] or 1024), pdl=not m[3])


def launch(x, lens, out, k=K, width=None, active=None, nan_low=True, variant=(1024, 4), cap=8192):
    if isinstance(variant, str):
        cuda_topk.launch_cuda_topk_cluster(
            x, x.stride(0), lens, active, out, k, x.shape[1] if width is None else width,
            nan_low=nan_low, cap=None if cap == 8192 else max(4, cap), **cluster_args(variant),
        )
        return out
    cuda_topk.launch_cuda_topk(
        x,
        x.stride(0),
        lens,
        active,
        out,
        k,
        x.shape[1] if width is None else width,
        nan_low=nan_low,
        threads=variant[0],
        vec=variant[1],
        cap=cap,
    )
    return out


def make_logits(kind: str, rows: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    if kind == "randn":
        return torch.randn(rows, width, device=DEV, generator=g)
    if kind == "ties":
        return torch.randint(0, 8, (rows, width), device=DEV, generator=g).float()
    if kind == "allsame":
        return torch.full((rows, width), 1.5, device=DEV)
    if kind == "close":  # share the top 22 bits, differ below
        return 1.0 + torch.randint(0, 512, (rows, width), device=DEV, generator=g).float() * 2**-23
    if kind == "inf_nan":
        x = torch.randn(rows, width, device=DEV, generator=g)
        p = torch.rand(rows, width, device=DEV, generator=g)
        x[p < 0.3] = float("-inf")
        x[(p >= 0.3) & (p < 0.35)] = float("nan")
        x[(p >= 0.35) & (p < 0.37)] = float("inf")
        return x
    if kind == "ascending":
        return torch.arange(width, device=DEV, dtype=torch.float32).expand(rows, width).contiguous()
    if kind == "relu_like":  # nonnegative, many exact zeros (indexer-like)
        return torch.randn(rows, width, device=DEV, generator=g).clamp_min(0) * 3
    raise ValueError(kind)


@guarded("exact")
def check_exact(
    kind,
    rows,
    width,
    lens_list,
    variant,
    *,
    active=None,
    cap=8192,
    k=K,
    lens64=False,
    unaligned=False,
    emulate_rows=4,
):
    x = make_logits(kind, rows, width + (1 if unaligned else 0), seed=rows * 7 + width)
    if unaligned:
        x = x[:, 1:]  # row base 4 bytes off 16-byte alignment, stride width+1: the scalar-load kernel
    lens = torch.tensor(lens_list, dtype=torch.int64 if lens64 else torch.int32, device=DEV)
    act = None if active is None else torch.tensor([active], dtype=torch.int32, device=DEV)
    out = torch.full((rows, k), -7, dtype=torch.int32, device=DEV)
    launch(x, lens, out, k=k, active=act, variant=variant, cap=cap)
    torch.cuda.synchronize()
    want = ref.topk_indices(x, lens, k, active_width=act)
    got_sorted, want_sorted = out.sort(dim=1).values, want.sort(dim=1).values
    set_ok = torch.equal(got_sorted, want_sorted)
    # element-for-element against the emulation on a few rows
    xc, lc = x[:emulate_rows].cpu(), lens[:emulate_rows].cpu()
    emu_out = emu.topk_indices(
        xc, lc, k, active_width=None if act is None else act.cpu(),
        tile=16384 if isinstance(variant, str) else variant[0] * 4 * variant[1], cap=cap,
    )
    order_ok = torch.equal(out[:emulate_rows].cpu(), emu_out)
    name = (f"{kind} rows={rows} width={width} var={variant} cap={cap} act={active} "
            f"lens64={lens64} unal={unaligned}")
    ok = set_ok and order_ok
    bad_rows = (got_sorted != want_sorted).any(dim=1).nonzero().flatten().tolist()[:5]
    log(
        f"  {'ok  ' if ok else 'FAIL'} {name}"
        + ("" if ok else f" set_ok={set_ok} order_ok={order_ok} bad_rows={bad_rows}")
    )
    RESULTS.setdefault("exact", []).append(
        dict(case=name, ok=ok, set_ok=set_ok, order_ok=order_ok, bad_rows=bad_rows)
    )
    return ok


def exactness(variants):
    log("== exactness (set vs torch reference; order vs the emulation) ==")
    for variant in variants:
        tile = 16384 if isinstance(variant, str) else variant[0] * 4 * variant[1]
        for kind in ("randn", "ties", "allsame", "close", "inf_nan", "ascending", "relu_like"):
            check_exact(kind, 3, 40000, [40000, 30000, 2100], variant)
            check_exact(kind, 2, tile, [tile, tile - 3], variant)  # one tile, in registers
        check_exact("randn", 4, 5000, [0, 1, 2048, 2049], variant)  # short, k, k+1
        check_exact("randn", 3, 70000, [70000, 65537, 9999], variant, cap=0)  # global refinement
        check_exact("ties", 3, 70000, [70000, 65537, 9999], variant, cap=64)
        check_exact("randn", 3, 50000, [50000, 40000, 3000], variant, active=30001)
        check_exact("randn", 3, 50000, [-5, 60000, 3000], variant, active=-1)
        check_exact("randn", 2, 33333, [33333, 20001], variant, lens64=True)
        check_exact("randn", 2, 33333, [33333, 20001], variant, unaligned=True)
        check_exact("randn", 2, 131072, [131072, 100000], variant)
        check_exact("randn", 2, 20000, [20000, 20000], variant, k=512)
        check_exact("randn", 2, 20000, [20000, 20000], variant, k=1)
        if isinstance(variant, str):  # keys past the shared-memory cap come from global memory
            check_exact("ties", 3, 70000, [70000, 65537, 9999], variant, cap=1000)
            check_exact("randn", 3, 70000, [70000, 65537, 9999], variant, cap=4)
    for v in variants:
        if not isinstance(v, str):  # the one-CTA kernel's candidate list past 48 KB of shared memory
            check_exact("randn", 2, 20000, [20000, 20000], v, cap=53248)
            break


@guarded("nan_low_off")
def check_scorer_nan():
    x = make_logits("randn", 2, 9000, 3)
    x[:, ::7] = -float("nan")  # the scorer's negative NaN
    lens = torch.tensor([9000, 9000], dtype=torch.int32, device=DEV)
    out = torch.empty(2, K, dtype=torch.int32, device=DEV)
    launch(x, lens, out, nan_low=False)
    want = ref.topk_indices(x, lens, K)
    ok = torch.equal(out.sort(1).values, want.sort(1).values)
    log(f"  {'ok  ' if ok else 'FAIL'} negative NaN with nan_low=False")
    RESULTS.setdefault("exact", []).append(dict(case="neg_nan_nan_low_off", ok=ok))


@guarded("capture")
def check_capture(variant):
    rows, width = 8, 65536
    x = make_logits("randn", rows, width, 11)
    lens = torch.full((rows,), width, dtype=torch.int32, device=DEV)
    act = torch.tensor([width], dtype=torch.int32, device=DEV)
    out = torch.empty(rows, K, dtype=torch.int32, device=DEV)
    fn = lambda: launch(x, lens, out, active=act, variant=variant)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    oks = []
    for seed, new_lens, a in [
        (1, [65536, 100, 0, 2048, 2049, 40000, 65535, 30000], 65536),
        (2, [65536] * 8, 50000),
        (3, [5000] * 8, 4000),
    ]:
        x.copy_(make_logits("ties" if seed == 2 else "randn", rows, width, seed))
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        act.fill_(a)
        before = torch.cuda.memory_allocated()
        g.replay()
        torch.cuda.synchronize()
        no_alloc = torch.cuda.memory_allocated() == before  # before the checks allocate
        want = ref.topk_indices(x, lens, K, active_width=act)
        eager = launch(x, lens, torch.empty_like(out), active=act, variant=variant)
        torch.cuda.synchronize()
        oks.append(
            torch.equal(out.sort(1).values, want.sort(1).values)
            and torch.equal(out, eager)
            and no_alloc
        )
    ok = all(oks)
    log(f"  {'ok  ' if ok else 'FAIL'} capture+replay with new data/lengths/active width {variant}: {oks}")
    RESULTS.setdefault("capture", []).append(dict(variant=list(variant), ok=ok, replays=oks))


@guarded("sync")
def check_no_sync(variant):
    x = make_logits("randn", 4, 20000, 5)
    lens = torch.full((4,), 20000, dtype=torch.int32, device=DEV)
    out = torch.empty(4, K, dtype=torch.int32, device=DEV)
    launch(x, lens, out, variant=variant)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            launch(x, lens, out, variant=variant)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    log(f"  ok   no sync under torch.cuda.set_sync_debug_mode('error') {variant}")
    RESULTS["no_sync"] = True


def timeit(calls, iters=20) -> float:
    """Median us per call: one graph of all ``calls``, replayed."""
    return graph_replay_us(calls, iters)


@guarded("time")
def time_shape(B, L, variants, ncalls):
    from vllm_sparse_sync.kernels import triton_ops as tk
    from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace

    copies = max(2, min(ncalls, (160 << 20) // (B * WIDE * 4) + 1))
    xs = [make_logits("randn", B, WIDE, 100 + i) for i in range(copies)]  # 128K wide: both bounds
    lens = torch.full((B,), L, dtype=torch.int32, device=DEV)
    out = torch.empty(B, K, dtype=torch.int32, device=DEV)
    res = dict(B=B, L=L, calls_per_graph=ncalls)
    exact = [x[:, :L] for x in xs]  # row stride 128K: the same memory, exact host width L
    for v in variants:
        log(f"  timing {tag(v)} B={B} L={L}")
        res[f"cuda_{tag(v)}_us"] = timeit(
            [lambda i=i, v=v: launch(exact[i % copies], lens, out, width=L, variant=v) for i in range(ncalls)]
        )
        res[f"cuda_{tag(v)}_wide_us"] = timeit(
            [lambda i=i, v=v: launch(xs[i % copies], lens, out, width=WIDE, variant=v) for i in range(ncalls)]
        )
        got = launch(exact[0], lens, torch.empty_like(out), width=L, variant=v)
        want = torch.topk(exact[0], K, dim=1).indices.int()  # randn: no ties in practice
        same = torch.equal(got.sort(1).values, want.sort(1).values)
        res[f"cuda_{tag(v)}_check"] = "ok" if same else "differs"
    best = min(variants, key=lambda v: res[f"cuda_{tag(v)}_us"])
    res["cuda_best"] = tag(best)
    if "cauto" in variants:
        plan = cuda_topk.cluster_plan_for(exact[0], B, L)
        res["cauto_size"] = plan.cluster if plan else None
        res["cauto_cap"] = plan.cap if plan else None
        plan = cuda_topk.cluster_plan_for(exact[0], B, WIDE)
        res["cauto_wide_size"] = plan.cluster if plan else None
        res["cauto_wide_cap"] = plan.cap if plan else None
    res["cuda_us"] = res[f"cuda_{res['cuda_best']}_us"]
    wide = res.get(f"cuda_{res['cuda_best']}_wide_us")
    res["cuda_wide_over_exact"] = wide / res["cuda_us"] if wide else None
    if "cauto" in variants:
        res["cauto_us"] = res["cuda_cauto_us"]
        res["cauto_wide_over_exact"] = res["cuda_cauto_wide_us"] / res["cuda_cauto_us"]
    try:
        ws = IndexerTopkWorkspace(B, K, 0, DEV)
        dense = [x[:, :L].contiguous() for x in xs[:2]]
        res["route_us"] = timeit(
            [lambda i=i: tk.topk_indices(dense[i % 2], lens, K, workspace=ws, out=out) for i in range(ncalls)]
        )
        res["route"] = ws.route(B, L, 1, score=False).kind
    except Exception as exc:
        res["route_error"] = f"{type(exc).__name__}: {exc}"
    res["torch_topk_us"] = timeit(
        [lambda i=i: torch.topk(exact[i % copies], K, dim=1) for i in range(min(ncalls, 8))]
    )
    coop, pers = PEERS.get((B, L), (None, None))
    peers = [p for p in (coop, pers) if p]
    res["best_peer_us"] = min(peers) if peers else None
    if peers:
        res["cuda_over_peer"] = res["cuda_us"] / min(peers)
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(
        [f"{t}x{v}" for t, v in cuda_topk.VARIANTS] + [f"c{c}" for c in cuda_topk.CLUSTER_SIZES] + ["cauto"]))
    ap.add_argument("--shapes", default="")
    ap.add_argument("--quick", action="store_true", help="first variant only in the exactness checks")
    ap.add_argument("--ncalls", type=int, default=16)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    variants = [parse_variant(s) for s in a.variants.split(",")]
    ok, why = cuda_topk.status()
    RESULTS["meta"] = dict(
        device=torch.cuda.get_device_name(0),
        torch=torch.__version__,
        status=why,
        capability=list(torch.cuda.get_device_capability()),
    )
    log(json.dumps(RESULTS["meta"]))
    if not ok:
        log(f"cuda top-k unavailable: {why}")
        return finish()
    major, minor = torch.cuda.get_device_capability()
    try:
        t0 = time.perf_counter()
        _, ptxas = cuda_topk.compile_source(f"sm_{major}{minor}", extra_options=("--ptxas-options=-v",))
        t1 = time.perf_counter()
        cuda_topk.warmup(DEV)
        RESULTS["compile_s"] = t1 - t0
        RESULTS["load_s"] = time.perf_counter() - t1
        RESULTS["ptxas"] = ptxas
        log(f"compiled in {t1 - t0:.2f} s, loaded in {RESULTS['load_s']:.2f} s\n{ptxas}")
    except Exception as exc:
        log(f"COMPILE/LOAD FAILED: {type(exc).__name__}: {exc}")
        RESULTS["errors"].append(f"compile: {exc}")
        return finish()
    exactness(variants[:1] if a.quick else variants)
    check_scorer_nan()
    log("== capture / sync ==")
    for v in variants[:2] + [v for v in variants[2:] if v in ("c8", "cauto")]:
        check_capture(v)
    check_no_sync(variants[0])
    log("== timing (us, CUDA-graph replays; k=2048; L = live length; wide = 128K host width) ==")
    shapes = SHAPES if not a.shapes else [tuple(int(p) for p in s.split("x")) for s in a.shapes.split(",")]
    rows = []
    for B, L in shapes:
        r = time_shape(B, L, variants, a.ncalls)
        if r is not None:
            rows.append(r)
            log(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}))
    RESULTS["timing"] = rows
    hdr = (f"{'B':>4} {'L':>7} {'cuda':>7} {'best':>7} {'wide/ex':>7} {'auto':>7} {'c':>2} {'auto w/e':>8} "
           f"{'route':>7} {'torch':>7} {'peer':>6} {'best/peer':>9} {'auto/peer':>9}")
    log(hdr)
    for r in rows:
        def f(v, fmt="{:7.1f}"):
            return fmt.format(v) if isinstance(v, (int, float)) else f"{'-':>{len(fmt.format(0))}}"

        peer = r.get("best_peer_us")
        log(
            f"{r['B']:>4} {r['L']:>7} {f(r.get('cuda_us'))} {r.get('cuda_best', '-'):>7} "
            f"{f(r.get('cuda_wide_over_exact'), '{:7.3f}')} {f(r.get('cauto_us'))} "
            f"{r.get('cauto_size') or '-':>2} {f(r.get('cauto_wide_over_exact'), '{:8.3f}')} "
            f"{f(r.get('route_us'))} {f(r.get('torch_topk_us'))} {f(peer, '{:6.1f}')} "
            f"{f(r.get('cuda_over_peer'), '{:9.2f}')} "
            f"{f(r['cauto_us'] / peer if peer and r.get('cauto_us') else None, '{:9.2f}')}"
        )
    finish()


def finish() -> None:
    n_exact = len(RESULTS.get("exact", []))
    n_ok = sum(1 for e in RESULTS.get("exact", []) if e["ok"])
    log(f"exact: {n_ok}/{n_exact} ok; errors: {len(RESULTS['errors'])}")
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "cuda_topk_check.json"), "w") as fh:
            json.dump(RESULTS, fh, indent=1, default=str)
        log(f"wrote {os.path.join(out, 'cuda_topk_check.json')}")


if __name__ == "__main__":
    main()
